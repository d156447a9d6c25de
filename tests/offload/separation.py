"""A device-separation harness: on a CPU-only machine, tensors tagged "device" (the KV cache,
device staging, device index tensors) and plain "host" tensors must never meet in one op other
than an explicit copy, exactly as CUDA refuses `index_select(cuda, idx, out=host)`.

Tags follow storages, so views inherit them; an op whose tensor inputs are all device tensors
makes device outputs. `TaggedOps` is `CpuOps` with CUDA's shape: a separate device staging
buffer, device index tensors, explicit uploads. Its `bind_thread` enters the mode in the worker
lanes too (dispatch modes are per thread).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from kvtier.offload.device import CpuOps, Lane, copy_to

aten = torch.ops.aten

# the only ops allowed to read one kind and write the other
EXPLICIT_COPIES = {aten.copy_.default, aten._to_copy.default}


class DeviceMixError(AssertionError):
    """An op mixed device and host tensors (CUDA would raise)."""


class DeviceSeparation(TorchDispatchMode):
    """Raises `DeviceMixError` on any op mixing device-tagged and host tensors."""

    def __init__(self) -> None:
        super().__init__()
        self._device: set[int] = set()
        # tagged tensors stay alive for the mode's life, so a freed device storage's address is
        # never reused by a host allocation (which would then read as device)
        self._keep: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.checked = 0  # ops seen, so a test can prove the mode was active

    def tag(self, t: torch.Tensor) -> torch.Tensor:
        """Mark `t`'s storage as device memory; returns `t`."""
        ptr = t.untyped_storage().data_ptr()
        if ptr:
            with self._lock:
                self._device.add(ptr)
                self._keep.append(t)
        return t

    def is_device(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self._device

    def _kind(self, t: torch.Tensor) -> str | None:
        if t.untyped_storage().nbytes() == 0:
            return None
        if self.is_device(t):
            return "device"
        # CUDA accepts 0-dim host scalars next to device tensors
        return None if t.dim() == 0 else "host"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        kinds = {k for t in tensors if (k := self._kind(t)) is not None}
        self.checked += 1
        if len(kinds) > 1 and func not in EXPLICIT_COPIES:
            shapes = [(tuple(t.shape), self._kind(t)) for t in tensors]
            raise DeviceMixError(f"{func} mixes device and host tensors: {shapes}")
        out = func(*args, **kwargs)
        if kinds == {"device"}:
            for o in tree_flatten(out)[0]:
                if isinstance(o, torch.Tensor):
                    self.tag(o)
        return out


class TaggedOps(CpuOps):
    """CPU ops shaped like CUDA's, with device tensors tagged in `mode`."""

    def __init__(self, mode: DeviceSeparation) -> None:
        super().__init__()
        self.mode = mode
        self.bound: list[str] = []

    def bind_thread(self) -> None:
        """Enter the mode in the calling thread (a lane), like CUDA's set_device."""
        self.bound.append(threading.current_thread().name)
        self.mode.__enter__()

    def index(self, ids: Sequence[int]) -> torch.Tensor:
        return self.mode.tag(torch.tensor(list(ids), dtype=torch.long))

    def staging(self, nbytes: int) -> torch.Tensor | None:
        return self.mode.tag(torch.empty(nbytes, dtype=torch.uint8))

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        return self.mode.tag(copy_to(host, self.device))

    def lane(self) -> Lane:
        return super().lane()
