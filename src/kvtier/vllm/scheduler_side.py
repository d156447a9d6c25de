"""The scheduler role of KVTierConnector (vLLM's EngineCore): the engine's `OffloadScheduler`,
its all-rank `LookupClient`, vLLM's requests and scheduler outputs adapted to the core, and every
rank's metrics merged for vLLM's /metrics."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.config import KVTierConfig
from kvtier.offload.groups import ChunkGroups, GroupSpec
from kvtier.offload.protocols import StepRequest
from kvtier.offload.steps import STATS
from kvtier.offload.wiring import SchedulerWiring, encode_step_meta
from kvtier.store import registry
from kvtier.topology import Topology, resolve
from kvtier.vllm.events import KVEvents, event_groups, kv_events_enabled
from kvtier.vllm.metadata import KVTierConnectorMetadata, KVTierWorkerMetadata
from kvtier.vllm.request_view import VLLMRequestView
from kvtier.vllm.rundir import offload_spec
from kvtier.vllm.state_block import StateBlockSize
from kvtier.vllm.stats import KVTierStats, StatsDelta

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["SchedulerSide"]

log = logging.getLogger("kvtier")

T = TypeVar("T")

_READY_TIMEOUT_S = 30.0
_STATS_EVERY_S = 1.0
# vLLM's null block (BlockPool hands block 0 out as the placeholder of a block a sliding-window
# group dropped): never a block of the request's own
_NULL_BLOCK = 0


def _bytes_per_token(
    kv_cache_config: KVCacheConfig | None, block_size: int, hybrid: ChunkGroups | None = None
) -> int | None:
    """Per-rank KV bytes of one token over all layers, for the load gate's rate seeds (a hybrid
    model's sliding-window groups count the blocks a chunk stores, not the chunk's)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if not groups:
        return None
    if hybrid is not None:
        total = sum(
            g.kv_cache_spec.page_size_bytes * len(g.layer_names) * n
            for g, n in zip(groups, hybrid.positions, strict=True)
        )
        return max(1, total // hybrid.chunk)
    total = sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in groups)
    return max(1, total // block_size)


def _held(ids: list[int] | tuple[int, ...]) -> list[int]:
    """A hybrid group's block table with vLLM's null block as -1 (a block it dropped)."""
    return [-1 if b == _NULL_BLOCK else b for b in ids]


def _offloadable(request: Request) -> bool:
    """Keys are chained over token ids only, so requests whose KV also depends on something
    else (images, LoRA weights, a cache salt, prompt embeddings: their token ids are
    placeholders) or that have no token ids stay out of the tier."""
    return (
        request.prompt_token_ids is not None
        and getattr(request, "prompt_embeds", None) is None
        and not getattr(request, "mm_features", None)
        and getattr(request, "lora_request", None) is None
        and getattr(request, "cache_salt", None) is None
    )


class SchedulerSide:
    """EngineCore half: lookups, load/save decisions, op terminals, merged metrics."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        config: KVTierConfig,
        run_dir: Path,
        model_id: str,
        block_size: int,
        kv_cache_config: KVCacheConfig | None,
        groups: tuple[GroupSpec, ...] | None = None,
    ) -> None:
        # the scheduler is no rank; topology comes from parallel_config, never a guess of 1
        topo: Topology = resolve(vllm_config, rank=0)
        role = str(vllm_config.kv_transfer_config.kv_role or "kv_both")
        spec = offload_spec(config, vllm_config, topo, run_dir, model_id)
        # a hybrid model: every group's block table is learned and every chunk carries each
        # group's positions
        self.hybrid = ChunkGroups(groups, config.chunk_size) if groups else None
        self.wiring = SchedulerWiring(
            spec,
            block_size=block_size,
            bytes_per_token=_bytes_per_token(kv_cache_config, block_size, self.hybrid),
            groups=self.hybrid,
            # prefill/decode hand-off through a shared tier: a producer only saves, a consumer
            # only loads
            loads=role != "kv_producer",
            saves=role != "kv_consumer",
        )
        self.metrics = self.wiring.metrics
        # a state is kept only where a prefill step ends on vLLM's block: that block must stay
        # the state groups' one
        self.state_block: StateBlockSize | None = None
        if self.hybrid is not None and self.hybrid.states:
            self.state_block = StateBlockSize(vllm_config.cache_config, self.hybrid.block_size)
            self.metrics.set_state_groups(len(self.hybrid.states))
        self.collector = self.wiring.collector
        self.client = self.wiring.client
        self.core = self.wiring.core
        self.guard = self.core.guard
        self.scope = self.wiring.scope
        # kept only when vLLM publishes KV events (routers learn what the tiers hold)
        self.events: KVEvents | None = None
        if kv_events_enabled(vllm_config):
            groups = []
            if self.hybrid is not None:
                groups = event_groups(kv_cache_config, self.hybrid.positions)
            self.events = KVEvents(block_size, config.chunk_size, self.metrics, groups)
        self.views: dict[str, VLLMRequestView] = {}
        # requests with a load in flight: vLLM itself delays their frees until finished_recving
        self._loading: set[str] = set()
        self._vllm_frees: set[str] = set()
        # requests whose views hold this step's boundary states (cleared next step)
        self._stated: set[str] = set()
        self._stats = StatsDelta()
        self._stats_at = -_STATS_EVERY_S
        # set by every hook that may move a metric; the merged view is walked only then
        self._dirty = True
        log.info("%s; %s; kv_role=%s", config.describe(), topo.describe(), role)
        if self.hybrid is not None:
            log.info("kvtier: hybrid model, KV cache groups per chunk: %s", self.hybrid.describe())

    def take_stats(self) -> KVTierStats | None:
        """What changed in the merged kvtier metrics since the last call (None if nothing)."""
        return self.guard.run("get_kv_connector_stats", None, self._take_stats, lambda: None)

    def _take_stats(self) -> KVTierStats | None:
        if not self._dirty:
            return None
        now = time.monotonic()
        if now - self._stats_at < _STATS_EVERY_S and (self.views or self.core.has_pending_work()):
            # a walk of every family costs most of a millisecond, and vLLM asks every
            # step: while requests are live, at most one per interval (they make more steps
            # come); the step that leaves the tier idle always hands the rest over
            return None
        self._dirty = False
        self._stats_at = now
        with self.core.clock.time(STATS):
            return self._stats.take(self.collector.collect())

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """(tokens the tier loads beyond vLLM's hit, load_async): a load predicted to take a
        small share of a step runs inside the forward of the step that admits the request
        (False), others on the ranks' load lanes while it waits in WAITING_FOR_REMOTE_KVS."""
        rid = request.request_id
        return self.guard.run(
            "get_num_new_matched_tokens",
            rid,
            lambda: self._matched(request, num_computed_tokens),
            lambda: self._quarantine_to(rid, (0, False)),
        )

    def _matched(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.state_block is not None:
            self.state_block.keep()  # before vLLM splits this request's first prefill step
        if not _offloadable(request):
            return 0, False
        self._dirty = True
        view = self.views.get(request.request_id)
        if view is None:
            view = self.views[request.request_id] = VLLMRequestView(request)
        n = self.core.get_num_new_matched_tokens(view, num_computed_tokens)
        if n is None:
            return None, False  # not known yet: vLLM keeps it waiting and asks next step
        return (n, self.core.load_is_async(request.request_id)) if n > 0 else (0, False)

    def _quarantine_to(self, req_id: str, answer: T, block_ids: list[int] | None = None,
                       counted: int = 0) -> T:  # fmt: skip
        self._dirty = True
        self.core.quarantine(req_id, block_ids, counted)
        return answer

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        """All of the request's external tokens under the deepest tier its lookup found the
        run in (vLLM has no remote source: a shared store is external_unspecified)."""
        if num_external_tokens <= 0:
            return {}

        def sources() -> dict[CacheHitSource, int]:
            tier = self.core.hit_tier(request.request_id)
            return {CacheHitSource(registry.hit_source(tier)): num_external_tokens}

        return self.guard.run(
            "get_external_cache_hit_sources",
            request.request_id,
            sources,
            lambda: {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens},
        )

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Learn the request's block table; hand the core a promised load's blocks."""
        view = self.views.get(request.request_id)
        if view is None:
            return
        self._dirty = True
        got: list[list[int]] = []
        hybrid = self.hybrid is not None
        tables: list[list[list[int]]] = []

        def learn() -> None:
            # vLLM's table is noted before anything else may fail: a load vLLM already counts
            # must reach the ranks over these blocks even then (to fail there), or its parked
            # request waits for a finished_recving nobody sends
            if hybrid:
                groups = [_held(ids) for ids in blocks.get_block_ids()]
                tables.append(groups)
                block_ids = max(groups, key=len)
                got.append(list(block_ids))
                view.set_group_block_ids(groups)
                self._allocated(
                    "update_state_after_alloc", self._handed_out(request.request_id, groups)
                )
            else:
                (block_ids,) = blocks.get_block_ids()
                got.append(list(block_ids))
                view.set_block_ids(block_ids)
            self.core.update_state_after_alloc(view, block_ids, num_external_tokens)

        # vLLM counts the promised tokens as coming: a failure sends a load the ranks fail, so
        # vLLM recomputes those blocks (a request parked for a load nobody makes would wait
        # forever)
        self.guard.run(
            "update_state_after_alloc",
            request.request_id,
            learn,
            lambda: self._quarantine_to(
                request.request_id,
                None,
                (tables[0] if hybrid else got[0]) if got else None,  # type: ignore[arg-type]
                num_external_tokens,
            ),
        )

    def build_connector_meta(self, out: SchedulerOutput) -> KVTierConnectorMetadata:
        """Preemptions, block tables and computed tokens of this step -> encoded OffloadMeta."""
        if out.preempted_req_ids:
            self._dirty = True
        for req_id in out.preempted_req_ids or ():
            self._per_request(req_id, lambda req_id=req_id: self._preempted(req_id))
        scheduled: list[StepRequest] = []
        prefill = 0
        if self.hybrid is not None:
            # copy-on-write targets are written this step too
            copies = getattr(out, "kv_cache_block_copies", None) or ()
            self._allocated("build_connector_meta", (int(c.dst_block_id) for c in copies))
            if self.hybrid.states:
                self._learn_states(out)
        for new in out.scheduled_new_reqs:
            item = self._per_request(new.req_id, lambda new=new: self._scheduled_new(out, new))
            if item is not None:
                scheduled.append(item)
                prefill += _prefill_tokens(item.view, new.num_computed_tokens,
                                           out.num_scheduled_tokens.get(new.req_id, 0))  # fmt: skip
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            item = self._per_request(req_id, lambda i=i: self._scheduled_cached(out, i))
            if item is not None:
                scheduled.append(item)
                prefill += _prefill_tokens(item.view, cached.num_computed_tokens[i],
                                           out.num_scheduled_tokens.get(req_id, 0))  # fmt: skip
        meta = self.wiring.build_meta(scheduled, out.preempted_req_ids or (), prefill)
        if self.events is not None:
            events = self.events
            for op in (*meta.saves, *meta.loads):
                view = self.views.get(op.req_id)
                if view is not None:
                    self._per_request(
                        op.req_id, lambda view=view, op=op: events.learn(view, op.first_chunk,
                                                                         op.chunks))  # fmt: skip
        if self._vllm_frees:
            meta.delayed_free = [r for r in meta.delayed_free if r not in self._vllm_frees]
            self._vllm_frees.clear()
        for op in meta.loads:
            if not op.sync:
                # only a parked request waits for finished_recving (vLLM holds its blocks
                # until then); a load inside the forward sends none, and its request's id left
                # here made request_finished let vLLM free blocks a save was still reading
                self._loading.add(op.req_id)
        return KVTierConnectorMetadata(encode_step_meta(meta))

    def _learn_states(self, out: SchedulerOutput) -> None:
        """This step's boundary states (vLLM's exact hand-off: a state group's table is not
        append-only) onto their requests' views: boundary -> each state group's block."""
        for req_id in self._stated:
            view = self.views.get(req_id)
            if view is not None:
                view.state_blocks = {}
        self._stated = set()
        state = getattr(out, "kv_connector_block_state", None)
        handoffs = getattr(state, "boundary_state_offloads", None) or {}
        for req_id, entries in handoffs.items():
            view = self.views.get(req_id)
            if view is not None:
                self._per_request(req_id, lambda view=view, entries=entries: self._states_of(
                    view, entries))  # fmt: skip

    def _states_of(self, view: VLLMRequestView, entries: list[tuple[int, int, int]]) -> None:
        """One request's hand-off: the chunk boundaries where every state group's state is."""
        assert self.hybrid is not None
        order = {g: i for i, g in enumerate(self.hybrid.states)}
        by_boundary: dict[int, list[int]] = {}
        for group, block, boundary in entries:
            i = order.get(int(group))
            if i is None or int(block) == _NULL_BLOCK or int(boundary) % self.hybrid.chunk:
                continue
            ids = by_boundary.setdefault(int(boundary), [-1] * len(order))
            ids[i] = int(block)
        view.state_blocks = {b: ids for b, ids in by_boundary.items() if min(ids) >= 0}
        self._stated.add(view.request_id)

    def _per_request(self, req_id: str, body: Callable[[], T]) -> T | None:
        """One request's share of a step hook: a failure quarantines that request only."""
        return self.guard.run("build_connector_meta", req_id, body,
                              lambda: self._quarantine_to(req_id, None))  # fmt: skip

    def _preempted(self, req_id: str) -> None:
        view = self.views.get(req_id)
        # reset_prefix_cache(reset_running_requests=True) preempts and re-admits in one
        # step: a load still unsent now was promised to the re-admission, not withdrawn
        if view is not None and self.core.pending_load(req_id) is None:
            self.core.request_preempted(view)
            view.set_block_ids(())
        elif view is not None:
            self.core.mark_readmitted(req_id)

    def _scheduled_new(self, out: SchedulerOutput, new: NewRequestData) -> StepRequest | None:
        view = self.views.get(new.req_id)
        if view is None:
            return None
        if self.hybrid is not None:
            groups = [_held(ids) for ids in new.block_ids]
            view.set_group_block_ids(groups)
            self._allocated("build_connector_meta", self._handed_out(new.req_id, groups))
        else:
            view.set_block_ids(new.block_ids[0])
        n = out.num_scheduled_tokens.get(new.req_id, 0)
        return StepRequest(view, new.num_computed_tokens + n, new.num_computed_tokens)

    def _allocated(self, hook: str, block_ids: Iterable[int]) -> None:
        """Blocks vLLM handed out this step, for the core to cancel the saves reading them as
        window or state blocks. Never raises (an exception out of a step hook ends
        EngineCore): when the check fails, every save in flight is cancelled instead (a
        cancelled save commits nothing), since any of them may read a reused block."""
        self.guard.run(hook, None,
                       lambda: self.core.blocks_allocated(block_ids),
                       self.core.ops.cancel_every_save)  # fmt: skip

    def _handed_out(self, req_id: str, groups: list[list[int]]) -> list[int]:
        """The blocks a new request's allocation may write: past its own prefix-cache hit
        (those blocks are shared and only read), in every group."""
        skip = self.core.hbm_floor(req_id) // self.core.block_size
        return [b for ids in groups for b in ids[skip:] if b >= 0]

    def _scheduled_cached(self, out: SchedulerOutput, i: int) -> StepRequest | None:
        cached = out.scheduled_cached_reqs
        req_id = cached.req_ids[i]
        view = self.views.get(req_id)
        if view is None:
            return None
        new_ids = cached.new_block_ids[i]
        if self.hybrid is not None:
            groups = [_held(ids) for ids in new_ids] if new_ids is not None else []
            self._allocated("build_connector_meta", (b for ids in groups for b in ids if b >= 0))
            if req_id in cached.resumed_req_ids:
                view.set_group_block_ids(groups)
            elif groups:
                view.extend_group_block_ids(groups)
        elif req_id in cached.resumed_req_ids:
            view.set_block_ids(new_ids[0] if new_ids is not None else ())
        elif new_ids is not None:
            view.extend_block_ids(new_ids[0])
        n = out.num_scheduled_tokens.get(req_id, 0)
        before = cached.num_computed_tokens[i]
        return StepRequest(view, before + n, before)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Every rank's report (op results, metrics) into the core's quorum."""
        data: list[bytes] = []
        worker_meta = output.kv_connector_worker_meta
        if worker_meta is not None:
            if not isinstance(worker_meta, KVTierWorkerMetadata):
                raise TypeError(
                    f"worker metadata is {type(worker_meta).__name__}, not KVTierWorkerMetadata"
                )
            self._dirty = True
            data = list(worker_meta.reports)
        for report in self.wiring.step_reports(data):
            if report.changes and self.events is not None:
                self.events.changed(report.changes)
        for req_id in output.finished_recving or ():
            self._loading.discard(req_id)

    def request_finished(self, request: Request) -> bool:
        """True when vLLM must keep the blocks until the workers report finished_sending."""
        view = self.views.pop(request.request_id, None)
        if view is None:
            return False
        self._dirty = True
        delay = self.core.request_finished(view)
        if request.request_id in self._loading:
            # aborted while its load is in flight: vLLM holds the blocks until the load's
            # finished_recving, so a finished_sending from us would free them a second time
            if delay:
                self._vllm_frees.add(request.request_id)
            return False
        return delay

    def retention_params(self, request_id: str) -> dict[str, Any] | None:
        """What the request's retention hint was granted, as the `kv_transfer_params` vLLM
        returns to the client (None without a hint)."""
        decision = self.core.planner.retention_decision(request_id)
        return None if decision is None else {"kvtier_retention": decision.as_dict()}

    def take_events(self) -> list[KVCacheEvent]:
        """KV-cache events for what the tiers stored and dropped since the last step."""
        events = self.events
        if events is None:
            return []
        return self.guard.run("take_events", None, events.take, list)

    def reset(self) -> None:
        """A new namespace epoch: every chunk stored before is unreachable, and routers are told
        it left the tiers."""
        self._dirty = True
        self.core.reset()
        if self.events is not None:
            self.events.clear()

    def shutdown(self) -> None:
        """Close the lookup client."""
        self.wiring.close()


def _prefill_tokens(view: VLLMRequestView, computed: int, scheduled: int) -> int:
    """Prompt tokens this step computes for the request (the load gate's prefill-rate sample)."""
    prompt = len(view.prompt_token_ids)
    return max(0, min(computed + scheduled, prompt) - computed)
