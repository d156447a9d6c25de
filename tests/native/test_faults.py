"""Degrade, never break (invariant 9) at engine level: a remote store killed and restarted, a
slow remote, a full disk, a rank whose load lane dies or hangs mid-load. Every request
completes with the greedy output of a run without offload; the counters say what it cost."""

from __future__ import annotations

import errno
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import kvtier.store.disk as disk_module
from kvtier.native import Engine, EngineConfig
from kvtier.offload.worker import DEADLINE
from kvtier.store.remote import RemoteTier
from tests.native.conftest import GREEDY, make_prompts
from tests.native.faults_connector import (
    FaultyLoadWorkerHalf,
    kvtier_engine,
    local_worker,
    rank_values,
    wait_until,
)
from tests.redis_local import RedisServer

PROMPT_LEN = 272  # 4 whole 64-token chunks and a tail: a full hit loads 256 tokens
CHUNKS = 4
SMALL_MEMORY = "1MiB"  # 4 slots of the tiny model's 256 KiB chunks: older prompts live below
REMOTE_LOGGER = "kvtier.store.remote"

# prompt groups, each drawn from its own seed
GROUPS = {"a": 4, "b": 4, "c": 4, "probe": 12, "tp": 2, "stuck": 3}


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[list[int]]]:
    """Distinct prompts per group (no prefix shared across groups)."""
    return {g: make_prompts(n, PROMPT_LEN, seed=100 + i) for i, (g, n) in enumerate(GROUPS.items())}


@pytest.fixture(scope="module")
def reference(
    tiny_model: Path, prompts: dict[str, list[list[int]]]
) -> dict[tuple[int, ...], list[int]]:
    """Greedy outputs of every prompt on an engine without offload."""
    every = [p for group in prompts.values() for p in group]
    with Engine(tiny_model, EngineConfig(num_threads=1, num_blocks=256)) as eng:
        outs = eng.generate(every, GREEDY)
    return {tuple(p): o.output_token_ids for p, o in zip(every, outs, strict=True)}


class Driver:
    """Serves prompts one at a time through `eng` and checks each output on the spot."""

    def __init__(self, eng: Engine, reference: dict[tuple[int, ...], list[int]]) -> None:
        self.eng = eng
        self.reference = reference
        self.sent = 0
        self.latencies: list[float] = []

    def serve(self, prompt: list[int], *, flush: bool = True) -> None:
        """One request from an empty HBM prefix cache; with `flush`, wait for write-behind."""
        self.eng.reset_prefix_cache()
        t0 = time.monotonic()
        (out,) = self.eng.generate([prompt], GREEDY, timeout_s=60.0)
        self.latencies.append(time.monotonic() - t0)
        self.sent += 1
        assert out.output_token_ids == self.reference[tuple(prompt)], f"request {self.sent}"
        if flush and self.eng.config.tensor_parallel_size == 1:
            stack = local_worker(self.eng).stack
            assert stack is not None
            assert stack.flush(10.0), "write-behind did not drain"

    def serve_batch(self, prompts: list[list[int]], after_first_step: Callable[[], None]) -> None:
        """Serve `prompts` together from an empty HBM prefix cache; `after_first_step` runs once
        their lookups were answered and their loads handed to the load lane (TP=1 only)."""
        self.eng.reset_prefix_cache()
        asked = {self.eng.add_request(p, GREEDY): p for p in prompts}
        worker = local_worker(self.eng)
        done: dict[str, list[int]] = {}
        deadline = time.monotonic() + 60.0
        first = True
        while self.eng.has_unfinished_requests():
            for out in self.eng.step():
                if out.finished:
                    done[out.request_id] = out.output_token_ids
            if first:
                after_first_step()
                first = False
            if self.eng.last_step_tokens == 0:
                worker.wait_loads(1.0)  # only loads in flight: wait for them, not a fixed time
            assert time.monotonic() < deadline, "the batch did not finish within 60 s"
        self.sent += len(prompts)
        for rid, prompt in asked.items():
            assert done[rid] == self.reference[tuple(prompt)], rid
        stack = worker.stack
        assert stack is not None and stack.flush(10.0)

    def completed(self) -> int:
        """Requests the engine finished."""
        return int(self.eng.stats()["requests_finished"])


def _breaker_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == REMOTE_LOGGER
        and r.levelno == logging.WARNING
        and "circuit breaker open" in r.getMessage()
    ]


@pytest.fixture
def redis_srv() -> Iterator[RedisServer]:
    """A redis-server this test may kill, restart or pause."""
    with RedisServer() as srv:
        yield srv


# ---- the remote store dies mid-run and comes back ---------------------------------------------


def test_remote_killed_mid_run_then_restarted_costs_hits_never_requests(
    tiny_model, tmp_path, prompts, reference, redis_srv, caplog
):
    caplog.set_level(logging.INFO, logger="kvtier")
    with kvtier_engine(
        tiny_model,
        tmp_path / "run",
        memory_bytes=SMALL_MEMORY,
        remote_url=redis_srv.url,
        breaker_failures=2,
        breaker_probe_s=0.2,
    ) as eng:
        worker = local_worker(eng)
        assert worker.stack is not None
        remote = worker.stack.lower[0]
        assert isinstance(remote, RemoteTier)
        m = worker.metrics
        drive = Driver(eng, reference)

        def remote_hits() -> float:
            return m.value("tier_hits_total", tier="remote")

        # before: written behind to the remote, then read back from it (memory holds 4 chunks)
        for p in prompts["a"]:
            drive.serve(p)
        for p in prompts["a"]:
            drive.serve(p)
        hits_before = remote_hits()
        assert hits_before >= 3 * CHUNKS
        assert m.value("breaker_open", tier="remote") == 0

        # during: the store dies while a batch of replays has its loads in flight ...
        drive.serve_batch(prompts["a"], after_first_step=redis_srv.kill)
        hits_at_kill = remote_hits()
        # ... and stays dead: replays and new prompts alike are served without it
        for p in prompts["a"] + prompts["b"]:
            drive.serve(p)
        assert remote_hits() == hits_at_kill
        assert m.value("breaker_open", tier="remote") == 1
        assert remote.breaker.is_open
        # ... and /metrics says so for the rank
        assert rank_values(eng, "breaker_open", tier="remote") == {"0": 1.0}
        assert m.value("dropped_writes_total", tier="remote", reason="breaker_open") > 0
        assert m.total("store_failures_total", tier="remote") >= 2
        down_warnings = _breaker_warnings(caplog)
        assert len(down_warnings) == 1, down_warnings  # logged once, however long it is down

        # after: same port, empty store; traffic lets the breaker's probe find it again
        redis_srv.restart()
        probes = itertools.cycle(prompts["probe"])
        wait_until(
            lambda: not remote.breaker.is_open,
            timeout_s=20.0,
            what="the remote breaker closing after the restart",
            step=lambda: drive.serve(next(probes)),
        )
        assert m.value("breaker_open", tier="remote") == 0
        hits_restart = remote_hits()
        for p in prompts["c"]:
            drive.serve(p)
        for p in prompts["c"]:
            drive.serve(p)
        assert remote_hits() - hits_restart >= 3 * CHUNKS  # remote hits resumed
        assert len(_breaker_warnings(caplog)) == 1
        closed = [r for r in caplog.records if "circuit breaker closed" in r.getMessage()]
        assert len(closed) == 1
        # nothing lost: every request completed (each output was checked as it came)
        assert drive.completed() == drive.sent
        assert eng.stats()["external_load_failures"] == m.total("load_failures_total")


# ---- a slow remote --------------------------------------------------------------------------


def test_slow_remote_never_holds_a_request_past_its_deadlines(
    tiny_model, tmp_path, prompts, reference, redis_srv
):
    with kvtier_engine(
        tiny_model,
        tmp_path / "run",
        remote_url=redis_srv.url,
        remote_timeout_ms=50,
        lookup_timeout_ms=200,
        breaker_failures=3,
        breaker_probe_s=0.2,
    ) as eng:
        worker = local_worker(eng)
        m = worker.metrics
        drive = Driver(eng, reference)
        drive.serve(prompts["a"][0])  # warm-up
        drive.serve(prompts["a"][1])
        healthy = min(drive.latencies)  # one request's latency with a healthy remote

        # stopped until every request below finished: a request that waited on the store
        # would never finish, where a timed DEBUG SLEEP could end first on a loaded host
        with redis_srv.paused():
            for p in prompts["b"]:  # new prompts: every lookup asks the stalled remote
                drive.serve(p, flush=False)
            slow = drive.latencies[-len(prompts["b"]) :]
            # each request paid at most a remote timeout (50 ms) or the lookup deadline
            # (200 ms), never the stall
            assert max(slow) < 1.0 + 2 * healthy, (slow, healthy)
            assert m.value("store_failures_total", tier="remote", reason="read_timeout") >= 1
            assert m.value("breaker_open", tier="remote") == 1

        # the store answers again: the breaker closes and the tier serves hits once more
        probes = itertools.cycle(prompts["probe"])
        wait_until(
            lambda: m.value("breaker_open", tier="remote") == 0,
            timeout_s=20.0,
            what="the remote breaker closing after the stall",
            step=lambda: drive.serve(next(probes)),
        )
        # writes reach the store again
        admin = redis_srv.client()
        keys_before = admin.dbsize()
        for p in prompts["c"]:
            drive.serve(p)
        assert admin.dbsize() - keys_before == len(prompts["c"]) * CHUNKS
        admin.close()
        assert drive.completed() == drive.sent


# ---- a full disk ----------------------------------------------------------------------------


def _enospc(fd: int, data: memoryview) -> None:
    raise OSError(errno.ENOSPC, "No space left on device (injected)")


def test_disk_full_during_writes_costs_disk_hits_never_requests(
    tiny_model, tmp_path, prompts, reference, monkeypatch
):
    disk_dir = tmp_path / "disk"
    with kvtier_engine(
        tiny_model,
        tmp_path / "run",
        memory_bytes=SMALL_MEMORY,
        disk_dir=str(disk_dir),
        disk_bytes="64MiB",
    ) as eng:
        worker = local_worker(eng)
        m = worker.metrics
        drive = Driver(eng, reference)
        records_at_start = sorted(disk_dir.rglob("*.kvr"))  # the startup self-test chunk

        # the disk fills up: every write-behind to it fails inside the rank
        with monkeypatch.context() as patch:
            patch.setattr(disk_module, "_write_all", _enospc)
            for p in prompts["a"]:
                drive.serve(p)
            for p in prompts["a"]:
                drive.serve(p)
        failed = m.value("store_failures_total", tier="disk", reason="enospc")
        assert failed >= 3 * CHUNKS
        assert m.value("tier_hits_total", tier="disk") == 0
        # nothing half-written is left behind, and nothing new was indexed
        assert list(disk_dir.rglob("*.tmp")) == []
        assert sorted(disk_dir.rglob("*.kvr")) == records_at_start

        # space is back: new chunks land on disk and are read back from it
        for p in prompts["b"]:
            drive.serve(p)
        for p in prompts["b"]:
            drive.serve(p)
        assert m.value("store_failures_total", tier="disk", reason="enospc") == failed
        assert m.value("tier_hits_total", tier="disk") >= 3 * CHUNKS
        assert len(list(disk_dir.rglob("*.kvr"))) >= len(records_at_start) + 4 * CHUNKS
        assert drive.completed() == drive.sent


# ---- a rank's load lane dies or hangs mid-load --------------------------------------------


def test_rank_dying_mid_load_fails_the_op_and_the_request_recomputes(
    tiny_model, tmp_path, prompts, reference
):
    fault = {"fault": "raise", "fail_rank": 1, "fail_loads": 1}
    with kvtier_engine(tiny_model, tmp_path / "run", tp=2, fault=fault) as eng:
        drive = Driver(eng, reference)
        p = prompts["tp"][0]
        drive.serve(p)  # saved on both ranks
        drive.serve(p)  # rank 1 raises reading chunk 2 of 4 (chunk 1 already in KV blocks)
        reason = "error:RankDied"
        assert eng.connector.metrics.value("load_failures_total", reason=reason) == 1
        assert rank_values(eng, "load_failures_total", reason=reason) == {"1": 1.0}
        # rank 0 read all 4 chunks, rank 1 died after its first (each also read the startup
        # self-test chunk) ...
        assert rank_values(eng, "tier_hits_total", tier="memory") == {"0": 5.0, "1": 2.0}
        # ... and the quorum failed the op: no rank counts it as retrieved, nothing was hit
        assert rank_values(eng, "retrieved_tokens_total") == {"0": 0.0, "1": 0.0}
        assert eng.stats()["external_prefix_cache_hits"] == 0
        assert eng.stats()["external_load_failures"] == 1
        # the lane survived: the next load of the same prefix succeeds on both ranks
        drive.serve(p)
        assert eng.stats()["external_prefix_cache_hits"] == CHUNKS * 64
        assert rank_values(eng, "retrieved_tokens_total") == {"0": 256.0, "1": 256.0}
        assert drive.completed() == drive.sent == 3


def test_stuck_load_lane_is_failed_by_the_per_load_deadline(
    tiny_model, tmp_path, prompts, reference, caplog
):
    caplog.set_level(logging.INFO, logger="kvtier")
    ttl = 1.0
    fault = {"fault": "stuck", "fail_rank": 0, "fail_loads": 1}
    # the deadline guards the load lane: every load asynchronous (a synchronous one runs in
    # the forward's own thread, from the memory tier only)
    with kvtier_engine(
        tiny_model, tmp_path / "run", fault=fault, lease_ttl_s=ttl, sync_load_fraction=0
    ) as eng:
        half = eng.executor.runner.connector
        assert isinstance(half, FaultyLoadWorkerHalf)
        worker = half.worker
        drive = Driver(eng, reference)
        first, second, third = prompts["stuck"]
        drive.serve(first)
        drive.serve(first)  # its load hangs reading chunk 2: the deadline fails it
        assert half.fired.is_set()
        assert ttl <= drive.latencies[-1] < ttl + 5.0
        assert worker.metrics.value("load_failures_total", reason=DEADLINE) == 1
        assert eng.connector.metrics.value("load_failures_total", reason=DEADLINE) == 1
        # a load queued behind the stuck one is failed by its own deadline too
        drive.serve(second)
        drive.serve(second)
        assert eng.connector.metrics.value("load_failures_total", reason=DEADLINE) == 2
        assert eng.stats()["external_prefix_cache_hits"] == 0

        # the stuck read returns: the lane drops the late result and skips the expired load
        half.release.set()
        wait_until(
            lambda: "came back after its deadline" in caplog.text,
            timeout_s=10.0,
            what="the stuck load coming back",
        )
        drive.serve(third)
        drive.serve(third)  # the lane serves loads again
        assert eng.stats()["external_prefix_cache_hits"] == CHUNKS * 64
        # only that load counts: the late one wrote nothing and counted nothing
        assert worker.metrics.value("retrieved_tokens_total") == CHUNKS * 64
        assert worker.metrics.value("load_failures_total", reason=DEADLINE) == 2
        assert drive.completed() == drive.sent == 6
