"""The host-adapter conformance suite: any host's request view must satisfy the core's
`RequestView` protocol and survive a whole lifecycle through the core untouched.

A host registers a factory `(req_id, prompt, computed, block_ids) -> view` plus a setter that
advances the host request (the host, not the core, owns its state).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.config import KVTierConfig
from kvtier.metrics import Metrics
from kvtier.offload.groups import FULL, SLIDING, ChunkGroups, GroupSpec
from kvtier.offload.messages import OpResult, WorkerReport
from kvtier.offload.protocols import RequestView, StepRequest
from kvtier.offload.scheduler import OffloadScheduler
from tests.offload.fakes import FakeLookup

CHUNK = 32
BLOCK = 16


@dataclass(frozen=True)
class HostAdapter:
    """How a host builds and advances a request view."""

    name: str
    make: Callable[[str, Sequence[int], int, Sequence[int]], Any]
    advance: Callable[[Any, int, Sequence[int]], None]
    # a host with hybrid models: advances the request with every KV cache group's table
    advance_groups: Callable[[Any, int, Sequence[Sequence[int]]], None] | None = None


class WriteGuard:
    """Wraps a view; any attribute write through the core would raise here."""

    __slots__ = ("_inner",)

    def __init__(self, inner: Any) -> None:
        object.__setattr__(self, "_inner", inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AssertionError(f"the offload core wrote {name!r} on a host request view")


def check_fields(adapter: HostAdapter) -> None:
    """The view exposes the protocol's fields with the host's values."""
    prompt = list(range(5, 5 + 3 * CHUNK))
    view = adapter.make("r1", prompt, 2 * BLOCK, [7, 8, 9])
    assert isinstance(view, RequestView), f"{adapter.name} view lacks RequestView fields"
    assert view.request_id == "r1"
    assert list(view.prompt_token_ids) == prompt
    assert view.num_computed_tokens == 2 * BLOCK
    assert list(view.block_ids) == [7, 8, 9]


def check_lifecycle(adapter: HostAdapter) -> None:
    """Lookup, allocation, load, save, terminals and finish through the core, read-only."""
    lookup = FakeLookup(hits=2)
    sched = OffloadScheduler(
        KVTierConfig(chunk_size=CHUNK, load_gate=False),
        lookup,
        model_id="conformance",
        block_size=BLOCK,
        world=2,
        metrics=Metrics(),
        cold_misses=False,  # the fake port holds chunks nobody saved
    )
    prompt = list(range(100, 100 + 3 * CHUNK + 7))
    n_blocks = -(-len(prompt) // BLOCK)
    raw = adapter.make("r1", prompt, 0, [])
    view = WriteGuard(raw)
    need = sched.get_num_new_matched_tokens(view, 0)
    assert need == 2 * CHUNK
    blocks = list(range(n_blocks))
    adapter.advance(raw, 0, blocks)
    assert sched.update_state_after_alloc(view, blocks, need) == need
    (load,) = sched.build_meta([]).loads
    reports = [WorkerReport(r, [OpResult(load.op_id, True)]) for r in range(2)]
    (outcome,) = sched.process_reports(reports)
    assert outcome.ok and outcome.tokens == need
    adapter.advance(raw, need, blocks)
    meta = sched.build_meta([StepRequest(view, len(prompt))])
    (save,) = meta.saves
    assert [c.block_ids for c in save.chunks] == [blocks[4:6]]
    sched.process_reports([WorkerReport(r, [OpResult(save.op_id, True)]) for r in range(2)])
    assert sched.request_finished(view) is False
    # the only lease not released by the scheduler is the loaded one: each rank releases it
    # itself right after its load (OffloadWorker), so the client never double-releases it
    assert lookup.outstanding() == {load.lookup_id}
    assert not sched.has_pending_work()


def check_hybrid_lifecycle(adapter: HostAdapter) -> None:
    """A hybrid registration (full attention + a 16-token sliding window): the load writes
    every group above the floor and below the window the host keeps, the save carries every
    group's positions of its chunks, through the core, read-only."""
    assert adapter.advance_groups is not None, f"{adapter.name} has no hybrid block tables"
    layout = ChunkGroups(
        [GroupSpec(FULL, BLOCK, ("fa",)), GroupSpec(SLIDING, BLOCK, ("sw",), reach=BLOCK - 1)],
        CHUNK,
    )
    lookup = FakeLookup(hits=2)
    sched = OffloadScheduler(
        KVTierConfig(chunk_size=CHUNK, load_gate=False),
        lookup,
        model_id="conformance",
        block_size=BLOCK,
        world=2,
        metrics=Metrics(),
        cold_misses=False,
        groups=layout,
    )
    prompt = list(range(100, 100 + 3 * CHUNK + 7))
    raw = adapter.make("r1", prompt, 0, [])
    view = WriteGuard(raw)
    need = sched.get_num_new_matched_tokens(view, 0)
    assert need == 2 * CHUNK
    full = list(range(7))
    # the host keeps a 16-token window: at 64 tokens its first 3 blocks are null (-1)
    window = [-1, -1, -1, 23, 24, 25, 26]
    adapter.advance_groups(raw, 0, [full, window])
    assert sched.update_state_after_alloc(view, full, need) == need
    (load,) = sched.build_meta([]).loads
    assert [c.block_ids for c in load.chunks] == [[0, 1, -1], [2, 3, 23]]
    reports = [WorkerReport(r, [OpResult(load.op_id, True)]) for r in range(2)]
    (outcome,) = sched.process_reports(reports)
    assert outcome.ok and outcome.tokens == need
    adapter.advance_groups(raw, need, [full, window])
    (save,) = sched.build_meta([StepRequest(view, len(prompt), need)]).saves
    assert [c.block_ids for c in save.chunks] == [[4, 5, 25]]
    sched.process_reports([WorkerReport(r, [OpResult(save.op_id, True)]) for r in range(2)])
    assert sched.request_finished(view) is False
    assert lookup.outstanding() == {load.lookup_id}
    assert not sched.has_pending_work()


CHECKS = (check_fields, check_lifecycle)
# hosts whose adapter serves hybrid models (advance_groups) run these too
HYBRID_CHECKS = (check_hybrid_lifecycle,)
