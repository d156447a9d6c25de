"""2-D copies on the copy engine: `cudaMemcpy2DAsync` from the CUDA runtime torch loaded.

A run of consecutive KV blocks is, per layer, one contiguous piece of a page array, and the
layers of a layer-outer layout (LBNHC, LBHNC) sit a fixed stride apart: one 2-D copy (rows =
layers, pitch = the layer stride) moves the whole run between the KV cache and a pinned tier
slot by DMA. torch's `copy_` cannot: for a strided device tensor it first runs an elementwise
kernel on the SMs into a contiguous temporary, which competes with the forward's GEMMs.

The runtime is the one already in the process (torch links it): found by name among the loaded
libraries, so no second copy of it is ever loaded. `load()` raises RuntimeError naming what is
missing; a host without it uses the kernel path (gather or scatter, then one copy), and says so.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch

CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction follows from the pointers (UVA)
# cudaDeviceProp.memPitch on current GPUs: a larger pitch is cudaErrorInvalidPitchValue, so
# layers further apart (a KV cache of several GiB per layer) go as one 1-D copy per row
MAX_PITCH = (1 << 31) - 1
_lock = threading.Lock()
_memcpy2d: ctypes._CFuncPtr | None = None  # type: ignore[name-defined]
# the same function called without releasing the GIL (ctypes.PyDLL): between two page-locked
# buffers it only queues the copy, and a release would let a thread running Python take the
# GIL from the lane for up to a switch interval
_memcpy2d_held: ctypes._CFuncPtr | None = None  # type: ignore[name-defined]
_error_string: ctypes._CFuncPtr | None = None  # type: ignore[name-defined]


def _loaded_cudart() -> str | None:
    """The path of the CUDA runtime library this process has mapped, if any."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.rsplit(" ", 1)[-1]
        if "/libcudart.so" in path:
            return path
    return None


def load() -> None:
    """Bind `cudaMemcpy2DAsync` from the loaded CUDA runtime (once per process)."""
    global _memcpy2d, _memcpy2d_held, _error_string
    with _lock:
        if _memcpy2d is not None:
            return
        if not torch.version.cuda:
            raise RuntimeError(f"torch {torch.__version__} is not a CUDA build")
        candidates = [p for p in (_loaded_cudart(),) if p]
        major = (torch.version.cuda or "").split(".")[0]
        if major:
            candidates.append(f"libcudart.so.{major}")
        errors = []
        for name in candidates:
            try:
                lib, held = ctypes.CDLL(name), ctypes.PyDLL(name)
            except OSError as e:
                errors.append(f"{name}: {e}")
                continue
            fn, fn_held = lib.cudaMemcpy2DAsync, held.cudaMemcpy2DAsync
            for f in (fn, fn_held):
                f.restype = ctypes.c_int
                f.argtypes = [
                    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                    ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p,
                ]  # fmt: skip
            err = lib.cudaGetErrorString
            err.restype = ctypes.c_char_p
            err.argtypes = [ctypes.c_int]
            _memcpy2d, _memcpy2d_held, _error_string = fn, fn_held, err
            return
        raise RuntimeError(
            "the CUDA runtime (libcudart) is not loadable in this process: "
            + ("; ".join(errors) or f"torch {torch.__version__} reports CUDA {torch.version.cuda}")
        )


class Span(NamedTuple):
    """One 2-D copy between the KV cache and a chunk buffer (a tier slot or staging): `height`
    rows of `width` bytes, each side's rows its pitch apart. Plain integers, so a lane issues a
    chunk without a torch call (each one a point where a thread running Python beside it takes
    the GIL); `keep` holds what the addresses point into until the copy is queued."""

    kv: int
    kv_pitch: int
    buf: int
    buf_pitch: int
    width: int
    height: int
    keep: tuple[object, ...] = ()

    @property
    def nbytes(self) -> int:
        """The bytes it moves."""
        return self.width * self.height

    def rows(self, first: int, end: int) -> Span:
        """Its rows `first` up to `end` as a span of their own."""
        return self._replace(
            kv=self.kv + first * self.kv_pitch,
            buf=self.buf + first * self.buf_pitch,
            height=end - first,
        )


# (dst, dst pitch, src, src pitch, width, height): one 2-D copy, queued or done
Memcpy2D = Callable[[int, int, int, int, int, int], None]


def issue(spans: Sequence[Span], to_host: bool, memcpy2d: Memcpy2D) -> None:
    """Each span as one `memcpy2d` call toward the host buffer (`to_host`) or the KV cache; a
    pitch over `MAX_PITCH` goes as one 1-D call per row."""
    for s in spans:
        if to_host:
            d, dp, src, sp = s.buf, s.buf_pitch, s.kv, s.kv_pitch
        else:
            d, dp, src, sp = s.kv, s.kv_pitch, s.buf, s.buf_pitch
        if s.height == 1:
            dp = sp = s.width
        if max(dp, sp) <= MAX_PITCH:
            memcpy2d(d, dp, src, sp, s.width, s.height)
        else:
            for i in range(s.height):
                memcpy2d(d + i * dp, s.width, src + i * sp, s.width, s.width, 1)


def host_memcpy2d(dst: int, dpitch: int, src: int, spitch: int, width: int, height: int) -> None:
    """A 2-D copy between host addresses, row by row (the CPU backend and simulated device)."""
    for i in range(height):
        ctypes.memmove(dst + i * dpitch, src + i * spitch, width)


def cuda_memcpy2d(stream: torch.cuda.Stream, hold_gil: bool = False) -> Memcpy2D:
    """`cudaMemcpy2DAsync` on `stream`, raising RuntimeError with the runtime's message;
    `hold_gil` only where every host buffer is page-locked (from pageable memory the call
    itself copies, and would hold the GIL for all of it)."""
    if _memcpy2d is None:
        load()
    fn, error_string = (_memcpy2d_held if hold_gil else _memcpy2d), _error_string
    assert fn is not None and error_string is not None
    handle = ctypes.c_void_p(stream.cuda_stream)

    def call(dst: int, dpitch: int, src: int, spitch: int, width: int, height: int) -> None:
        code = fn(dst, dpitch, src, spitch, width, height, CUDA_MEMCPY_DEFAULT, handle)
        if code:
            raise RuntimeError(
                f"cudaMemcpy2DAsync of {height} x {width} bytes failed: {code} "
                f"({(error_string(code) or b'').decode()})"
            )

    return call
