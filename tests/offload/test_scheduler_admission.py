"""Admission through the OffloadScheduler: a rejected request emits no save and is counted, a
P/D producer's saves are forced through, and `admission=all` writes everything."""

from __future__ import annotations

from kvtier.config import KVTierConfig
from kvtier.metrics import Metrics
from kvtier.offload.messages import OpResult, WorkerReport
from kvtier.offload.protocols import StepRequest
from kvtier.offload.scheduler import OffloadScheduler
from tests.offload.fakes import FakeLookup, SlotView

CHUNK = 32
BLOCK = 16
# a chunk is 32 KiB: the memory tier holds 200 chunks, fewer than the ~500 decided between two
# returns of a short prompt, but enough for them once the one-off prompts stay out
BYTES_PER_TOKEN = 1024


def make(**kw: object) -> tuple[OffloadScheduler, Metrics]:
    metrics = Metrics(rank=0)
    cfg = {"chunk_size": CHUNK, "load_gate": False, "memory_bytes": 200 * CHUNK * BYTES_PER_TOKEN}
    sched = OffloadScheduler(
        KVTierConfig(**{**cfg, **{k: v for k, v in kw.items() if k != "loads"}}),
        FakeLookup(0),  # the tier never has anything: every chunk that comes back was lost
        model_id="m",
        block_size=BLOCK,
        world=1,
        metrics=metrics,
        bytes_per_token=BYTES_PER_TOKEN,
        loads=bool(kw.get("loads", True)),
        cold_misses=False,
    )
    return sched, metrics


def serve(sched: OffloadScheduler, req_id: str, tokens: list[int]) -> int:
    """One request through lookup, one step and its save terminal; chunks it saved."""
    view = SlotView(req_id, tokens)
    sched.get_num_new_matched_tokens(view, 0)
    view.advance(0, list(range(100, 100 + -(-len(tokens) // BLOCK))))
    saves = sched.build_meta([StepRequest(view, len(tokens))]).saves
    sched.process_reports([WorkerReport(0, [OpResult(s.op_id, True) for s in saves])])
    sched.request_finished(view)
    sched.build_meta([])
    return sum(len(s.chunks) for s in saves)


def one_off(i: int) -> list[int]:
    return [100_000 + i * 1000 + t for t in range(8 * CHUNK + 1)]  # 8 chunks, never again


def returning(i: int) -> list[int]:
    return [(i % 50) * 100 + t % 100 for t in range(2 * CHUNK + 1)]  # 2 chunks, back often


def teach(sched: OffloadScheduler) -> None:
    for i in range(300):
        serve(sched, f"o{i}", one_off(i))
        serve(sched, f"r{i}", returning(i))


def test_a_rejected_request_saves_nothing_and_is_counted() -> None:
    sched, metrics = make()
    teach(sched)
    assert (False, 4) in sched.planner.admission.rejected_classes
    rejected0 = metrics.value("admission_total", decision="rejected")
    assert serve(sched, "late", one_off(10_000)) == 0
    assert metrics.value("admission_total", decision="rejected") == rejected0 + 8
    # the short prompts that come back are still written
    assert serve(sched, "again", returning(7)) == 2
    assert metrics.value("admission_returns_total", decision="admitted") > 0
    assert metrics.value("admission_pressure") == 1.0


def test_a_prefill_producers_saves_are_forced_through() -> None:
    sched, metrics = make(loads=False)
    teach(sched)
    assert serve(sched, "late", one_off(10_000)) == 8
    assert metrics.value("admission_total", decision="rejected") == 0
    assert metrics.value("admission_total", decision="forced") == 300 * 10 + 8


def test_admission_all_writes_everything() -> None:
    sched, metrics = make(admission="all")
    teach(sched)
    assert serve(sched, "late", one_off(10_000)) == 8
    assert metrics.value("admission_total", decision="rejected") == 0
