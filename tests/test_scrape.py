"""The /metrics reader: deltas of parsed samples, a window's counters and the identities they
keep, with the numbers when one fails."""

from __future__ import annotations

import pytest

from kvtier.scrape import Counters, Identity, MetricSet, identities

METRICS_BEFORE = """\
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{model_name="m"} 100.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{model_name="m"} 10.0
# TYPE vllm:external_prefix_cache_queries counter
vllm:external_prefix_cache_queries_total{model_name="m"} 90.0
# TYPE vllm:external_prefix_cache_hits counter
vllm:external_prefix_cache_hits_total{model_name="m"} 0.0
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{model_name="m"} 100.0
# TYPE kvtier_retrieved_tokens counter
kvtier_retrieved_tokens_total{rank="scheduler"} 0.0
kvtier_retrieved_tokens_total{rank="0"} 0.0
kvtier_retrieved_tokens_total{rank="1"} 0.0
"""


def metrics_after(ext_queries: float, retrieved_rank1: float) -> str:
    return f"""\
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{{model_name="m"}} 1100.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{{model_name="m"}} 310.0
# TYPE vllm:external_prefix_cache_queries counter
vllm:external_prefix_cache_queries_total{{model_name="m"}} {ext_queries}
# TYPE vllm:external_prefix_cache_hits counter
vllm:external_prefix_cache_hits_total{{model_name="m"}} 512.0
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{{model_name="m"}} 1100.0
# TYPE kvtier_retrieved_tokens counter
kvtier_retrieved_tokens_total{{rank="scheduler"}} 0.0
kvtier_retrieved_tokens_total{{rank="0"}} 512.0
kvtier_retrieved_tokens_total{{rank="1"}} {retrieved_rank1}
"""


def test_metric_deltas_and_counters() -> None:
    delta = MetricSet.parse(metrics_after(790.0, 512.0)).delta(MetricSet.parse(METRICS_BEFORE))
    c = Counters.of(delta)
    assert (c.prompt_tokens, c.hbm_queries, c.hbm_hits) == (1000.0, 1000.0, 300.0)
    assert (c.ext_queries, c.ext_hits) == (700.0, 512.0)
    assert c.retrieved_by_rank == {"0": 512.0, "1": 512.0}
    assert c.hbm_hit_rate == pytest.approx(0.3)
    assert c.external_hit_rate == pytest.approx(0.512)
    assert c.hit_rate == pytest.approx(0.812)


def test_identities_hold_on_consistent_counters() -> None:
    delta = MetricSet.parse(metrics_after(790.0, 512.0)).delta(MetricSet.parse(METRICS_BEFORE))
    got = {i.name: i for i in identities(Counters.of(delta), tp=2, offload=True)}
    assert all(i.holds for i in got.values())
    ident = got["hbm_misses_eq_external_queries"]
    assert (ident.lhs, ident.rhs) == (700.0, 700.0)
    assert got["retrieved_eq_external_hits"].describe().endswith("512 == 512 holds")


def test_identities_fail_with_numbers() -> None:
    # one external query too many, and rank 1 retrieved less than rank 0
    delta = MetricSet.parse(metrics_after(791.0, 256.0)).delta(MetricSet.parse(METRICS_BEFORE))
    got = {i.name: i for i in identities(Counters.of(delta), tp=2, offload=True)}
    failed = got["hbm_misses_eq_external_queries"]
    assert not failed.holds
    assert (failed.lhs, failed.rhs) == (700.0, 701.0)
    assert not got["retrieved_eq_external_hits"].holds
    assert got["retrieved_eq_external_hits"].lhs == 384.0
    assert "384 == 512 FAILS" in got["retrieved_eq_external_hits"].describe()
    # without offload, any external hit is a failure
    off = {i.name: i for i in identities(Counters.of(delta), tp=2, offload=False)}
    assert not off["no_external_hits_off"].holds
    assert Identity("b", "x <= y", 3.0, 2.0, "<=").holds is False
