"""Hook and lane clocks: wall time and the thread's CPU time apart, so waiting is not work."""

from __future__ import annotations

import threading
import time

from kvtier.metrics import Metrics
from kvtier.offload.device import CpuOps
from kvtier.offload.lane import WorkLane
from kvtier.offload.steps import LOOKUP, REPORT, HookClock

_BURN_S = 0.02


def _burn(cpu_s: float) -> None:
    """Spend `cpu_s` of this thread's CPU time (not wall time: a slow core still burns it)."""
    end = time.thread_time() + cpu_s
    while time.thread_time() < end:
        pass


def _sample(m: Metrics, name: str, **labels: str) -> float:
    value = m.registry.get_sample_value(name, {"rank": str(m.rank), **labels})
    return 0.0 if value is None else value


def test_a_hook_that_waits_counts_wall_time_but_no_cpu_time() -> None:
    m = Metrics(rank="scheduler")
    clock = HookClock(m)
    blocked = threading.Event()
    with clock.time(LOOKUP):
        # nothing sets it: the hook waits, as a lookup does behind a host thread's GIL
        blocked.wait(0.05)
    clock.flush()
    wall = _sample(m, "kvtier_hook_seconds_sum", hook=LOOKUP)
    cpu = _sample(m, "kvtier_hook_cpu_seconds_total", hook=LOOKUP)
    assert wall >= 0.05
    assert cpu < 0.2 * wall, (wall, cpu)


def test_a_hook_that_works_counts_its_cpu_time_and_sums_per_step() -> None:
    m = Metrics(rank=0)
    clock = HookClock(m)
    for _ in range(2):
        with clock.time(REPORT):
            _burn(_BURN_S)
    clock.flush()
    cpu = _sample(m, "kvtier_hook_cpu_seconds_total", hook=REPORT)
    wall = _sample(m, "kvtier_hook_seconds_sum", hook=REPORT)
    assert 2 * _BURN_S <= cpu <= wall + 1e-6
    # both calls fell in one step: one observation
    assert _sample(m, "kvtier_hook_seconds_count", hook=REPORT) == 1
    clock.flush()  # a step without the hook observes nothing and adds no CPU
    assert _sample(m, "kvtier_hook_seconds_count", hook=REPORT) == 1
    assert _sample(m, "kvtier_hook_cpu_seconds_total", hook=REPORT) == cpu


def test_a_lane_counts_the_cpu_its_jobs_spend_and_not_its_idle_time() -> None:
    m = Metrics(rank=0)
    lane = WorkLane("kvtier-save-test", CpuOps(), cpu=m.lane_cpu("save"))
    lane.start()
    try:
        lane.call(lambda _lane: _burn(_BURN_S), timeout_s=10.0)
        # jobs run in order: once the next one has run, the first one's CPU is counted
        lane.call(lambda _lane: None, timeout_s=10.0)
        after_job = _sample(m, "kvtier_lane_cpu_seconds_total", lane="save")
        assert after_job >= _BURN_S
        # a job that only waits adds (almost) nothing
        lane.call(lambda _lane: threading.Event().wait(0.05), timeout_s=10.0)
        lane.call(lambda _lane: None, timeout_s=10.0)
        waited = _sample(m, "kvtier_lane_cpu_seconds_total", lane="save") - after_job
        assert waited < 0.01
    finally:
        assert lane.close()
