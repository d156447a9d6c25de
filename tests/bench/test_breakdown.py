"""The step breakdown read from a window's histogram deltas."""

from __future__ import annotations

import pytest

from kvtier.bench.breakdown import breakdown, hist
from kvtier.scrape import MetricSet


def _hist(name: str, rank: str, buckets: dict[str, float], total: float, **labels: str):
    """Samples of one cumulative histogram as a MetricSet holds them."""
    out = {}
    for le, cum in buckets.items():
        key = tuple(sorted({"rank": rank, "le": le, **labels}.items()))
        out[(f"{name}_bucket", key)] = cum
    key = tuple(sorted({"rank": rank, **labels}.items()))
    out[(f"{name}_count", key)] = buckets["+Inf"]
    out[(f"{name}_sum", key)] = total
    return out


def test_quantiles_interpolate_within_buckets_over_ranks() -> None:
    # 10 steps per rank on two ranks: 10 in (0, 10 ms], 10 in (10, 20 ms]
    samples = {
        **_hist("kvtier_step_seconds", "0", {"0.01": 10, "0.02": 10, "+Inf": 10}, 0.05),
        **_hist("kvtier_step_seconds", "1", {"0.01": 0, "0.02": 10, "+Inf": 10}, 0.15),
    }
    h = hist(MetricSet(samples), "kvtier_step_seconds", scheduler=False)
    assert h.count == 20 and h.mean == pytest.approx(0.01)
    assert h.quantile(0.5) == pytest.approx(0.01)
    assert h.quantile(0.75) == pytest.approx(0.015)
    # the scheduler's samples are apart from the ranks'
    assert hist(MetricSet(samples), "kvtier_step_seconds", scheduler=True).count == 0


def test_hook_costs_are_per_engine_step_and_parked_steps_per_load() -> None:
    samples = {
        **_hist("kvtier_step_seconds", "0", {"0.1": 100, "+Inf": 100}, 2.0),  # 20 ms steps
        # lookups ran in 10 of the 100 steps, 1 ms each: 0.1 ms per engine step
        **_hist(
            "kvtier_hook_seconds", "scheduler", {"0.001": 10, "+Inf": 10}, 0.01, hook="lookup"
        ),
        **_hist("kvtier_hook_seconds", "0", {"0.001": 100, "+Inf": 100}, 0.05, hook="report"),
        # 4 loads: 3 in the forward (0 steps), 1 parked 2 steps
        **_hist("kvtier_load_parked_steps", "scheduler", {"0.0": 3, "2.0": 4, "+Inf": 4}, 2.0),
        ("kvtier_sync_loads_total", (("rank", "scheduler"),)): 3.0,
    }
    b = breakdown(MetricSet(samples), world=1)
    assert b.steps == 100 and b.step_mean_ms == pytest.approx(20.0)
    lookup = b.hook("lookup")
    assert lookup is not None and lookup.steps == 10
    assert lookup.per_step_ms == pytest.approx(0.1) and lookup.mean_ms == pytest.approx(1.0)
    report = b.hook("report")
    assert report is not None and report.per_step_ms == pytest.approx(0.5)
    save = b.hook("save")
    assert save is not None and save.steps == 0 and save.p50_ms is None
    assert (b.loads, b.sync_loads, b.parked_mean_steps) == (4, 3, 0.5)
    assert b.parked_p50_steps == 0.0


def _counter(name: str, rank: str, value: float, **labels: str):
    return {(name, tuple(sorted({"rank": rank, **labels}.items()))): value}


def test_cpu_per_step_splits_work_from_waiting_and_lanes_count_per_rank() -> None:
    samples = {
        **_hist("kvtier_step_seconds", "0", {"0.1": 100, "+Inf": 100}, 2.0),  # 20 ms steps
        **_hist("kvtier_step_seconds", "1", {"0.1": 100, "+Inf": 100}, 2.0),
        # the lookups took 0.1 ms of wall per engine step, of which 0.02 ms on the CPU
        **_hist(
            "kvtier_hook_seconds", "scheduler", {"0.001": 10, "+Inf": 10}, 0.01, hook="lookup"
        ),
        **_counter("kvtier_hook_cpu_seconds_total", "scheduler", 0.002, hook="lookup"),
        # two ranks' reports: 0.3 ms of CPU per rank-step
        **_counter("kvtier_hook_cpu_seconds_total", "0", 0.03, hook="report"),
        **_counter("kvtier_hook_cpu_seconds_total", "1", 0.03, hook="report"),
        **_counter("kvtier_lane_cpu_seconds_total", "0", 0.1, lane="save"),
        **_counter("kvtier_lane_cpu_seconds_total", "1", 0.1, lane="load"),
    }
    b = breakdown(MetricSet(samples), world=2)
    lookup, report, save = b.hook("lookup"), b.hook("report"), b.hook("save")
    assert lookup is not None and report is not None and save is not None
    assert lookup.per_step_ms == pytest.approx(0.1)
    assert lookup.cpu_per_step_ms == pytest.approx(0.02)
    assert report.cpu_per_step_ms == pytest.approx(0.3)
    # the path: the scheduler's hooks plus one rank's, each per engine step
    assert b.path_cpu_per_step_ms == pytest.approx(0.32)
    # 0.2 s of lane CPU over 200 rank-steps
    assert b.lanes_cpu_per_step_ms == pytest.approx(1.0)
    # a server that exports no CPU counters reads unknown, never 0
    assert save.cpu_per_step_ms is None
    bare = breakdown(MetricSet(_hist("kvtier_step_seconds", "0", {"+Inf": 1}, 0.02)), world=1)
    assert bare.path_cpu_per_step_ms is None and bare.lanes_cpu_per_step_ms is None
