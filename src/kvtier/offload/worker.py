"""OffloadWorker: the per-rank half of the offload core.

It owns the rank's TierStack, codec and LookupServer, and two lanes (threads bound to the KV
device, each with a kernel and a copy stream on CUDA). Saves leave the forward path:
`wait_for_save` only records where the forward stands and queues the step's saves; the save
lane pipelines them (`saving.py`): up to `transfer_depth` chunks gathered and on the link while
the oldest is committed. Asynchronous loads run on the load lane the same way (`loading.py`).
Synchronous loads (`LoadOp.sync`) are queued by the thread that calls `start_load_kv`, on a lane
of its own, and the compute stream waits for them on the device: the forward thread never waits
on the host for them, and the forward reads their blocks after they landed. An operation
reports only after its copies completed; a preempted request's saves are cancelled and never
commit bytes read after its blocks were given back.

Every load reports exactly once, even when the lane cannot: a load still unfinished
`lease_ttl_s` after it was queued (its leases have expired by then) is reported failed with
reason `deadline`, and the lane writes no further block for it when it comes back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from kvtier import cpus
from kvtier.config import KVTierConfig
from kvtier.errors import StartupError
from kvtier.keys import Namespace
from kvtier.lookup import LookupServer
from kvtier.lookup.endpoints import key_dir_of
from kvtier.metrics import Metrics, snapshot
from kvtier.offload import messages
from kvtier.offload.codec import PageCodec
from kvtier.offload.device import DeviceOps, Lane, Mark, ops_for
from kvtier.offload.gil import apply_switch_interval
from kvtier.offload.group_codec import GroupedCodec, codec_for, state_parts
from kvtier.offload.hooks import HOOK_ERROR, HookGuard
from kvtier.offload.lane import WorkLane
from kvtier.offload.loading import (
    Buffers,
    LoadPath,
    LoadRun,
    PendingLoad,
    StepWaves,
    SyncMarks,
)
from kvtier.offload.messages import (
    LoadOp,
    OffloadMeta,
    OpResult,
    SaveOp,
    TierChange,
    WorkerReport,
)
from kvtier.offload.outbox import Outbox
from kvtier.offload.pages import KVCacheDescription, KVPages, describe_pages
from kvtier.offload.rank_ops import RankOps
from kvtier.offload.saving import PREEMPTED, PendingSave, SavePath, SaveRun
from kvtier.offload.selftest import SELF_TEST_KEY, codec_round_trip, fail_startup, padding
from kvtier.offload.steps import LOAD, REPORT, SAVE, HookClock, start
from kvtier.offload.waves import Waves, plan_waves
from kvtier.store.arena import check_host_memory
from kvtier.store.factory import build_stack
from kvtier.store.stack import TierStack

log = logging.getLogger("kvtier")
# a rank's metrics ride along its reports, a busy rank's at most this often (an idle rank's
# with every report that has news), and an idle engine's steps refresh them this often
_SNAPSHOT_EVERY_S = 1.0
_GIB = 1 << 30
DEADLINE = "deadline"  # load failure reason: the lane did not finish it within lease_ttl_s
_SELF_TEST_TIMEOUT_S = 120.0
# close() waits this long for copies still in flight before it lets the arena go
_CLOSE_WAIT_S = 10.0
__all__ = ["DEADLINE", "PREEMPTED", "OffloadWorker"]


@dataclasses.dataclass(frozen=True, slots=True)
class RankIdentity:
    """Who a rank is: its place in the world, the model it serves, where its lookup server
    listens (None: no server) and how many ranks share its host's memory."""

    rank: int
    world: int
    model_id: str
    lookup_endpoint: str | None
    ranks_on_host: int = 1
    tp_size: int = 0  # ranks per pipeline stage (0: the whole world is one stage)

    @property
    def first_of_stage(self) -> bool:
        """The first TP rank of its pipeline stage (ranks are pp-major, as in vLLM)."""
        return self.rank % (self.tp_size or self.world) == 0

    @property
    def tag(self) -> str:
        return f"kvtier[rank {self.rank}/{self.world}]"


@dataclasses.dataclass(slots=True)
class Datapath:
    """A registered rank's copy machinery: the save and load paths and their lanes, and the
    sync loads' own path and lane (queued from the forward's thread: the lane is made there,
    on first use)."""

    saves: SavePath
    loads: LoadPath
    sync_loads: LoadPath
    save_lane: WorkLane
    load_lane: WorkLane
    sync_lane: Lane | None = None


class OffloadWorker:
    """Loads and saves KV chunks of one rank and answers its lookups."""

    def __init__(
        self,
        config: KVTierConfig,
        *,
        rank: int,
        world: int,
        model_id: str,
        metrics: Metrics,
        lookup_endpoint: str | None,
        ranks_on_host: int = 1,
        clock: Callable[[], float] = time.monotonic,
        ops: DeviceOps | None = None,
        report_changes: bool = False,
        compute_cpus: frozenset[int] | None = None,
        tp_size: int = 0,
    ) -> None:
        """`tp_size` is the ranks per pipeline stage (0: one stage); `clock` times the per-load
        deadline (`config.lease_ttl_s` after a load is queued); `ranks_on_host` sizes the
        host-RAM check (every rank of every replica on this host);
        `ops` drives the KV device (default: the device the KV cache lives on);
        `report_changes` puts what the tiers store and drop into the reports (KV events);
        `compute_cpus` are the cores the host bound its compute threads to on this machine
        (None: it binds none), which `config.lane_cpus` 'auto' keeps the copy lanes off."""
        self.config = config
        self.me = RankIdentity(rank, world, model_id, lookup_endpoint, ranks_on_host, tp_size)
        self.metrics = metrics
        self.guard = HookGuard(self.metrics, self.tag)
        self.stack: TierStack | None = None
        self.codec: PageCodec | GroupedCodec | None = None
        self.pages: KVPages | None = None
        self.server: LookupServer | None = None
        self._ops = ops
        self.outbox = Outbox(rank, metrics)
        self.degraded = ""  # why this rank fails every op at once ("": it serves)
        self._clock = clock
        self._book: RankOps[PendingLoad, PendingSave] = RankOps()
        self._path: Datapath | None = None  # the copy paths and lanes, once registered
        self.clock = HookClock(metrics)
        self._step_t0: float | None = None
        self._selftest_ids = itertools.count()
        self._report_changes = report_changes
        self.placement = cpus.Placement.of(config.lane_cpus, compute_cpus)
        # layer-by-layer sync loads (`enable_layer_waves`): the plan, and this step's wave
        # marks not yet joined into the compute stream (None: joined)
        self._waves: Waves | None = None
        self._wave_marks: list[Mark | None] = []
        # this step's sync loads, reported loaded before the forward (a failed join overrules)
        self._step_sync: list[LoadOp] = []

    @property
    def rank(self) -> int:
        return self.me.rank

    @property
    def tag(self) -> str:
        return self.me.tag

    @property
    def lookup_endpoint(self) -> str | None:
        return self.me.lookup_endpoint

    # ---- startup ------------------------------------------------------------------------------

    def register_kv_caches(self, desc: KVCacheDescription) -> None:
        """Build pages, codec, tiers, lanes and lookup server for this rank's KV cache, then
        self-test the codec on real blocks; any failure stops startup."""
        chunk = self.config.chunk_size
        if chunk % desc.block_size:
            raise StartupError(
                f"{self.tag}: chunk_size={chunk} is not a multiple of the KV block size "
                f"{desc.block_size}; set chunk_size to a multiple of {desc.block_size}"
            )
        self.pages = pages = describe_pages(desc)
        ops = self._ops = self._ops or ops_for(pages.device)
        # on every backend: an asynchronous device's lanes still need the GIL to issue each
        # chunk and to wake from its event, and beside a forward running Python the
        # interpreter's 5 ms starved them (bench row datapath.sim.gil)
        apply_switch_interval(self.config, self.tag)
        # a hybrid registration gets one codec per KV cache group (kvtier.offload.group_codec)
        self.codec = codec = codec_for(pages, chunk // desc.block_size, ops)
        pad = sum(p.length for p in padding(pages, [0]))
        if pad:
            log.warning(
                "%s: every KV block carries %d bytes of page padding (layout %s) that kvtier "
                "does not move; the self-test checks that nothing writes there",
                self.tag,
                pad,
                pages.layout,
            )
        ns = Namespace(
            model_id=self.me.model_id,
            layout_fingerprint=pages.fingerprint,
            dtype=pages.dtype,
            chunk_size=chunk,
            tp_size=self.me.world,
            tp_rank=self.rank,
            tenant=self.config.tenant,
        )
        check_host_memory(self.config.memory_bytes, self.me.ranks_on_host, self.tag)
        # a replicated layout keeps one copy below memory for every rank of a stage: the
        # stage's first rank writes it (a later stage's layers are another layout: rank 0's
        # copy is not theirs)
        shared = dataclasses.replace(ns, replicated=True) if desc.replicated else ns
        self.stack = build_stack(
            self.config,
            ns.fingerprint,
            codec.chunk_bytes,
            self.metrics,
            lower_namespace=shared.fingerprint,
            writes_lower=not desc.replicated or self.me.first_of_stage,
            state_parts=state_parts(codec),
            engine="" if self.lookup_endpoint is None else str(key_dir_of(self.lookup_endpoint)),
        )
        if self._report_changes:
            self.stack.listen(self._tier_changed)
        ops.host_locked(self.stack.memory.page_locked)
        try:
            self._start_lanes(ops, codec.chunk_bytes)
            if self.config.self_test:
                self._self_test(desc)
        except BaseException:
            self.close()
            raise
        if self.lookup_endpoint is not None:
            self.server = LookupServer(self.rank, self.stack, self.lookup_endpoint, self.metrics)
            self.server.start()
        log.info(
            "%s: registered %d KV tensors (%s), %d B/chunk, namespace %s%s, tiers %s, "
            "lookup server %s",
            self.tag,
            len(desc.tensors),
            pages.describe(),
            codec.chunk_bytes,
            ns.hex,
            f" (replicated: lower tiers {shared.hex}, written by rank 0)"
            if desc.replicated
            else "",
            "+".join(self.stack.tiers),
            self.lookup_endpoint,
        )

    def _tier_changed(self, change: str, tier: str, key: bytes) -> None:
        """A tier stored or dropped a chunk (called under that tier's lock: record only)."""
        if key != SELF_TEST_KEY:
            self.outbox.change(TierChange(change, tier, key))

    def _start_lanes(self, ops: DeviceOps, chunk_bytes: int) -> None:
        assert self.stack is not None and self.codec is not None
        depth = self.config.transfer_depth
        saves = SavePath(
            self.stack,
            self.codec,
            [ops.staging(chunk_bytes) for _ in range(depth)],
            self._save_reported,
            self.guard,
            self.tag,
            dma=ops.dma,
            moved=lambda path: self.metrics.transfer_chunk("save", path).inc(),
            persistent=self.config.persistent_ring,
        )

        def load_path(report: Callable[[LoadRun], None]) -> LoadPath:
            assert self.stack is not None and self.codec is not None
            bufs = [Buffers(ops.staging(chunk_bytes)) for _ in range(depth)]
            return LoadPath(
                self.stack, self.codec, ops, bufs, report, self.guard, self.tag,
                moved=lambda path: self.metrics.transfer_chunk("load", path).inc(),
                persistent=self.config.persistent_ring,
            )  # fmt: skip

        self._path = path = Datapath(
            saves,
            load_path(self._load_reported),
            load_path(lambda run: None),
            self._lane("save", ops),
            self._lane("load", ops),
        )
        path.load_lane.start()
        path.save_lane.start()
        placed = self.placement.startup_line()
        if placed is not None:
            log.info("%s: %s", self.tag, placed)

    def _lane(self, kind: str, ops: DeviceOps) -> WorkLane:
        cpu = self.metrics.lane_cpu(kind)
        return WorkLane(f"kvtier-{kind}-{self.rank}", ops, self.placement.lanes, cpu=cpu)

    def _self_test(self, desc: KVCacheDescription) -> None:
        """Pattern -> real blocks -> save path -> clear -> load path -> compare -> restore."""
        assert self.codec is not None and self.stack is not None
        assert self._path is not None
        stack, key, dp = self.stack, SELF_TEST_KEY, self._path

        codec = self.codec

        def save(block_ids: Sequence[int]) -> None:
            job = PendingSave(SaveOp("self-test", "self-test", [], 0), self._ops_fence())
            saves = dp.saves
            assert saves is not None
            # the chunk and, for a model with state layers, its boundary's state record
            for ref in codec.records(codec.refs(key, block_ids)):
                reason = self._save_lane_call(lambda lane, ref=ref: saves.one(lane, job, ref))
                if reason:
                    raise RuntimeError(f"the save path failed: {reason}")

        def load(block_ids: Sequence[int]) -> None:
            lease = f"kvtier-self-test-{next(self._selftest_ids)}"
            if stack.lookup([key], lease) < 1:
                stack.release(lease)
                raise RuntimeError("the saved chunk is not in the tier")
            # the load path releases the lease once it read the chunk
            op = LoadOp("self-test", "self-test", lease, codec.refs(key, block_ids), 0)
            p = PendingLoad(op, 0.0, 0.0, self._ops_fence())
            loads = dp.loads
            assert loads is not None
            t0 = time.perf_counter()
            run = self._load_lane_call(lambda lane: loads.one(lane, p))
            if run.reason or not run.served:
                raise RuntimeError(f"the load path failed: {run.reason or 'nothing read'}")
            self.outbox.selftest_load = (self.config.chunk_size, time.perf_counter() - t0)

        try:
            bpc = self.config.chunk_size // desc.block_size  # a chunk's blocks in each group
            codec_round_trip(desc, self.codec.ops, bpc, save, load, self.pages)
        except Exception as e:
            assert self.pages is not None
            raise fail_startup(self.tag, self.pages.device, self.pages.layout, e) from e
        log.info(
            "%s: self-test moved one chunk (%d B) through the codec on %s and back",
            self.tag,
            self.codec.chunk_bytes,
            self.pages.device if self.pages else "?",
        )

    def _save_lane_call(self, fn: Callable[[Lane], str]) -> str:
        assert self._path is not None
        return self._path.save_lane.call(fn, _SELF_TEST_TIMEOUT_S)

    def _load_lane_call(self, fn: Callable[[Lane], LoadRun]) -> LoadRun:
        assert self._path is not None
        return self._path.load_lane.call(fn, _SELF_TEST_TIMEOUT_S)

    def _ops_fence(self) -> object | None:
        return self._ops.fence() if self._ops is not None else None

    def enable_layer_waves(self, layers: Sequence[str]) -> bool:
        """The host's forward calls `wait_for_layer_load` before each of `layers` (in this
        order) reads its KV: sync loads then land wave by wave and each layer waits only for
        its own wave. Only a host that keeps that promise for every layer may call this
        (vLLM does not under full CUDA graphs). False, logged, where it gains nothing: a
        synchronous device, a cross-layer layout, a hybrid's groups."""
        if self.pages is None or self.codec is None or self._ops is None:
            raise RuntimeError("enable_layer_waves before register_kv_caches")
        why = ""
        # a tensor no named layer waits for would be read by a layer without its wave
        unnamed = sorted({r.tensor for g in self.pages.segments for r in g.runs} - set(layers))
        if not self._ops.asynchronous:
            why = "the device copies synchronously"
        elif unnamed:
            why = f"the host names no layer for {len(unnamed)} KV tensor(s), e.g. {unnamed[0]!r}"
        elif not isinstance(self.codec, PageCodec):
            why = "a hybrid model's groups move by gather and scatter"
        else:
            self._waves = plan_waves(
                self.pages, self.codec.stack_sizes(), layers, self.config.load_waves
            )
            why = (
                ""
                if self._waves is not None
                else (
                    "load_waves is 1"
                    if self.config.load_waves < 2
                    else "no stack row holds fewer than all layers"
                )
            )
        if why:
            log.info("%s: layer-by-layer loads off: %s", self.tag, why)
            return False
        assert self._waves is not None
        log.info("%s: layer-by-layer loads: %d waves over %d layers", self.tag,
                 self._waves.count, len(layers))  # fmt: skip
        return True

    def wait_for_layer_load(self, layer: str) -> None:
        """Before `layer` reads its KV: the compute stream waits for the waves of this step's
        sync loads that hold its pages (no host wait). Nothing to do without waves."""
        if self._wave_marks:
            marks = self._take_waves(layer)
            self._join_guarded("wait_for_layer_load", marks)

    def _take_waves(self, layer: str) -> list[Mark]:
        """The marks of the waves `layer` reads that no earlier layer joined (taken off)."""
        assert self._waves is not None
        # a layer the plan does not know waits for every wave
        last = self._waves.of_layer.get(layer, self._waves.count - 1)
        marks = self._wave_marks
        taken = [m for m in marks[: last + 1] if m is not None]
        marks[: last + 1] = [None] * min(last + 1, len(marks))
        if not any(m is not None for m in marks):
            self._wave_marks = []
        return taken

    def _settle_waves(self) -> None:
        """After the forward: waves no layer asked for mean the host skipped a layer's call; the
        compute stream waits for them now, and sync loads go back to one join per step."""
        if not self._wave_marks:
            return
        left = [m for m in self._wave_marks if m is not None]
        self._wave_marks = []
        self._join_guarded("start_load_kv", left)
        log.warning(
            "%s: a forward read layers without wait_for_layer_load for %d wave(s) of a sync "
            "load; layer-by-layer loads are off from now on", self.tag, len(left),
        )  # fmt: skip
        self._waves = None

    # ---- per step -----------------------------------------------------------------------------

    def degrade(self, reason: str) -> None:
        """A worker hook failed and this rank's state can no longer be trusted: from now on
        every load fails at once (its blocks recomputed) and every save fails, each reported
        as usual, so the engine serves on without the tier on this rank."""
        if not self.degraded:
            log.error("%s: the tier is off on this rank from now on (%s)", self.tag, reason)
        self.degraded = self.degraded or reason
        if self._path is not None:
            for path in (self._path.loads, self._path.sync_loads):
                path.degraded = self.degraded
        # a preemption this rank may have missed: no save in flight commits another byte
        with self._book.lock:
            jobs = list(self._book.saving.values())
        for job in jobs:
            with job.lock:
                job.cancelled = True

    def begin_step(self) -> None:
        """The host bound a new step's metadata: the step's time on this rank starts now."""
        self._step_t0 = time.perf_counter()

    def start_load_kv(self, meta: OffloadMeta) -> None:
        """Queue this step's synchronous loads so the forward runs after them on the device
        (no host wait), queue its asynchronous ones on the load lane, note delayed frees,
        count agreed loads. A load that cannot even be started reports failed (its blocks
        recomputed): none is left unreported or silently unread."""
        with self.clock.time(LOAD):
            self._start_loads(meta)

    def _start_loads(self, meta: OffloadMeta) -> None:
        now = self._clock()
        fence = self._ops_fence() if meta.loads else None
        ttl = self.config.lease_ttl_s
        pending = [PendingLoad(op, now, now + ttl, fence) for op in meta.loads]
        with self._book.lock:
            for op_id, ok in meta.load_terminals.items():
                tokens, nbytes, readmitted = self._book.uncounted.pop(op_id, (0, 0, False))
                if ok and tokens:
                    self.metrics.retrieved_tokens.inc(tokens)
                    self.metrics.retrieved_bytes.inc(nbytes)
                    if readmitted:
                        self.metrics.readmitted_retrieved_tokens.inc(tokens)
                    self.outbox.metrics_dirty = True
            for p in pending:
                self._book.inflight[p.op.req_id] += 1
                if not p.op.sync:
                    self._book.pending[p.op.op_id] = p
            self.outbox.delayed.update(meta.delayed_free)
        self._step_sync = []
        self.guard.run("start_load_kv", None, self._settle_waves, self.degrade_on_hook_error)
        tails: dict[str, Mark] = {}
        queued: list[PendingLoad] = []
        # every sync load's scatter chunks first, then all their copy-engine chunks wave-major
        step = StepWaves() if self._waves is not None else None
        for p in pending:
            # one load at a time under the guard: a failure costs its own request only
            marks = self.guard.run(
                "start_load_kv",
                p.op.req_id,
                lambda p=p: self._dispatch_load(p, queued, step),
                lambda p=p: self._fail_load(p, HOOK_ERROR),
            )
            if marks is not None:
                tails.update(marks.tails)
        waves: list[Mark | None] = []
        if step is not None and step.loads:
            waves = self.guard.run(
                "start_load_kv",
                None,
                lambda: self._issue_step_waves(step),
                lambda: self._step_waves_failed(step),
            )
        self._wave_marks = waves if any(m is not None for m in waves) else []
        if tails:
            # the forward runs after the sync loads' copies and scatters, ordered on the device
            self._join_guarded("start_load_kv", list(tails.values()))
        if queued:
            self.guard.run(
                "start_load_kv",
                queued[0].op.req_id,
                lambda: self._submit_loads(queued),
                lambda: [self._fail_load(p, HOOK_ERROR) for p in queued] and None,
            )

    def _dispatch_load(
        self, p: PendingLoad, queued: list[PendingLoad], step: StepWaves | None
    ) -> SyncMarks | None:
        """Start one load: a sync one is queued ahead of the forward on the device (its marks
        returned: the last on each lane stream; its copy-engine chunks wait in `step` when
        there is a wave plan), an async one joins the step's batch for the load lane."""
        if p.op.sync:
            return self._run_sync_load(p, step)
        queued.append(p)
        return None

    def _issue_step_waves(self, step: StepWaves) -> list[Mark | None]:
        assert self._path is not None and self._path.sync_lane is not None
        assert self._waves is not None
        return self._path.sync_loads.issue_waves(self._path.sync_lane, step, self._waves.count)

    def _step_waves_failed(self, step: StepWaves) -> list[Mark | None]:
        """The step's wave copies could not all be queued (what was, landed): the loads that
        had chunks waiting fail; no wave is left for a layer to wait for."""
        self._overrule([p.op for p, _ in step.loads], HOOK_ERROR)
        return []

    def _join(self, marks: Iterable[Mark]) -> None:
        assert self._ops is not None
        for mark in marks:
            self._ops.join(mark)

    def _join_guarded(self, hook: str, marks: list[Mark]) -> None:
        """Order the compute stream after `marks` (this step's sync-load copies); if the device
        refuses, wait for them on the host, so what the forward queues next runs after they
        landed, and if that fails too, report this step's sync loads failed (their blocks
        recomputed). Either way the rank stops serving from the tier."""
        self.guard.run(hook, None, lambda: self._join(marks), lambda: self._join_failed(marks))

    def _join_failed(self, marks: list[Mark]) -> None:
        try:
            for mark in marks:
                mark.wait()
        except Exception:  # the device is gone: the loads' bytes cannot be vouched for
            log.exception("%s: waiting on the host for a sync load's copies failed", self.tag)
            self._overrule(self._step_sync, HOOK_ERROR)
        self.degrade(HOOK_ERROR)

    def degrade_on_hook_error(self) -> None:
        """A hook's fallback: the rank's state can no longer be trusted (`degrade`)."""
        self.degrade(HOOK_ERROR)

    def _overrule(self, loads: Iterable[LoadOp], reason: str) -> None:
        """Sync loads of this step, already reported loaded, whose bytes may not be there
        when the forward reads them: their results become failures, their blocks invalid."""
        ops = {op.op_id: op for op in loads}
        with self._book.lock:
            failed = self.outbox.overrule(set(ops), reason)
            for op_id in failed:
                self.outbox.invalid.extend(self._claimed_blocks(ops[op_id]))
        for _ in failed:
            self.metrics.load_failure(reason).inc()

    def _submit_loads(self, loads: list[PendingLoad]) -> None:
        assert self._path is not None
        path = self._path.loads
        self._path.load_lane.submit(lambda lane: path.run(lane, loads), settle=path.settle)

    def _fail_load(self, p: PendingLoad, reason: str) -> None:
        """Report a load failed without running it (nothing of it was written, or what was
        is recomputed): its lease released, its blocks invalid, finished_recving if parked."""
        with p.lock:
            if p.done or p.expired:
                return
            p.expired = True
        if self.stack is not None:
            self.stack.release(p.op.lookup_id)
        self.metrics.load_failure(reason).inc()
        result = OpResult(p.op.op_id, False, reason)
        with self._book.lock:
            self._book.pending.pop(p.op.op_id, None)
        self._record(p.op.req_id, result, recv=not p.op.sync, invalid=self._claimed_blocks(p.op))

    def wait_for_save(self, meta: OffloadMeta) -> None:
        """Queue this step's saves behind the forward that computed their blocks; returns
        without waiting for any copy."""
        # the forward is over: no layer may still be waiting for a wave
        self.guard.run("wait_for_save", None, self._settle_waves, self.degrade_on_hook_error)
        if not meta.saves:
            return
        with self.clock.time(SAVE):
            self._queue_saves(meta)

    def _queue_saves(self, meta: OffloadMeta) -> None:
        if self.degraded:
            for op in meta.saves:
                with self._book.lock:
                    self._book.inflight[op.req_id] += 1
                self.metrics.save_failure(self.degraded).inc()
                self._record(op.req_id, OpResult(op.op_id, False, self.degraded), recv=False,
                             invalid=())  # fmt: skip
            return
        fence = self._ops_fence()
        jobs: list[PendingSave] = []
        for op in meta.saves:
            job = PendingSave(op, fence)
            with self._book.lock:
                self._book.inflight[op.req_id] += 1
            # one save at a time under the guard: a failure costs its own request only
            self.guard.run(
                "save",
                op.req_id,
                lambda job=job: self._save(job, jobs),
                lambda job=job: self._fail_save(job, HOOK_ERROR),
            )
        if not jobs:
            return
        assert self._path is not None
        save_lane, path = self._path.save_lane, self._path.saves
        # one lane job for the step: its chunks share one pipeline
        self.guard.run(
            "wait_for_save",
            jobs[0].op.req_id,
            lambda: save_lane.submit(lambda lane: path.run(lane, jobs), settle=path.settle),
            lambda: [self._fail_save(job, HOOK_ERROR) for job in jobs] and None,
        )

    def _save(self, job: PendingSave, batch: list[PendingSave]) -> None:
        """Admit one save into the step's batch; the save lane moves the whole batch."""
        with self._book.lock:
            self._book.saving[job.op.op_id] = job
        batch.append(job)

    def _fail_save(self, job: PendingSave, reason: str) -> None:
        with self._book.lock:
            self._book.saving.pop(job.op.op_id, None)
        self.metrics.save_failure(reason).inc()
        self._record(job.op.req_id, OpResult(job.op.op_id, False, reason), recv=False, invalid=())

    def handle_preemptions(self, req_ids: Iterable[str], op_ids: Iterable[str] = ()) -> None:
        """These requests' blocks (or these saves' blocks) are about to be reused: their
        in-flight saves commit nothing read from now on (a chunk copied before this call still
        commits). If that cannot be done, no save in flight commits (the rank degrades)."""
        self.guard.run(
            "handle_preemptions",
            None,
            lambda: self._cancel_saves(req_ids, op_ids),
            lambda: self.degrade(HOOK_ERROR),
        )

    def _cancel_saves(self, req_ids: Iterable[str], op_ids: Iterable[str] = ()) -> None:
        wanted = set(req_ids)
        ops = set(op_ids)
        if not wanted and not ops:
            return
        with self._book.lock:
            jobs = [
                j for j in self._book.saving.values() if j.op.req_id in wanted or j.op.op_id in ops
            ]
        for job in jobs:
            with job.lock:
                job.cancelled = True

    def take_report(self) -> WorkerReport:
        """Drain what finished since the last call into one report (loads past their deadline
        are reported failed first); a failure here turns the tier off on this rank."""
        with self.clock.time(REPORT):
            return self.guard.run(
                "get_finished", None, self._drain_report, lambda: self._degraded_report()
            )

    def _degraded_report(self) -> WorkerReport:
        self.degrade(HOOK_ERROR)
        return WorkerReport(rank=self.rank)

    def _drain_report(self) -> WorkerReport:
        self._expire_loads()
        if self._path is not None:
            self._path.sync_loads.reap()
        with self._book.lock:
            return self.outbox.take(self._book.inflight)

    def encode_report(self, report: WorkerReport) -> bytes:
        """Wire bytes of `report` for the scheduler, with a snapshot of this rank's metrics once
        a second, or when they changed and nothing is in flight; b"" when there is nothing to
        say. Closes the rank's step: its time and its hooks' are observed here."""
        return self.guard.run(
            "build_connector_worker_meta",
            None,
            lambda: self._encode_report(report),
            lambda: self._carry_results(report) or self._degraded_bytes(),
        )

    def _degraded_bytes(self) -> bytes:
        self.degrade(HOOK_ERROR)
        return b""

    def _carry_results(self, report: WorkerReport) -> None:
        """Op results of a report that could not be sent go out with the next one (the host
        already has its finished ids): the scheduler still learns every op's end."""
        with self._book.lock:
            self.outbox.carry(report.results)

    def _encode_report(self, report: WorkerReport) -> bytes:
        t0, c0 = start()
        if self._step_t0 is not None:
            self.metrics.step_seconds.observe(t0 - self._step_t0)
            self._step_t0 = None
        # this step's hooks; this call's own time is counted with the next step's
        self.clock.flush()
        now = time.monotonic()
        box = self.outbox
        since = now - box.last_snapshot
        fresh = box.metrics_dirty or not report.is_empty()
        # a snapshot reads every family (0.2 ms with the step histograms): at most one
        # per _SNAPSHOT_EVERY_S while operations are in flight (more steps follow them), and
        # always once the rank is idle with news (this report may be the last for a while)
        if since >= _SNAPSHOT_EVERY_S or (fresh and self._is_idle()):
            box.metrics_dirty = False
            report.metrics = snapshot(self.metrics.registry)
            box.last_snapshot = now
        elif fresh:
            box.metrics_dirty = True
        data = b"" if report.is_empty() and not report.metrics else messages.encode(report)
        self.clock.add_since(REPORT, t0, c0)
        return data

    def _is_idle(self) -> bool:
        with self._book.lock:
            return not self._book.inflight

    def wait_loads(self, timeout_s: float) -> bool:
        """Block until no load or save is queued or running (deadline-bounded); for drains and
        tests."""
        return self._book.wait_idle(timeout_s)

    wait_idle = wait_loads

    def close(self) -> None:
        """Stop the lanes and the lookup server, wait for copies in flight, flush and close
        the tiers. A copy that does not complete in time keeps the memory arena allocated (and
        page-locked) for the rest of the process: unregistering memory a DMA still writes
        would corrupt whatever the host puts there next."""
        settled = True
        dp, self._path = self._path, None
        if dp is not None:
            for lane in (dp.load_lane, dp.save_lane):
                if not lane.close():
                    log.warning("%s: lane %s still busy at close; leaving it", self.tag, lane.name)
                    settled = False
            settled = _poll(dp.sync_loads.reap, _CLOSE_WAIT_S) and settled
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.stack is not None:
            if not settled:
                log.error(
                    "%s: copies still in flight at close; the memory tier's arena stays "
                    "allocated and registered for the rest of the process",
                    self.tag,
                )
                self.stack.memory.abandon_arena()
            self.stack.close()
            self.stack = None

    # ---- reports of the pipelines (on the lanes' threads) --------------------------------------

    def _save_reported(self, run: SaveRun) -> None:
        assert self.codec is not None
        op = run.job.op
        seconds = time.perf_counter() - run.t0
        if run.reason:
            self.metrics.save_failure(run.reason).inc()
            result = OpResult(op.op_id, False, run.reason, run.stored, seconds)
        else:
            nbytes = (run.stored + run.states) * self.codec.chunk_bytes
            if run.states:
                self.metrics.state_parts_stored.inc(run.states)
            self.metrics.save_seconds.observe(seconds)
            # only chunks written now count: one the tier already held was not stored again
            self.metrics.stored_tokens.inc(run.stored * self.config.chunk_size)
            self.metrics.stored_bytes.inc(nbytes)
            self.outbox.metrics_dirty = True
            result = OpResult(op.op_id, True, "", nbytes, seconds, "memory")
        with self._book.lock:
            self._book.saving.pop(op.op_id, None)
        self._record(op.req_id, result, recv=False, invalid=())

    def _load_reported(self, run: LoadRun) -> None:
        outcome = self._load_outcome(run)
        if outcome is None:
            log.warning(
                "%s: load %s came back after its deadline had reported it failed; "
                "its result is dropped",
                self.tag,
                run.p.op.op_id,
            )
            return
        self._finish_load(run.p, *outcome)

    def _run_sync_load(self, p: PendingLoad, step: StepWaves | None = None) -> SyncMarks:
        """Queue a sync load from the calling thread on its own lane; it is reported at once
        (its bytes land before the forward reads them: the compute stream waits for the
        returned marks), never expires and reports no finished_recving."""
        assert self._ops is not None and self._path is not None
        dp = self._path
        if dp.sync_lane is None:
            # made in the thread that runs the forward (on CUDA: streams of its device)
            dp.sync_lane = self._ops.lane()
        run, marks = dp.sync_loads.issue_sync(dp.sync_lane, p, self._waves, step)
        outcome = self._load_outcome(run)
        assert outcome is not None  # only a deadline drops a result, and it never expires
        self._record(p.op.req_id, outcome[0], recv=False, invalid=outcome[1])
        self._step_sync.append(p.op)
        return marks

    def _finish_load(self, p: PendingLoad, result: OpResult, invalid: Iterable[int]) -> None:
        with self._book.lock:
            self._book.pending.pop(p.op.op_id, None)
        self._record(p.op.req_id, result, recv=True, invalid=invalid)

    def _expire_loads(self) -> None:
        """Report failed every load still unfinished past its deadline (a stuck lane, a tier
        that never returns): the host recomputes instead of waiting forever."""
        now = self._clock()
        with self._book.lock:
            late = [p for p in self._book.pending.values() if now >= p.deadline]
        for p in late:
            with p.lock:
                if p.done or p.expired:
                    continue
                # after this, the lane queues no block write for it (issuing holds p.lock)
                p.expired = True
                queued = list(p.marks)
            # writes queued before that must land before the host recomputes these blocks
            for mark in queued:
                with contextlib.suppress(RuntimeError):
                    mark.wait()
            log.error(
                "%s: load %s not finished %.1fs after it was queued (lease_ttl_s=%.1f); "
                "reporting it failed so the request recomputes",
                self.tag,
                p.op.op_id,
                now - p.queued_at,
                self.config.lease_ttl_s,
            )
            self.metrics.load_failure(DEADLINE).inc()
            result = OpResult(p.op.op_id, False, DEADLINE, 0, now - p.queued_at, "")
            self._finish_load(p, result, self._claimed_blocks(p.op))

    def _record(self, req_id: str, result: OpResult, *, recv: bool, invalid: Iterable[int]) -> None:
        with self._book.lock:
            self.outbox.record(result, req_id, recv=recv, invalid=invalid)
            self._book.reported(req_id)

    def _load_outcome(self, run: LoadRun) -> tuple[OpResult, list[int]] | None:
        """The result and suspect blocks of a load whose chunks are all queued (sync) or
        landed (async), or None when its deadline reported it failed meanwhile (then nothing of
        it is counted here)."""
        assert self.codec is not None
        p, op = run.p, run.p.op
        with p.lock:
            if p.expired or run.expired:
                return None
            p.done = True
        try:
            return self._account_load(run)
        except Exception:  # claimed above: a defect here still reports the load, failed
            log.exception("%s: accounting load %s failed", self.tag, op.op_id)
            self.metrics.load_failure(HOOK_ERROR).inc()
            return OpResult(op.op_id, False, HOOK_ERROR), self._claimed_blocks(op)

    def _account_load(self, run: LoadRun) -> tuple[OpResult, list[int]]:
        """Count, log and judge a load this side claimed: its result and suspect blocks."""
        assert self.codec is not None
        op = run.p.op
        reason = run.reason
        seconds = time.perf_counter() - run.t0
        nbytes = run.written * self.codec.bytes_per_block + run.states * self.codec.chunk_bytes
        got = op.tokens if not reason else 0
        if run.states and not reason:
            self.metrics.state_parts_loaded.inc(run.states)
        self.metrics.load_seconds.observe(seconds)
        if reason:
            self.metrics.load_failure(reason).inc()
        else:
            with self._book.lock:
                self._book.uncounted[op.op_id] = (got, nbytes, op.readmitted)
        log.info(
            "%s: Retrieved %d of %d required tokens (%.3f GiB, %.2f GB/s, %s)%s",
            self.tag,
            got,
            op.tokens,
            nbytes / _GIB,
            nbytes / max(seconds, 1e-9) / 1e9,
            "in the forward" if op.sync else "async",
            f" failed: {reason}" if reason else "",
        )
        tier = run.served.most_common(1)[0][0] if run.served else ""
        result = OpResult(op.op_id, not reason, reason, nbytes, seconds, tier)
        # a failed load leaves every block it wrote suspect: the host recomputes them
        return result, (self._claimed_blocks(op) if reason else [])

    @staticmethod
    def _claimed_blocks(op: LoadOp) -> list[int]:
        return [b for ref in op.chunks for b in ref.block_ids if b >= 0]


def _poll(done: Callable[[], bool], timeout_s: float) -> bool:
    """Call `done` every 10 ms until it is true or `timeout_s` passed (a sleep, not a spin)."""
    deadline = time.monotonic() + timeout_s
    pause = threading.Event()
    while not done():
        if time.monotonic() >= deadline:
            return False
        pause.wait(0.01)
    return True
