"""The save lane's pipeline: a step's chunks gathered, copied to their memory-tier slots and
committed, with up to `transfer_depth` chunks on the link while the host commits the oldest.

Per chunk: reserve a slot -> (after the forward's fence) gather the blocks into a staging
buffer on the kernel stream -> one copy to the slot on the copy stream -> its mark. On retire
(in issue order, so a chain's chunks are committed deepest first as they were issued): the
mark is waited for, and the chunk committed unless its request was preempted meanwhile (blocks
reused after a cancel may have been read: such bytes never commit). On the CPU backend the
gather writes the slot itself and every mark is already reached.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvtier.offload.codec import PageCodec, gather_call
from kvtier.offload.device import Lane
from kvtier.offload.hooks import HOOK_ERROR, HookGuard
from kvtier.offload.messages import ChunkRef, SaveOp
from kvtier.offload.transfer import Flights, Peak, settle
from kvtier.store.stack import TierStack

log = logging.getLogger("kvtier")
PREEMPTED = "preempted"  # save failure reason: its request's blocks were taken back first
RESIDENT = "resident"  # the tier held the chunk already: not stored again, not a failure


@dataclass(eq=False, slots=True)
class PendingSave:
    """A save handed to the lane. `fence` is where the forward that wrote its blocks stands;
    `lock` makes cancelling it and committing one of its chunks mutually exclusive."""

    op: SaveOp
    fence: object | None
    lock: threading.Lock = field(default_factory=threading.Lock)
    cancelled: bool = False


@dataclass(eq=False, slots=True)
class SaveRun:
    """One save's progress through the pipeline."""

    job: PendingSave
    t0: float = field(default_factory=time.perf_counter)
    stored: int = 0
    states: int = 0  # state record parts stored (a hybrid model's boundary states)
    reason: str = ""
    in_flight: int = 0
    issued: bool = False
    reported: bool = False


# told a save's run once all its chunks were retired
Report = Callable[[SaveRun], None]


class SavePath:
    """The save lane's transfers (one per rank; run only on the save lane's thread)."""

    def __init__(
        self,
        stack: TierStack,
        codec: PageCodec,
        staging: Sequence[torch.Tensor | None],
        report: Report,
        guard: HookGuard,
        tag: str,
        dma: bool = False,
        moved: Callable[[str], None] = lambda path: None,
        persistent: bool = True,
    ) -> None:
        """`staging`: one device buffer per transfer in flight (None: gather into the slot);
        `dma`: contiguous runs go by the lane's 2-D copies; `moved(path)` counts each chunk;
        `persistent`: a step's last chunks stay in flight into the next job (`settle`)."""
        self._stack = stack
        self._codec = codec
        self._staging = list(staging)
        self._report = report
        self._guard = guard
        self._tag = tag
        self._dma = dma
        self._moved = moved
        self._peak = Peak()
        self._persistent = persistent
        self._ring: Flights[torch.Tensor | None] = Flights(self._staging, self._peak)
        # chunk key -> issue number of its copy still in flight (its slot reserved, not yet
        # committed): a later save of the same key waits for it instead of failing no_slot
        self._in_ring: dict[bytes, int] = {}

    def run(self, lane: Lane, jobs: Sequence[PendingSave]) -> None:
        """A step's saves, pipelined across all their chunks; each reports once."""
        runs = [SaveRun(job) for job in jobs]
        flights = self._ring
        earlier = flights.issued  # what the lane's previous jobs left in flight is before this
        try:
            for run in runs:
                # deepest chunk first: a chain's head is committed last, so it is the most recent
                for ref in reversed(self._codec.records(run.job.op.chunks)):
                    if run.reason:
                        break
                    flights.retire_landed()
                    self._issue(lane, flights, run, ref)
                run.issued = True
                self._maybe_report(run)
            # this job's chunks may stay on the link into the lane's next job (it settles the
            # ring when it has no more work); an earlier job's never wait longer than this one
            if self._persistent:
                flights.retire_before(earlier)
            else:
                flights.drain()
        except Exception as e:  # noqa: BLE001 - counted by the guard; every save reports below
            self._failed(lane, e)
            for run in runs:
                run.reason = run.reason or HOOK_ERROR
                run.issued, run.in_flight = True, 0
                self._maybe_report(run)

    def settle(self, lane: Lane) -> None:
        """Retire every chunk still in flight, committing what landed (the lane runs this when
        it runs out of work, and before a job of another kind)."""
        try:
            self._ring.drain()
        except Exception as e:  # noqa: BLE001 - counted by the guard; the saves report below
            self._failed(lane, e)

    def _failed(self, lane: Lane, e: Exception) -> None:
        """A defect of kvtier's own (the copy path's errors are caught per chunk): nothing
        queued may land after its slot is freed, and every chunk in flight tells its save it
        failed (so each save still reports)."""
        self._guard.failed("save", None, e)
        settle(lane, self._tag)
        self._ring.abandon(e)

    def one(self, lane: Lane, job: PendingSave, ref: ChunkRef) -> str:
        """Save one chunk and wait for it (the self-test): "" when stored, else the reason; it
        reports nothing."""
        run = SaveRun(job, reported=True)
        flights: Flights[torch.Tensor | None] = Flights(self._staging)
        self._issue(lane, flights, run, ref)
        flights.drain()
        return run.reason if run.reason else ("" if run.stored or run.states else RESIDENT)

    def _issue(
        self, lane: Lane, flights: Flights[torch.Tensor | None], run: SaveRun, ref: ChunkRef
    ) -> None:
        stack, job = self._stack, run.job
        with job.lock:
            if job.cancelled:
                run.reason = PREEMPTED
                return
        number = self._in_ring.get(ref.key)
        if number is not None:
            # the same chunk is still on the link for an earlier save (two requests sharing a
            # prefix, the same step or the last one): it lands and commits first, then this
            # save finds it stored
            flights.retire_before(number + 1)
        if stack.memory.contains(ref.key):
            return
        # the parent link keeps the chain prefix-closed: a chunk's slot never comes from its parent
        slot = stack.reserve(ref.key, ref.parent)
        if slot is None:
            if not stack.memory.contains(ref.key):
                run.reason = "no_slot"
            return
        issued = False
        try:
            staging = flights.acquire()
            codec, ids, part = self._codec, list(ref.block_ids), ref.part
            dma = self._dma and staging is not None and part < 0
            regions = codec.regions(ids, slot) if dma else None
            if regions is not None:
                # KV pages straight into the pinned slot on the copy engine: no kernel on the
                # SMs beside the forward, no staging buffer
                mark = lane.copy_regions(regions, to_host=True, fence=job.fence)
                self._moved("dma")
            else:
                lane.after(job.fence)
                with lane.active():
                    dst = slot if staging is None else staging
                    mark = lane.launch(gather_call(codec, ids, dst, part))
                    if staging is not None:
                        mark = lane.copy(slot, staging, after=mark)
                self._moved("host" if staging is None else "kernel")
            run.in_flight += 1
            self._in_ring[ref.key] = flights.issued
            flights.push(mark, lambda error: self._landed(run, ref, error))
            issued = True
        except (RuntimeError, ValueError) as e:
            log.exception("%s: save %s raised", self._tag, job.op.op_id)
            # the slot goes back to the free list below: a copy queued into it before the raise
            # must land first, or a later chunk written there by the CPU could be overwritten
            settle(lane, self._tag)
            run.reason = f"error:{type(e).__name__}"
        finally:
            if not issued:
                stack.abort(ref.key)

    def _landed(self, run: SaveRun, ref: ChunkRef, error: BaseException | None) -> None:
        """The chunk's copy completed (or failed): commit it, or free its slot."""
        committed = False
        self._in_ring.pop(ref.key, None)
        try:
            if error is not None:
                log.error("%s: save %s: the device failed: %s", self._tag, run.job.op.op_id, error)
                run.reason = run.reason or f"error:{type(error).__name__}"
                return
            with run.job.lock:
                if run.job.cancelled:
                    run.reason = PREEMPTED
                    return
                self._stack.commit(ref.key)
                committed = True
            if ref.part < 0:
                run.stored += 1
            else:
                run.states += 1
        finally:
            if not committed:
                self._stack.abort(ref.key)
            run.in_flight -= 1
            self._maybe_report(run)

    @property
    def peak_in_flight(self) -> int:
        """The most chunks this path had on the link at once."""
        return self._peak.value

    def _maybe_report(self, run: SaveRun) -> None:
        if run.issued and not run.in_flight and not run.reported:
            run.reported = True
            self._report(run)
