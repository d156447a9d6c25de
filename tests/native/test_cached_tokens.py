"""`num_cached_tokens` and `num_external_tokens` (the server's `cached_tokens` is their sum)
describe the first admission only: set once, never grown by a later load, never above the
prompt."""

from __future__ import annotations

import random

from kvtier.native.sampling import SamplingParams
from kvtier.native.sequence import Sequence

from .sim_connector import Plan, SimConnector, make_scheduler

BS = 16


def _step(sched, conn: SimConnector) -> list:
    out = sched.schedule()
    conn.build_connector_meta(out)
    report = conn.rank_step()
    sampled = [7 if sr.computed_after_step >= sr.seq.num_tokens else -1 for sr in out.scheduled]
    return sched.update_from_output(out, sampled, [report])


def test_cached_tokens_count_the_first_admission_once_and_never_exceed_the_prompt():
    rng = random.Random(3)
    prefix = [rng.randrange(3, 1000) for _ in range(384)]
    conn = SimConnector({}, BS)
    # 43 blocks: A (11) and B (24 cached + 8) fill the pool, so A's first decode block
    # preempts B after B's first admission (384 tokens from HBM, nothing from the tier)
    sched = make_scheduler(43, BS, conn, max_num_batched_tokens=1024, max_num_seqs=4)
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    warm = Sequence("P", [*prefix, 5], SamplingParams(temperature=0, max_tokens=1), 0, 0)
    sched.add(warm)
    while sched.has_unfinished():
        _step(sched, conn)
    a = Sequence("A", [rng.randrange(3, 1000) for _ in range(176)], greedy, 0, 1)
    b = Sequence("B", [*prefix, *(rng.randrange(3, 1000) for _ in range(128))], greedy, 0, 2)
    sched.add(a)
    sched.add(b)
    _step(sched, conn)
    assert b.num_cached_tokens == 384 and b.num_external_tokens == 0
    _step(sched, conn)
    assert sched.stats.num_preemptions == 1 and b.num_computed_tokens == 0
    # the re-admission loads 496 tokens from the tier: still not B's first admission
    conn.plans["B"] = Plan(hit_tokens=496, is_async=True)
    sched.bm.reset_prefix_cache()
    final = {}
    while sched.has_unfinished():
        final.update({o.request_id: o for o in _step(sched, conn) if o.finished})
    # the load did happen, counted apart from first admissions as vLLM's PrefixCacheStats does
    assert sched.stats.preempted_external_hits == 496
    assert sched.stats.external_prefix_cache_hits == 0
    out = final["B"]
    assert (out.num_cached_tokens, out.num_external_tokens) == (384, 0)
    assert out.num_cached_tokens + out.num_external_tokens <= out.prompt_tokens == 512
    assert (final["A"].num_cached_tokens, final["A"].num_external_tokens) == (0, 0)


def test_cached_tokens_of_a_first_admission_load_count_only_what_loaded():
    rng = random.Random(4)
    prompt = [rng.randrange(3, 1000) for _ in range(200)]
    conn = SimConnector({"L": Plan(hit_tokens=192, is_async=True, fail_block=8)}, BS)
    sched = make_scheduler(20, BS, conn, max_num_batched_tokens=256)
    sched.add(Sequence("L", prompt, SamplingParams(temperature=0, max_tokens=2), 0, 0))
    final = {}
    while sched.has_unfinished():
        final.update({o.request_id: o for o in _step(sched, conn) if o.finished})
    # blocks 0-7 loaded, block 8 failed: 128 tokens came from the tier, the rest was computed
    assert (final["L"].num_cached_tokens, final["L"].num_external_tokens) == (0, 128)
