"""The one thread that drives an `Engine` behind the server (the engine is not thread-safe).

Other threads talk to it through a queue: new requests, aborts and calls run between steps.
For every output it applies the client's view (text, stop strings) before the next step, so a
stop string ends the request with no token generated past it, and hands a `SeqUpdate` to the
request's sink. It also keeps what `/health` and `/metrics` need:

- a stall clock: with requests queued and no step making progress (computing tokens or
  emitting outputs) for `stall_timeout_s`, `health()` names the stall even while a step hangs;
- an engine failure (`engine.step()` raised, a TP rank died): every request in flight fails with
  500, the failure is logged once, and `on_fatal` is called so the process can exit nonzero.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvtier.native.detokenizer import TextStream
from kvtier.native.engine import Engine
from kvtier.native.sampling import SamplingParams
from kvtier.native.sequence import RequestOutput
from kvtier.native.serve_metrics import RequestTimes, ServeMetrics

__all__ = ["EngineFailure", "EngineLoop", "EngineUnavailable", "SeqUpdate"]

log = logging.getLogger("kvtier.server")
T = TypeVar("T")

DEFAULT_STALL_TIMEOUT_S = 60.0


class EngineUnavailable(RuntimeError):
    """The engine loop is not accepting work (stopped, or the engine failed)."""


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
class _Submit:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    sink: Callable[[object], bool]
    arrival: float
    text: TextStream


@dataclass(frozen=True)
class _Abort:
    rid: str


@dataclass(frozen=True)
class _Call:
    fn: Callable[[Engine], Any]
    future: concurrent.futures.Future[Any]


@dataclass
class _Track:
    """What the loop knows of one live request: where updates go, its text and its times."""

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
    ) -> None:
        if not stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s={stall_timeout_s} must be > 0 seconds")
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
        self._tracks: dict[str, _Track] = {}  # loop thread only (other threads read its size)
        self._finished: Counter[str] = Counter()  # finished requests by reason, loop thread only
        self._progress_at = clock()  # the latest step that made progress (or the idle moment)
        self.fatal: str | None = None
        self._thread = threading.Thread(target=self._run, name="kvtier-engine-loop", daemon=True)

    # ---- any thread ----------------------------------------------------------------------------

    def start(self) -> None:
        """Publish the first metrics snapshot and start the loop thread."""
        self._publish()
        self._thread.start()

    def submit(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        sink: Callable[[object], bool],
        arrival: float,
        text: TextStream,
    ) -> None:
        """Queue a new request; raises EngineUnavailable when the loop no longer takes work."""
        self._put(_Submit(rid, prompt_ids, params, sink, arrival, text))

    def abort(self, rid: str) -> None:
        """Ask the loop to abort a request (a no-op once it finished or the loop stopped)."""
        with contextlib.suppress(EngineUnavailable):
            self._put(_Abort(rid))

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
        if self.fatal is not None:
            return self.fatal
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

    def _put(self, cmd: _Submit | _Abort | _Call) -> None:
        with self._cv:
            if self._closed or self._stopping:
                raise EngineUnavailable(self.fatal or "the server is shutting down")
            if isinstance(cmd, _Submit) and not self._tracks and not self._inbox:
                self._progress_at = self.clock()  # idle until now: the stall clock starts here
            self._inbox.append(cmd)
            self._idle.clear()
            self._cv.notify()

    # ---- loop thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                cmds = self._take()
                if cmds is None:
                    break
                for cmd in cmds:
                    self._apply(cmd)
                dead = self.dead_rank()
                if dead is not None:
                    raise RuntimeError(dead)
                if self.engine.has_unfinished_requests():
                    self._step()
                self._publish()
        except Exception as exc:
            # the scheduler's state after a half-done step is unknown: stop serving
            self.fatal = f"engine failed: {type(exc).__name__}: {_first_line(exc)}"
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
            try:
                self.engine.add_request(cmd.prompt_ids, cmd.params, request_id=cmd.rid)
            except ValueError as exc:  # ConfigError is a ValueError too
                cmd.sink(EngineFailure(400, str(exc)))
                return
            times = RequestTimes(cmd.arrival, len(cmd.prompt_ids), cmd.params.max_tokens)
            self._tracks[cmd.rid] = _Track(cmd.sink, cmd.params, cmd.text, times)
        elif isinstance(cmd, _Abort):
            track = self._tracks.pop(cmd.rid, None)
            if self.engine.abort(cmd.rid) and track is not None:
                log.info("%s: aborted (client went away)", cmd.rid)
        elif cmd.future.set_running_or_notify_cancel():
            try:
                cmd.future.set_result(cmd.fn(self.engine))
            except Exception as exc:  # noqa: BLE001 - the caller gets it through the future
                cmd.future.set_exception(exc)

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
            times.finished_at = now
            times.generated = len(out.output_token_ids)
            times.cached = out.num_cached_tokens
            times.external = out.num_external_tokens
            self._record(out, update, track)
        if not track.sink(update) and reason is None:
            self._tracks.pop(out.request_id, None)
            self.engine.abort(out.request_id)

    def _record(self, out: RequestOutput, update: SeqUpdate, track: _Track) -> None:
        self.metrics.observe_request(track.times, track.gaps, update.finish_reason or "")
        t = track.times
        log.info(
            "%s: prompt=%d cached=%d (hbm=%d external=%d) completion=%d finish=%s "
            "ttft=%.3fs e2e=%.3fs%s",
            out.request_id, out.prompt_tokens, out.num_cached_tokens + out.num_external_tokens,
            out.num_cached_tokens, out.num_external_tokens, len(out.output_token_ids),
            update.finish_reason, (t.first_token_at or t.arrival) - t.arrival,
            (t.finished_at or t.arrival) - t.arrival,
            f" error={out.error}" if out.error else "",
        )  # fmt: skip

    def _publish(self) -> None:
        self.metrics.publish(self.engine.stats(), self._finished)

    def _shutdown(self) -> None:
        with self._cv:
            self._closed = True
            pending = list(self._inbox)
            self._inbox.clear()
            self._idle.set()
        status, reason = (500, self.fatal) if self.fatal else (503, "the server is shutting down")
        for track in self._tracks.values():
            track.sink(EngineFailure(status, reason))
        self._tracks.clear()
        for cmd in pending:
            if isinstance(cmd, _Submit):
                cmd.sink(EngineFailure(503, reason))
            elif isinstance(cmd, _Call) and cmd.future.set_running_or_notify_cancel():
                cmd.future.set_exception(EngineUnavailable(reason))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "(no message)"
