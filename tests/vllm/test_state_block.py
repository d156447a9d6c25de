"""`StateBlockSize` without vLLM: the scheduler's block size is put back under state groups."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from kvtier.vllm.state_block import StateBlockSize


def test_a_block_size_vllm_reset_is_put_back_once_and_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cache = SimpleNamespace(block_size=256)
    keeper = StateBlockSize(cache, 256)
    keeper.keep()
    assert cache.block_size == 256
    # what vLLM's CPU platform does when the engine process re-runs its config check
    cache.block_size = 128
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        keeper.keep()
        keeper.keep()
    assert cache.block_size == 256
    [line] = [r.getMessage() for r in caplog.records]
    assert "block size became 128 tokens" in line and "--block-size 256" in line
