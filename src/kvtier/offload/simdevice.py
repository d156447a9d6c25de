"""A simulated KV device: CUDA's streams, events and copy engine, modelled on the host.

No GPU has been lent to kvtier, yet the device path's speed is a matter of ordering: whether the
copy engine is kept busy, whether a thread waits where it should not, whether a host thread
spins. `SimOps` is a `DeviceOps` that runs the real worker code with those properties
observable:

- every lane has a kernel stream and a copy stream, and the host has a compute stream; each
  stream is a thread that runs its queue in order, so work is asynchronous to the thread that
  queued it exactly as on CUDA (a scatter queued before its copy landed would read old bytes);
- a copy occupies one of the copy engines (one shared by both directions, or one per direction)
  for `latency + bytes / bandwidth` of modelled time; its bytes are written at the end of that
  interval, so a buffer reused before its copy's mark was reached shows up as wrong bytes;
- a mark (an event) is reached when its work is; `Mark.wait` blocks the calling thread on a
  condition for real time, never a spin, and is counted per thread (`SimStats.host_waits`).

Device memory is host memory here: `staging` buffers are what the model treats as device, and
the direction of a copy is told by which side is one of them. Kernels (gather, scatter) take the
host's real time on their stream's thread; `time_scale` stretches the modelled copy times so
the ratio of link time to that host work can be set to a GPU's (where a gather runs at HBM
speed, tens of times the link's).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from kvtier.offload import dma
from kvtier.offload.device import Lane, Mark, copy_to

_GB = 1e9


@dataclass(frozen=True, slots=True)
class CopyModel:
    """The modelled copy engine: per-engine bandwidth, per-copy latency, engine count."""

    gbps: float = 25.0
    latency_us: float = 5.0
    # 1: both directions share one engine; 2: one engine per direction (H2D, D2H)
    engines: int = 1
    # modelled durations are multiplied by this (the host's own work is not)
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.gbps <= 0:
            raise ValueError(f"CopyModel gbps={self.gbps} must be > 0 (e.g. 25 for PCIe Gen4)")
        if self.latency_us < 0:
            raise ValueError(f"CopyModel latency_us={self.latency_us} must be >= 0")
        if self.engines not in (1, 2):
            raise ValueError(f"CopyModel engines={self.engines} must be 1 or 2")
        if self.time_scale <= 0:
            raise ValueError(f"CopyModel time_scale={self.time_scale} must be > 0 (1 = real)")

    def seconds(self, nbytes: int) -> float:
        """Modelled wall time of one copy of `nbytes`."""
        return (self.latency_us * 1e-6 + nbytes / (self.gbps * _GB)) * self.time_scale


@dataclass(slots=True)
class SimStats:
    """What the simulated device saw; read it after `SimOps.synchronize`."""

    copies: int = 0
    copy_bytes: int = 0
    h2d: int = 0
    d2h: int = 0
    kernels: int = 0
    engine_busy_s: float = 0.0  # modelled seconds the engines were copying, summed
    # idle stretches between two copies on an engine (modelled seconds, summed): a copy that
    # could have been queued earlier (the host waking, committing, reporting) shows up here
    engine_idle_s: float = 0.0
    engine_gaps: int = 0  # copies that found their engine idle after its previous copy
    peak_in_flight: int = 0  # most copies queued and not yet complete at once
    host_waits: collections.Counter[str] = field(default_factory=collections.Counter)
    host_wait_s: collections.Counter[str] = field(default_factory=collections.Counter)
    joins: collections.Counter[str] = field(default_factory=collections.Counter)


class SimEvent:
    """A mark on a simulated stream: reached when the work queued before it completed. A
    failure on its stream (a kernel that raised) is re-raised by `wait`, as CUDA reports an
    asynchronous error at the next synchronisation."""

    __slots__ = ("_ops", "_set", "t_done", "error")

    def __init__(self, ops: SimOps) -> None:
        self._ops = ops
        self._set = threading.Event()
        self.t_done = 0.0  # monotonic time the work completed, in the model
        self.error: BaseException | None = None

    def _complete(self, t_done: float, error: BaseException | None = None) -> None:
        self.t_done = t_done
        self.error = error
        self._set.set()

    def done(self) -> bool:
        """Reached, without waiting."""
        return self._set.is_set()

    def wait(self) -> None:
        """Block the calling thread until reached (a condition wait; counted per thread)."""
        name = threading.current_thread().name
        t0 = time.monotonic()
        self._set.wait()
        self._ops._count_wait(name, time.monotonic() - t0)
        if self.error is not None:
            raise RuntimeError(f"simulated device: queued work failed: {self.error}")

    def _device_wait(self) -> float:
        """A stream waiting on this mark (not a host wait); returns when it was reached."""
        self._set.wait()
        return self.t_done


@dataclass(slots=True)
class _Item:
    kind: str  # "kernel" | "copy" | "regions" | "wait" | "record"
    event: SimEvent | None
    fn: Callable[[], object] | None = None
    dst: torch.Tensor | None = None
    src: torch.Tensor | None = None
    # "regions": 2-D copies, one engine copy each, and their direction
    spans: Sequence[dma.Span] = ()
    to_host: bool = False
    dep: SimEvent | None = None
    queued_at: float = field(default_factory=time.monotonic)


class _Engine:
    """One copy engine: the modelled time at which it is next free."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free_at = 0.0

    def forget(self) -> None:
        """Drop the engine's history: its next copy's wait is not an idle gap."""
        with self._lock:
            self._free_at = 0.0

    def reserve(self, ready_at: float, seconds: float) -> tuple[float, float, float]:
        """The copy's modelled (start, end), and how long the engine sat idle before it since
        its previous copy (0 for its first)."""
        with self._lock:
            start = max(ready_at, self._free_at)
            idle = start - self._free_at if self._free_at else 0.0
            self._free_at = start + seconds
            return start, self._free_at, idle


class SimStream:
    """An in-order queue run by one thread. Time is modelled per item: an item starts when the
    item before it on this stream and the mark it depends on are done (their modelled times),
    so the stream thread's own wake-up delays do not leave the engine idle."""

    def __init__(self, name: str, ops: SimOps) -> None:
        self.name = name
        self._ops = ops
        self._cond = threading.Condition()
        self._queue: collections.deque[_Item] = collections.deque()
        self._closed = False
        self._last_t = 0.0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"sim-{name}", daemon=True)
        self._thread.start()

    def put(self, item: _Item) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError(f"simulated stream {self.name} is closed")
            self._queue.append(item)
            self._cond.notify()

    def record(self) -> SimEvent:
        ev = SimEvent(self._ops)
        self.put(_Item("record", ev))
        return ev

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=30.0)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                item = self._queue.popleft()
            self._step(item)

    def _step(self, item: _Item) -> None:
        # an item starts once queued, after the item before it and the mark it depends on
        ready = max(self._last_t, item.queued_at)
        if item.dep is not None:
            ready = max(ready, item.dep._device_wait())
            if item.dep.error is not None and self._error is None:
                self._error = item.dep.error
        if item.kind == "kernel":
            assert item.fn is not None
            _sleep_until(ready)
            if self._error is None:
                token = self._ops._enter(self)
                try:
                    item.fn()
                except Exception as e:  # noqa: BLE001 - sticky, raised by the next wait
                    self._error = e
                finally:
                    self._ops._exit(token)
            self._last_t = time.monotonic()
        elif item.kind == "copy":
            assert item.dst is not None and item.src is not None
            try:
                self._last_t = self._ops._copy(item.dst, item.src, ready, self._error is None)
            except RuntimeError as e:
                self._error = self._error or e
                self._last_t = time.monotonic()
        elif item.kind == "regions":
            for span in item.spans:
                try:
                    ready = self._ops._engine_copy(
                        span.nbytes,
                        lambda s=span: dma.issue([s], item.to_host, dma.host_memcpy2d),
                        ready,
                        self._error is None,
                        item.to_host,
                    )
                except RuntimeError as e:
                    self._error = self._error or e
                    ready = time.monotonic()
            self._last_t = ready
        else:
            self._last_t = ready
        if item.event is not None:
            item.event._complete(self._last_t, self._error)


def _sleep_until(t: float) -> None:
    """Block (on a condition, not a spin) until monotonic time `t`."""
    left = t - time.monotonic()
    if left > 0:
        threading.Event().wait(left)


class _SimLane:
    """A lane of the simulated device: a kernel stream and a copy stream."""

    def __init__(self, ops: SimOps, name: str) -> None:
        self._ops = ops
        self.kernels = ops._stream(f"{name}-kernels")
        self.copies = ops._stream(f"{name}-copies")

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        token = self._ops._enter(self.kernels)
        try:
            yield
        finally:
            self._ops._exit(token)

    def after(self, fence: object | None) -> None:
        if fence is not None:
            assert isinstance(fence, SimEvent), f"a fence of another device: {fence!r}"
            self.kernels.put(_Item("wait", None, dep=fence))

    def launch(self, fn: Callable[[], object], after: Mark | None = None) -> Mark:
        ev = SimEvent(self._ops)
        self._ops._kernel_queued()
        self.kernels.put(_Item("kernel", ev, fn=fn, dep=_dep(after)))
        return ev

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Mark | None = None) -> Mark:
        ev = SimEvent(self._ops)
        self._ops._copy_queued()
        self.copies.put(_Item("copy", ev, dst=dst, src=src, dep=_dep(after)))
        return ev

    def copy_regions(
        self, spans: Sequence[dma.Span], to_host: bool, fence: object | None = None
    ) -> Mark:
        if fence is not None:
            assert isinstance(fence, SimEvent), f"a fence of another device: {fence!r}"
            self.copies.put(_Item("wait", None, dep=fence))
        ev = SimEvent(self._ops)
        for _ in spans:
            self._ops._copy_queued()
        self.copies.put(_Item("regions", ev, spans=list(spans), to_host=to_host))
        return ev

    def finish(self) -> None:
        self.kernels.record().wait()
        self.copies.record().wait()


def _dep(mark: Mark | None) -> SimEvent | None:
    if mark is None or isinstance(mark, SimEvent):
        return mark
    if not mark.done():
        mark.wait()  # a host mark (already reached everywhere kvtier makes one)
    return None


class SimOps:
    """`DeviceOps` of the simulated device (see the module docstring). Call `close()` at the
    end: it stops the stream threads."""

    asynchronous = True
    dma = True

    def __init__(self, model: CopyModel | None = None) -> None:
        self.model = model or CopyModel()
        self.device = torch.device("cpu")
        self.stats = SimStats()
        self._lock = threading.Lock()
        self._engines = [_Engine() for _ in range(self.model.engines)]
        self._device_ptrs: set[int] = set()
        self._keep: list[torch.Tensor] = []
        self._streams: list[SimStream] = []
        self._local = threading.local()
        self._in_flight = 0
        # the rate this host copies bytes at, learnt from the copies done so far: a copy's
        # bytes are written just before its modelled end
        self._host_bps = 5e9
        self.compute = self._stream("compute")

    # ---- DeviceOps ---------------------------------------------------------------------------

    def bind_thread(self) -> None:
        """Nothing to bind: one simulated device."""

    def index(self, ids: Sequence[int]) -> torch.Tensor:
        """Host ids (device memory is host memory here)."""
        return torch.tensor(list(ids), dtype=torch.long)

    def staging(self, nbytes: int) -> torch.Tensor | None:
        """A buffer the model treats as device memory."""
        t = torch.empty(nbytes, dtype=torch.uint8)
        with self._lock:
            self._device_ptrs.add(t.untyped_storage().data_ptr())
            self._keep.append(t)  # its address is never reused by a host buffer
        return t

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """Host memory."""
        return torch.empty(nbytes, dtype=torch.uint8)

    def lane(self) -> Lane:
        """A lane named after the calling thread."""
        return _SimLane(self, threading.current_thread().name)

    def host_locked(self, locked: bool) -> None:
        """Nothing to change: the simulated engine's copies are the same either way."""

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        """A synchronous copy (used outside the timed path: the self-test's pattern)."""
        return copy_to(host, self.device)

    def fence(self) -> object | None:
        """A mark on the calling thread's current stream (the compute stream by default)."""
        return self._current().record()

    def join(self, mark: Mark) -> None:
        """The calling thread's current stream waits for `mark` on the device; counted."""
        self.stats.joins[threading.current_thread().name] += 1
        self._current().put(_Item("wait", None, dep=_dep(mark)))

    # ---- for tests and the bench ---------------------------------------------------------------

    def run_on_compute(self, fn: Callable[[], object]) -> SimEvent:
        """Queue `fn` on the compute stream (a forward reading or writing KV blocks)."""
        ev = SimEvent(self)
        self.compute.put(_Item("kernel", ev, fn=fn))
        return ev

    def forget_idle(self) -> None:
        """Start counting the engines' idle gaps afresh: the next copy on each engine opens a
        measured burst (the wait since the last burst is not a gap within it)."""
        for engine in self._engines:
            engine.forget()

    def synchronize(self) -> None:
        """Wait for everything queued on every stream so far (a host wait, counted)."""
        with self._lock:
            streams = list(self._streams)
        for s in streams:
            s.record().wait()

    def close(self) -> None:
        """Stop every stream thread after its queued work."""
        with self._lock:
            streams, self._streams = self._streams, []
        for s in streams:
            s.close()

    # ---- the model -----------------------------------------------------------------------------

    def _stream(self, name: str) -> SimStream:
        s = SimStream(name, self)
        with self._lock:
            self._streams.append(s)
        return s

    def _current(self) -> SimStream:
        return getattr(self._local, "stream", None) or self.compute

    def _enter(self, stream: SimStream) -> SimStream | None:
        before = getattr(self._local, "stream", None)
        self._local.stream = stream
        return before

    def _exit(self, token: SimStream | None) -> None:
        self._local.stream = token

    def _count_wait(self, thread: str, seconds: float) -> None:
        with self._lock:
            self.stats.host_waits[thread] += 1
            self.stats.host_wait_s[thread] += seconds

    def _kernel_queued(self) -> None:
        with self._lock:
            self.stats.kernels += 1

    def _copy_queued(self) -> None:
        with self._lock:
            self._in_flight += 1
            self.stats.peak_in_flight = max(self.stats.peak_in_flight, self._in_flight)

    def _is_device(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self._device_ptrs

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, ready: float, ok: bool) -> float:
        """Run one copy on its engine: reserve the modelled interval, write the bytes just
        before it ends, return when it ended."""
        to_host = self._is_device(src)
        if to_host == self._is_device(dst):
            with self._lock:
                self._in_flight -= 1
            raise RuntimeError(
                "simulated device: a copy must cross between a staging buffer and host memory "
                f"(dst {tuple(dst.shape)}, src {tuple(src.shape)})"
            )
        nbytes = src.numel() * src.element_size()
        return self._engine_copy(nbytes, lambda: dst.copy_(src), ready, ok, to_host)

    def _engine_copy(
        self, nbytes: int, move: Callable[[], object], ready: float, ok: bool, to_host: bool
    ) -> float:
        """One copy of `nbytes` in `to_host`'s direction on its engine (a 2-D one moves its
        rows as one); `move` writes its bytes just before its modelled end."""
        seconds = self.model.seconds(nbytes)
        engine = self._engines[1 if to_host and len(self._engines) > 1 else 0]
        _, end, idle = engine.reserve(ready, seconds)
        _sleep_until(end - nbytes / self._host_bps)
        if ok:
            t0 = time.perf_counter()
            move()
            spent = time.perf_counter() - t0
            if spent > 0 and nbytes >= 1 << 16:
                self._host_bps = 0.8 * self._host_bps + 0.2 * (nbytes / spent)
        _sleep_until(end)
        with self._lock:
            self._in_flight -= 1
            self.stats.copies += 1
            self.stats.copy_bytes += nbytes
            self.stats.engine_busy_s += seconds
            self.stats.engine_idle_s += idle
            self.stats.engine_gaps += idle > 0
            if to_host:
                self.stats.d2h += 1
            else:
                self.stats.h2d += 1
        # the modelled end, not when this thread woke: the stream's next copy is ready then, so
        # a late wake-up of the simulating thread never shows up as the engine idling
        return end
