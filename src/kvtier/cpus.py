"""CPU sets: parsing `0-3,5`, the CPUs this host gives the process, and where copy lanes run.

On a CPU backend the host binds its compute threads to cores (vLLM: VLLM_CPU_OMP_THREADS_BIND),
and every thread a bound thread starts inherits that binding, kvtier's copy lanes included: they
then take time slices from the forward they are meant to overlap. `lane_cpus` moves them to the
cores the compute threads leave free when at least two are, and leaves them alone otherwise: a
lone free core is where the serving frontend runs (vLLM's API server and scheduler, and often
the client), and lanes there measured slower than lanes beside the forward (vLLM on 2 cores,
no-reuse output tok/s 37.1 against 39.3).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import ConfigError

__all__ = [
    "AUTO",
    "AUTO_MIN_FREE",
    "INHERIT",
    "Placement",
    "check_setting",
    "describe",
    "host_cpus",
    "lane_cpus",
    "parse_cpu_list",
]

AUTO = "auto"  # lanes on the host's CPUs minus the compute threads' cores, if 2+ are left
INHERIT = "inherit"  # lanes keep the affinity of the thread that starts them
# the free cores 'auto' needs before it moves the lanes: one of them stays the frontend's
AUTO_MIN_FREE = 2
# cgroup v2, then v1: the CPUs a container may use (os.cpu_count() ignores both)
_CGROUP_CPUSETS = (
    Path("/sys/fs/cgroup/cpuset.cpus.effective"),
    Path("/sys/fs/cgroup/cpuset/cpuset.effective_cpus"),
)


def parse_cpu_list(text: str, what: str = "CPU list") -> frozenset[int]:
    """`0-3,5` as {0, 1, 2, 3, 5}; a ConfigError naming `what` and the value when malformed."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, dash, hi = part.partition("-")
        try:
            first, last = (int(lo), int(hi)) if dash else (int(part), int(part))
        except ValueError:
            first, last = -1, -1
        if first < 0 or last < first:
            raise ConfigError(
                f"{what} {text!r}: {part!r} is not a CPU id or range; write ids and ranges "
                "such as '1' or '2-3,6'"
            )
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def check_setting(value: str) -> None:
    """Raise a ConfigError unless `value` is 'auto', 'inherit' or a CPU list."""
    if value not in (AUTO, INHERIT):
        parse_cpu_list(value, "lane_cpus")


def host_cpus() -> frozenset[int]:
    """The CPUs this process was given: those of the process that started it (a host binds the
    workers it starts, not itself; `taskset` or `numactl` on the server bind both) within its
    container's cgroup cpuset, plus the calling thread's own."""
    given = _cgroup_cpus()
    try:
        parent = frozenset(os.sched_getaffinity(os.getppid()))
    except OSError:
        parent = given  # the parent is gone or not ours to read: the cgroup alone bounds it
    return (given & parent) | frozenset(os.sched_getaffinity(0))


def _cgroup_cpus() -> frozenset[int]:
    """The container's cpuset, else every online CPU."""
    for path in _CGROUP_CPUSETS:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text:
            return parse_cpu_list(text, str(path))
    return frozenset(range(os.cpu_count() or 1))


def lane_cpus(
    setting: str, compute: frozenset[int] | None, host: frozenset[int]
) -> frozenset[int] | None:
    """The CPUs copy lanes should run on, or None to leave them where they start: `setting`
    'inherit' or a CPU list, or 'auto': `host` minus the `compute` cores (None when the host
    binds no compute threads or leaves fewer than AUTO_MIN_FREE cores free)."""
    if setting == INHERIT:
        return None
    if setting != AUTO:
        return parse_cpu_list(setting, "lane_cpus")
    if compute is None:
        return None
    spare = host - compute
    return spare if len(spare) >= AUTO_MIN_FREE else None


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a rank's copy lanes run (`lanes`, None: where they start) beside the cores the
    host bound its compute threads to (`compute`, None: none bound)."""

    setting: str
    lanes: frozenset[int] | None
    compute: frozenset[int] | None
    host: frozenset[int]

    @classmethod
    def of(cls, setting: str, compute: frozenset[int] | None) -> Placement:
        """The placement `setting` (`lane_cpus`) gives on this host."""
        host = host_cpus()
        return cls(setting, lane_cpus(setting, compute, host), compute, host)

    def startup_line(self) -> str | None:
        """What the startup log says about it (None: nothing was asked or bound)."""
        if self.lanes is not None:
            return (
                f"copy lanes on CPUs {describe(self.lanes)} (compute threads: "
                f"{describe(self.compute)}; lane_cpus {self.setting})"
            )
        if self.setting != AUTO or self.compute is None:
            return None
        free = self.host - self.compute
        why = f"free: {describe(free)}, left to the frontend" if free else "none free"
        return (
            f"copy lanes stay with the compute threads on CPUs {describe(self.compute)} ({why}; "
            f"lane_cpus auto moves them with {AUTO_MIN_FREE} or more free)"
        )


def describe(cpus: frozenset[int] | None) -> str:
    """`1,3-5` for a set (compact ranges), 'unpinned' for None."""
    if cpus is None:
        return "unpinned"
    if not cpus:
        return "none"
    ids = sorted(cpus)
    runs: list[str] = []
    start = prev = ids[0]
    for cpu in ids[1:] + [-2]:
        if cpu == prev + 1:
            prev = cpu
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = cpu
    return ",".join(runs)
