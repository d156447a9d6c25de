"""CPU placement of a rank's service threads (lanes, lookup server, write-behind).

A host that pins its compute threads to cores (vLLM's CPU backend binds each rank's OpenMP
threads, and every thread they start inherits that binding) would otherwise put kvtier's
threads on the compute cores, where each chunk copy and lookup reply takes time from the
forward. Threads inherit the CPU set of the thread that starts them, so a worker starts them
inside `on_cpus(service_cpus)`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator

log = logging.getLogger("kvtier")


def parse_cpu_list(text: str) -> set[int]:
    """CPUs of a Linux CPU list ("0-3,8,10-11"); empty for an empty string."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        if not (lo.isdigit() and (not sep or hi.isdigit())):
            raise ValueError(f"CPU list {text!r} has {part!r}, which is no CPU or CPU range")
        cpus.update(range(int(lo), int(hi) + 1) if sep else (int(lo),))
    return cpus


def machine_cpus() -> set[int]:
    """The CPUs this process may use at all (its cgroup's cpuset, else every online CPU)."""
    for path in ("/sys/fs/cgroup/cpuset.cpus.effective", "/sys/devices/system/cpu/online"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text:
            return parse_cpu_list(text)
    return set(range(os.cpu_count() or 1))


def spare_cpus(compute: Iterable[int]) -> frozenset[int] | None:
    """The machine's CPUs that no compute thread is bound to; None when there are none."""
    spare = machine_cpus() - set(compute)
    return frozenset(spare) if spare else None


@contextlib.contextmanager
def on_cpus(cpus: frozenset[int] | None) -> Iterator[None]:
    """Run the block with the calling thread bound to `cpus` (threads it starts keep them),
    then restore its CPU set; a no-op for None or where the OS refuses."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as e:
        log.warning("kvtier: cannot move service threads to CPUs %s (%s)", sorted(cpus), e)
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
