"""Where an engine step's time goes: the seconds each kvtier hook took, summed per step.

Hooks add their time while a step runs; `flush` observes each hook's sum once into
`kvtier_hook_seconds{hook}` (a hook that did not run in the step is not observed), so the
histogram's count is the steps the hook ran in and its sum the total it cost. The CPU time of
the thread inside the hook goes to `kvtier_hook_cpu_seconds{hook}`: wall time less CPU time is
the hook waiting (for the GIL behind a host thread, or for a core), not kvtier's work.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from kvtier.metrics import Metrics

# hook names (the `hook` label)
LOOKUP = "lookup"  # scheduler: get_num_new_matched_tokens, every call of the step
META = "meta"  # scheduler: building (and encoding) the step's OffloadMeta
REPORTS = "reports"  # scheduler: decoding and applying the ranks' reports
STATS = "stats"  # scheduler: metrics handed to the host (vLLM's connector stats)
LOAD = "load"  # rank: start_load_kv (queueing async loads, running sync ones)
SAVE = "save"  # rank: wait_for_save (queueing the step's saves)
REPORT = "report"  # rank: draining and encoding its report (with a metrics snapshot)


class HookClock:
    """Per-step sums of hook time for one rank (or the scheduler)."""

    def __init__(self, metrics: Metrics) -> None:
        self._m = metrics
        self._acc: dict[str, tuple[float, float]] = {}

    @contextmanager
    def time(self, hook: str) -> Iterator[None]:
        """Add the wall and thread CPU time spent inside the block to `hook`'s sums."""
        t0, c0 = start()
        try:
            yield
        finally:
            self.add_since(hook, t0, c0)

    def add_since(self, hook: str, t0: float, c0: float) -> None:
        """Add the wall and CPU time since `start()` returned (t0, c0) to `hook`'s sums."""
        self.add(hook, time.perf_counter() - t0, time.thread_time() - c0)

    def add(self, hook: str, seconds: float, cpu_seconds: float) -> None:
        """Add `seconds` of wall time, `cpu_seconds` of them on the CPU, to `hook`'s sums."""
        wall, cpu = self._acc.get(hook, (0.0, 0.0))
        self._acc[hook] = (wall + seconds, cpu + cpu_seconds)

    def flush(self) -> None:
        """Observe every hook that ran since the last flush, once each, and start over."""
        acc, self._acc = self._acc, {}
        for hook, (wall, cpu) in acc.items():
            self._m.hook(hook).observe(wall)
            self._m.hook_cpu(hook).inc(cpu)


def start() -> tuple[float, float]:
    """(wall, thread CPU) clock readings to time a hook from, for `HookClock.add_since`."""
    return time.perf_counter(), time.thread_time()
