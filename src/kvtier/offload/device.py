"""The KV device as the offload core drives it: index tensors, staging, streams and fences.

Every op the codec runs touches tensors of one device only; host <-> device bytes cross in
explicit copies. On CUDA a lane (the save or the load thread) owns two side streams, one for
kernels (gather, scatter) and one for copies, its copies are non-blocking from pinned memory,
and its work is complete only once its mark (a blocking-sync event) is reached.
On the CPU the same code runs with host tensors: no stream, no staging (the destination is
written in place), nothing to wait for. `kvtier.offload.simdevice` models a GPU's streams and
copy engine on the host, so the asynchronous path is tested without one.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import torch

from kvtier.offload import dma

log = logging.getLogger("kvtier")


class Mark(Protocol):
    """A position in a lane's queue (a CUDA event): complete once everything queued on the lane
    before it has completed."""

    def wait(self) -> None:
        """Block the calling thread until the mark is reached (a real wait, never a spin)."""
        ...

    def done(self) -> bool:
        """Whether the mark is reached, without waiting."""
        ...


class Lane(Protocol):
    """One worker thread's view of the device: a kernel stream and a copy stream.

    `launch` queues device ops (the codec's gather or scatter) on the kernel stream, `copy` one
    host <-> device transfer on the copy stream (the copy engine); each runs after the mark it is
    given and returns a mark of its own, so a gather can feed a copy and a copy a scatter while
    the next chunk's work proceeds on the other stream. `after` orders the kernel stream after a
    fence of the compute stream (the forward that wrote or still reads the blocks).
    """

    def active(self) -> contextlib.AbstractContextManager[None]:
        """Make this lane's kernel stream current for the ops inside."""
        ...

    def after(self, fence: object | None) -> None:
        """Order this lane's next kernel work after `fence` (the forward that wrote the blocks)."""
        ...

    def launch(self, fn: Callable[[], object], after: Mark | None = None) -> Mark:
        """Queue the device ops `fn` issues on the kernel stream, after `after`; their mark."""
        ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Mark | None = None) -> Mark:
        """Queue one host <-> device copy on the copy stream, after `after`; its mark."""
        ...

    def copy_regions(
        self, spans: Sequence[dma.Span], to_host: bool, fence: object | None = None
    ) -> Mark:
        """Queue the 2-D copies between the KV cache and host buffers (the codec's `regions`)
        on the copy stream, after `fence` (the forward that wrote or may still read the
        blocks): the copy engine moves a contiguous run with no kernel and no staging buffer.
        Its mark."""
        ...

    def finish(self) -> None:
        """Block the calling thread until every op queued on this lane has completed."""
        ...


class DeviceOps(Protocol):
    """What the codec and the worker's lanes need from the rank's KV device."""

    device: torch.device
    # copies and kernels are queued and complete later (CUDA, the simulated device); False
    # where every op is complete when it returns (the CPU backend)
    asynchronous: bool
    # the lanes' `copy_regions` moves contiguous runs by DMA (CUDA with its runtime bound, the
    # simulated device); False: every chunk goes through a kernel and staging, or in place
    dma: bool

    def bind_thread(self) -> None:
        """Run in every thread that touches the device: sets the rank's device there."""
        ...

    def index(self, ids: Sequence[int]) -> torch.Tensor:
        """Block ids as an int64 tensor on the device (uploaded without a host wait)."""
        ...

    def staging(self, nbytes: int) -> torch.Tensor | None:
        """A device buffer for one chunk, or None when the device is the host (stage in place)."""
        ...

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A host buffer the copy engine reads and writes directly (pinned on CUDA)."""
        ...

    def lane(self) -> Lane:
        """A lane for one worker thread (call it from that thread)."""
        ...

    def host_locked(self, locked: bool) -> None:
        """Whether the memory tier's arena, which the lanes' 2-D copies read and write beside
        `host_buffer`s, is page-locked (lanes made after the call go by it)."""
        ...

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        """A device copy of a host tensor (an explicit copy)."""
        ...

    def fence(self) -> object | None:
        """Record the current (compute) stream's position; None where work is synchronous."""
        ...

    def join(self, mark: Mark) -> None:
        """Order the current (compute) stream's next work after `mark`, without a host wait."""
        ...


class DoneMark:
    """A mark that is already reached (host work completes before the call returns)."""

    def wait(self) -> None:
        return

    def done(self) -> bool:
        return True


DONE = DoneMark()


class HostLane:
    """CPU: ops run synchronously in the calling thread."""

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        yield

    def after(self, fence: object | None) -> None:
        return

    def launch(self, fn: Callable[[], object], after: Mark | None = None) -> Mark:
        fn()
        return DONE

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Mark | None = None) -> Mark:
        dst.copy_(src)
        return DONE

    def copy_regions(
        self, spans: Sequence[dma.Span], to_host: bool, fence: object | None = None
    ) -> Mark:
        dma.issue(spans, to_host, dma.host_memcpy2d)
        return DONE

    def finish(self) -> None:
        return


_HostLane = HostLane  # the name tests and older callers used


class CpuOps:
    """The KV cache is host memory: no staging, no streams."""

    asynchronous = False
    dma = False  # the codec writes the host slot in place: nothing to copy twice

    def __init__(self) -> None:
        self.device = torch.device("cpu")

    def bind_thread(self) -> None:
        """Nothing to bind on the host."""

    def index(self, ids: Sequence[int]) -> torch.Tensor:
        """Host int64 ids."""
        return torch.tensor(list(ids), dtype=torch.long)

    def staging(self, nbytes: int) -> torch.Tensor | None:
        """None: the codec writes host destinations in place."""
        return None

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """Plain host memory."""
        return torch.empty(nbytes, dtype=torch.uint8)

    def lane(self) -> Lane:
        """A synchronous lane."""
        return HostLane()

    def host_locked(self, locked: bool) -> None:
        """Nothing to change: host copies hold no lock."""

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        """A copy (the device is the host)."""
        return copy_to(host, self.device)

    def fence(self) -> object | None:
        """Host work is complete when the call returns."""
        return None

    def join(self, mark: Mark) -> None:
        """Nothing to order: the mark was reached when it was made."""


class _CudaMark:
    """A blocking-sync CUDA event: `synchronize` sleeps the thread until the GPU signals it,
    where a default event would spin a core for the whole copy."""

    __slots__ = ("event",)

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.event = torch.cuda.Event(blocking=True)
        self.event.record(stream)

    def wait(self) -> None:
        self.event.synchronize()

    def done(self) -> bool:
        return bool(self.event.query())


def _wait_on(stream: torch.cuda.Stream, mark: Mark | None) -> None:
    if isinstance(mark, _CudaMark):
        stream.wait_event(mark.event)
    elif mark is not None and not mark.done():
        mark.wait()  # a host-side mark (never made by a CUDA lane): wait for it here


def _no_dma(dst: int, dpitch: int, src: int, spitch: int, width: int, height: int) -> None:
    raise RuntimeError("2-D copies need the CUDA runtime bound (CudaOps.dma is False)")


class _CudaLane:
    """Two side streams: kernels on one, copies (the copy engine) on the other, so the gather
    of chunk i+1 runs while chunk i crosses the link. Copies are non-blocking from pinned
    memory; marks are blocking events."""

    def __init__(self, device: torch.device, dma_bound: bool, hold_gil: bool) -> None:
        self._kernels = torch.cuda.Stream(device=device)
        self._copies = torch.cuda.Stream(device=device)
        self._memcpy2d = dma.cuda_memcpy2d(self._copies, hold_gil) if dma_bound else _no_dma

    def active(self) -> contextlib.AbstractContextManager[None]:
        return torch.cuda.stream(self._kernels)

    def after(self, fence: object | None) -> None:
        if fence is not None:
            self._kernels.wait_event(fence)  # type: ignore[arg-type]

    def launch(self, fn: Callable[[], object], after: Mark | None = None) -> Mark:
        _wait_on(self._kernels, after)
        with torch.cuda.stream(self._kernels):
            fn()
        return _CudaMark(self._kernels)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Mark | None = None) -> Mark:
        _wait_on(self._copies, after)
        with torch.cuda.stream(self._copies):
            dst.copy_(src, non_blocking=True)
        return _CudaMark(self._copies)

    def copy_regions(
        self, spans: Sequence[dma.Span], to_host: bool, fence: object | None = None
    ) -> Mark:
        if fence is not None:
            self._copies.wait_event(fence)  # type: ignore[arg-type]
        dma.issue(spans, to_host, self._memcpy2d)
        return _CudaMark(self._copies)

    def finish(self) -> None:
        _CudaMark(self._kernels).wait()
        _CudaMark(self._copies).wait()


class CudaOps:
    """One CUDA device of a rank."""

    asynchronous = True

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda" or device.index is None:
            raise ValueError(f"CudaOps needs a cuda device with an index, got {device}")
        self.device = device
        try:
            dma.load()
            self.dma = True
        except (RuntimeError, OSError, AttributeError) as e:
            # correct either way: every chunk then takes the gather/scatter kernel and a
            # staging buffer (kvtier_transfer_chunks_total{path="kernel"} says how many)
            log.warning(
                "kvtier: no 2-D DMA on %s (%s); chunks move through a copy kernel", device, e
            )
            self.dma = False
        self._host_locked = False

    def host_locked(self, locked: bool) -> None:
        """With every host buffer page-locked, a 2-D copy's issue only queues it: the lanes then
        issue it holding the GIL (`dma.cuda_memcpy2d`)."""
        self._host_locked = locked

    def bind_thread(self) -> None:
        """A new thread starts on cuda:0; every rank's lanes must run on the rank's device."""
        torch.cuda.set_device(self.device)

    def index(self, ids: Sequence[int]) -> torch.Tensor:
        """Ids through pinned memory, uploaded on the current stream without a host wait
        (`torch.tensor(..., device=cuda)` is a synchronous copy from pageable memory). The
        caching host allocator keeps the pinned block until the upload completed."""
        host = torch.empty(len(ids), dtype=torch.long, pin_memory=True)
        host.copy_(torch.tensor(list(ids), dtype=torch.long))
        return host.to(self.device, non_blocking=True)

    def staging(self, nbytes: int) -> torch.Tensor | None:
        """One chunk of device memory."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """Pinned host memory: the copy engine's DMA reads it without a pageable bounce."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def lane(self) -> Lane:
        """A lane on a fresh side stream of this device."""
        return _CudaLane(self.device, self.dma, self._host_locked)

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        """A copy on this device."""
        return copy_to(host, self.device)

    def fence(self) -> object | None:
        """An event at the current stream's position (after this step's forward); only
        streams wait for it, so it needs no blocking sync."""
        event = torch.cuda.Event()
        # this device's stream, whatever device the calling thread has current (a TP=1 native
        # engine on cuda:1 never makes it current): a fence on another device's stream orders
        # nothing here
        event.record(torch.cuda.current_stream(self.device))
        return event

    def join(self, mark: Mark) -> None:
        """The current stream (the forward's) waits for `mark` on the device."""
        if isinstance(mark, _CudaMark):
            torch.cuda.current_stream(self.device).wait_event(mark.event)
        else:
            mark.wait()


def copy_to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A fresh tensor on `device` holding `t`'s values: one explicit copy, whatever the devices
    (a plain `.to()` returns `t` itself when it is already there)."""
    out = torch.empty(t.shape, dtype=t.dtype, device=device)
    out.copy_(t)
    return out


def ops_for(device: torch.device) -> DeviceOps:
    """The ops of the device a rank's KV cache lives on."""
    if device.type == "cpu":
        return CpuOps()
    if device.type == "cuda":
        return CudaOps(device if device.index is not None else torch.device("cuda", 0))
    raise ValueError(
        f"KV cache on device {device}: kvtier moves KV on 'cpu' and 'cuda' devices only"
    )
