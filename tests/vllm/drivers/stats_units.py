"""Unit checks of `kvtier.vllm.stats` (it imports vLLM, so it runs under .venv-vllm).

Prints `{"checks": {name: "ok" | "<traceback>"}}`. Args (JSON): `{}`.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from types import SimpleNamespace

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from kvtier.metrics import Metrics
from tests.vllm.drivers.common import args, emit


def check_delta_sends_changes_only() -> None:
    from kvtier.vllm.stats import StatsDelta

    m = Metrics(rank=0, registry=CollectorRegistry())
    m.retrieved_tokens.inc(512)
    m.capacity("memory").set(64)
    m.load_seconds.observe(0.01)
    delta = StatsDelta()
    first = delta.take(m.registry.collect())
    assert first is not None
    c, g = first.data["c"], first.data["g"]
    assert c == {'["kvtier_retrieved_tokens_total",[["rank","0"]]]': 512.0}, c
    assert g['["kvtier_tier_capacity_bytes",[["rank","0"],["tier","memory"]]]'] == 64.0, g
    assert g['["kvtier_load_seconds_count",[["rank","0"]]]'] == 1.0, g
    assert not any("_created" in k for k in (*c, *g))
    assert delta.take(m.registry.collect()) is None  # nothing moved
    m.retrieved_tokens.inc(256)
    again = delta.take(m.registry.collect())
    assert again is not None and again.data == {
        "c": {'["kvtier_retrieved_tokens_total",[["rank","0"]]]': 256.0},
        "g": {},
    }, again.data


def check_aggregate_and_reduce() -> None:
    from kvtier.vllm.stats import KVTierStats

    r0 = '["kvtier_retrieved_tokens_total",[["rank","0"]]]'
    r1 = '["kvtier_retrieved_tokens_total",[["rank","1"]]]'
    sched = '["kvtier_load_failures_total",[["rank","scheduler"],["reason","miss"]]]'
    fail0 = '["kvtier_load_failures_total",[["rank","0"],["reason","miss"]]]'
    gauge = '["kvtier_world_size",[["rank","scheduler"]]]'
    a = KVTierStats(data={"c": {r0: 512.0, sched: 1.0}, "g": {gauge: 1.0}})
    b = KVTierStats(data={"c": {r0: 256.0, r1: 768.0, fail0: 1.0}, "g": {gauge: 2.0}})
    both = a.aggregate(b)
    assert both.data["c"] == {r0: 768.0, r1: 768.0, sched: 1.0, fail0: 1.0}, both.data
    assert both.data["g"] == {gauge: 2.0}
    assert a.data["c"][r0] == 512.0, "aggregate must not change its operands"
    reduced = both.reduce()
    # worker ranks only: the scheduler's own count of the same failed load is not added
    assert reduced["retrieved_tokens"] == 1536 and reduced["load_failures"] == 1, reduced
    assert not both.is_empty() and KVTierStats(data={"c": {}, "g": {}}).is_empty()


def check_prom_replay_survives_a_second_logger() -> None:
    from kvtier.vllm.stats import KVTierPromMetrics

    types = {Counter: Counter, Gauge: Gauge, Histogram: Histogram}
    labels = ["model_name", "engine"]
    r0 = '["kvtier_retrieved_tokens_total",[["rank","0"]]]'
    cap = '["kvtier_tier_capacity_bytes",[["rank","0"],["tier","memory"]]]'
    config = SimpleNamespace(  # the base class stores the first; kvtier reads the world
        kv_transfer_config=None, parallel_config=SimpleNamespace(tensor_parallel_size=1)
    )
    for _ in range(2):  # vLLM rebuilds its stat loggers per engine in one process
        prom = KVTierPromMetrics(config, types, labels, {0: ["tiny", "0"]})
        prom.observe({"c": {r0: 512.0}, "g": {cap: 64.0}}, engine_idx=0)
    want = {"model_name": "tiny", "engine": "0", "rank": "0"}
    got = REGISTRY.get_sample_value("kvtier_retrieved_tokens_total", want)
    assert got == 1024.0, got
    got = REGISTRY.get_sample_value("kvtier_tier_capacity_bytes", {**want, "tier": "memory"})
    assert got == 64.0, got


def check_counters_are_exported_at_zero_from_startup() -> None:
    from prometheus_client import generate_latest

    from kvtier.vllm.stats import KVTierPromMetrics

    types = {Counter: Counter, Gauge: Gauge, Histogram: Histogram}
    config = SimpleNamespace(
        kv_transfer_config=None,
        parallel_config=SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1),
    )
    KVTierPromMetrics(config, types, ["model_name", "engine"], {0: ["zero", "0"]})
    for rank in ("scheduler", "0", "1"):
        want = {"model_name": "zero", "engine": "0", "rank": rank}
        for name in ("kvtier_stored_tokens_total", "kvtier_retrieved_tokens_total"):
            got = REGISTRY.get_sample_value(name, want)
            assert got == 0.0, (name, rank, got)
    text = generate_latest(REGISTRY).decode()
    # failure counters by reason have no child yet, but their families are declared
    for family in ("kvtier_save_failures_total", "kvtier_store_failures_total"):
        assert f"# TYPE {family} counter" in text, family


CHECKS: tuple[Callable[[], None], ...] = (
    check_delta_sends_changes_only,
    check_aggregate_and_reduce,
    check_prom_replay_survives_a_second_logger,
    check_counters_are_exported_at_zero_from_startup,
)


def main() -> None:
    args()
    results: dict[str, str] = {}
    for check in CHECKS:
        try:
            check()
        except Exception:  # noqa: BLE001 - every check's failure is reported, not just the first
            results[check.__name__] = traceback.format_exc()
        else:
            results[check.__name__] = "ok"
    emit({"checks": results})


if __name__ == "__main__":
    main()
