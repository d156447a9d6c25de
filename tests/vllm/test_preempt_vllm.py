"""Preemption: vLLM preempts running requests and re-admits them in the next step
(`reset_prefix_cache(reset_running_requests=True)`); the re-admission's tier load must not be
withdrawn as the preempted one's (that request would wait for it forever), and the restored
requests still decode pass 1's tokens (in float32: pass 2's batch shapes cannot be pass 1's)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.vllm.conftest import CHUNK, TIER, DriverRun, loadable_tokens, retrieved_lines


def test_preempted_requests_restore_again_and_decode_the_same(
    run_driver: Callable[..., DriverRun], tiny_vllm_model_f32: Path
) -> None:
    args = {"model": str(tiny_vllm_model_f32), "extra": TIER}
    run = run_driver("preempt", args, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    r = run.result
    n = len(r["prompt_lens"])

    assert r["pass2"]["vllm:num_preemptions"] == n
    assert min(r["preempted_at"].values()) >= 4, "the requests were preempted while decoding"
    # each request restored its prefix twice: at admission and at re-admission after preemption
    lines = retrieved_lines(run.stderr)
    assert [x.failed for x in lines] == [None] * 2 * n
    assert sum(x.got for x in lines) == 2 * loadable_tokens(r["prompt_lens"], CHUNK)
    assert r["out2"] == r["out1"]
    # counters that add up: vLLM counts the re-admissions apart from its external hits, and
    # kvtier counts their loads apart from the retrieved tokens that match those hits
    k = r["kvtier2"]
    assert k["readmitted_retrieved_tokens"] == loadable_tokens(r["prompt_lens"], CHUNK)
    ext_hits = r["pass2"]["vllm:external_prefix_cache_hits"]
    assert k["retrieved_tokens"] - k["readmitted_retrieved_tokens"] == ext_hits
