"""The connector hook contract: restore through the hooks, load errors, delayed frees, quorum."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kvtier.errors import ConfigError
from kvtier.native import SamplingParams, SequenceStatus
from kvtier.native.connector import (
    ConnectorContext,
    ConnectorRole,
    ConnectorSpec,
    KVOutputAggregator,
    NullConnector,
    build_connector,
)

from .conftest import GREEDY, DictConnector, dict_connector, make_prompts

BS = 16
PROMPT_LEN = 304
WORKER_ORDER = [
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_save",
    "get_finished",
    "get_block_ids_with_load_errors",
    "build_worker_meta",
    "clear_connector_metadata",
]


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def _worker(engine: Any) -> DictConnector:
    return engine.executor.runner.connector


def _identity_closes(stats: dict[str, float]) -> bool:
    return (
        stats["prefix_cache_queries"] - stats["prefix_cache_hits"]
        == stats["external_prefix_cache_queries"]
    )


@pytest.mark.parametrize("load_async", [True, False], ids=["async", "sync"])
def test_two_pass_restore_through_hooks(make_engine, prompts, baseline, load_async):
    eng = make_engine(dict_connector(load_async=load_async))
    first = eng.generate(prompts, GREEDY)
    assert [o.output_token_ids for o in first] == baseline
    conn: DictConnector = eng.connector
    assert len(conn.stored) == len(prompts) * PROMPT_LEN // BS  # every full prompt block saved
    assert not eng.scheduler.held  # delayed frees all settled

    eng.reset_prefix_cache()
    before = eng.stats()
    second = eng.generate(prompts, GREEDY)
    d = _delta(eng.stats(), before)

    assert [o.output_token_ids for o in second] == baseline
    total = len(prompts) * PROMPT_LEN
    assert d["prefix_cache_hits"] == 0
    # a full hit leaves the last prompt token to compute: 303 of 304 tokens each
    assert d["external_prefix_cache_hits"] == len(prompts) * (PROMPT_LEN - 1)
    assert d["external_prefix_cache_hits"] >= 0.99 * total
    assert d["external_prefix_cache_queries"] == total
    assert all(o.num_external_tokens == PROMPT_LEN - 1 for o in second)
    assert all(o.num_cached_tokens == 0 for o in second)
    assert _identity_closes(eng.stats())
    worker = _worker(eng)
    assert worker.loaded_blocks == len(conn.stored)
    assert worker.order == WORKER_ORDER
    # every step reported each rank's worker bytes to the scheduler half
    assert msgspec.msgpack.decode(conn.outputs[-1].worker_meta[0]) == [0, len(conn.stored)]

    # the loaded blocks were published to the HBM prefix cache: a third pass hits HBM
    before = eng.stats()
    third = eng.generate(prompts, GREEDY)
    d = _delta(eng.stats(), before)
    assert [o.output_token_ids for o in third] == baseline
    assert d["prefix_cache_hits"] == len(prompts) * (PROMPT_LEN - BS)
    # HBM keeps one block to compute (18 of 19 hit); the connector still offers 15 of its tokens
    assert d["external_prefix_cache_hits"] == len(prompts) * (BS - 1)


@pytest.mark.parametrize("load_async", [True, False], ids=["async", "sync"])
def test_load_error_recomputes_from_first_bad_block(make_engine, prompts, baseline, load_async):
    eng = make_engine(dict_connector(load_async=load_async, fail_load_block=5))
    eng.generate(prompts, GREEDY)
    eng.reset_prefix_cache()
    before = eng.stats()
    out = eng.generate(prompts, GREEDY)
    d = _delta(eng.stats(), before)
    # block 5 of every load was poisoned and reported: only a recompute gives these outputs
    assert [o.output_token_ids for o in out] == baseline
    assert d["external_prefix_cache_hits"] == len(prompts) * 5 * BS
    assert all(o.num_external_tokens == 5 * BS for o in out)
    assert d["external_load_failures"] == len(prompts)
    assert _identity_closes(eng.stats())


def test_delayed_free_is_honoured(make_engine, prompts):
    # 10 blocks: the first request's 5 held blocks keep the second (6 blocks) waiting
    eng = make_engine(dict_connector(send_delay={"0": 3}), num_blocks=10)
    conn: DictConnector = eng.connector
    bm = eng.block_manager
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    first = eng.add_request(prompts[0][:64], params)
    done = False
    while not done:
        done = any(o.finished for o in eng.step())
    held = conn.finished[first]
    assert len(held) == 5 and first in eng.scheduler.held
    second = eng.add_request(prompts[1][:96], params)
    steps_held = 0
    while first in eng.scheduler.held:
        assert all(bm.ref_counts[b] == 1 and b not in bm.free_queue for b in held)
        seq = eng.scheduler.get(second)
        assert seq is not None and seq.status is SequenceStatus.WAITING and not seq.block_ids
        eng.step()
        steps_held += 1
    assert steps_held >= 4  # save sent one step after the finish, then 3 steps of delay
    assert all(bm.ref_counts[b] == 0 and b in bm.free_queue for b in held)
    assert len(conn.stored) == 4  # the 4 full prompt blocks, committed on finished_sending
    eng.drain()
    assert eng.stats()["requests_finished"] == 2
    assert bm.num_free_blocks() == 10


def test_abort_while_loading_keeps_blocks_until_recving(make_engine, prompts):
    eng = make_engine(dict_connector(load_async=True, recv_delay={"0": 3}))
    eng.generate(prompts[:1], GREEDY)
    eng.reset_prefix_cache()
    rid = eng.add_request(prompts[0], GREEDY)
    eng.step()
    seq = eng.scheduler.parked[rid]
    blocks = list(seq.block_ids)
    assert len(blocks) == PROMPT_LEN // BS
    assert eng.abort(rid)
    assert eng.scheduler.held[rid].wait_recv
    bm = eng.block_manager
    while rid in eng.scheduler.held:
        # the worker may still be writing these blocks: nobody else may get them
        assert all(bm.ref_counts[b] == 1 for b in blocks)
        eng.step()
    assert all(bm.ref_counts[b] == 0 for b in blocks)
    # the aborted load's blocks were never published to the prefix cache
    assert not any(bm.block_hash[b] for b in blocks)
    assert eng.stats()["requests_aborted"] == 1
    assert not eng.has_unfinished_requests()


def test_preemption_calls_connector_hooks(make_engine):
    # 3 prompts of 10 blocks fill 30 blocks; the first decode block forces a preemption
    prompts = make_prompts(3, 160, seed=11)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = [o.output_token_ids for o in make_engine().generate(prompts, params)]
    eng = make_engine(dict_connector(), num_blocks=30)
    out = eng.generate(prompts, params)
    assert [o.output_token_ids for o in out] == expected
    stats = eng.stats()
    assert stats["num_preemptions"] > 0
    conn: DictConnector = eng.connector
    assert len(conn.preempted) == stats["num_preemptions"]
    assert _worker(eng).calls["handle_preemptions"] > 0
    assert _identity_closes(stats)


def test_hook_call_counts(make_engine, prompts):
    eng = make_engine(dict_connector())
    eng.generate(prompts[:2], GREEDY)
    conn: DictConnector = eng.connector
    steps = conn.calls["build_connector_meta"]
    assert conn.calls["get_num_new_matched_tokens"] == 2
    assert conn.calls["update_state_after_alloc"] == 2
    assert conn.calls["request_finished"] == 2
    assert conn.calls["update_connector_output"] == steps
    worker = _worker(eng)
    for hook in WORKER_ORDER:
        assert worker.calls[hook] == steps
    # registered caches: one block-major contiguous tensor per layer, views of one allocation
    kv = worker.kv
    assert len(kv) == 4 and all(t.is_contiguous() for t in kv)
    assert kv[0].shape == (eng.config.num_blocks, 2, 16, 2, 64)
    layer_bytes = kv[0].numel() * kv[0].element_size()
    assert all(kv[i].data_ptr() - kv[0].data_ptr() == i * layer_bytes for i in range(4))
    eng.close()
    assert conn.calls["shutdown"] == 1 and worker.calls["shutdown"] == 1


class GreedyConnector(NullConnector):
    """Claims the whole prompt, violating the last-token rule."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        return request.num_tokens - num_computed_tokens, False


def test_connector_claiming_the_last_token_is_an_error(make_engine):
    eng = make_engine(ConnectorSpec(f"{__name__}:GreedyConnector"))
    eng.add_request(list(range(10, 50)), GREEDY)
    with pytest.raises(RuntimeError, match="must leave the last token"):
        eng.step()


class HalfConnector:
    """Lacks most hooks."""

    def __init__(self, role: ConnectorRole, context: ConnectorContext) -> None:
        self.role = role

    def shutdown(self) -> None:
        """Nothing."""


def _ctx() -> ConnectorContext:
    return ConnectorContext("m", "llama", "float32", 16, 8, 2, 2, 2, 64, 1, -1, "cpu")


def test_build_connector_checks_hooks_and_args():
    with pytest.raises(ConfigError, match="lacks the hooks"):
        build_connector(ConnectorSpec(f"{__name__}:HalfConnector"), ConnectorRole.WORKER, _ctx())
    with pytest.raises(ConfigError, match="cannot be imported"):
        build_connector(ConnectorSpec("no.such.module:X"), ConnectorRole.SCHEDULER, _ctx())
    with pytest.raises(ConfigError, match="cannot be sent"):
        ConnectorSpec.of(("kvtier.native.connector:NullConnector", {"f": object()}))
    spec = ConnectorSpec.of(("kvtier.native.connector:NullConnector", {}))
    assert isinstance(build_connector(spec, ConnectorRole.WORKER, _ctx()), NullConnector)


def test_aggregator_needs_every_rank():
    agg = KVOutputAggregator(world=2)
    expect = {"a", "b"}
    assert agg.add(0, ["a"], ["b"], expect, expect) == (set(), set())
    # a duplicate from the same rank adds no quorum
    assert agg.add(0, ["a"], ["b"], expect, expect) == (set(), set())
    assert agg.pending() == {"b": [0]}
    assert agg.add(1, ["a"], [], expect, expect) == ({"a"}, set())
    assert agg.add(1, [], ["b"], expect, expect) == (set(), {"b"})
    # ids nobody waits for are dropped, not kept half-voted
    assert agg.add(0, ["zzz"], [], expect, expect) == (set(), set())
    assert agg.ignored == 1 and agg.pending() == {}


def test_external_queries_need_a_connector(make_engine):
    eng = make_engine()
    eng.generate(make_prompts(2, 40, seed=3), GREEDY)
    s = eng.stats()
    assert s["external_prefix_cache_queries"] == 0 and s["prefix_cache_queries"] == 80
