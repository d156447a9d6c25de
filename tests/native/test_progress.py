"""The native scheduler cannot wedge: work queued implies progress within a bounded number of
steps, for any workload on any pool that fits one request, with or without a connector that
promises tier hits; every block and every lease comes back at the end."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.native import Engine, EngineConfig

from .conftest import GREEDY, make_prompts
from .faults_connector import kvtier_engine
from .sim_connector import Arrival, Plan, SimConnector, drive, make_scheduler

BS = 16


def _assert_all_returned(sched, conn: SimConnector) -> None:
    bm = sched.bm
    assert bm.num_free_blocks() == bm.num_blocks
    assert all(r == 0 for r in bm.ref_counts)
    assert not (sched.waiting or sched.ready or sched.running or sched.parked or sched.held)
    assert conn.open_leases() == {}
    assert not (conn.promised or conn.unsent or conn.inflight or conn.saving)
    assert conn.errors == []


def test_async_tier_hits_on_a_full_pool_do_not_wedge():
    # issue 10 item 1: every request's load parks on a pool it fills exactly; once loaded,
    # the 289th token of each needs one more block than the load held
    prompts = [[random.Random(i).randrange(3, 1000) for _ in range(289)] for i in range(8)]
    plans = {f"r{i}": Plan(hit_tokens=288, is_async=True, delay=1) for i in range(8)}
    conn = SimConnector(plans, BS)
    sched = make_scheduler(36, BS, conn, max_num_batched_tokens=512, max_num_seqs=16)
    arrivals = [Arrival(0, f"r{i}", p, 8) for i, p in enumerate(prompts)]
    run = drive(sched, arrivals, max_stall=5, max_steps=2000)
    assert run.longest_stall <= 5, f"wedged: {run.steps} steps, finished {sorted(run.finished)}"
    assert run.finished == {f"r{i}": 8 for i in range(8)}
    _assert_all_returned(sched, conn)


@st.composite
def workloads(draw: st.DrawFn) -> tuple[int, list[Arrival], dict[str, Plan], bool, int]:
    n = draw(st.integers(1, 8))
    bases = [[random.Random(b).randrange(3, 1000) for _ in range(160)] for b in range(3)]
    arrivals: list[Arrival] = []
    plans: dict[str, Plan] = {}
    need = 0
    for i in range(n):
        rid = f"r{i}"
        shared = draw(st.integers(0, 160))
        tail = draw(st.integers(1 if shared else 2, 96))
        rng = random.Random(1000 + i)
        prompt = bases[draw(st.integers(0, 2))][:shared] + [
            rng.randrange(3, 1000) for _ in range(tail)
        ]
        max_tokens = draw(st.integers(1, 6))
        arrivals.append(Arrival(draw(st.integers(0, 6)), rid, prompt, max_tokens))
        need = max(need, -(-(len(prompt) + max_tokens) // BS))
        hit_blocks = draw(st.integers(0, len(prompt) // BS))
        fail = draw(st.one_of(st.none(), st.integers(0, 6)))
        plans[rid] = Plan(
            hit_tokens=hit_blocks * BS,
            is_async=draw(st.booleans()),
            fail_block=fail,
            delay=draw(st.integers(0, 4)),
            send_delay=draw(st.integers(0, 3)),
        )
    num_blocks = draw(st.integers(need, 2 * need))
    offload = draw(st.booleans())
    batch = draw(st.sampled_from([16, 48, 256]))
    return num_blocks, arrivals, plans, offload, batch


@settings(
    max_examples=300,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(workloads())
def test_progress_invariant_for_any_workload_and_pool(case):
    num_blocks, arrivals, plans, offload, batch = case
    conn = SimConnector(plans if offload else {}, BS)
    sched = make_scheduler(
        num_blocks, BS, conn if offload else None, max_num_batched_tokens=batch, max_num_seqs=4
    )
    # nothing may stand still longer than the slowest rank report (4 steps) plus a save's hold
    max_stall = 4 + 3 + 2
    run = drive(sched, arrivals, max_stall=max_stall, max_steps=5000)
    assert run.longest_stall <= max_stall, (
        f"stalled {run.longest_stall} steps at step {run.steps} on {num_blocks} blocks: "
        f"waiting={len(sched.waiting)} ready={len(sched.ready)} running={len(sched.running)} "
        f"parked={len(sched.parked)} held={len(sched.held)}"
    )
    assert run.steps <= 5000, "no wedge, but no end either (livelock)"
    assert run.finished == {a.request_id: a.max_tokens for a in arrivals}
    _assert_all_returned(sched, sched.connector)


def test_kvtier_engine_on_a_tight_pool_does_not_wedge(tiny_model, tmp_path):
    # issue 10 item 1's recipe on the real engine and tier: prompts go in one by one, the HBM
    # prefix cache is reset, then all at once: every one is a 256-token tier hit whose 33-token
    # tail needs 3 more blocks than its load; 33 blocks fit two loads and one spare block
    prompts = make_prompts(8, 289, seed=5)
    with Engine(tiny_model, EngineConfig(num_threads=1, num_blocks=33)) as plain:
        expected = [o.output_token_ids for o in plain.generate(prompts, GREEDY)]
    with kvtier_engine(tiny_model, tmp_path / "run", num_blocks=33) as eng:
        for p in prompts:
            eng.generate([p], GREEDY)
        eng.drain()
        eng.reset_prefix_cache()
        before = eng.stats()
        # a wedge never ends: generate's deadline turns it into a failure naming what is open
        out = eng.generate(prompts, GREEDY, timeout_s=60)
        s = eng.stats()
        assert [o.output_token_ids for o in out] == expected
        assert s["external_prefix_cache_hits"] - before["external_prefix_cache_hits"] >= 8 * 256
        assert eng.block_manager.num_free_blocks() == 33
