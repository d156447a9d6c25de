"""The connector under vLLM's own scheduler and Model Runner V2's hook order (`ActiveKVConnector`,
what CUDA deployments run), with a stand-in forward: every block a load restores holds exactly
the KV the forward would have written, through preemptions in both passes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.vllm.conftest import CHUNK, TIER, DriverRun, loadable_tokens, retrieved_lines


def test_v2_hook_order_restores_exact_kv_through_preemptions(
    run_driver: Callable[..., DriverRun], tiny_vllm_model: Path
) -> None:
    # 16 blocks of 128 tokens and 400 decode tokens each: vLLM must preempt
    args = {"model": str(tiny_vllm_model), "extra": TIER, "num_blocks": 16, "max_tokens": 400}
    run = run_driver("hooks_v2", args)
    r = run.result
    assert r["bad"] == [] and r["checked"] > 0
    assert r["pass1"]["preemptions"] > 0 and r["pass2"]["preemptions"] > 0
    assert r["pass2"]["external_hits"] == loadable_tokens(r["prompt_lens"], CHUNK), (
        r,
        run.warnings(),
    )
    assert r["pass2"]["prefix_hits"] == 0
    lines = retrieved_lines(run.stderr)
    assert lines and not [x for x in lines if x.failed]
