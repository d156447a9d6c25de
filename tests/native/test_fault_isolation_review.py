"""Fault isolation in the native engine (invariant 18): a failure inside a connector hook or a
tier costs one request its tier hit, never the engine, its block pool or another request's
tokens. Each test compares tokens with a clean run of the same prompts and checks the pool is
whole afterwards; the kvtier engine is built once per module and reused."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.config import KVTierConfig
from kvtier.native import Engine, EngineConfig, SamplingParams
from kvtier.native.connector import ConnectorSpec
from kvtier.native.offload import connector_spec
from kvtier.native.sampling import Sampler, SampleSpec
from tests.native.conftest import dict_connector, make_prompts
from tests.native.faults_connector import (
    FaultyLoadWorkerHalf,
    kvtier_engine,
    wait_until,
)
from tests.native.hook_faults import SCHEDULER, WORKER

BS = 16
NUM_BLOCKS = 30  # three 160-token prompts (10 blocks each) fill it: decoding preempts
PREEMPT_PROMPTS = make_prompts(3, 160, seed=1811)
PREEMPT_PARAMS = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
SEEDED = [
    SamplingParams(temperature=1.0, seed=1000 + i, max_tokens=8, ignore_eos=True) for i in range(4)
]


class Injected(RuntimeError):
    """What an injected fault raises (a defect inside kvtier, as the engine sees it)."""


def hook_errors(eng: Engine, hook: str) -> float:
    """`kvtier_hook_errors_total{hook}` summed over the scheduler and the ranks (/metrics)."""
    return sum(
        s.value
        for fam in eng.connector.collector.collect()
        for s in fam.samples
        if s.name == "kvtier_hook_errors_total" and s.labels.get("hook") == hook
    )


def assert_pool_whole(eng: Engine) -> None:
    """No request left, every block free, the offload core holds no request state."""
    assert not eng.has_unfinished_requests()
    bm = eng.block_manager
    assert bm.num_free_blocks() == bm.num_blocks, "KV blocks leaked"
    assert all(c == 0 for c in bm.ref_counts)
    core = getattr(eng.connector, "core", None)
    if core is not None:
        assert core._reqs == {}, f"offload state left: {list(core._reqs)}"


def run_all(eng: Engine, prompts: list[list[int]], params: Any, ids: list[str]) -> dict[str, Any]:
    """`prompts` under `ids` to completion (and the connector drained): final outputs by id."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    for rid, p, sp in zip(ids, prompts, plist, strict=True):
        eng.add_request(p, sp, request_id=rid)
    done: dict[str, Any] = {}
    wait_until(
        lambda: not eng.has_unfinished_requests(),
        60.0,
        "the batch finishing",
        step=lambda: done.update({o.request_id: o for o in eng.step() if o.finished}),
    )
    return done


# ---- a failed synchronous load recomputes to the clean run's tokens, seeded sampling too ------


@pytest.fixture(scope="module")
def seeded_reference(tiny_model: Path, prompts: list[list[int]]) -> list[list[int]]:
    with Engine(tiny_model, EngineConfig(num_threads=1)) as eng:
        return [o.output_token_ids for o in eng.generate(prompts[:4], SEEDED)]


@pytest.mark.parametrize("load_async", [False, True], ids=["sync", "async"])
def test_a_failed_load_recomputes_seeded_sampling_to_the_clean_runs_tokens(
    make_engine: Callable[..., Engine],
    prompts: list[list[int]],
    seeded_reference: list[list[int]],
    load_async: bool,
) -> None:
    """A synchronous load runs in the step that computes the prompt's last token, so rank 0
    samples from KV the load may have failed to write; the scheduler throws that token away and
    recomputes from the first bad block. The thrown-away draw had advanced the request's seeded
    generator, so the recomputed request sampled a different stream than a clean run (greedy
    hid it: the existing load-error tests are all greedy)."""
    eng = make_engine(dict_connector(load_async=load_async, fail_load_block=5))
    first = eng.generate(prompts[:4], SEEDED)
    assert [o.output_token_ids for o in first] == seeded_reference
    eng.reset_prefix_cache()
    before = eng.stats()
    second = eng.generate(prompts[:4], SEEDED)
    after = eng.stats()
    # every load failed at block 5 and the request recomputed from there ...
    assert after["external_load_failures"] - before["external_load_failures"] == 4
    assert all(o.num_external_tokens == 5 * BS for o in second)
    # ... to exactly the tokens of the clean run, whose generator drew once per token
    assert [o.output_token_ids for o in second] == seeded_reference
    assert_pool_whole(eng)


def test_the_sampler_rewinds_a_draw_the_scheduler_threw_away() -> None:
    """A draw the scheduler threw away and rewound is drawn again as the same token; the
    stream then goes on as a clean run's does."""
    torch.manual_seed(0)
    logits = torch.randn(1, 512)
    spec = SampleSpec("a", 1.0, 1.0, 7)
    clean = Sampler()
    stream = [clean.sample(logits, [spec])[0].token for _ in range(6)]
    assert len(set(stream)) > 1  # a real draw, not a degenerate distribution
    rewound = Sampler()
    got = []
    for i in range(6):
        if i in (0, 3):  # drawn, thrown away (a failed synchronous load), rewound
            rewound.sample(logits, [spec])
            rewound.rewind(["a"])
        got.append(rewound.sample(logits, [spec])[0].token)
    assert got == stream


def test_a_request_id_used_again_once_free_draws_its_own_seeded_stream(
    make_engine: Callable[..., Engine], prompts: list[list[int]]
) -> None:
    """The engine frees a request id when its request ends, and a finished request's generator
    was dropped only after the next step's forward had sampled: a new request under that id,
    admitted in that step, drew its first token from the old request's advanced generator."""
    eng = make_engine()
    params = SEEDED[0]

    def once() -> list[int]:
        eng.add_request(prompts[0][:40], params, request_id="same")
        done: list[list[int]] = []
        wait_until(
            lambda: bool(done),
            30.0,
            "the request finishing",
            step=lambda: done.extend(o.output_token_ids for o in eng.step() if o.finished),
        )
        return done[0]

    first = once()
    assert once() == first


# ---- kvtier scheduler hooks that raise: one request pays, the engine serves on --------------


@pytest.fixture(scope="module")
def preempt_reference(tiny_model: Path) -> list[list[int]]:
    """Greedy tokens of the preempting batch on the same pool without a connector."""
    with Engine(tiny_model, EngineConfig(num_threads=1, num_blocks=NUM_BLOCKS)) as eng:
        return [o.output_token_ids for o in eng.generate(PREEMPT_PROMPTS, PREEMPT_PARAMS)]


@pytest.fixture(scope="module")
def tight_kvtier(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """One kvtier engine on a 30-block pool for the module's hook-fault tests."""
    run = tmp_path_factory.mktemp("fault-isolation") / "run"
    with kvtier_engine(tiny_model, run, num_blocks=NUM_BLOCKS) as eng:
        yield eng


def _raise_once(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> list[str]:
    """Make `owner.name` raise `Injected` on its first call; returns the ids it raised for."""
    inner = getattr(owner, name)
    fired: list[str] = []

    def wrapped(req: Any, *args: Any) -> Any:
        if not fired:
            fired.append(req.request_id)
            raise Injected(f"injected fault in {name}")
        return inner(req, *args)

    monkeypatch.setattr(owner, name, wrapped)
    return fired


def test_request_preempted_that_raises_costs_one_request_never_the_engine(
    tight_kvtier: Engine, preempt_reference: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every other kvtier scheduler hook runs under the HookGuard; `request_preempted` did
    not, so an exception in it (its lease release, or its own check that a preempted request
    has no load on the ranks) escaped `Scheduler._preempt` and ended the engine loop."""
    eng = tight_kvtier
    fired = _raise_once(monkeypatch, eng.connector.core, "request_preempted")
    before = eng.stats()
    errors = hook_errors(eng, "request_preempted")
    ids = [f"pre-{i}" for i in range(3)]
    done = run_all(eng, PREEMPT_PROMPTS, PREEMPT_PARAMS, ids)
    assert fired, "no preemption happened: the test does not test anything"
    assert eng.stats()["num_preemptions"] > before["num_preemptions"]
    assert [done[i].output_token_ids for i in ids] == preempt_reference
    assert hook_errors(eng, "request_preempted") == errors + 1
    assert_pool_whole(eng)
    # the engine serves on, the tier too: the batch again, its prompts from the tier
    monkeypatch.undo()
    eng.reset_prefix_cache()
    hits = eng.stats()["external_prefix_cache_hits"]
    again = run_all(eng, PREEMPT_PROMPTS, PREEMPT_PARAMS, [f"again-{i}" for i in range(3)])
    assert [again[f"again-{i}"].output_token_ids for i in range(3)] == preempt_reference
    assert eng.stats()["external_prefix_cache_hits"] > hits
    assert_pool_whole(eng)


# hooks whose failure leaves the rank serving (get_finished and the report's encoding turn the
# tier off on their rank for good: the engine-per-hook tests in test_hook_faults.py hold those)
POOL_HOOKS = [*SCHEDULER, "start_load_kv", "save"]


def _all_hook_errors(eng: Engine) -> float:
    return sum(
        s.value
        for fam in eng.connector.collector.collect()
        for s in fam.samples
        if s.name == "kvtier_hook_errors_total"
    )


def test_each_hook_that_raises_leaves_the_block_pool_whole_under_preemption(
    tight_kvtier: Engine, preempt_reference: list[list[int]]
) -> None:
    """Pins what test_hook_faults.py leaves open: after a hook raised for one request of a batch
    that preempts (a 30-block pool), with tier saves and loads in flight, every request has the
    clean run's tokens, every block is back in the free pool (no request held for a
    finished_sending that never comes) and the offload core forgets every request."""
    eng = tight_kvtier
    sched_half, worker_half = eng.connector, eng.executor.runner.connector
    for hook in POOL_HOOKS:
        role = SCHEDULER if hook in SCHEDULER else WORKER
        owner_path, method, req_id = role[hook]
        owner: Any = sched_half if role is SCHEDULER else worker_half
        for name in owner_path.split("."):
            owner = getattr(owner, name)
        victim = f"{hook}-victim"
        inner = getattr(owner, method)
        if req_id is None:  # update_connector_output: the op's owner, looked up live
            ops = owner.ops
            req_id = lambda term, ops=ops: ops.owner(term.op_id)  # noqa: E731

        def wrapped(*args: Any, inner=inner, req_id=req_id, victim=victim) -> Any:
            if req_id(*args) == victim:
                raise Injected(f"injected fault for {victim}")
            return inner(*args)

        errors = _all_hook_errors(eng)
        # a new tier epoch: nothing saved before is reachable, so the victim saves, then loads
        eng.connector.core.reset()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(owner, method, wrapped)
            for attempt in ("save", "load"):  # the victim's saves fail, then its loads
                eng.reset_prefix_cache()
                hits = eng.stats()["external_prefix_cache_hits"]
                ids = [f"{hook}-{attempt}-0", victim, f"{hook}-{attempt}-2"]
                done = run_all(eng, PREEMPT_PROMPTS, PREEMPT_PARAMS, ids)
                if attempt == "load":  # the other requests did restore from the tier
                    assert eng.stats()["external_prefix_cache_hits"] > hits, hook
                got = [done[i].output_token_ids for i in ids]
                assert got == preempt_reference, (hook, attempt)
                assert_pool_whole(eng)
                assert not eng.scheduler.held, (hook, attempt)
        assert _all_hook_errors(eng) > errors, f"{hook}: the fault never fired"


def test_a_loaded_request_preempted_before_the_core_heard_of_its_load_costs_no_engine(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The realistic path to the unguarded `request_preempted`: a rank's report fails to
    encode once (the rank carries its results to the next report, as designed), in the step
    that reports a parked request's load finished. The engine moves the request to `ready`
    from the rank's finished_recving; the core still counts the load open. A running request
    that needs a block in the very next step preempts the ready one (the first victim), and the
    core's own check ("preempted while its load is on the ranks") raised RuntimeError out of
    the engine step: one failed encode plus an ordinary preemption ended the engine."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    b_prompt, a_prompt = make_prompts(1, 320, seed=77)[0], make_prompts(1, 150, seed=78)[0]
    with Engine(tiny_model, EngineConfig(num_threads=1)) as plain:
        ref_b, ref_a = (
            plain.generate([p], params)[0].output_token_ids for p in (b_prompt, a_prompt)
        )
    config = KVTierConfig(chunk_size=64, memory_bytes="64MiB", load_gate=False,
                          lookup_timeout_ms=2000, sync_load_fraction=0)  # fmt: skip
    spec = connector_spec(config, tiny_model, run_dir=tmp_path / "run")
    # B's load stalls on its second chunk until released, so A can be placed exactly
    faulty = ConnectorSpec(
        "tests.native.faults_connector:build",
        {**spec.args, "fault": "stuck", "fail_rank": 0, "fail_loads": 1},
    )
    # 30 blocks: B's 320-token prompt holds 20 while parked, A's 150 tokens 10 (160 at most);
    # one running request at a time, so B, once loaded, waits in `ready` for A's seat
    cfg = EngineConfig(num_threads=1, num_blocks=30, max_num_seqs=1)
    with Engine(tiny_model, cfg, faulty) as eng:
        half = eng.executor.runner.connector
        assert isinstance(half, FaultyLoadWorkerHalf)
        worker = half.worker
        sched = eng.scheduler
        assert eng.generate([b_prompt], params)[0].output_token_ids == ref_b  # B is saved
        eng.reset_prefix_cache()
        eng.add_request(b_prompt, params, request_id="b")
        wait_until(lambda: "b" in sched.parked and half.fired.is_set(), 10.0,
                   "B parking on its (stalled) load", step=eng.step)  # fmt: skip
        eng.add_request(a_prompt, params, request_id="a")
        done: dict[str, list[int]] = {}

        def step() -> None:
            done.update({o.request_id: o.output_token_ids for o in eng.step() if o.finished})

        a = sched.get("a")
        assert a is not None
        # A decodes up to its 10th block's last slot: its next token needs an 11th block
        wait_until(lambda: a.num_tokens == 160, 10.0, "A filling its 10 blocks", step=step)
        assert "b" in sched.parked and eng.block_manager.num_free_blocks() == 0

        inner = worker._encode_report
        failed: list[bool] = []

        def encode_once(report: Any) -> bytes:
            if "b" in report.finished_recving and not failed:
                failed.append(True)
                raise Injected("injected: the rank's report could not be encoded")
            return inner(report)

        monkeypatch.setattr(worker, "_encode_report", encode_once)
        half.release.set()
        assert worker.wait_loads(10.0), "B's load did not land"
        step()  # the rank reports B loaded; its results ride with the next report
        assert failed and [s.request_id for s in sched.ready] == ["b"]
        assert eng.connector.core.pending_load("b") is not None  # the core: still loading
        # A needs a block now: B, loaded and waiting for a seat, is the victim
        wait_until(lambda: not eng.has_unfinished_requests(), 30.0, "the requests finishing",
                   step=step)  # fmt: skip
        assert eng.stats()["num_preemptions"] >= 1
        assert done == {"a": ref_a, "b": ref_b}
        assert hook_errors(eng, "request_preempted") == 1
        assert_pool_whole(eng)
