"""The one thread that drives an `Engine` behind the server (the engine is not thread-safe).

Other threads talk to it through a queue: new requests, aborts and calls run between steps.
For every output it applies the client's view (text, stop strings) before the next step, so a
stop string ends the request with no token generated past it, and hands a `SeqUpdate` to the
request's sink. It also keeps what `/health` and `/metrics` need:

- a stall clock: with requests queued and no step making progress (computing tokens or
  emitting outputs) for `stall_timeout_s`, `health()` names the stall even while a step hangs;
- an engine failure (`engine.step()` raised, a TP rank died): every request in flight fails with
  500, the failure is logged once, and `on_fatal` is called so the process can exit nonzero.

Requests are submitted as a `Submission`: the client's request id and one engine request per
sequence (`n` x prompts), under engine ids the loop makes (`srv-<n>`, unique for the loop's
life), so a client's id never reaches the engine, the connector or a TP rank, whatever its
length or content. A client id is live from `submit` until its last sequence ended; a second
submission under a live id is refused (`DuplicateRequestId`) without touching the first, and an
abort names its submission's engine ids, so it can only end its own sequences. One failing
sequence (the sampler raised, the engine refused it) ends its siblings and the client gets one
error. At most `max_queued_seqs` sequences are in the loop at once (`Overloaded` beyond).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvtier.native.detokenizer import TextStream
from kvtier.native.engine import Engine
from kvtier.native.sampling import SamplingParams
from kvtier.native.sequence import RequestOutput, loggable
from kvtier.native.serve_metrics import RequestTimes, ServeMetrics
from kvtier.native.tp import WorkerError

__all__ = [
    "DuplicateRequestId", "EngineFailure", "EngineLoop", "EngineUnavailable", "Overloaded",
    "SeqSpec", "SeqUpdate", "Submission",
]  # fmt: skip

log = logging.getLogger("kvtier.server")
T = TypeVar("T")

DEFAULT_STALL_TIMEOUT_S = 60.0
DEFAULT_MAX_QUEUED_SEQS = 1024
# what a client hears when its sequence failed inside the engine; the cause is in the log
SEQ_FAILED = (
    "the request failed in the engine; the server log has the cause (logged with the request "
    "id) and the server keeps serving other requests"
)


class EngineUnavailable(RuntimeError):
    """The engine loop is not accepting work (stopped, or the engine failed)."""


class DuplicateRequestId(ValueError):
    """A request id that a request still in flight holds."""

    def __init__(self, rid: str) -> None:
        super().__init__(f"request id {loggable(rid)} is in flight")
        self.rid = rid


class Overloaded(RuntimeError):
    """Admitting the sequences would put more than `max_queued_seqs` in the loop."""

    def __init__(self, queued: int, asked: int, limit: int) -> None:
        super().__init__(f"{queued} sequences queued, {asked} more asked, limit {limit}")
        self.queued, self.asked, self.limit = queued, asked, limit


class _RankDied(RuntimeError):
    """A TP rank process exited (its message names the rank, pid and exit code)."""


@dataclass(frozen=True)
class EngineFailure:
    """Delivered instead of an update when a request cannot go on (status and reason)."""

    status: int
    message: str


@dataclass(frozen=True)
class SeqUpdate:
    """One engine output as the client sees it: the new text and how the sequence ended."""

    output: RequestOutput
    text: str
    finish_reason: str | None  # None while running
    stop_reason: int | str | None  # the stop string or stop token that ended it

    @property
    def finished(self) -> bool:
        """Whether this is the sequence's last update."""
        return self.finish_reason is not None


@dataclass(frozen=True)
class SeqSpec:
    """One sequence of a submission: what it runs and where its updates go."""

    prompt_ids: list[int]
    params: SamplingParams
    sink: Callable[[object], bool]  # on the loop thread; False when nobody listens
    text: TextStream
    retention: object | None = None  # the client's retention hint (offload.retention)


@dataclass(frozen=True)
class Submission:
    """A client's request in the loop: its id and its sequences' engine ids (in order)."""

    rid: str
    engine_ids: tuple[str, ...]


@dataclass(eq=False)
class _Group:
    """The loop's view of one submission: how many of its sequences have not ended."""

    sub: Submission
    left: int
    failed: bool = False


@dataclass(frozen=True)
class _Submit:
    group: _Group
    index: int
    spec: SeqSpec
    arrival: float


@dataclass(frozen=True)
class _Abort:
    engine_ids: tuple[str, ...]


@dataclass(frozen=True)
class _Call:
    fn: Callable[[Engine], Any]
    future: concurrent.futures.Future[Any]


@dataclass
class _Track:
    """What the loop knows of one live request: where updates go, its text and its times."""

    group: _Group
    index: int
    sink: Callable[[object], bool]
    params: SamplingParams
    text: TextStream
    times: RequestTimes
    last_at: float | None = None
    gaps: list[float] = field(default_factory=list)


class EngineLoop:
    """Drives an `Engine` on its own thread; `sink(item)` gets each `SeqUpdate` (or an
    `EngineFailure`) on that thread and returns False when nobody listens, which aborts."""

    def __init__(
        self,
        engine: Engine,
        metrics: ServeMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
        stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
        on_fatal: Callable[[str], None] | None = None,
        idle_wait_s: float = 0.5,
        transfer_wait_s: float = 0.001,
        max_queued_seqs: int = DEFAULT_MAX_QUEUED_SEQS,
    ) -> None:
        if not stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s={stall_timeout_s} must be > 0 seconds")
        if max_queued_seqs < 1:
            raise ValueError(f"max_queued_seqs={max_queued_seqs} must be >= 1")
        self.engine = engine
        self.metrics = metrics
        self.clock = clock
        self.stall_timeout_s = stall_timeout_s
        self.on_fatal = on_fatal
        self._idle_wait_s = idle_wait_s
        self._transfer_wait_s = transfer_wait_s
        self._cv = threading.Condition()
        self._inbox: deque[_Submit | _Abort | _Call] = deque()
        self._stopping = False
        self._closed = False  # set by the loop thread on exit: no command is taken after it
        self._idle = threading.Event()
        self._tracks: dict[str, _Track] = {}  # by engine id; loop thread only (size read)
        self._finished: Counter[str] = Counter()  # finished requests by reason, loop thread only
        self._progress_at = clock()  # the latest step that made progress (or the idle moment)
        self.max_queued_seqs = max_queued_seqs
        self._live: dict[str, _Group] = {}  # client id -> its submission (under _cv)
        self._queued = 0  # sequences submitted and not ended (under _cv)
        self._engine_ids = itertools.count()
        self.fatal: str | None = None  # the failure in full, for the log and on_fatal
        self.fatal_public: str | None = None  # what clients are told (no exception text)
        self._thread = threading.Thread(target=self._run, name="kvtier-engine-loop", daemon=True)

    # ---- any thread ----------------------------------------------------------------------------

    def start(self) -> None:
        """Publish the first metrics snapshot and start the loop thread."""
        self._publish()
        self._thread.start()

    def submit(self, rid: str, seqs: Sequence[SeqSpec], arrival: float) -> Submission:
        """Queue a client request's sequences, all or none.

        Raises DuplicateRequestId when a request in flight holds `rid`, Overloaded when the
        sequences would pass `max_queued_seqs`, EngineUnavailable when the loop no longer
        takes work.
        """
        with self._cv:
            self._check_open()
            if rid in self._live:
                raise DuplicateRequestId(rid)
            if self._queued + len(seqs) > self.max_queued_seqs:
                raise Overloaded(self._queued, len(seqs), self.max_queued_seqs)
            ids = tuple(f"srv-{next(self._engine_ids)}" for _ in seqs)
            group = _Group(Submission(rid, ids), len(seqs))
            self._live[rid] = group
            self._queued += len(seqs)
            for i, spec in enumerate(seqs):
                self._enqueue(_Submit(group, i, spec, arrival))
        return group.sub

    def abort(self, sub: Submission) -> None:
        """End a submission's sequences that have not ended (a no-op for those that did, or
        once the loop stopped); never touches another submission, whatever its id."""
        with contextlib.suppress(EngineUnavailable):
            self._put(_Abort(sub.engine_ids))

    @property
    def queued(self) -> int:
        """Sequences submitted and not ended (what `max_queued_seqs` bounds)."""
        with self._cv:
            return self._queued

    def call(self, fn: Callable[[Engine], T]) -> concurrent.futures.Future[T]:
        """Run `fn(engine)` on the loop thread between steps; its result comes in the future."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._put(_Call(fn, fut))
        return fut

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is queued, running, loading or holding blocks (drained)."""
        return self._idle.wait(timeout_s)

    def stall_seconds(self) -> float:
        """Seconds since a step last made progress while requests are queued (0 when idle)."""
        with self._cv:
            busy = bool(self._tracks) or any(isinstance(c, _Submit) for c in self._inbox)
            since = self._progress_at
        return max(0.0, self.clock() - since) if busy else 0.0

    def dead_rank(self) -> str | None:
        """Which TP rank process exited, if one did."""
        for rank, proc in enumerate(getattr(self.engine.executor, "procs", [])):
            code = proc.poll()
            if code is not None:
                return f"TP rank {rank} (pid {proc.pid}) exited with code {code}"
        return None

    def health(self) -> str | None:
        """None when the engine can serve, else why not (failed, a dead rank, stalled)."""
        if self.fatal_public is not None:
            return self.fatal_public
        if self._closed or not self._thread.is_alive():
            return "the engine loop is not running"
        dead = self.dead_rank()
        if dead is not None:
            return dead
        stalled = self.stall_seconds()
        if stalled > self.stall_timeout_s:
            return (
                f"engine stalled: {len(self._tracks)} requests queued and no step made progress "
                f"for {stalled:.0f} s (limit {self.stall_timeout_s:g} s, --stall-timeout)"
            )
        return None

    def stop(self, timeout_s: float = 30.0) -> None:
        """Fail what is in flight with 503 and stop the thread (the engine stays open)."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.error("engine loop did not stop within %.0f s (a step is stuck)", timeout_s)

    def _check_open(self) -> None:
        if self._closed or self._stopping:
            raise EngineUnavailable(self.fatal_public or "the server is shutting down")

    def _put(self, cmd: _Abort | _Call) -> None:
        with self._cv:
            self._check_open()
            self._enqueue(cmd)

    def _enqueue(self, cmd: _Submit | _Abort | _Call) -> None:
        # under _cv
        if isinstance(cmd, _Submit) and not self._tracks and not self._inbox:
            self._progress_at = self.clock()  # idle until now: the stall clock starts here
        self._inbox.append(cmd)
        self._idle.clear()
        self._cv.notify()

    def _release(self, group: _Group, count: int = 1) -> None:
        """`count` sequences of `group` ended (loop thread): free their queue places, and the
        client id once none is left."""
        with self._cv:
            self._queued -= count
            group.left -= count
            if group.left <= 0 and self._live.get(group.sub.rid) is group:
                del self._live[group.sub.rid]

    # ---- loop thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                cmds = self._take()
                if cmds is None:
                    break
                for cmd in cmds:
                    self._apply(cmd)
                # a rank dead between steps: the executor names it and stops the survivors, as
                # a failed step would (else they wait on their dead peer until close)
                try:
                    self.engine.executor.check_ranks()
                except WorkerError as exc:
                    raise _RankDied(str(exc)) from None
                if self.engine.has_unfinished_requests():
                    self._step()
                self._publish()
        except Exception as exc:
            # the scheduler's state after a half-done step is unknown: stop serving
            self.fatal = f"engine failed: {type(exc).__name__}: {_first_line(exc)}"
            # clients hear the kind (a dead rank is our own words); the text stays in the log
            self.fatal_public = (
                f"engine failed: {exc}" if isinstance(exc, _RankDied)
                else f"engine failed ({type(exc).__name__}); the server is exiting and its "
                "log has the cause"
            )  # fmt: skip
            log.error(
                "kvtier serve: %s; failing %d requests in flight, the server exits",
                self.fatal, len(self._tracks), exc_info=exc,
            )  # fmt: skip
        finally:
            self._shutdown()
        if self.fatal is not None and self.on_fatal is not None:
            self.on_fatal(self.fatal)

    def _take(self) -> list[_Submit | _Abort | _Call] | None:
        eng = self.engine
        with self._cv:
            if self._stopping:
                return None
            if not self._inbox:
                if not eng.has_unfinished_requests():
                    self._idle.set()
                    self._progress_at = self.clock()
                    # wake for work, or after a while to check the ranks are alive
                    self._cv.wait(self._idle_wait_s)
                elif eng.last_step_tokens == 0:
                    # only transfers in flight (loads, delayed frees): give them a moment, but
                    # wake at once for a new request
                    self._cv.wait(self._transfer_wait_s)
            if self._stopping:
                return None
            cmds = list(self._inbox)
            self._inbox.clear()
        return cmds

    def _apply(self, cmd: _Submit | _Abort | _Call) -> None:
        if isinstance(cmd, _Submit):
            group, spec = cmd.group, cmd.spec
            eid = group.sub.engine_ids[cmd.index]
            if group.failed:  # a sibling already failed: this one never starts
                self._release(group)
                return
            try:
                self.engine.add_request(
                    spec.prompt_ids, spec.params, request_id=eid, retention=spec.retention
                )
            except ValueError as exc:  # ConfigError is a ValueError too
                # the engine's validation words (ours, about the prompt), never the client's id
                self._release(group)
                self._fail_group(group, spec.sink, EngineFailure(400, str(exc)))
                return
            times = RequestTimes(cmd.arrival, len(spec.prompt_ids), spec.params.max_tokens)
            self._tracks[eid] = _Track(group, cmd.index, spec.sink, spec.params, spec.text, times)
        elif isinstance(cmd, _Abort):
            for eid in cmd.engine_ids:
                track = self._tracks.pop(eid, None)
                if track is None:
                    continue  # ended already: its id is never reused, so nothing else is hit
                self.engine.abort(eid)
                self._release(track.group)
                log.info("%s: aborted (client went away)", self._name(track))
        elif cmd.future.set_running_or_notify_cancel():
            try:
                cmd.future.set_result(cmd.fn(self.engine))
            except Exception as exc:  # noqa: BLE001 - the caller gets it through the future
                cmd.future.set_exception(exc)

    def _fail_group(
        self, group: _Group, sink: Callable[[object], bool], failure: EngineFailure
    ) -> None:
        """A sequence of `group` failed: end its live siblings and tell the client once."""
        if group.failed:
            return
        group.failed = True
        for eid in group.sub.engine_ids:
            track = self._tracks.pop(eid, None)
            if track is not None:
                self.engine.abort(eid)
                self._release(group)
        sink(failure)

    @staticmethod
    def _name(track: _Track) -> str:
        """How the log names a sequence: the client's id (escaped, capped), its engine id."""
        sub = track.group.sub
        eid = sub.engine_ids[track.index]
        return f"{loggable(sub.rid)} ({eid})"

    def _step(self) -> None:
        t0 = self.clock()
        outs = self.engine.step()
        now = self.clock()
        tokens = self.engine.last_step_tokens
        if tokens > 0 or outs:
            self._progress_at = now
        if tokens > 0:
            self.metrics.observe_iteration(tokens)
        for rid in self.engine.last_scheduled_new:
            track = self._tracks.get(rid)
            if track is not None and track.times.scheduled_at is None:
                track.times.scheduled_at = t0
        for out in outs:
            self._deliver(out, now)

    def _deliver(self, out: RequestOutput, now: float) -> None:
        track = self._tracks.get(out.request_id)
        if track is None:
            if out.finished and out.finish_reason is not None:
                self._finished[out.finish_reason] += 1
            return
        times = track.times
        if times.first_token_at is None and out.new_token_ids:
            times.first_token_at = now
        elif track.last_at is not None:
            track.gaps.extend([now - track.last_at] * len(out.new_token_ids))
        track.last_at = now
        text = track.text.update(out.output_token_ids, out.finished)
        reason, stop = out.finish_reason, None
        if track.text.stopped_by is not None:
            reason, stop = "stop", track.text.stopped_by
            if not out.finished:
                # ended by a stop string: finish it before the next step generates past it
                self.engine.abort(out.request_id, reason="stop")
        elif reason == "stop":
            last = out.output_token_ids[-1] if out.output_token_ids else None
            stop = last if last in track.params.stop_token_ids else None
        update = SeqUpdate(out, text, reason, stop)
        if reason is not None:
            self._finished[reason] += 1
            del self._tracks[out.request_id]
            self._release(track.group)
            times.finished_at = now
            times.generated = len(out.output_token_ids)
            times.cached = out.num_cached_tokens
            times.external = out.num_external_tokens
            self._record(out, update, track)
            if reason == "error":
                self._fail_group(track.group, track.sink, EngineFailure(500, SEQ_FAILED))
                return
        if not track.sink(update) and reason is None:
            self._tracks.pop(out.request_id, None)
            self.engine.abort(out.request_id)
            self._release(track.group)

    def _record(self, out: RequestOutput, update: SeqUpdate, track: _Track) -> None:
        self.metrics.observe_request(track.times, track.gaps, update.finish_reason or "")
        t = track.times
        log.info(
            "%s: prompt=%d cached=%d (hbm=%d external=%d) completion=%d finish=%s "
            "ttft=%.3fs e2e=%.3fs%s",
            self._name(track), out.prompt_tokens, out.num_cached_tokens + out.num_external_tokens,
            out.num_cached_tokens, out.num_external_tokens, len(out.output_token_ids),
            update.finish_reason, (t.first_token_at or t.arrival) - t.arrival,
            (t.finished_at or t.arrival) - t.arrival,
            f" error={out.error!r}" if out.error else "",
        )  # fmt: skip

    def _publish(self) -> None:
        self.metrics.publish(self.engine.stats(), self._finished)

    def _shutdown(self) -> None:
        with self._cv:
            self._closed = True
            pending = list(self._inbox)
            self._inbox.clear()
            self._idle.set()
        status, reason = (
            (500, self.fatal_public) if self.fatal_public else (503, "the server is shutting down")
        )
        for track in self._tracks.values():
            self._release(track.group)
            if not track.group.failed:
                track.group.failed = True  # one failure per client request
                track.sink(EngineFailure(status, reason))
        self._tracks.clear()
        for cmd in pending:
            if isinstance(cmd, _Submit):
                self._release(cmd.group)
                if not cmd.group.failed:
                    cmd.group.failed = True
                    cmd.spec.sink(EngineFailure(503, reason))
            elif isinstance(cmd, _Call) and cmd.future.set_running_or_notify_cancel():
                cmd.future.set_exception(EngineUnavailable(reason))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "(no message)"
