"""The seed's regression at TP=2: the scheduler's lookup client covers both ranks (world=2 read
from vLLM's parallel_config) and both ranks retrieve. A lookup scope outside the world stops
startup with a TopologyError (tests/vllm/test_startup_errors_vllm.py, at TP=1: the check is the
same against the world this test proves is read right, and a TP=2 start that fails costs the
suite half a minute)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.vllm.conftest import CHUNK, TIER, DriverRun, loadable_tokens, retrieved_lines

# the in-process engine core keeps the scheduler connector in the driver; workers are processes
TP2 = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def test_tp2_all_rank_lookup_retrieves_on_every_rank(
    run_driver: Callable[..., DriverRun], tiny_vllm_model: Path
) -> None:
    extra = {**TIER, "lookup_scope": [0, 1]}
    run = run_driver(
        "two_pass", {"model": str(tiny_vllm_model), "tp": 2, "extra": extra}, TP2, timeout_s=280
    )
    r = run.result
    want = loadable_tokens(r["prompt_lens"], CHUNK)
    n = len(r["prompt_lens"])

    assert "kvtier: lookup client on ranks [0, 1] (world=2)" in run.stderr
    assert "world=1" not in run.stderr
    lines = retrieved_lines(run.stderr)
    for rank in (0, 1):
        mine = [x for x in lines if x.rank == rank]
        assert [(x.world, x.failed) for x in mine] == [(2, None)] * n, f"rank {rank}: {mine}"
        assert sum(x.got for x in mine) == want
    p2 = r["pass2"]
    assert p2["vllm:prefix_cache_hits"] == 0
    # every rank loads its own heads of the same tokens: sum over ranks / TP == external hits
    assert sum(x.got for x in lines) / 2 == p2["vllm:external_prefix_cache_hits"] == want
    retrieved = r["kvtier"]["retrieved_tokens"]
    assert retrieved["rank=0"] == retrieved["rank=1"] == want
    assert r["out2"] == r["out1"]
