"""The load pipelines: chunks read from the tiers and scattered into KV blocks, several on the
link at once.

Per chunk: the memory tier's slot is pinned (and verified where reads verify), or a lower tier
reads the chunk into a pinned host buffer; one copy into a device staging buffer on the copy
stream; the scatter into the blocks on the kernel stream after that copy and after the fence
taken when the load started (a forward still queued there may be using the blocks). On the CPU
backend the scatter reads the slot itself.

- Asynchronous loads (the load lane) retire in issue order: wait for the scatter's mark, unpin
  the slot. A load reports after all its chunks landed, so no block of a failed load is written
  after the host was told to recompute it.
- Synchronous loads (the forward's thread, inside `start_load_kv`) never wait on the host: the
  last mark on each of the lane's streams (copy-engine chunks on the copy stream, scatters on
  the kernel stream) is joined into the compute stream, so the forward runs after them on the
  device. The last chunk's mark alone would not do: a run of blocks after a fragmented chunk
  lands on the copy stream while that chunk's scatter may still run on the kernel stream.
  Staging buffers are reused in stream order (a copy into a buffer waits on the device for the
  scatter that last read it); the pinned slots are let go at a later step, once their marks
  are reached.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvtier.offload.codec import PageCodec, scatter_call
from kvtier.offload.device import DeviceOps, Lane, Mark
from kvtier.offload.dma import Span
from kvtier.offload.hooks import HookGuard
from kvtier.offload.messages import ChunkRef, LoadOp
from kvtier.offload.transfer import Flights, Peak, settle, settling
from kvtier.offload.waves import Waves
from kvtier.store.stack import TierStack


@dataclass(eq=False, slots=True)
class PendingLoad:
    """A load handed to a lane. `fence` is where the compute stream stood when the load was
    started: its blocks may still be in use by work queued there (a forward still running under
    async scheduling, the self-test's clearing), so no scatter overtakes it. `lock` makes
    finishing and expiring it mutually exclusive, and is held while a lane queues writes into
    KV blocks; `marks` are those writes, which an expiry waits for, so nothing of it lands once
    it was reported failed."""

    op: LoadOp
    queued_at: float
    deadline: float
    fence: object | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: bool = False
    expired: bool = False
    marks: list[Mark] = field(default_factory=list)


@dataclass(eq=False, slots=True)
class LoadRun:
    """One load's progress: blocks written, the tiers that served it, why it failed."""

    p: PendingLoad
    t0: float = field(default_factory=time.perf_counter)
    written: int = 0
    states: int = 0  # state record parts written (a hybrid model's boundary states)
    served: Counter[str] = field(default_factory=Counter)
    reason: str = ""
    expired: bool = False  # stopped because its deadline reported it failed
    in_flight: int = 0
    issued: bool = False
    reported: bool = False


@dataclass(eq=False, slots=True)
class Buffers:
    """One transfer's buffers: device staging (None: the device is the host) and a host buffer
    for chunks a lower tier reads (made on first use; pinned on CUDA)."""

    staging: torch.Tensor | None
    host: torch.Tensor | None = None


_COPIES = "copies"
_KERNELS = "kernels"


@dataclass(eq=False, slots=True)
class _Issued:
    mark: Mark
    held: contextlib.ExitStack
    tier: str
    blocks: int
    state: bool = False  # a part of a boundary-state record
    stream: str = _KERNELS  # the lane stream its last work is on (ordering by stream)


@dataclass(eq=False, slots=True)
class _Deferred:
    """A sync chunk bound for the copy engine wave by wave: its source pinned, its regions per
    wave, not yet queued."""

    held: contextlib.ExitStack
    tier: str
    blocks: int
    pieces: list[list[Span]]


@dataclass(eq=False, slots=True)
class SyncMarks:
    """What the compute stream waits for after a step's sync loads: before the forward, the
    last mark on each lane stream (`tails`); with a wave plan, each wave's last copy
    (`waves`), waited for by the first layer that reads it."""

    tails: dict[str, Mark] = field(default_factory=dict)
    waves: list[Mark | None] = field(default_factory=list)


@dataclass(eq=False, slots=True)
class StepWaves:
    """A step's sync loads' chunks for the copy engine, held back until every load's chunks
    for the scatter kernel are queued: a later load's staging copy queued behind an earlier
    load's waves would hold the forward (which joins it before layer 0) for all of them."""

    loads: list[tuple[PendingLoad, list[_Deferred]]] = field(default_factory=list)


_MISS = "miss"
_EXPIRED = "expired"


class LoadPath:
    """Issues the chunks of loads on a lane; `run` for the load lane, `issue_sync` for the
    forward's thread."""

    def __init__(
        self,
        stack: TierStack,
        codec: PageCodec,
        ops: DeviceOps,
        buffers: Sequence[Buffers],
        report: Callable[[LoadRun], None],
        guard: HookGuard,
        tag: str,
        moved: Callable[[str], None] = lambda path: None,
        persistent: bool = True,
    ) -> None:
        """`moved(path)` counts each chunk by the path it took (dma, kernel, host);
        `persistent`: the load lane's last chunks stay in flight into its next job (`settle`)."""
        self._moved = moved
        self._persistent = persistent
        self._stack = stack
        self._codec = codec
        self._ops = ops
        self._buffers = list(buffers)
        self._report = report
        self._guard = guard
        self._tag = tag
        self._peak = Peak()
        self._ring: Flights[Buffers] = Flights(self._buffers, self._peak)
        # why this rank fails every load at once ("": it serves); set by the worker
        self.degraded = ""
        # synchronous loads: the next buffer, each buffer's last scatter, slots still pinned
        self._next = 0
        self._last_read: list[Mark | None] = [None] * len(self._buffers)
        self._held: deque[_Issued] = deque()
        self._held_lock = threading.Lock()

    # ---- the load lane -----------------------------------------------------------------------

    def run(self, lane: Lane, loads: Sequence[PendingLoad]) -> None:
        """Asynchronous loads, pipelined across all their chunks; each reports once, after
        everything it queued landed."""
        flights = self._ring
        earlier = flights.issued  # what the lane's previous jobs left in flight is before this
        try:
            for run in [LoadRun(p) for p in loads]:
                self._run_one(lane, flights, run)
            # this job's last chunks may stay on the link into the lane's next job (it settles
            # the ring when it has no more work); an earlier job's never wait longer than this
            if self._persistent:
                flights.retire_before(earlier)
            else:
                flights.drain()
        except Exception as e:  # noqa: BLE001 - counted by the guard; what is in flight ends below
            self._failed(lane, e)

    def settle(self, lane: Lane) -> None:
        """Retire every chunk still in flight, so each load reports (the load lane runs this
        when it runs out of work, and before a job of another kind)."""
        try:
            self._ring.drain()
        except Exception as e:  # noqa: BLE001 - counted by the guard; what is in flight ends below
            self._failed(lane, e)

    def _failed(self, lane: Lane, e: Exception) -> None:
        """A defect of kvtier's own (a report that raised, while chunks were still on the
        link): nothing queued may land after its slot is let go, and every chunk still in
        flight lets go of its slot and tells its load it failed."""
        self._guard.failed("load", None, e)
        settle(lane, self._tag)
        self._ring.abandon(e)

    def one(self, lane: Lane, p: PendingLoad) -> LoadRun:
        """Run one load to completion on `lane` (the self-test); it reports nothing."""
        flights: Flights[Buffers] = Flights(self._buffers)
        run = LoadRun(p, reported=True)
        self._run_one(lane, flights, run)
        flights.drain()
        return run

    def _run_one(self, lane: Lane, flights: Flights[Buffers], run: LoadRun) -> None:
        op = run.p.op
        # timed from its own first chunk, not from its job's start: a load queued behind others
        # in one job would otherwise read as a slow tier to the load gate
        run.t0 = time.perf_counter()
        first = flights.issued  # the chunks before this are other loads', which may report

        def before_read() -> None:
            # a lower tier's read may take long (a remote store, a cold disk): the other loads'
            # chunks still on the link (a copy each, at most) retire and report first
            flights.retire_before(first)

        try:
            run.reason = op.fail or self.degraded
            for ref in () if run.reason else self._codec.records(op.chunks):
                try:
                    flights.retire_landed()
                    bufs = flights.acquire()
                    got = self._issue(lane, run.p, ref, bufs, None, before_read=before_read)
                except Exception as e:  # noqa: BLE001 - counted by the guard, reported below
                    # whatever a tier or the codec raised, the lane lives on to serve later
                    # loads, and this one reports; a scatter queued before the raise must not
                    # land after the host was told to recompute these blocks
                    self._guard.failed("load", op.req_id, e)
                    run.reason = f"error:{type(e).__name__}"
                    settle(lane, self._tag)
                    break
                if isinstance(got, str):
                    run.reason = got if got == _MISS else run.reason
                    run.expired = got == _EXPIRED
                    break
                run.in_flight += 1
                flights.push(got.mark, lambda err, got=got, run=run: self._landed(run, got, err))
        finally:
            self._stack.release(op.lookup_id)
            run.issued = True
            self._maybe_report(run)

    def _landed(self, run: LoadRun, got: _Issued, error: BaseException | None) -> None:
        got.held.close()
        if error is not None:
            run.reason = run.reason or f"error:{type(error).__name__}"
        else:
            run.served[got.tier] += 1
            run.written += got.blocks
            run.states += got.state
        run.in_flight -= 1
        self._maybe_report(run)

    @property
    def peak_in_flight(self) -> int:
        """The most chunks this path had on the link at once."""
        return self._peak.value

    def _maybe_report(self, run: LoadRun) -> None:
        if run.issued and not run.in_flight and not run.reported:
            run.reported = True
            self._report(run)

    # ---- the forward's thread ------------------------------------------------------------------

    def issue_sync(
        self, lane: Lane, p: PendingLoad, waves: Waves | None = None, step: StepWaves | None = None
    ) -> tuple[LoadRun, SyncMarks]:
        """Queue a synchronous load's chunks without any host wait; its run (as it will be once
        the marks are reached) and the marks the compute stream must wait for: the last one on
        each lane stream its chunks used (each stream runs in order, the two do not). With
        `waves`, the chunks the copy engine moves go wave by wave (every chunk's first layers,
        then the next ones), each wave's last copy in `SyncMarks.waves`; with `step` too, they
        wait there for `issue_waves`, after every load of the step."""
        self.reap()
        run = LoadRun(p)
        marks = SyncMarks(waves=[None] * (waves.count if waves else 0))
        deferred: list[_Deferred] = []
        op = p.op
        try:
            run.reason = op.fail or self.degraded
            for ref in () if run.reason else self._codec.records(op.chunks):
                k = self._next
                bufs = Buffers(self._buffers[k].staging)  # a fresh host buffer, if any is needed
                got = self._issue(lane, p, ref, bufs, self._last_read[k], waves)
                if isinstance(got, str):
                    run.reason = _MISS
                    break
                if isinstance(got, _Deferred):
                    deferred.append(got)
                    run.served[got.tier] += 1
                    run.written += got.blocks
                    continue
                marks.tails[got.stream] = got.mark
                if got.stream == _KERNELS:
                    # only a chunk that went through staging buffer k is its last reader: a
                    # run on the copy engine read none, and its mark says nothing of the
                    # scatter still reading the buffer
                    self._next = (k + 1) % len(self._buffers)
                    self._last_read[k] = got.mark
                with self._held_lock:
                    self._held.append(got)
                run.served[got.tier] += 1
                run.written += got.blocks
                run.states += got.state
            # chunks read before a miss still land, as they do without waves
            if step is None:
                self._issue_waves(lane, [(p, deferred)], marks)
            elif deferred:
                step.loads.append((p, deferred))
        except Exception as e:  # noqa: BLE001 - counted by the guard, reported by the caller
            self._guard.failed("load", op.req_id, e)
            run.reason = f"error:{type(e).__name__}"
            settle(lane, self._tag)
            for d in deferred:
                d.held.close()  # never handed to `_held`: nothing of them is still landing
        finally:
            self._stack.release(op.lookup_id)
        return run, marks

    def issue_waves(self, lane: Lane, step: StepWaves, count: int) -> list[Mark | None]:
        """Queue the copies `issue_sync` held back in `step`, wave-major over all its loads;
        each wave's last copy. On an error, what was queued has landed when this raises, and
        every slot is let go: the caller reports the step's loads in `step` failed."""
        marks = SyncMarks(waves=[None] * count)
        try:
            self._issue_waves(lane, step.loads, marks)
        except BaseException:
            settle(lane, self._tag)
            for _, deferred in step.loads:
                for d in deferred:
                    d.held.close()
            raise
        return marks.waves

    def _issue_waves(
        self,
        lane: Lane,
        loads: Sequence[tuple[PendingLoad, Sequence[_Deferred]]],
        marks: SyncMarks,
    ) -> None:
        """Queue the deferred chunks' copies wave-major (every load's chunks of a wave before
        the next wave); each chunk's slot is held until its last wave's copy completed."""
        last: dict[int, Mark] = {}
        for w in range(len(marks.waves)):
            for p, deferred in loads:
                for d in deferred:
                    if d.pieces[w]:
                        with p.lock, settling(lane, self._tag):
                            mark = lane.copy_regions(d.pieces[w], to_host=False, fence=p.fence)
                            p.marks.append(mark)
                        last[id(d)] = marks.waves[w] = mark
        for _, deferred in loads:
            for d in deferred:
                self._moved("dma")
                mark = last.get(id(d))
                if mark is None:
                    d.held.close()  # every block of it was in HBM: nothing to copy
                    continue
                with self._held_lock:
                    self._held.append(_Issued(mark, d.held, d.tier, d.blocks, stream=_COPIES))

    def reap(self, wait: bool = False) -> bool:
        """Unpin the slots of synchronous loads whose copies completed (all of them, waiting,
        when `wait`); True when none is left."""
        while True:
            with self._held_lock:
                if not self._held:
                    return True
                got = self._held[0]
                if not wait and not got.mark.done():
                    return False
                self._held.popleft()
            if wait:
                try:
                    got.mark.wait()
                except RuntimeError:
                    pass  # the device failed: the slot is let go all the same, nothing lands
            got.held.close()

    # ---- one chunk -----------------------------------------------------------------------------

    def _issue(
        self,
        lane: Lane,
        p: PendingLoad,
        ref: ChunkRef,
        bufs: Buffers,
        reusable: Mark | None,
        waves: Waves | None = None,
        before_read: Callable[[], None] = lambda: None,
    ) -> _Issued | _Deferred | str:
        """Read one chunk's source and queue its copy and scatter; `reusable`: the mark after
        which the staging buffer may be overwritten (None: it is free now). With `waves`, a
        chunk the copy engine can move is returned unqueued, its regions split by wave.
        `before_read` runs before a lower tier is read (which may take long)."""
        stack, codec = self._stack, self._codec
        held = contextlib.ExitStack()
        try:
            # the slot stays pinned until the scatter's copy finished (the flight's retire), so
            # neither a lease expiring nor eviction can hand it to another chunk meanwhile
            src = held.enter_context(stack.pinned_view(ref.key))
            tier = stack.memory.name
            if src is None:
                if bufs.host is None:
                    bufs.host = self._ops.host_buffer(codec.chunk_bytes)
                host = bufs.host
                held.callback(lambda: host)  # alive until the copy out of it completed
                before_read()
                found = stack.read_into(ref.key, host, ref.parent)
                if found is None:
                    held.close()
                    return _MISS
                src, tier = host, found
            ids = list(ref.block_ids)
            with p.lock, settling(lane, self._tag):
                if p.expired:
                    held.close()
                    return _EXPIRED  # its deadline reported it failed: write no more blocks
                regions = None
                part = ref.part
                if self._ops.dma and bufs.staging is not None and part < 0:
                    if waves is not None and isinstance(codec, PageCodec):
                        pieces = codec.wave_regions(ids, src, waves)
                        if pieces is not None:
                            return _Deferred(held, tier, sum(1 for b in ids if b >= 0), pieces)
                    regions = codec.regions(ids, src, skips=True)
                if regions is not None:
                    # the slot straight into the KV pages on the copy engine, after the forward
                    # that may still use the blocks: no staging buffer, no scatter kernel
                    mark = lane.copy_regions(regions, to_host=False, fence=p.fence)
                    self._moved("dma")
                else:
                    lane.after(p.fence)
                    with lane.active():
                        if bufs.staging is None:
                            mark = lane.launch(scatter_call(codec, src, ids, part))
                        else:
                            staging = bufs.staging
                            copied = lane.copy(staging, src, after=reusable)
                            scatter = scatter_call(codec, staging, ids, part)
                            mark = lane.launch(scatter, after=copied)
                    self._moved("host" if bufs.staging is None else "kernel")
                p.marks.append(mark)
        except BaseException:
            # every copy it queued was queued under `settling`, which waited for it: the slot
            # may be unpinned now
            held.close()
            raise
        stream = _KERNELS if regions is None else _COPIES
        if ref.part >= 0:
            return _Issued(mark, held, tier, 0, state=True, stream=stream)
        return _Issued(mark, held, tier, sum(1 for b in ids if b >= 0), stream=stream)
