"""Abort while a tier load is in flight: vLLM keeps the request's blocks until the load's
finished_recving and frees them once; kvtier must not free them a second time. The engine
drains to zero used blocks and serves the same prompts correctly afterwards."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.vllm.conftest import TIER, DriverRun, retrieved_lines


def test_abort_during_load_frees_blocks_once(
    run_driver: Callable[..., DriverRun], tiny_vllm_model: Path
) -> None:
    args = {"model": str(tiny_vllm_model), "extra": TIER}
    run = run_driver("abort", args, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    r = run.result
    n = len(r["prompt_lens"])

    assert r["victim_status_before_abort"] == "WAITING_FOR_REMOTE_KVS"
    assert r["victim_pending_load"] == [0, 512]
    assert r["victim_blocks_held_after_abort"] is True  # vLLM waits for the load to finish
    assert r["usage_after_abort"] == 0.0  # ... then frees every block, once
    assert r["usage_at_end"] == 0.0
    # the held load still ran to its terminal; afterwards every prompt restored normally
    lines = retrieved_lines(run.stderr)
    assert [(x.got, x.failed) for x in lines] == [(512, None)] * (1 + n)
    assert r["out2"] == r["out1"]
