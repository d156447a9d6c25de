"""A recorder of the torch ops dispatched in a block: the copy lanes' issue path must make none
per chunk (each torch call releases the GIL, and beside a thread running Python each release
can cost a lane a whole switch interval)."""

from __future__ import annotations

from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode


class TorchOps(TorchDispatchMode):
    """Records every aten op dispatched inside it (`ops`), running each as usual."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))
