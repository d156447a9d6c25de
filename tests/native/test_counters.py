"""Counters that add up under preemption (issue: "counters that add up"): a request preempted
and admitted again is not a second query of the prefix cache, as vLLM's PrefixCacheStats keeps
it apart; its second load from the tier is counted apart from the external hits too. So on a
drained native server every identity holds with preemptions: HBM misses == external queries,
the ranks' retrieved tokens (re-admissions left out) / TP == external hits, and the usage's
cached tokens == prefix hits + external hits."""

from __future__ import annotations

from pathlib import Path

from kvtier import scrape
from kvtier.native import SamplingParams
from kvtier.native.serve_metrics import ServeMetrics
from tests.native.conftest import make_prompts
from tests.native.faults_connector import kvtier_engine
from tests.native.test_offload import rank_total


def test_every_identity_holds_when_requests_are_preempted_after_their_load(
    tiny_model: Path, tmp_path: Path
) -> None:
    prompts = make_prompts(3, 320, seed=13)  # 5 whole 64-token chunks each
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    # 60 blocks of 16 hold two requests' prompts and decode: the third preempts the latest
    # the three must be admitted in one step: every load inside its step (an asynchronous one
    # lands when the host lets it), and every lookup answered at its first ask (one answered
    # after lookup_wait_ms, 5 ms, admits its request a step later: on an oversubscribed host
    # the admissions drifted apart, the third waited for blocks, and none was preempted)
    with kvtier_engine(
        tiny_model, tmp_path / "run", num_blocks=60, sync_load_fraction=1e6, lookup_wait_ms=2000
    ) as eng:
        eng.generate(prompts[:1], params)
        eng.generate(prompts[1:2], params)
        eng.generate(prompts[2:], params)  # one at a time: every chunk stored, no preemption
        assert eng.stats()["num_preemptions"] == 0
        eng.reset_prefix_cache()
        before = eng.stats()
        retrieved0 = rank_total(eng, "retrieved_tokens_total")
        readmitted0 = rank_total(eng, "readmitted_retrieved_tokens_total")
        outs = eng.generate(prompts, params)
        after = eng.stats()
        retrieved = rank_total(eng, "retrieved_tokens_total") - retrieved0
        readmitted = rank_total(eng, "readmitted_retrieved_tokens_total") - readmitted0
    d = {k: after[k] - before[k] for k in after if isinstance(after[k], int | float)}
    assert d["num_preemptions"] > 0, "the test needs a preemption after a load"
    # the re-admissions loaded again, and those loads are counted apart
    assert readmitted > 0
    c = scrape.Counters(
        prompt_tokens=d["prompt_tokens"],
        hbm_queries=d["prefix_cache_queries"],
        hbm_hits=d["prefix_cache_hits"],
        ext_queries=d["external_prefix_cache_queries"],
        ext_hits=d["external_prefix_cache_hits"],
        retrieved_by_rank={"0": retrieved},
        has_external=True,
        readmitted_by_rank={"0": readmitted},
    )
    failed = [i.describe() for i in scrape.identities(c, 1, offload=True) if not i.holds]
    assert not failed, failed
    # each request's usage reports its first admission, the counters count first admissions
    cached = sum(o.num_cached_tokens + o.num_external_tokens for o in outs)
    assert cached == d["prefix_cache_hits"] + d["external_prefix_cache_hits"]
    # and nothing of a first admission is lost: every prompt but its last token from the tier
    assert d["external_prefix_cache_hits"] == sum(len(p) - 1 for p in prompts)
    # the server exports the re-admissions' own counts
    serve = ServeMetrics("tiny", None)
    serve.publish(after, {})
    ms = scrape.MetricSet.parse(serve.render().decode())
    exported = {
        "preempted_queries": "kvtier_engine_preempted_prefix_cache_queries_total",
        "preempted_hits": "kvtier_engine_preempted_prefix_cache_hits_total",
        "preempted_external_queries": "kvtier_engine_preempted_external_prefix_cache_queries_total",
        "preempted_external_hits": "kvtier_engine_preempted_external_prefix_cache_hits_total",
    }
    for key, name in exported.items():
        assert ms.total(name) == after[key], name
    assert after["preempted_external_hits"] > 0
