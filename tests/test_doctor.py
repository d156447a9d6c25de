"""`kvtier doctor`: every check on synthetic scrapes (pass and fail), the command's exit codes
and output, and three real TP=2 native servers: healthy, lookup scope cut to rank 0, and a
corrupted tier."""

from __future__ import annotations

import contextlib
import http.server
import json
import logging
import random
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer
import uvicorn
from prometheus_client import CollectorRegistry
from typer.testing import CliRunner

from kvtier.config import KVTierConfig
from kvtier.doctor import (
    ADMISSION,
    BREAKERS,
    CHECK_NAMES,
    DROPPED,
    EXTERNAL,
    HOOK_ERRORS,
    IDENTITIES,
    LEASES,
    LOAD_FAILURES,
    PRESENT,
    PROGRESS,
    RETRIEVING,
    SAVE_FAILURES,
    SCOPE_CHECK,
    SKIPPED,
    STORE_FAILURES,
    TIMEOUTS,
    VERIFY,
    WORKERS,
    Check,
    Status,
    diagnose,
    doctor_command,
    metrics_url,
    parse_client_line,
)
from kvtier.metrics import MergedCollector, Metrics
from kvtier.native import Engine, EngineConfig
from kvtier.native.modelgen import init_model
from kvtier.native.offload import connector_spec
from kvtier.native.serve_metrics import ServeMetrics
from kvtier.native.server import EngineServer, bind_socket
from tests.local_http import serving

CHUNK = 64

# ---- synthetic scrapes --------------------------------------------------------------------------

# a drained TP=2 server after a two-pass run of 4 prompts of 5 chunks (each restores 319 tokens)
HEALTHY_STATS = {
    "prefix_cache_queries": 2560,
    "prefix_cache_hits": 0,
    "external_prefix_cache_queries": 2560,
    "external_prefix_cache_hits": 1276,
    "prompt_tokens": 2560,
    "generation_tokens": 16,
    "num_requests_running": 0,
    "num_requests_waiting": 0,
}


class Fake:
    """A server's /metrics built from the real families: a scheduler and per-rank Metrics in one
    registry, behind the native server's vLLM-named ServeMetrics."""

    def __init__(
        self,
        world: int = 2,
        scope: list[int] | None = None,
        ranks: list[int] | None = None,
        kvtier: bool = True,
        **stats: float,
    ) -> None:
        self.reg = CollectorRegistry()
        self.sched = Metrics("scheduler", self.reg)
        self.sched.set_lookup_scope(list(range(world)) if scope is None else scope, world)
        self.sched.set_load_failure_policy(False)
        self.rank = {r: Metrics(r, self.reg) for r in (range(world) if ranks is None else ranks)}
        for m in self.rank.values():
            m.capacity("memory").set(64 << 20)
        collector = MergedCollector(self.reg) if kvtier else None
        self.serve = ServeMetrics("tiny", collector)
        self.stats = {**HEALTHY_STATS, **stats}

    def healthy(self, retrieved: float = 1276, loads: int = 4, idle: tuple[int, ...] = ()) -> Fake:
        """Two passes' worth of per-rank counters on every rank (nothing retrieved on `idle`)."""
        self.sched.lookups.inc(8)
        for r, m in self.rank.items():
            m.stored_tokens.inc(1280)
            m.retrieved_tokens.inc(0 if r in idle else retrieved)
            for _ in range(loads):
                m.load_seconds.observe(0.001)
        return self

    def text(self, stalled_s: float | None = 0.0) -> str:
        """The scrape; `stalled_s` is what the engine-stall gauges say (None: not exported)."""
        self.serve.publish(self.stats, {"length": 8})
        return with_stall(self.serve.render().decode(), stalled_s)

    def diagnose(self, log: str | None = None, tp: int | None = None) -> dict[str, Check]:
        checks = diagnose(self.text(), log, tp)
        return {c.name: c for c in checks}


STALL_LIMIT_S = 60.0


def with_stall(text: str, stalled_s: float | None) -> str:
    """`text` with the native server's stall gauges as recorded (over any the server wrote)."""
    kept = [ln for ln in text.splitlines() if "kvtier_engine_stall" not in ln]
    if stalled_s is not None:
        kept += [
            "# HELP kvtier_engine_stall_seconds Seconds since an engine step last made progress.",
            "# TYPE kvtier_engine_stall_seconds gauge",
            f'kvtier_engine_stall_seconds{{model_name="tiny"}} {stalled_s}',
            "# HELP kvtier_engine_stalled 1 while requests are queued and no step progressed.",
            "# TYPE kvtier_engine_stalled gauge",
            f'kvtier_engine_stalled{{model_name="tiny"}} {float(stalled_s > STALL_LIMIT_S)}',
        ]
    return "\n".join(kept) + "\n"


def statuses(checks: dict[str, Check]) -> dict[str, str]:
    return {name: str(c.status) for name, c in checks.items()}


def test_a_healthy_scrape_passes_every_check_with_its_numbers():
    checks = Fake().healthy().diagnose(log=client_line([0, 1], 2), tp=2)
    assert list(checks) == list(CHECK_NAMES)
    assert set(statuses(checks).values()) == {"PASS"}, statuses(checks)
    assert checks[SCOPE_CHECK].numbers["scope"] == [0, 1]
    assert checks[SCOPE_CHECK].numbers["log_world"] == 2
    assert checks[WORKERS].numbers["capacity_bytes_by_rank"] == {"0": 64 << 20, "1": 64 << 20}
    assert checks[RETRIEVING].numbers["retrieved_tokens_by_rank"] == {"0": 1276, "1": 1276}
    assert checks[RETRIEVING].numbers["loads_by_rank"] == {"0": 4, "1": 4}
    assert "rank 1: 4 loads / 1276 tokens" in checks[RETRIEVING].detail
    assert checks[EXTERNAL].numbers == {
        "external_queries": 2560,
        "external_hits": 1276,
        "stored_tokens": 2560,
    }
    ids = {i["name"]: (i["lhs"], i["rhs"]) for i in checks[IDENTITIES].numbers["identities"]}
    assert ids["retrieved_eq_external_hits"] == (1276, 1276)
    assert ids["hbm_misses_eq_external_queries"] == (2560, 2560)


def test_no_kvtier_families_fails_the_first_check_and_stops():
    checks = diagnose(Fake(kvtier=False).text(), None, None)
    assert [(c.name, c.status) for c in checks] == [(PRESENT, Status.FAIL)]
    assert "offload is not on or this is not a kvtier server" in checks[0].detail


# ---- lookup client on every rank ----


def client_line(ranks: list[int], world: int) -> str:
    return (
        "2026-09-18 08:20:01 INFO kvtier: kvtier: offload on; chunk=64 tokens\n"
        f"2026-09-18 08:20:01 INFO kvtier: kvtier: lookup client on ranks {ranks} (world={world})\n"
    )


def test_scope_cut_to_rank_0_fails_naming_the_missing_rank():
    check = Fake(world=2, scope=[0]).healthy().diagnose()[SCOPE_CHECK]
    assert check.status is Status.FAIL
    assert check.numbers["missing"] == [1] and check.numbers["scope"] == [0]
    assert "skips [1]" in check.detail


def test_world_misread_as_1_fails_even_though_scope_0_is_in_range():
    # the seed: TP=4 reported world=1, and the default scope [0] is in range, so nothing errs
    fake = Fake(world=1, scope=[0], ranks=[0, 1, 2, 3]).healthy()
    check = fake.diagnose()[SCOPE_CHECK]
    assert check.status is Status.FAIL
    assert "ranks [1, 2, 3] run workers but world=1" in check.detail
    with_tp = fake.diagnose(tp=4)
    assert with_tp[SCOPE_CHECK].status is Status.FAIL
    assert "world=1 but --tp 4" in with_tp[SCOPE_CHECK].detail
    assert with_tp[WORKERS].status is Status.PASS  # --tp 4 is the world the ranks are held to


def test_no_scope_metrics_fails_as_no_lookup_client():
    fake = Fake().healthy()
    text = "\n".join(
        line
        for line in fake.text().splitlines()
        if "kvtier_lookup_scope" not in line and "kvtier_world_size" not in line
    )
    check = {c.name: c for c in diagnose(text + "\n", None, 2)}[SCOPE_CHECK]
    assert check.status is Status.FAIL and "built no lookup client" in check.detail


def test_the_log_line_must_agree_with_metrics_and_exist():
    fake = Fake().healthy()
    assert fake.diagnose(log=client_line([0, 1], 2))[SCOPE_CHECK].status is Status.PASS
    other = fake.diagnose(log=client_line([0], 1))[SCOPE_CHECK]
    assert other.status is Status.FAIL
    assert other.numbers["log_ranks"] == [0] and other.numbers["log_world"] == 1
    assert "the log says ranks [0] (world=1)" in other.detail
    none = fake.diagnose(log="INFO kvtier serve: listening\n")[SCOPE_CHECK]
    assert none.status is Status.FAIL and "no 'kvtier: lookup client on ranks" in none.detail
    # a restarted server appends to its log: the last line counts
    restarted = client_line([0], 1) + client_line([0, 1], 2)
    assert fake.diagnose(log=restarted)[SCOPE_CHECK].status is Status.PASS
    assert parse_client_line(restarted).ranks == (0, 1)  # type: ignore[union-attr]


def test_world_that_disagrees_with_tp_fails():
    check = Fake(world=2).healthy().diagnose(tp=4)[SCOPE_CHECK]
    assert check.status is Status.FAIL and "world=2 but --tp 4" in check.detail


# ---- a worker on every rank ----


def test_a_rank_without_a_worker_fails_naming_it():
    checks = Fake(world=2, ranks=[0]).healthy().diagnose()
    assert checks[WORKERS].status is Status.FAIL
    assert checks[WORKERS].numbers["missing"] == [1]
    assert "ranks [1] report no worker" in checks[WORKERS].detail


def test_a_fresh_server_without_rank_metrics_is_undetermined_not_failed():
    fresh = Fake(ranks=[], prompt_tokens=0, prefix_cache_queries=0,
                 external_prefix_cache_queries=0, external_prefix_cache_hits=0)  # fmt: skip
    checks = fresh.diagnose()
    assert checks[WORKERS].status is Status.UNDETERMINED
    assert "send one request" in checks[WORKERS].detail
    assert checks[SCOPE_CHECK].status is Status.PASS
    # after traffic, no rank reporting is a failure
    served = Fake(ranks=[]).diagnose()
    assert served[WORKERS].status is Status.FAIL


# ---- every rank retrieving ----


def test_one_rank_retrieving_nothing_fails():
    check = Fake().healthy(idle=(1,)).diagnose()[RETRIEVING]
    assert check.status is Status.FAIL
    assert check.numbers["retrieved_tokens_by_rank"] == {"0": 1276, "1": 0}
    assert "ranks [1] retrieved nothing while ranks [0] did" in check.detail


def test_uneven_retrieval_warns():
    fake = Fake().healthy()
    fake.rank[0].retrieved_tokens.inc(64)
    check = fake.diagnose()[RETRIEVING]
    assert check.status is Status.WARN and "uneven" in check.detail


def test_all_zero_is_undetermined_with_the_three_causes_and_the_write_only_lean():
    fake = Fake(external_prefix_cache_hits=0).healthy(retrieved=0, loads=0)
    checks = fake.diagnose()
    check = checks[RETRIEVING]
    assert check.status is Status.UNDETERMINED
    for cause in ("(1) no reuse", "(2) the reuse distance lies outside [HBM pool, tier)",
                  "(3) lookups never hit, the write-only tier"):  # fmt: skip
        assert cause in check.detail
    assert "stored=2560 tokens (all ranks), external queries=2560, external hits=0" in (
        check.detail
    )
    assert "the numbers fit (3)" in check.detail
    # nothing stored at all points at (1) instead
    empty = Fake(external_prefix_cache_hits=0, external_prefix_cache_queries=0)
    assert "nothing is stored yet, so (1)" in empty.diagnose()[RETRIEVING].detail


# ---- external queries and hits ----


def test_external_hits_pass_and_a_tier_written_and_never_read_fails():
    assert Fake().healthy().diagnose()[EXTERNAL].status is Status.PASS
    never = Fake(external_prefix_cache_hits=0).healthy(retrieved=0, loads=0).diagnose()
    assert never[EXTERNAL].status is Status.FAIL
    assert "tier written and never read" in never[EXTERNAL].detail
    assert never[EXTERNAL].numbers == {
        "external_queries": 2560,
        "external_hits": 0,
        "stored_tokens": 2560,
        "hbm_hits": 0,
        "skipped_hbm_satisfies": 0,
        "lookups": 8,
    }
    idle = Fake(external_prefix_cache_hits=0, external_prefix_cache_queries=0).diagnose()
    assert idle[EXTERNAL].status is Status.UNDETERMINED
    assert "no HBM miss has reached the connector" in idle[EXTERNAL].detail


def test_repeats_that_fit_hbm_warn_instead_of_failing_as_never_read():
    # a healthy vLLM server whose repeats all hit its own prefix cache: nothing to load yet
    fake = Fake(external_prefix_cache_hits=0, prefix_cache_hits=1024)
    fake.healthy(retrieved=0, loads=0).sched.skipped_load("hbm_satisfies").inc(4)
    check = fake.diagnose()[EXTERNAL]
    assert check.status is Status.WARN and check.detail.startswith("repeats fit in HBM")
    assert check.numbers["hbm_hits"] == 1024 and check.numbers["skipped_hbm_satisfies"] == 4


def test_traffic_that_repeated_no_first_chunk_warns_instead_of_failing_as_never_read():
    # every lookup was answered cold (no prompt began with a saved chunk): not a broken path
    fake = Fake(external_prefix_cache_hits=0)
    for m in fake.rank.values():
        m.stored_tokens.inc(1280)
    fake.sched.cold_lookups.inc(8)
    check = fake.diagnose()[EXTERNAL]
    assert check.status is Status.WARN and check.detail.startswith("no repeated prefix yet")
    assert check.numbers["cold_lookups"] == 8 and check.numbers["lookups"] == 0
    # once a lookup reached the ranks and still nothing hit, it is the never-read failure
    fake.sched.lookups.inc(1)
    assert fake.diagnose()[EXTERNAL].status is Status.FAIL


def test_absent_counters_are_undetermined_not_passed():
    # vLLM before its counters were exported at startup: kvtier families only after use
    keep = ("kvtier_lookup_scope", "kvtier_world_size", "kvtier_tier_capacity", "vllm:")
    text = "\n".join(
        ln for ln in Fake().healthy().text().splitlines()
        if any(k in ln for k in keep)
    ) + "\n"  # fmt: skip
    checks = {c.name: c for c in diagnose(text, None, 2)}
    for name in (SAVE_FAILURES, STORE_FAILURES, LOAD_FAILURES, VERIFY, LEASES, TIMEOUTS):
        assert checks[name].status is Status.UNDETERMINED, (name, checks[name])
        assert "unknown, not zero" in checks[name].detail
    assert checks[EXTERNAL].status is Status.UNDETERMINED


def test_store_failures_warn_and_a_tier_refusing_writes_without_evicting_fails():
    fake = Fake().healthy()
    assert fake.diagnose()[STORE_FAILURES].status is Status.PASS
    fake.rank[0].store_failure("remote", "timeout").inc(3)
    check = fake.diagnose()[STORE_FAILURES]
    assert check.status is Status.WARN and check.numbers["by_tier_reason"] == {"remote/timeout": 3}
    # the disk filled up and nothing is evicted: every write fails, the tier is frozen
    fake.rank[1].store_failure("disk", "enospc").inc(40)
    check = fake.diagnose()[STORE_FAILURES]
    assert check.status is Status.FAIL and check.numbers["frozen_tiers"] == ["rank 1 disk"]
    assert "the rank 1 disk tier refuses writes" in check.detail
    fake.rank[1].eviction("disk").inc(12)  # it evicts to make room: a warning only
    assert fake.diagnose()[STORE_FAILURES].status is Status.WARN


def test_memory_full_of_a_write_behind_backlog_names_the_knobs():
    """Saves that waited for the write-behind in vain: the warning says the lower tier writes
    slower than saves arrive, and names what to raise; waits that got a slot stay quiet."""
    fake = Fake().healthy()
    fake.rank[0].store_failure("memory", "all_pinned").inc(5)
    fake.rank[0].slot_wait("slot").inc(5)
    check = fake.diagnose()[STORE_FAILURES]
    assert check.status is Status.WARN and "write_wait_ms" not in check.detail
    fake.rank[0].slot_wait("none").inc(2)
    check = fake.diagnose()[STORE_FAILURES]
    assert check.status is Status.WARN and check.numbers["slot_waits"] == {"none": 2, "slot": 5}
    assert "2 saves waited write_wait_ms in vain" in check.detail
    assert "raise memory_bytes, or write_wait_ms" in check.detail


def test_a_wedged_engine_fails_the_progress_check_and_its_signature_warns():
    # issue 10 item 1 as recorded: 8 waiting, none running, the KV cache full, no step for 120 s
    wedged = Fake(num_requests_waiting=8, kv_cache_usage=1.0).healthy()
    check = {c.name: c for c in diagnose(wedged.text(stalled_s=120.0), None, 2)}[PROGRESS]
    assert check.status is Status.FAIL and check.detail.startswith("wedged: requests are queued")
    assert check.numbers["stall_seconds"] == 120 and check.numbers["waiting"] == 8
    moving = {c.name: c for c in diagnose(wedged.text(stalled_s=2.0), None, 2)}[PROGRESS]
    assert moving.status is Status.PASS
    # no stall gauge (vLLM): the same scrape shows the wedge signature
    bare = {c.name: c for c in diagnose(wedged.text(stalled_s=None), None, 2)}[PROGRESS]
    assert bare.status is Status.WARN and "the wedge signature" in bare.detail
    idle = {c.name: c for c in diagnose(Fake().healthy().text(None), None, 2)}[PROGRESS]
    assert idle.status is Status.UNDETERMINED


# ---- identities ----


def test_identities_warn_when_not_drained_and_fail_when_they_do_not_close():
    busy = Fake(num_requests_running=2, num_requests_waiting=1).healthy().diagnose()
    assert busy[IDENTITIES].status is Status.WARN
    assert "not drained (2 running, 1 waiting)" in busy[IDENTITIES].detail
    # the retrieved tokens of the ranks are not the external hits TP times over
    off = Fake(external_prefix_cache_hits=1000).healthy().diagnose()
    assert off[IDENTITIES].status is Status.FAIL
    assert "1276 == 1000 FAILS" in off[IDENTITIES].detail
    # HBM misses that never reached the connector
    leak = Fake(external_prefix_cache_queries=2000).healthy().diagnose()
    assert leak[IDENTITIES].status is Status.FAIL
    assert "2560 == 2000 FAILS" in leak[IDENTITIES].detail
    # --tp sets the divisor: the same counters at TP=1 do not close
    assert Fake().healthy().diagnose(tp=1)[IDENTITIES].status is Status.FAIL


# ---- counters that must stay at zero ----


def test_hook_errors_fail_naming_the_hook_and_the_rank():
    fake = Fake().healthy()
    assert fake.diagnose()[HOOK_ERRORS].status is Status.PASS
    fake.sched.hook_error("update_state_after_alloc").inc(2)
    fake.rank[1].hook_error("get_finished").inc()
    check = fake.diagnose()[HOOK_ERRORS]
    assert check.status is Status.FAIL
    assert check.numbers["by"] == {"get_finished": 1, "update_state_after_alloc": 2}
    assert check.numbers["by_rank"] == {"1": 1}
    assert check.numbers["scheduler"] == {"update_state_after_alloc": 2}
    assert "defect of kvtier's own" in check.detail


def test_verify_failures_fail_naming_tier_reason_and_rank():
    fake = Fake().healthy()
    fake.rank[1].verify_failure("memory", "checksum_mismatch").inc(3)
    fake.rank[0].verify_failure("disk", "length_mismatch").inc()
    check = fake.diagnose()[VERIFY]
    assert check.status is Status.FAIL
    assert check.numbers["by"] == {"disk/length_mismatch": 1, "memory/checksum_mismatch": 3}
    assert check.numbers["by_rank"] == {"0": 1, "1": 3}
    assert "memory/checksum_mismatch: 3" in check.detail and "corrupted" in check.detail


def test_lease_expiries_and_double_releases_warn_with_counts():
    fake = Fake().healthy()
    fake.rank[0].lease_expiries.inc(2)
    fake.rank[1].lease_double_releases.inc()
    check = fake.diagnose()[LEASES]
    assert check.status is Status.WARN
    assert check.numbers["expiries"] == 2 and check.numbers["double_releases"] == 1
    assert check.numbers["expiries_by_rank"] == {"0": 2}


def test_lookup_timeouts_warn_and_fail_when_a_rank_misses_most_lookups():
    fake = Fake().healthy()  # 8 lookups
    fake.sched.lookup_timeout(1).inc(2)
    check = fake.diagnose()[TIMEOUTS]
    assert check.status is Status.WARN
    assert check.numbers == {"lookups": 8, "timeouts_by_target": {"1": 2}}
    fake.sched.lookup_timeout(1).inc(2)  # 4 of 8: half the lookups
    check = fake.diagnose()[TIMEOUTS]
    assert check.status is Status.FAIL and "ranks [1] missed at least 50%" in check.detail


def test_dropped_writes_load_and_save_failures_warn_by_reason():
    fake = Fake().healthy()
    fake.rank[0].dropped_write("disk", "queue_full").inc(5)
    fake.sched.load_failure("miss").inc()
    fake.rank[1].load_failure("miss").inc()
    fake.rank[1].save_failure("all_pinned").inc(2)
    checks = fake.diagnose()
    assert checks[DROPPED].status is Status.WARN
    assert checks[DROPPED].numbers["by"] == {"disk/queue_full": 5}
    assert checks[LOAD_FAILURES].status is Status.WARN
    assert checks[LOAD_FAILURES].numbers == {
        "ops_by_reason": {"miss": 1},
        "by_rank_reason": {"1/miss": 1},
    }
    assert "1 loads failed, by reason: miss: 1" in checks[LOAD_FAILURES].detail
    assert checks[SAVE_FAILURES].status is Status.WARN
    assert checks[SAVE_FAILURES].numbers["by"] == {"all_pinned": 2}


def test_skipped_loads_are_informational():
    fake = Fake().healthy()
    fake.sched.skipped_load("too_small").inc(3)
    check = fake.diagnose()[SKIPPED]
    assert check.status is Status.PASS
    assert check.numbers == {"by_reason": {"too_small": 3}}
    assert "too_small: 3" in check.detail


def test_an_open_breaker_fails_and_a_closed_one_passes():
    fake = Fake().healthy()
    fake.rank[0].breaker("remote").set(0)
    assert fake.diagnose()[BREAKERS].status is Status.PASS
    fake.rank[1].breaker("remote").set(1)
    check = fake.diagnose()[BREAKERS]
    assert check.status is Status.FAIL and check.numbers["open"] == ["rank 1 remote"]


def test_bad_input_raises_naming_the_value():
    with pytest.raises(ValueError, match="--tp 0 must be >= 1"):
        diagnose(Fake().text(), None, 0)
    with pytest.raises(ValueError, match="not Prometheus text"):
        diagnose("kvtier_x{rank=0 1\n", None, None)


def test_metrics_url_forms():
    assert metrics_url("http://h:8000") == "http://h:8000/metrics"
    assert metrics_url("h:8000/") == "http://h:8000/metrics"
    assert metrics_url("https://h/metrics") == "https://h/metrics"


# ---- the command ---------------------------------------------------------------------------------


def cli(args: list[str]) -> Any:
    app = typer.Typer()
    app.command()(doctor_command)
    return CliRunner().invoke(app, args)


@contextlib.contextmanager
def static_metrics(text: str) -> Iterator[str]:
    """A plain HTTP server answering /metrics with `text` (anything else: 404)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = text.encode() if self.path == "/metrics" else b"not here"
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            return

    with serving(http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)) as url:
        yield url


def test_cli_json_exit_codes_and_table(tmp_path):
    with static_metrics(Fake().healthy().text()) as ok_url:
        good = cli([ok_url, "--json", "--tp", "2"])
        table = cli([ok_url])
        missing_log = cli([ok_url, "--log", str(tmp_path / "nope.log")])
        bad_tp = cli([ok_url, "--tp", "0"])
    assert good.exit_code == 0, good.output
    doc = json.loads(good.output)
    assert doc["ok"] is True and doc["url"] == f"{ok_url}/metrics"
    assert [c["name"] for c in doc["checks"]] == list(CHECK_NAMES)
    assert {c["status"] for c in doc["checks"]} == {"PASS"}
    assert table.exit_code == 0 and "no check failed" in table.output
    assert "PASS" in table.output and "kvtier doctor" in table.output
    assert missing_log.exit_code == 2 and "cannot read --log" in missing_log.output
    assert bad_tp.exit_code == 2 and "--tp 0 must be >= 1" in bad_tp.output

    with static_metrics(Fake(scope=[0]).healthy().text()) as cut_url:
        failed = cli([cut_url, "--json"])
        failed_table = cli([cut_url])
        not_found = cli([f"{cut_url}/elsewhere/metrics"])
    assert failed.exit_code == 1
    doc = json.loads(failed.output)
    assert doc["ok"] is False
    assert [c["name"] for c in doc["checks"] if c["status"] == "FAIL"] == [SCOPE_CHECK]
    assert failed_table.exit_code == 1 and "FAIL" in failed_table.output
    assert not_found.exit_code == 2 and "answered HTTP 404" in not_found.output


def test_cli_unreachable_url_exits_2_with_a_clear_message():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = cli([f"http://127.0.0.1:{port}", "--timeout", "5"])
    assert result.exit_code == 2
    assert f"cannot reach http://127.0.0.1:{port}/metrics" in result.output
    assert "is the server up" in result.output and "Traceback" not in result.output


# ---- real TP=2 native servers --------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("doctor") / "model", dtype="float32")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """4 prompts of 5 whole 64-token chunks."""
    rng = random.Random(3)
    return [[rng.randrange(3, 2048) for _ in range(5 * CHUNK)] for _ in range(4)]


ENV = {
    "KVTIER_CHUNK_SIZE": str(CHUNK),
    "KVTIER_MEMORY_BYTES": "64MiB",
    "KVTIER_LOAD_GATE": "false",
    # a busy 2-core box must not turn a healthy lookup into a timeout
    "KVTIER_LOOKUP_TIMEOUT_MS": "5000",
}


@contextlib.contextmanager
def captured_log(path: Path) -> Iterator[None]:
    """The `kvtier` logger's INFO lines of this process, written to `path` (a startup log)."""
    logger = logging.getLogger("kvtier")
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        handler.close()


def engine(model: Path, run_dir: Path, spec_args: dict[str, Any] | None = None, **env: str):
    config = KVTierConfig.from_env({**ENV, **env})
    spec: Any = connector_spec(config, model, run_dir=run_dir)
    if spec_args is not None:
        spec = ("tests.native.faulty:build", {**spec.args, **spec_args})
    cfg = EngineConfig(num_threads=1, tensor_parallel_size=2, num_blocks=256)
    return Engine(model, cfg, spec)


@contextlib.contextmanager
def http_server(eng: Engine) -> Iterator[tuple[str, EngineServer]]:
    """`eng` behind EngineServer and a real uvicorn on a free port, in a thread."""
    try:
        srv = EngineServer(eng, model_name="tiny").start()
    except BaseException:
        eng.close()
        raise
    sock = bind_socket("127.0.0.1", 0)
    sock.listen(64)  # connections queue here until uvicorn accepts them: no start-up race
    uv = uvicorn.Server(uvicorn.Config(srv.app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", srv
    finally:
        uv.should_exit = True
        thread.join(timeout=15)
        sock.close()
        srv.close()


def two_pass(base: str, srv: EngineServer, prompts: list[list[int]]) -> None:
    """Pass 1, reset the HBM prefix cache, pass 2; returns once /metrics says drained."""
    body = {"model": "tiny", "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=base, timeout=60.0) as c:
        for _ in range(2):
            for p in prompts:
                r = c.post("/v1/completions", json={**body, "prompt": p})
                assert r.status_code == 200, r.text
            assert srv.loop.wait_idle(30.0), "the server did not go idle within 30 s"
            assert c.post("/reset_prefix_cache").status_code == 200
        deadline = time.monotonic() + 30.0
        pause = threading.Event()
        while True:
            text = c.get("/metrics").text
            busy = [
                line
                for line in text.splitlines()
                if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting"))
                and not line.endswith(" 0.0")
            ]
            if not busy:
                return
            assert time.monotonic() < deadline, f"not drained within 30 s: {busy}"
            pause.wait(0.05)


def failing(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in doc["checks"] if c["status"] == "FAIL"}


def test_real_healthy_server_passes_every_check(model, prompts, tmp_path):
    log = tmp_path / "server.log"
    with captured_log(log):
        eng = engine(model, tmp_path / "run")
    with http_server(eng) as (base, srv):
        two_pass(base, srv, prompts)
        result = cli([base, "--json", "--tp", "2", "--log", str(log)])
        stall_gauge = "kvtier_engine_stalled" in httpx.get(f"{base}/metrics").text
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    checks = {c["name"]: c for c in doc["checks"]}
    want = {n: "PASS" for n in CHECK_NAMES}
    if not stall_gauge:  # the stall gauges come with the native server's engine loop
        want[PROGRESS] = "UNDETERMINED"
    assert {n: c["status"] for n, c in checks.items()} == want
    assert checks[SCOPE_CHECK]["numbers"]["log_ranks"] == [0, 1]
    # pass 2 restores 319 of each 320-token prompt on both ranks
    assert checks[RETRIEVING]["numbers"]["retrieved_tokens_by_rank"] == {"0": 4 * 319,
                                                                        "1": 4 * 319}  # fmt: skip
    assert checks[EXTERNAL]["numbers"]["external_hits"] == 4 * 319


def test_real_server_with_lookup_scope_cut_to_rank_0_fails_the_scope_check(
    model, prompts, tmp_path
):
    log = tmp_path / "server.log"
    with captured_log(log):
        eng = engine(model, tmp_path / "run", KVTIER_LOOKUP_SCOPE="0")
    assert "kvtier: lookup client on ranks [0] (world=2)" in log.read_text()
    with http_server(eng) as (base, srv):
        two_pass(base, srv, prompts)
        result = cli([base, "--json", "--log", str(log)])
    assert result.exit_code == 1, result.output
    doc = json.loads(result.output)
    # the hidden failure: it serves and retrieves, and only the scope says it is cut
    assert set(failing(doc)) == {SCOPE_CHECK}
    scope = failing(doc)[SCOPE_CHECK]
    assert scope["numbers"]["missing"] == [1] and scope["numbers"]["world"] == 2
    assert "skips [1]" in scope["detail"]


def test_real_server_with_a_corrupted_tier_fails_the_verify_check(model, prompts, tmp_path):
    eng = engine(model, tmp_path / "run", {"fail_rank": 1}, KVTIER_VERIFY_MEMORY_READS="true")
    with http_server(eng) as (base, srv):
        two_pass(base, srv, prompts)
        result = cli([base, "--json", "--tp", "2"])
    assert result.exit_code == 1, result.output
    fails = failing(json.loads(result.output))
    assert VERIFY in fails
    verify = fails[VERIFY]
    assert verify["numbers"]["by"] == {"memory/checksum_mismatch": 1}
    assert verify["numbers"]["by_rank"] == {"1": 1}
    assert "memory/checksum_mismatch: 1" in verify["detail"]
    # the op that rank 1 could not read was recomputed; no rank counted it as retrieved, so the
    # identities still close: the verify check alone names the fault
    assert IDENTITIES not in fails


def test_a_multiconnector_parent_that_fails_requests_on_load_errors_fails_its_check() -> None:
    from kvtier.doctor import POLICY

    fake = Fake().healthy()
    fake.sched.set_load_failure_policy(True)
    check = fake.diagnose(log=client_line([0, 1], 2), tp=2)[POLICY]
    assert check.status is Status.FAIL
    assert '"kv_load_failure_policy": "recompute" on the MultiConnector' in check.detail


# ---- admission ----


def admission_fake(pressure: float, rejected_back: int) -> Fake:
    fake = Fake().healthy()
    fake.sched.admission("admitted").inc(4000)
    fake.sched.admission("rejected").inc(2000)
    fake.sched.admission_return("admitted").inc(900)
    if rejected_back:
        fake.sched.admission_return("rejected").inc(rejected_back)
    fake.sched.admission_pressure.set(pressure)
    return fake


def test_admission_shows_what_it_kept_out_and_passes_under_pressure() -> None:
    # a tier too small for what comes back: rejected chunks returning is the price, no alarm
    check = admission_fake(pressure=0.7, rejected_back=400).diagnose()[ADMISSION]
    assert check.status is Status.PASS
    assert check.numbers["decided"] == {"admitted": 4000, "rejected": 2000}
    assert check.numbers["returns"] == {"admitted": 900, "rejected": 400}


def test_admission_warns_when_it_rejected_what_a_roomy_tier_would_have_served() -> None:
    check = admission_fake(pressure=0.0, rejected_back=400).diagnose()[ADMISSION]
    assert check.status is Status.WARN
    assert "400 rejected chunks came back" in check.detail


def test_admission_without_regret_passes_without_pressure_too() -> None:
    assert admission_fake(pressure=0.0, rejected_back=10).diagnose()[ADMISSION].status is (
        Status.PASS
    )


def test_admission_fails_when_a_chunk_rejected_with_room_came_back() -> None:
    """The admission policy writes through while the tiers have room; a chunk it rejected with
    room that came back is a defect, not a judgement call: FAIL, whatever the pressure."""
    fake = admission_fake(pressure=0.7, rejected_back=400)
    assert fake.diagnose()[ADMISSION].numbers["rejected_with_room"] == 0
    fake.sched.admission_rejected_roomy.inc(3)
    check = fake.diagnose()[ADMISSION]
    assert check.status is Status.FAIL
    assert "3 chunks were rejected while the tiers had room" in check.detail
    assert check.numbers["rejected_with_room"] == 3


# ---- load or recompute ----


def test_load_cost_shows_the_decisions_and_warns_when_predictions_miss_for_long() -> None:
    from kvtier.doctor import LOAD_COST

    fake = Fake().healthy()
    fake.sched.load_decision("load", "memory").inc(40)
    fake.sched.load_decision("recompute", "remote").inc(7)
    for _ in range(40):
        fake.sched.load_prediction_ratio.observe(1.1)
    fake.sched.load_misprediction_share.set(0.1)
    check = fake.diagnose()[LOAD_COST]
    assert check.status is Status.PASS
    assert check.numbers["decisions"] == {"memory/load": 40, "remote/recompute": 7}
    fake.sched.load_misprediction_share.set(0.8)
    check = fake.diagnose()[LOAD_COST]
    assert check.status is Status.WARN
    assert "80% of recent loads" in check.detail and "load_policy: always" in check.detail
    # a few early misses are not "for long": no verdict before 32 predicted loads
    few = Fake().healthy()
    few.sched.load_decision("load", "memory").inc(3)
    for _ in range(3):
        few.sched.load_prediction_ratio.observe(5.0)
    few.sched.load_misprediction_share.set(1.0)
    assert few.diagnose()[LOAD_COST].status is Status.PASS


# ---- boundary states ----


def test_a_state_hybrid_that_stored_chunks_and_no_state_fails_the_states_check() -> None:
    """A Mamba / gated-delta-net hybrid's hit ends only where a boundary state is held: chunks
    without one are a tier written and never read (what vLLM's reset of the scheduler's block
    size did under `vllm serve`), so doctor FAILs it; an attention-only model passes."""
    from kvtier.doctor import STATES

    plain = Fake().healthy()
    assert plain.diagnose()[STATES].status is Status.PASS
    fake = Fake().healthy()
    fake.sched.set_state_groups(1)
    check = fake.diagnose()[STATES]
    assert check.status is Status.FAIL
    assert "rank(s) 0, 1 stored chunks" in check.detail
    assert "--mamba-cache-mode align" in check.detail
    fake.rank[0].state_parts_stored.inc(3)
    check = fake.diagnose()[STATES]
    assert check.status is Status.FAIL and "rank(s) 1 stored" in check.detail
    fake.rank[1].state_parts_stored.inc(3)
    fake.rank[1].state_parts_loaded.inc(2)
    check = fake.diagnose()[STATES]
    assert check.status is Status.PASS
    assert check.numbers["state_parts_loaded"] == "1: 2"
