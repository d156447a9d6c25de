"""The KV device as the offload core drives it: index tensors, staging, streams and fences.

Every op the codec runs touches tensors of one device only; host <-> device bytes cross in
explicit copies. On CUDA a lane (the save or the load thread) owns a side stream, its copies are
non-blocking from pinned memory, and its work is complete only after its event synchronised.
On the CPU the same code runs with host tensors: no stream, no staging (the destination is
written in place), nothing to wait for.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch


class Lane(Protocol):
    """One worker thread's view of the device: its stream, and a barrier for its work."""

    def active(self) -> contextlib.AbstractContextManager[None]:
        """Make this lane's stream current for the ops inside."""
        ...

    def after(self, fence: object | None) -> None:
        """Order this lane's next work after `fence` (the forward that wrote the blocks)."""
        ...

    def finish(self) -> None:
        """Block the calling thread until every op queued on this lane has completed."""
        ...


class DeviceOps(Protocol):
    """What the codec and the worker's lanes need from the rank's KV device."""

    device: torch.device

    def bind_thread(self) -> None:
        """Run in every thread that touches the device: sets the rank's device there."""
        ...

    def index(self, ids: Sequence[int]) -> torch.Tensor:
        """Block ids as an int64 tensor on the device."""
        ...

    def staging(self, nbytes: int) -> torch.Tensor | None:
        """A device buffer for one chunk, or None when the device is the host (stage in place)."""
        ...

    def lane(self) -> Lane:
        """A lane for one worker thread (call it from that thread)."""
        ...

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        """A device copy of a host tensor (an explicit copy)."""
        ...

    def fence(self) -> object | None:
        """Record the current (compute) stream's position; None where work is synchronous."""
        ...


class _HostLane:
    """CPU: ops run synchronously in the calling thread."""

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        yield

    def after(self, fence: object | None) -> None:
        return

    def finish(self) -> None:
        return


class CpuOps:
    """The KV cache is host memory: no staging, no streams."""

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

    def lane(self) -> Lane:
        """A synchronous lane."""
        return _HostLane()

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        """A copy (the device is the host)."""
        return copy_to(host, self.device)

    def fence(self) -> object | None:
        """Host work is complete when the call returns."""
        return None


class _CudaLane:
    """A side stream; `finish` records an event on it and waits for it."""

    def __init__(self, device: torch.device) -> None:
        self._stream = torch.cuda.Stream(device=device)

    def active(self) -> contextlib.AbstractContextManager[None]:
        return torch.cuda.stream(self._stream)

    def after(self, fence: object | None) -> None:
        if fence is not None:
            self._stream.wait_event(fence)  # type: ignore[arg-type]

    def finish(self) -> None:
        event = torch.cuda.Event()
        event.record(self._stream)
        event.synchronize()


class CudaOps:
    """One CUDA device of a rank."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda" or device.index is None:
            raise ValueError(f"CudaOps needs a cuda device with an index, got {device}")
        self.device = device

    def bind_thread(self) -> None:
        """A new thread starts on cuda:0; every rank's lanes must run on the rank's device."""
        torch.cuda.set_device(self.device)

    def index(self, ids: Sequence[int]) -> torch.Tensor:
        """Ids copied to the device (a few dozen bytes)."""
        return torch.tensor(list(ids), dtype=torch.long, device=self.device)

    def staging(self, nbytes: int) -> torch.Tensor | None:
        """One chunk of device memory."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def lane(self) -> Lane:
        """A lane on a fresh side stream of this device."""
        return _CudaLane(self.device)

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        """A copy on this device."""
        return copy_to(host, self.device)

    def fence(self) -> object | None:
        """An event at the current stream's position (after this step's forward)."""
        event = torch.cuda.Event()
        event.record()
        return event


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
