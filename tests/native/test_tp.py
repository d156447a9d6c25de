"""Tensor parallelism over worker processes: same tokens as TP=1, per-rank KV shards, quorum
over ranks for connector reports, and a dead rank surfacing as an error instead of a hang."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.native import Engine, EngineConfig
from kvtier.native.tp import WorkerError

from .conftest import GREEDY, dict_connector


@pytest.fixture(scope="module")
def tp2(tiny_model: Path) -> Iterator[Engine]:
    """One TP=2 engine for the module; rank 1 reports finished loads two steps late."""
    eng = Engine(
        tiny_model,
        EngineConfig(tensor_parallel_size=2, num_threads=1),
        connector_factory=dict_connector(load_async=True, recv_delay={"1": 2}),
    )
    yield eng
    eng.close()


def test_each_rank_holds_half_the_kv_heads(tp2: Engine):
    layers, kv_heads, head_dim = 4, 2, 64
    want = [layers, tp2.config.num_blocks, 2, tp2.config.block_size, kv_heads // 2, head_dim]
    assert tp2.kv_cache_shapes == [want, want]


def test_tp2_matches_tp1_and_restores_with_quorum(tp2: Engine, prompts, baseline):
    first = tp2.generate(prompts, GREEDY)
    assert [o.output_token_ids for o in first] == baseline  # token for token
    assert len(tp2.connector.stored) == len(prompts) * 19  # saves committed by both ranks

    tp2.reset_prefix_cache()
    before = tp2.stats()
    ids = [tp2.add_request(p, GREEDY) for p in prompts]
    final = {}
    half_voted = 0
    while tp2.has_unfinished_requests():
        for o in tp2.step():
            if o.finished:
                final[o.request_id] = o
        for rid, ranks in tp2.scheduler.aggregator.pending().items():
            # rank 0 reported its load; the request waits for rank 1
            assert ranks == [0] and rid in tp2.scheduler.parked
            half_voted += 1
    assert half_voted >= 2 * len(prompts)  # two late steps per request
    assert [final[i].output_token_ids for i in ids] == baseline
    after = tp2.stats()
    assert after["external_prefix_cache_hits"] - before["external_prefix_cache_hits"] == 8 * 303
    assert after["prefix_cache_hits"] == before["prefix_cache_hits"]
    # every step carried both ranks' worker bytes to the scheduler half
    assert len(tp2.connector.outputs[-1].worker_meta) == 2


def test_dead_rank_is_a_clear_error(tp2: Engine, prompts):
    victim = tp2.executor.pids[1]
    os.kill(victim, signal.SIGKILL)
    tp2.add_request(prompts[0][:40], GREEDY)
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=rf"TP rank 1 \(pid {victim}\) exited with code -9") as e:
        tp2.step()
    assert time.monotonic() - t0 < 15
    # the survivor, stuck in a collective with a dead peer, is ended and reaped: no zombie
    assert "stopped the surviving ranks [0]" in str(e.value)
    assert all(p.poll() is not None for p in tp2.executor.procs)
    with pytest.raises(WorkerError, match="failed earlier"):
        tp2.step()


def test_rank_startup_failure_names_the_rank_and_cause(tiny_model: Path):
    spec = ("kvtier.native.no_such_module:Factory", {})
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"(?s)failed to start up.*no_such_module"):
        Engine(tiny_model, EngineConfig(tensor_parallel_size=2), connector_factory=spec)
    assert time.monotonic() - t0 < 60


def test_a_rank_killed_while_the_server_is_idle_fails_it_and_stops_the_survivor(
    tiny_model: Path,
):
    """The serving loop finds a dead rank at an idle wake-up, before any step: it fails the
    engine naming the rank and ends the survivor (blocked for good in a collective with its
    dead peer) at once, as a failed step does, not only when the process closes the engine."""
    from kvtier.native.server import EngineServer

    eng = Engine(tiny_model, EngineConfig(tensor_parallel_size=2, num_threads=1))
    srv = EngineServer(eng, model_name="tiny").start()
    try:
        assert srv.loop.wait_idle(30.0)
        victim = eng.executor.pids[1]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 30.0
        pause = threading.Event()  # never set: a bounded wait between checks
        procs = eng.executor.procs
        while not (srv.loop.fatal and all(p.poll() is not None for p in procs)):
            assert time.monotonic() < deadline, (srv.loop.fatal, [p.poll() for p in procs])
            pause.wait(0.05)
        assert f"TP rank 1 (pid {victim}) exited with code -9" in srv.loop.fatal
        assert "stopped the surviving ranks [0]" in srv.loop.fatal
    finally:
        srv.close()
