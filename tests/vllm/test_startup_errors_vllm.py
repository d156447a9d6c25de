"""Startup errors of KVTierConnector inside vLLM name the value and the fix."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.vllm.conftest import TIER, DriverRun, retrieved_lines


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


def test_chunk_size_above_max_model_len_stops_startup_naming_both(
    run_driver: Callable[..., DriverRun], tiny_vllm_model: Path
) -> None:
    # the driver serves max_model_len=2048: a 4096-token chunk could never be filled
    args = {"model": str(tiny_vllm_model), "extra": {**TIER, "chunk_size": 4096}}
    run = run_driver("bad_startup", args, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert run.result["started"] is False
    first = run.result["errors"][0]
    assert first.startswith("kvtier.errors.ConfigError: ")
    assert "chunk_size=4096 is larger than the model's max_model_len=2048" in first


def test_a_lookup_scope_outside_the_world_stops_startup(
    run_driver: Callable[..., DriverRun], tiny_vllm_model: Path
) -> None:
    """The seed's bug class: a scope naming ranks the world (read from vLLM's parallel config)
    does not have is refused by name, before any lookup client could serve a write-only tier."""
    args = {"model": str(tiny_vllm_model), "extra": {**TIER, "lookup_scope": [0, 1]}}
    run = run_driver("bad_startup", args, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert run.result["started"] is False
    first = run.result["errors"][0]
    assert first.startswith("kvtier.errors.TopologyError: ")
    assert "lookup_scope (0, 1) names ranks [1] outside [0, 1)" in first
    assert "world=1 from tp=1 x pp=1" in first
    # no client was built, so nothing could pretend to serve
    assert "lookup client on ranks" not in run.stderr
    assert not retrieved_lines(run.stderr)
