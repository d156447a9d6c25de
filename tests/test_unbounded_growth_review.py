"""State that must not grow without bound in a server that runs for weeks: every per-request and
per-operation record kvtier keeps ends on every path that ends its request or operation (a
lost report, a hook that raised), or stays under its cap.

Each test drives the real classes through many requests ending on one path and asserts the
container's size is back at its baseline (or under its bound)."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.config import KVTierConfig
from kvtier.lookup import LookupClient, LookupServer, endpoint_for, make_run_dir
from kvtier.metrics import Metrics
from kvtier.native import Engine, EngineConfig
from kvtier.native.modelgen import init_model
from kvtier.native.offload import connector_spec
from kvtier.offload.ledger import OpLedger
from kvtier.offload.messages import OpResult, WorkerReport
from kvtier.offload.scheduler import OffloadScheduler
from kvtier.store.registry import order
from tests.lookup_helpers import FakeBackend
from tests.native.conftest import GREEDY, make_prompts
from tests.offload.fakes import SlotView
from tests.offload.test_scheduler import BLOCK, CHUNK, blocks, make, prompt

N = 40  # requests (or operations) ended on the suspect path per test


class Injected(RuntimeError):
    """A defect of kvtier's own inside a hook (what the hook guard turns into a fallback)."""


# ---- the scheduler's operation ledger ---------------------------------------------------------


def test_ops_whose_report_was_lost_leave_at_most_the_tombstone_cap_behind() -> None:
    """`Quorum` keeps the ids of closed operations as tombstones, capped at 4096, so a stale
    report is ignored. An operation whose report was lost (one rank never answered) is
    abandoned by `OpLedger.overdue`, and `abandon` added its tombstone without applying the cap:
    with a rank whose reports are lost no operation ever completes, nothing trims, and the
    tombstones grow by one per operation for good."""
    now = [0.0]
    ledger = OpLedger(world=2, clock=lambda: now[0])
    cap = ledger.quorum._tombstones
    total = cap + 500
    for i in range(total):
        op_id = ledger.open("save", f"req-{i}")
        # rank 0 answers, rank 1's report is lost
        assert ledger.report(0, OpResult(op_id, True, "")) is None
    now[0] = 100.0
    assert len(ledger.overdue(10.0)) == total
    for op_id in list(ledger._ops):
        ledger.close(op_id)
    assert len(ledger.quorum._open) == 0
    assert len(ledger.quorum._closed) <= cap, len(ledger.quorum._closed)


# ---- the scheduler's requests after a hook raised ---------------------------------------------


def test_a_finished_requests_state_goes_when_processing_its_loads_terminal_raised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request finished (aborted) while its load was on the ranks keeps its state until the
    load's terminal. When processing that terminal raised after the ledger had closed the op
    (the load planner's learning from it, here), `_forget_op` found no owner (the op was
    closed) and returned: the finished request's `RequestState` stayed in `_reqs` for good."""
    sched, _lookup, metrics = make(hits=4, world=1)

    def boom(*args: Any) -> None:
        raise Injected("learning from a load failed")

    monkeypatch.setattr(sched.load_planner, "_learn", boom)
    for i in range(N):
        view = SlotView(f"r{i}", prompt(4 * CHUNK, salt=i))
        need = sched.get_num_new_matched_tokens(view, 0)
        assert need and sched.update_state_after_alloc(view, blocks(4 * CHUNK), need)
        (op,) = sched.build_meta([]).loads
        assert sched.request_finished(view) is True  # aborted while its load is in flight
        sched.process_reports([WorkerReport(rank=0, results=[OpResult(op.op_id, True, "")])])
    assert metrics.value("hook_errors_total", hook="update_connector_output") == N
    assert not sched.ops
    assert len(sched._reqs) == 0, len(sched._reqs)


# ---- the lookup client after request_finished raised ------------------------------------------


@pytest.fixture
def gated_lookup() -> Iterator[tuple[LookupClient, threading.Event]]:
    """A real one-rank lookup service whose rank answers no lookup until the gate opens."""
    run_dir = make_run_dir()
    gate = threading.Event()
    backend = FakeBackend(0, [], gate=gate)
    ep = endpoint_for(0, run_dir=run_dir)
    server = LookupServer(0, backend, ep, Metrics(0)).start()
    client = LookupClient(
        {0: ep}, Metrics("scheduler"), chunk_size=CHUNK, world=1, timeout_ms=60_000,
        tier_order=order(),
    )  # fmt: skip
    try:
        client.wait_ready(10.0)
        yield client, gate
    finally:
        gate.set()
        client.close()
        server.close()
        shutil.rmtree(run_dir, ignore_errors=True)


def test_a_lookup_in_flight_is_cancelled_when_request_finished_raised(
    gated_lookup: tuple[LookupClient, threading.Event], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request whose lookup is still in flight ends (aborted) and `request_finished` raises:
    the fallback `_finish_after` dropped the request's state without cancelling its lookup, so
    the lookup client kept the `PendingLookup` in `_inflight` for good (and the rank its lease
    until the deadline), one per such request."""
    client, _gate = gated_lookup
    config = KVTierConfig(chunk_size=CHUNK, load_gate=False, lookup_wait_ms=0,
                          lookup_timeout_ms=60_000)  # fmt: skip
    sched = OffloadScheduler(
        config, client, model_id="m", block_size=BLOCK, world=1, metrics=Metrics("scheduler"),
        cold_misses=False,
    )  # fmt: skip

    def boom(req: Any) -> bool:
        raise Injected("request_finished failed")

    monkeypatch.setattr(sched, "_finished", boom)
    for i in range(N):
        view = SlotView(f"r{i}", prompt(4 * CHUNK, salt=i))
        assert sched.get_num_new_matched_tokens(view, 0) is None  # the lookup is in flight
        assert sched.request_finished(view) is False
    assert len(sched._reqs) == 0
    assert len(client._inflight) == 0, len(client._inflight)


# ---- a rank's loads awaiting their terminal, on the native engine ------------------------------

PROMPTS = make_prompts(6, 192, seed=31)  # three whole 64-token chunks each


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama the native engine tests use (tests/native/conftest.py)."""
    return init_model(tmp_path_factory.mktemp("tiny") / "model", dtype="float32")


def test_a_ranks_uncounted_loads_end_when_processing_their_terminal_raised(
    tiny_model: Path, tmp_path: Path
) -> None:
    """A rank keeps each load that succeeded there in `RankOps.uncounted` until the scheduler's
    meta carries the load's agreed terminal (then counts its tokens retrieved, or not). When
    processing the terminal raised (`update_connector_output`'s hook error), `_forget_op` also
    dropped the terminal the ranks were to hear: every rank kept that load's entry for good,
    one per load whose terminal failed."""
    config = KVTierConfig(chunk_size=64, memory_bytes="64MiB", load_gate=False,
                          lookup_timeout_ms=2000)  # fmt: skip
    spec = connector_spec(config, tiny_model, run_dir=tmp_path / "run")
    with Engine(tiny_model, EngineConfig(num_threads=1, num_blocks=256), spec) as eng:
        core = eng.connector.core
        book = eng.executor.runner.connector.worker._book

        def run(tag: str) -> None:
            for i, p in enumerate(PROMPTS):
                eng.add_request(p, GREEDY, request_id=f"{tag}{i}")
            while eng.has_unfinished_requests():
                eng.step()

        run("save")  # the prompts reach the tier
        baseline = len(book.uncounted)
        inner = core._terminal

        def terminal(term: Any) -> Any:
            if term.op_id.startswith("ld"):
                raise Injected("processing a load's terminal failed")
            return inner(term)

        core._terminal = terminal
        try:
            eng.reset_prefix_cache()
            run("load")
            core._terminal = inner
            eng.reset_prefix_cache()
            run("again")  # later steps carry what the ranks are told
        finally:
            core._terminal = inner
        loads = eng.stats()["external_prefix_cache_hits"]
    assert loads > 0, "no request restored from the tier: the path was not exercised"
    assert len(book.uncounted) == baseline, (baseline, len(book.uncounted))
