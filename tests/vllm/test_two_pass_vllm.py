"""Two-pass restore through `vllm.LLM` (TP=1, in-process engine): pass 2 gets its prefix from
kvtier, not from vLLM's own prefix cache, and decodes exactly what pass 1 decoded.

It runs under async scheduling, vLLM's default on GPUs (step N+1 scheduled while step N runs),
which vLLM's CPU platform turns off: the driver turns it back on. Every other vLLM test runs
the synchronous scheduler the CPU platform picks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.vllm.conftest import CHUNK, TIER, DriverRun, loadable_tokens, retrieved_lines

IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def test_two_pass_restore_from_tier(
    run_driver: Callable[..., DriverRun], tiny_vllm_model: Path
) -> None:
    args = {"model": str(tiny_vllm_model), "extra": TIER, "async_scheduling": True}
    run = run_driver("two_pass", args, IN_PROCESS)
    r = run.result
    assert (r["async_scheduling"], r["scheduler"]) == (True, "AsyncScheduler")
    want = loadable_tokens(r["prompt_lens"], CHUNK)
    p1, p2 = r["pass1"], r["pass2"]

    # pass 1: distinct prompts, empty tier -> no hits anywhere, so its outputs are the reference
    assert p1["vllm:prefix_cache_hits"] == 0
    assert p1["vllm:external_prefix_cache_hits"] == 0
    # pass 2: vLLM's prefix cache was reset; every whole chunk comes from the tier's host memory
    assert p2["vllm:prefix_cache_hits"] == 0
    assert p2["vllm:external_prefix_cache_hits"] == want > 0
    assert p2["by_source:host"] == want
    assert p2["vllm:prompt_tokens_cached"] == want
    for p in (p1, p2):
        assert (
            p["vllm:prefix_cache_queries"] - p["vllm:prefix_cache_hits"]
            == p["vllm:external_prefix_cache_queries"]
        )
    assert r["out2"] == r["out1"], "restored KV changed the greedy output"

    lines = retrieved_lines(run.stderr)
    assert [(x.rank, x.world, x.failed) for x in lines] == [(0, 1, None)] * len(r["prompt_lens"])
    assert sum(x.got for x in lines) == want
    kv = r["kvtier"]
    assert kv["retrieved_tokens"]["rank=0"] == want
    # pass 1 stored every whole chunk once; pass 2 found them all and stored nothing again
    assert kv["stored_tokens"]["rank=0"] == want
    assert not kv["load_failures"]
    assert "kvtier: lookup client on ranks [0] (world=1)" in run.stderr
