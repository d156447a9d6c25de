"""The seed's regression at TP=2: the scheduler's lookup client covers both ranks (world=2 read
from vLLM's parallel_config) and both ranks retrieve, on a Qwen3-Next-shaped hybrid: every
rank restores its attention groups and its own shard of the gated-delta-net state (vLLM's
tp_replicated=False), under its own namespace. A lookup scope outside the world stops startup
with a TopologyError (tests/vllm/test_startup_errors_vllm.py, at TP=1: the check is the same
against the world this test proves is read right, and a TP=2 start that fails costs the suite
half a minute). A dense model at TP=2 runs in tests/native/test_tp.py (the native engine) and
`bench e2e --tp 2`; one TP=2 vLLM start is what the suite affords.

The engine core runs in a process of its own, as under `vllm serve`: there vLLM's CPU platform
re-runs its config check after the KV cache is sized and puts the scheduler's block size back to
its 128-token default under a 256-token state block, so prefill steps stop where no state is
kept and no state reached the tier (kvtier puts the block size back; the in-process engines of
the other tests never see this)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.vllm.conftest import DriverRun, retrieved_lines
from tests.vllm.state_checks import GDN_TIER, GDN_VLLM, gdn_restored

# the engine core and both workers are processes of their own, as under `vllm serve`
TP2 = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def test_tp2_all_rank_lookup_retrieves_on_every_rank(
    run_driver: Callable[..., DriverRun], tiny_gdn_hybrid_model: Path
) -> None:
    args = {
        "model": str(tiny_gdn_hybrid_model),
        "tp": 2,
        "extra": {**GDN_TIER, "lookup_scope": [0, 1]},
        # the reference pass after pass 2: each state pass 2 reads was stored at first sight
        "hbm_after": True,
        "serial": True,
        "n": 2,  # two prompts: each serial pass at TP=2 costs a cross-process step per token
        # 674 and 711 tokens: a 128-token step split stops at 640, past the 512 state boundary
        "base_len": 674,
        "llm_kwargs": GDN_VLLM,
    }
    run = run_driver("two_pass", args, TP2, timeout_s=280)
    r = run.result
    assert "kvtier: hybrid model, KV cache groups per chunk: state(gdn_attn" in run.stderr
    assert "kvtier: lookup client on ranks [0, 1] (world=2)" in run.stderr
    assert "world=1" not in run.stderr
    # both ranks: every prompt restored with its state, outputs those of vLLM's own prefix cache
    want = gdn_restored(run)
    lines = retrieved_lines(run.stderr)
    assert sorted({x.rank for x in lines}) == [0, 1]
    assert {x.world for x in lines} == {2}
    # every rank loads its own heads and state shard of the same tokens: sum over ranks / TP ==
    # external hits
    assert sum(x.got for x in lines) / 2 == r["pass2"]["vllm:external_prefix_cache_hits"] == want
    kv = r["kvtier"]
    assert kv["retrieved_tokens"] == {"rank=0": want, "rank=1": want, "rank=scheduler": 0.0}
    assert not kv["load_failures"]
