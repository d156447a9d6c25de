"""Where an engine step's time goes: the seconds each kvtier hook took, summed per step.

Hooks add their time while a step runs; `flush` observes each hook's sum once into
`kvtier_hook_seconds{hook}` (a hook that did not run in the step is not observed), so the
histogram's count is the steps the hook ran in and its sum the total it cost.
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
        self._acc: dict[str, float] = {}

    @contextmanager
    def time(self, hook: str) -> Iterator[None]:
        """Add the time spent inside the block to `hook`'s sum for this step."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(hook, time.perf_counter() - t0)

    def add(self, hook: str, seconds: float) -> None:
        """Add `seconds` to `hook`'s sum for this step."""
        self._acc[hook] = self._acc.get(hook, 0.0) + seconds

    def flush(self) -> None:
        """Observe every hook that ran since the last flush, once each, and start over."""
        acc, self._acc = self._acc, {}
        for hook, seconds in acc.items():
            self._m.hook(hook).observe(seconds)
