"""Startup errors of KVTierConnector inside vLLM name the value and the fix."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.vllm.conftest import TIER, DriverRun


def test_chunk_size_not_multiple_of_block_size_stops_startup(
    run_driver: Callable[..., DriverRun], tiny_vllm_model: Path
) -> None:
    # vLLM's CPU block size is 128; 320 is a valid kvtier chunk (x16) but not a whole block count
    args = {"model": str(tiny_vllm_model), "extra": {**TIER, "chunk_size": 320}}
    run = run_driver("bad_startup", args, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert run.result["started"] is False
    first = run.result["errors"][0]
    assert first.startswith("kvtier.errors.ConfigError: ")
    assert "chunk_size=320 is not a multiple of vLLM's KV block size 128" in first
    assert "(e.g. 384)" in first


def test_a_codec_that_cannot_move_a_block_stops_startup(
    run_driver: Callable[..., DriverRun], tiny_vllm_model: Path
) -> None:
    args = {"model": str(tiny_vllm_model), "extra": TIER, "codec_fault": True}
    run = run_driver("bad_startup", args, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert run.result["started"] is False
    assert any(
        "kvtier.errors.StartupError: kvtier[rank 0/1]: self-test failed on device cpu, KV "
        "layout LBHNC" in e
        for e in run.result["errors"]
    ), run.result["errors"]
