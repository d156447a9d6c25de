"""The cores vLLM's CPU backend binds its compute threads to on this host, read from
VLLM_CPU_OMP_THREADS_BIND as vLLM reads it (vLLM-free, so it is testable without vLLM)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from kvtier.cpus import parse_cpu_list

__all__ = ["BIND_ENV", "compute_cpus"]

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def compute_cpus(
    environ: Mapping[str, str],
    *,
    is_cpu: bool,
    ranks_on_host: int,
    own_cpus: Callable[[], frozenset[int]] = lambda: frozenset(os.sched_getaffinity(0)),
) -> frozenset[int] | None:
    """Every local rank's compute cores: the union of the `|`-separated lists of an explicit
    binding; under 'auto' the worker's own cores when it is the host's only rank (the other
    ranks' are unknown here); None off the CPU backend, under 'nobind', or when unknown."""
    if not is_cpu:
        return None
    bind = environ.get(BIND_ENV, "auto").strip() or "auto"
    if bind == "nobind":
        return None
    if bind == "auto":
        return own_cpus() if ranks_on_host == 1 else None
    cores: set[int] = set()
    for part in bind.split("|"):
        cores |= parse_cpu_list(part, BIND_ENV)
    return frozenset(cores)
