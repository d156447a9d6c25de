"""Bytes from outside kvtier's process (disk tier files, shared-store records, request fields)
never reach a KV cache, leak across tenants, hang a request, stop the engine or grow memory
without bound. Each test pins one way they did before its fix (a FIFO or a sparse giant file
under a record's name, a NaN retention TTL), or a shape checked safe."""

from __future__ import annotations

import os
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier.metrics import Metrics
from kvtier.store import record
from kvtier.store.disk import DiskTier

from .conftest import key_of, payload_of

SIZE = 4096
RECORD = record.HEADER_BYTES + SIZE


def _record_path(tier: DiskTier, key: bytes) -> Path:
    h = key.hex()
    return tier.directory / h[:2] / f"{h}.kvr"


def _call_bounded(fn: Callable[[], object], unblock: Callable[[], None]) -> tuple[bool, object]:
    """Run `fn` on a daemon thread; (finished, result). A call still blocked after the join
    is released with `unblock` so the test process never hangs itself."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - reported to the test
            box["result"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(2.0)
    finished = not t.is_alive()
    if not finished:
        unblock()
        t.join(5.0)
    return finished, box.get("result")


def _one_record(tmp_path: Path, namespace: bytes, metrics: Metrics, i: int
                ) -> tuple[DiskTier, bytes, Path]:  # fmt: skip
    """A disk tier holding one record (key `i`), and that record's file."""
    tier = DiskTier(tmp_path, 10 * RECORD, namespace, metrics)
    k = key_of(i)
    assert tier.put(k, payload_of(i, SIZE))
    return tier, k, _record_path(tier, k)


# ---- disk tier ----------------------------------------------------------------------------


def test_disk_record_replaced_by_fifo_is_a_miss_not_a_hang(
    tmp_path: Path, namespace: bytes, metrics: Metrics
) -> None:
    """Another process swaps an indexed record file for a FIFO: the read must not block."""
    tier, k, path = _one_record(tmp_path, namespace, metrics, 1)
    path.unlink()
    os.mkfifo(path, 0o600)

    held: list[int] = []

    def unblock() -> None:
        # O_RDWR never blocks on a FIFO and counts as a writer: the blocked open() returns,
        # and the file reads as 0 bytes (fstat size 0)
        held.append(os.open(path, os.O_RDWR | os.O_NONBLOCK))

    try:
        finished, result = _call_bounded(lambda: tier.get(k), unblock)
    finally:
        for fd in held:
            os.close(fd)
    assert finished, "DiskTier.get blocked forever in open() on a FIFO planted as a record"
    assert result is None
    assert metrics.value("verify_failures_total", tier="disk", reason="untrusted_file") == 1
    tier.close()


def test_disk_sparse_huge_file_is_not_read_into_memory(
    tmp_path: Path, namespace: bytes, metrics: Metrics
) -> None:
    """A record file truncated up to a huge (sparse, free on disk) size: the reader allocates
    and fills a buffer of the file's size, not of the record size the tier indexed."""
    tier, k, path = _one_record(tmp_path, namespace, metrics, 2)
    huge = 64 << 20  # 64 MiB for a 4 KiB record; nothing stops 64 GiB
    os.truncate(path, huge)
    tracemalloc.start()
    try:
        got = tier.get(k)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got is None
    assert peak < 16 * RECORD, f"reading one {RECORD}-byte record allocated {peak} bytes"
    assert metrics.value("verify_failures_total", tier="disk", reason="length_mismatch") == 1
    tier.close()


def test_disk_file_larger_than_memory_is_a_counted_miss_not_an_exception(
    tmp_path: Path, namespace: bytes, metrics: Metrics
) -> None:
    """A 1 TiB sparse file under a record's name: get() must read as a miss (dropped,
    counted), not raise MemoryError into the load (and again on every later lookup)."""
    tier, k, path = _one_record(tmp_path, namespace, metrics, 3)
    os.truncate(path, 1 << 40)
    try:
        got = tier.get(k)
    except MemoryError:
        pytest.fail("DiskTier.get raised MemoryError for a huge sparse record file")
    assert got is None
    assert not tier.contains(k)
    tier.close()


def test_disk_record_replaced_by_directory_is_a_counted_miss(
    tmp_path: Path, namespace: bytes, metrics: Metrics
) -> None:
    """Checked safe: a directory under a record's name reads as an io_error miss."""
    tier, k, path = _one_record(tmp_path, namespace, metrics, 4)
    path.unlink()
    path.mkdir()
    assert tier.get(k) is None
    assert not tier.contains(k)
    tier.close()


# ---- shared store -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_server() -> Iterator[object]:
    from tests.redis_local import RedisServer

    with RedisServer() as srv:
        yield srv


def test_remote_cross_tenant_and_cross_namespace_replay_never_serves(
    redis_server: object, metrics: Metrics, namespace: bytes, other_namespace: bytes
) -> None:
    """Checked safe: a record copied from another tenant's key, or from another namespace of
    the same tenant, or a state record planted under a chunk's key, is a counted miss; the
    read_into buffer is never filled."""
    import torch

    from kvtier.keys import state_key
    from kvtier.store.remote import RemoteTier
    from tests.record_key import codec_for_tests

    url = redis_server.url  # type: ignore[attr-defined]
    mine = RemoteTier(url, namespace, metrics, codec=codec_for_tests(namespace, "a"), tenant="a")
    theirs = RemoteTier(
        url, namespace, Metrics(rank=0), codec=codec_for_tests(namespace, "b"), tenant="b"
    )
    other_ns = RemoteTier(
        url, other_namespace, Metrics(rank=0), codec=codec_for_tests(other_namespace, "a"),
        tenant="a",
    )  # fmt: skip
    admin = redis_server.client()  # type: ignore[attr-defined]
    try:
        k = key_of(10)
        s = state_key(k, 0)
        assert theirs.put(k, payload_of(1, SIZE))
        assert other_ns.put(k, payload_of(2, SIZE))
        assert mine.put(s, payload_of(3, SIZE))
        dst = torch.full((SIZE,), 7, dtype=torch.uint8)
        for source in (theirs.redis_key(k), other_ns.redis_key(k), mine.redis_key(s)):
            admin.set(mine.redis_key(k), admin.get(source))
            assert mine.read_into(k, dst) is False
            assert bool((dst == 7).all())
        assert metrics.total("verify_failures_total") == 3
    finally:
        admin.close()
        for t in (mine, theirs, other_ns):
            t.close()


# ---- clients' request fields --------------------------------------------------------------


def test_retention_hint_with_nan_ttl_is_refused() -> None:
    """`retain_ttl_s: NaN` (Python's json, hence FastAPI's request.json(), parses the NaN
    literal) slips past `ttl <= 0` and `ttl > max_ttl_s`."""
    from kvtier.offload.retention import hint_from_params

    with pytest.raises(ValueError):
        hint_from_params({"retain_ttl_s": float("nan")})


def test_admin_route_refuses_nan_ttl() -> None:
    """The native admin route parses its body with json.loads: NaN passes its `ttl <= 0`."""
    from kvtier.native.retention_routes import APIError, _target

    with pytest.raises(APIError):
        _target(b'{"prompt_cache_key": "s", "ttl_s": NaN}', None)


def test_one_nan_deadline_does_not_freeze_every_tenants_retention() -> None:
    """A NaN deadline never expires and, at the top of the deadline heap, stops every later
    deadline from expiring: one request fills the whole retention budget for all tenants,
    for good."""
    from kvtier.offload.retention import REJECTED, RetentionHint, RetentionLedger

    now = [1000.0]
    ledger = RetentionLedger(
        4, tenant_share=1.0, default_ttl_s=60, max_ttl_s=600, clock=lambda: now[0]
    )
    ledger.decide([key_of(100)], RetentionHint(ttl_s=float("nan"), tenant="mallory"), 1)
    ledger.decide(
        [key_of(i) for i in range(101, 104)], RetentionHint(ttl_s=30.0, tenant="alice"), 1
    )
    now[0] += 10**6  # every deadline a real TTL could set is long past
    decision, _, _ = ledger.decide([key_of(200)], RetentionHint(ttl_s=30.0, tenant="bob"), 1)
    assert ledger.retained_chunks() <= 1, "alice's expired chunks are still held"
    assert decision.status != REJECTED
