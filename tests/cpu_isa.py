"""The CPU's vector ISA as the kernels see it, and how a test runs a process as on AVX2 only.

bf16 numerics depend on the kernels (AVX2, AVX-512, AMX), so the suite prints which ones this
machine runs and can run a vLLM driver a second time on AVX2 kernels (tests/vllm/avx2)."""

from __future__ import annotations

import os
from pathlib import Path

AVX2_SITE = Path(__file__).resolve().parent / "vllm" / "avx2"


def cpu_flags() -> set[str]:
    """The flags of the first CPU in /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def vector_isa(flags: set[str] | None = None) -> str:
    """`AMX`, `AVX-512`, `AVX2` or `none`: the widest vector ISA the CPU offers."""
    flags = cpu_flags() if flags is None else flags
    if {"amx_tile", "amx_bf16"} <= flags:
        return "AMX"
    if "avx512f" in flags:
        return "AVX-512"
    return "AVX2" if "avx2" in flags else "none"


def avx2_env(env: dict[str, str]) -> dict[str, str]:
    """`env` for a process that runs the kernels of an AVX2-only CPU: torch's probes answer
    as one does (tests/vllm/avx2/sitecustomize.py), ATen and oneDNN capped at AVX2."""
    path = os.pathsep.join(p for p in (str(AVX2_SITE), env.get("PYTHONPATH", "")) if p)
    return {**env, "PYTHONPATH": path, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
