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
from collections.abc import Sequence
from pathlib import Path

import torch

CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction follows from the pointers (UVA)
# cudaDeviceProp.memPitch on current GPUs: a larger pitch is cudaErrorInvalidPitchValue, so
# layers further apart (a KV cache of several GiB per layer) go as one 1-D copy per row
MAX_PITCH = (1 << 31) - 1
_lock = threading.Lock()
_memcpy2d: ctypes._CFuncPtr | None = None  # type: ignore[name-defined]
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
    global _memcpy2d, _error_string
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
                lib = ctypes.CDLL(name)
            except OSError as e:
                errors.append(f"{name}: {e}")
                continue
            fn = lib.cudaMemcpy2DAsync
            fn.restype = ctypes.c_int
            fn.argtypes = [
                ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p,
            ]  # fmt: skip
            err = lib.cudaGetErrorString
            err.restype = ctypes.c_char_p
            err.argtypes = [ctypes.c_int]
            _memcpy2d, _error_string = fn, err
            return
        raise RuntimeError(
            "the CUDA runtime (libcudart) is not loadable in this process: "
            + ("; ".join(errors) or f"torch {torch.__version__} reports CUDA {torch.version.cuda}")
        )


def region(t: torch.Tensor) -> tuple[int, int, int, int]:
    """(address, pitch, width, height) of a 2-D uint8 tensor whose rows are contiguous."""
    if t.dtype != torch.uint8 or t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(f"a 2-D copy needs uint8 rows of contiguous bytes, got {t.dtype} "
                         f"{tuple(t.shape)} strides {t.stride()}")  # fmt: skip
    height, width = t.shape
    pitch = t.stride(0) if height > 1 else width
    return t.data_ptr(), pitch, width, height


def copy_2d(pieces: Sequence[tuple[torch.Tensor, torch.Tensor]], stream: torch.cuda.Stream) -> None:
    """Queue one `cudaMemcpy2DAsync` per (dst, src) pair on `stream`; same shapes each."""
    if _memcpy2d is None:
        load()
    assert _memcpy2d is not None and _error_string is not None
    handle = ctypes.c_void_p(stream.cuda_stream)
    for dst, src in pieces:
        if dst.shape != src.shape:
            raise ValueError(f"2-D copy of {tuple(src.shape)} into {tuple(dst.shape)}")
        d, dpitch, width, height = region(dst)
        s, spitch, _, _ = region(src)
        if max(dpitch, spitch) <= MAX_PITCH:
            calls = [(d, dpitch, s, spitch, height)]
        else:
            calls = [(d + i * dpitch, width, s + i * spitch, width, 1) for i in range(height)]
        for dd, dp, ss, sp, h in calls:
            code = _memcpy2d(dd, dp, ss, sp, width, h, CUDA_MEMCPY_DEFAULT, handle)
            if code:
                raise RuntimeError(
                    f"cudaMemcpy2DAsync of {h} x {width} bytes failed: {code} "
                    f"({(_error_string(code) or b'').decode()})"
                )
