"""The scheduler side of the offload core and its host adapters, in scenarios where a request
could read wrong KV bytes (or the tier could store them), or never finish; each reproduced a
defect before its fix (a request restored inside the forward let vLLM free blocks a save still
read; a lost rank report kept a load open for good).

Each test here is deterministic (no sleeps) and states the contract it checks. The vLLM
scheduler adapter is driven without vLLM: the few vLLM names it imports are stubbed in
`sys.modules` for the duration of one test, and vLLM's own calls are replayed in the order
vLLM 0.32's `Scheduler` makes them (`vllm/v1/core/sched/scheduler.py`).
"""

from __future__ import annotations

import enum
import importlib
import sys
import types
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from kvtier.config import KVTierConfig
from kvtier.metrics import Metrics
from kvtier.offload import messages
from kvtier.offload.messages import OpResult, WorkerReport
from kvtier.offload.protocols import StepRequest
from kvtier.offload.scheduler import OffloadScheduler
from tests.offload.fakes import FakeLookup, SlotView
from tests.offload.test_scheduler import BLOCK, CHUNK, blocks, make, prompt

# ---- vLLM's scheduler adapter without vLLM ------------------------------------------------------


class _CacheHitSource(enum.StrEnum):
    LOCAL = "local"
    EXTERNAL_CPU = "external_cpu"
    EXTERNAL_DISK = "external_disk"
    EXTERNAL_UNSPECIFIED = "external_unspecified"

    @classmethod
    def _missing_(cls, value: object) -> _CacheHitSource:
        return cls.EXTERNAL_UNSPECIFIED


@dataclass
class _KVConnectorStats:
    data: dict[str, Any] = field(default_factory=dict)


class _Plain:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


def _stub_modules() -> dict[str, types.ModuleType]:
    """The vLLM modules (and names) kvtier.vllm.scheduler_side imports at module level."""
    names = {
        "vllm": {},
        "vllm.v1": {},
        "vllm.v1.metrics": {},
        "vllm.v1.metrics.cache_hit_source": {"CacheHitSource": _CacheHitSource},
        "vllm.v1.core": {},
        "vllm.v1.core.kv_cache_utils": {"maybe_convert_block_hash": lambda h: h},
        "vllm.distributed": {},
        "vllm.distributed.kv_events": {
            "BlockRemoved": _Plain, "BlockStored": _Plain, "KVCacheEvent": _Plain,
        },
        "vllm.distributed.kv_transfer": {},
        "vllm.distributed.kv_transfer.kv_connector": {},
        "vllm.distributed.kv_transfer.kv_connector.v1": {},
        "vllm.distributed.kv_transfer.kv_connector.v1.base": {
            "KVConnectorMetadata": type("KVConnectorMetadata", (), {}),
            "KVConnectorWorkerMetadata": type("KVConnectorWorkerMetadata", (), {}),
        },
        "vllm.distributed.kv_transfer.kv_connector.v1.metrics": {
            "KVConnectorPromMetrics": _Plain,
            "KVConnectorStats": _KVConnectorStats,
            "PromMetric": object,
        },
    }  # fmt: skip
    mods = {}
    for name, attrs in names.items():
        mod = types.ModuleType(name)
        mod.__path__ = []  # a package, so submodules resolve
        for k, v in attrs.items():
            setattr(mod, k, v)
        mods[name] = mod
    return mods


@pytest.fixture
def vllm_side(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """`kvtier.vllm.scheduler_side`, imported over stubbed vLLM modules (undone afterwards)."""
    for name, mod in _stub_modules().items():
        monkeypatch.setitem(sys.modules, name, mod)
    for name in (
        "kvtier.vllm.scheduler_side", "kvtier.vllm.events", "kvtier.vllm.metadata",
        "kvtier.vllm.stats",
    ):  # fmt: skip
        monkeypatch.delitem(sys.modules, name, raising=False)
    module = importlib.import_module("kvtier.vllm.scheduler_side")
    yield module
    for name in list(sys.modules):
        if name.startswith("kvtier.vllm.") and name != "kvtier.vllm.request_view":
            if name not in ("kvtier.vllm.rundir", "kvtier.vllm.state_block"):
                sys.modules.pop(name, None)


class _Wiring:
    """SchedulerWiring's two per-step calls, without a lookup client or metrics merge."""

    def __init__(self, core: OffloadScheduler) -> None:
        self.core = core

    def build_meta(self, scheduled, preempted, prefill_tokens):
        return self.core.build_meta(scheduled, preempted)

    def step_reports(self, reports):
        decoded = [messages.decode_report(d) for d in reports if d]
        self.core.process_reports(decoded)
        return decoded


def _side(module: types.ModuleType, core: OffloadScheduler) -> Any:
    """A SchedulerSide over `core` (dense model, no KV events), as its __init__ leaves it."""
    side = object.__new__(module.SchedulerSide)
    side.hybrid = None
    side.wiring = _Wiring(core)
    side.metrics = core._m
    side.core = core
    side.guard = core.guard
    side.events = None
    side.state_block = None
    side.views = {}
    side._loading = set()
    side._vllm_frees = set()
    side._stated = set()
    side._dirty = True
    return side


def _vllm_request(req_id: str, tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=req_id, prompt_token_ids=tokens, num_computed_tokens=0, mm_features=None,
        lora_request=None, cache_salt=None, kv_transfer_params=None,
    )  # fmt: skip


class _Blocks:
    """vLLM's KVCacheBlocks as update_state_after_alloc reads it (one group)."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (list(self.ids),)


def _out(
    new: list[tuple[str, list[int], int, int]] = (),  # type: ignore[assignment]
    cached: list[tuple[str, list[int] | None, int, int]] = (),  # type: ignore[assignment]
    preempted: tuple[str, ...] = (),
) -> SimpleNamespace:
    """A SchedulerOutput: new = (req, block ids, computed, scheduled), cached likewise."""
    return SimpleNamespace(
        preempted_req_ids=set(preempted),
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r, block_ids=(ids,), num_computed_tokens=c)
            for r, ids, c, _ in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, *_ in cached],
            new_block_ids=[None if ids is None else (ids,) for _, ids, _, _ in cached],
            num_computed_tokens=[c for _, _, c, _ in cached],
            resumed_req_ids=set(),
        ),
        num_scheduled_tokens={r: n for r, _, _, n in (*new, *cached)},
    )


def _connector_output(module: types.ModuleType, reports: list[WorkerReport], **kw: Any) -> Any:
    from kvtier.vllm.metadata import KVTierWorkerMetadata

    return SimpleNamespace(
        kv_connector_worker_meta=KVTierWorkerMetadata([messages.encode(r) for r in reports]),
        finished_recving=set(kw.get("recving", ())),
        finished_sending=set(kw.get("sending", ())),
    )


def _decode(meta: Any) -> messages.OffloadMeta:
    return messages.decode_meta(meta.data) if meta.data else messages.OffloadMeta()


# ---- 1. vLLM: a request restored by a sync load never delays its free again --------------------


def test_vllm_request_restored_in_the_forward_keeps_its_blocks_while_its_save_reads_them(
    vllm_side: types.ModuleType,
) -> None:
    """Invariant 14: a request's blocks stay allocated until its saves reported. vLLM 0.32
    frees a finished request's blocks at once unless the connector's request_finished says
    True (or the request is WAITING_FOR_REMOTE_KVS). A load run inside the forward (the default
    on a memory-only tier, `sync_load_fraction` 0.25) never reports finished_recving, yet
    SchedulerSide put its request into `_loading` and never takes it out: when that request
    later finishes with a save in flight, request_finished answers False, vLLM frees (and
    reuses) the blocks the save lane is still copying into the tier."""
    sched, lookup, _ = make(hits=2, world=1, sync_load_fraction=1e9)
    sched.gate.observe_step(1.0)  # a measured step: loads may run inside the forward
    side = _side(vllm_side, sched)
    tokens = prompt(4 * CHUNK + 1)
    req = _vllm_request("a", tokens)
    ids = blocks(len(tokens))

    # step 1: vLLM admits it with a sync load of 2 chunks and schedules the rest of the prompt
    n, is_async = side.get_num_new_matched_tokens(req, 0)
    assert (n, is_async) == (2 * CHUNK, False)
    side.update_state_after_alloc(req, _Blocks(ids), n)
    computed = n
    rest = len(tokens) - computed
    meta = _decode(side.build_connector_meta(_out(new=[("a", ids, computed, rest)])))
    (load,) = meta.loads
    assert load.sync
    # the rank ran it inside the forward: a result, and (sync) no finished_recving
    req.num_computed_tokens = len(tokens)
    side.update_connector_output(
        _connector_output(vllm_side, [WorkerReport(0, [OpResult(load.op_id, True)])])
    )

    # step 2: a decode step; the prompt's computed chunks past the hit are saved now
    meta = _decode(side.build_connector_meta(_out(cached=[("a", [], len(tokens), 1)])))
    (save,) = meta.saves
    assert [c.block_ids for c in save.chunks] == [ids[4:6], ids[6:8]]
    # the request finishes at this step's output, its save still copying on the save lane
    stale = "a" in side._loading
    delay = side.request_finished(req)
    assert delay is True, (
        "request_finished answered False with a save in flight over the request's blocks: "
        f"vLLM frees them now (sync load's request id still in SchedulerSide._loading: {stale})"
    )
    # and what it answered instead dropped the delayed free the core asked the ranks for
    assert _decode(side.build_connector_meta(_out())).delayed_free == ["a"]


# ---- 2. a rank report the scheduler cannot read: "their ops end by their deadlines" -------------


def test_a_load_whose_report_was_lost_ends_as_failed_and_parks_nothing_after() -> None:
    """SchedulerWiring.step_reports drops a report it cannot decode. A rank's deadline only
    fails loads it has not reported yet: a load whose result was in the lost report is done
    there, never reported again, so its quorum stayed open for good: its chunks stayed in the
    scheduler's in-flight index, every later request sharing them was answered None ("ask
    again"), and the loaded request never saved again. Twice `lease_ttl_s` after it opened,
    the scheduler now ends it as failed (`report_lost`)."""
    from kvtier.offload.wiring import SchedulerWiring

    now = [0.0]
    lookup, metrics = FakeLookup(2), Metrics(rank=0)
    sched = OffloadScheduler(
        KVTierConfig(chunk_size=CHUNK, load_gate=False, sync_load_fraction=0),
        lookup, model_id="m", block_size=BLOCK, world=1, metrics=metrics,
        cold_misses=False, clock=lambda: now[0],
    )  # fmt: skip
    wiring = object.__new__(SchedulerWiring)
    wiring.core = sched
    wiring._step_t0 = None
    wiring._step_prefill = 0
    p = prompt(2 * CHUNK + 1)
    a = SlotView("a", p)
    need = sched.get_num_new_matched_tokens(a, 0)
    sched.update_state_after_alloc(a, blocks(len(p)), need)
    (load,) = sched.build_meta([]).loads
    good = messages.encode(WorkerReport(0, [OpResult(load.op_id, True)], finished_recving=["a"]))
    # the host got finished_recving through its own channel; the report bytes arrive damaged
    wiring.step_reports([good[: len(good) // 2]])
    # the rank has nothing more to say about that load: every later report is empty
    for _ in range(3):
        sched.build_meta([])
        wiring.step_reports([messages.encode(WorkerReport(0))])
    a.advance(len(p), blocks(len(p)))
    assert sched.build_meta([StepRequest(a, len(p) + 1)]).saves == []
    # a second request with the same prefix waits behind it meanwhile
    b = SlotView("b", p)
    assert sched.get_num_new_matched_tokens(b, 0) is None
    # twice lease_ttl_s on (every rank has ended its loads by lease_ttl_s), the next reports
    # end it as failed: nothing parks behind it any more
    now[0] += 2 * sched.config.lease_ttl_s
    wiring.step_reports([messages.encode(WorkerReport(0))])
    assert sched.pending_load("a") is None, (
        "the load whose report was lost is still open in the quorum: it never ends, and parks "
        "every later request sharing its chunks"
    )
    assert sched.get_num_new_matched_tokens(b, 0) is not None
    assert metrics.value("load_failures_total", reason="report_lost") == 1
