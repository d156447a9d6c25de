"""Load or recompute against a real store made slow: the throttling proxy itself, then
`kvtier bench load-cost --quick` through it (a real redis-server, the native engine), asserting
what the policies decided and that every first token equals no offload's. Its timing rows are
the bench's to judge (docs/benchmarks.md), not this test's."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from typer.testing import CliRunner

from kvtier.bench.throttle import ThrottledProxy
from kvtier.cli import app
from tests.redis_local import RedisServer


@pytest.fixture(scope="module")
def store() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


def test_the_proxy_passes_bytes_intact_at_its_rate_and_changes_rate_live(
    store: RedisServer,
) -> None:
    admin = store.client()
    value = bytes(range(256)) * 4096  # 1 MiB
    admin.set("proxy-test", value)
    with ThrottledProxy(("127.0.0.1", store.port), rate=4 * 2**20) as proxy:
        slow = redis.Redis(port=proxy.port)
        t0 = time.perf_counter()
        assert slow.get("proxy-test") == value
        # 1 MiB over a 4 MiB/s link: at least a quarter second (an upper bound would time
        # the machine, not the proxy)
        assert time.perf_counter() - t0 >= 0.2
        proxy.set_rate(1e9)
        assert slow.get("proxy-test") == value
        assert proxy.bytes_down >= 2 * len(value)
        slow.close()
    admin.close()
    with pytest.raises(ValueError, match="must be > 0"):
        ThrottledProxy(("127.0.0.1", store.port), rate=0)


def test_bench_load_cost_recomputes_what_a_slow_store_holds_and_splits_a_mixed_hit(
    store: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "load-cost.json"
    result = CliRunner().invoke(
        app, ["bench", "load-cost", "--remote-url", store.url, "--quick", "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    rows = {r["id"]: r for r in json.loads(out.read_text())["rows"]}
    # every first token equals no offload's, in every arm and the mixed case
    assert rows["outputs.mismatches"]["value"] == 0
    cost = rows["slow.cost.ttft"]["detail"]
    # 3 restores: the first load teaches the model the store's speed, the rest recompute
    assert cost.get("remote/load", 0) <= 1
    assert cost["remote/recompute"] >= 2
    assert cost["remote/recompute"] == cost["skipped/slower_than_recompute"]
    # load_policy always read every hit from the slow store
    assert rows["slow.always.ttft"]["detail"]["remote/load"] == 3
    mixed = rows["mixed.cost.ttft"]["detail"]
    assert mixed["memory/load"] == 2  # the heads in memory, loaded
    assert rows["mixed.cost.split"]["pass"] is True, mixed
    assert "sweep.flips" not in rows  # the quick form leaves the sweep to the full bench


def test_bench_load_cost_recomputes_what_a_throttled_disk_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk tier on a real device whose reads a block-I/O cgroup caps at 4 MiB/s, its page
    cache dropped before each restore (the suite runs as root, as its tmpfs faults do). The
    tier lives under the checkout's build/: a real block device, never a tmpfs."""
    monkeypatch.chdir(tmp_path)
    build = Path(__file__).resolve().parents[2] / "build"
    build.mkdir(exist_ok=True)
    out = tmp_path / "load-cost-disk.json"
    result = CliRunner().invoke(
        app, ["bench", "load-cost", "--disk", str(build), "--quick", "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    rows = {r["id"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["disk.outputs.mismatches"]["value"] == 0
    cost = rows["disk.cost.ttft"]["detail"]
    # the first loads teach the model the disk's speed (a 3-prompt run: at most 2), the rest
    # recompute
    assert cost.get("disk/load", 0) <= 2
    assert cost["disk/recompute"] >= 1
    assert rows["disk.always.ttft"]["detail"]["disk/load"] == 3
    # the throttled arm read the device: every always-arm restore waited on it
    assert rows["disk.always.ttft"]["value"] > 1.0
    assert not list(build.glob("kvtier-load-cost-disk-*"))  # its tier directory is gone


def test_bench_load_cost_needs_exactly_one_slow_tier() -> None:
    result = CliRunner().invoke(app, ["bench", "load-cost", "--quick"])
    # a usage error: exit 2 with one line naming both flags, no traceback
    assert result.exit_code == 2
    assert "--remote-url" in result.output and "--disk" in result.output
    assert "Traceback" not in result.output


def test_a_disk_on_a_virtual_filesystem_is_refused_by_name() -> None:
    from kvtier.bench.disk_throttle import device_of
    from kvtier.errors import ConfigError

    with pytest.raises(ConfigError, match="virtual filesystem.*leave --disk out"):
        device_of(Path("/dev/shm"))  # a tmpfs: no block device to throttle
    assert device_of(Path(__file__).resolve().parent).count(":") == 1
