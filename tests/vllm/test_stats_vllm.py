"""kvtier's metrics on vLLM's /metrics: deltas, aggregation and replay (`kvtier.vllm.stats`)."""

from __future__ import annotations

from collections.abc import Callable

from tests.vllm.conftest import DriverRun

CHECKS = (
    "check_delta_sends_changes_only",
    "check_aggregate_and_reduce",
    "check_prom_replay_survives_a_second_logger",
    "check_counters_are_exported_at_zero_from_startup",
)


def test_stats_units(run_driver: Callable[..., DriverRun]) -> None:
    results = run_driver("stats_units", {}).result["checks"]
    assert set(results) == set(CHECKS)
    failed = {name: err for name, err in results.items() if err != "ok"}
    assert not failed, "\n".join(f"{name}:\n{err}" for name, err in failed.items())
