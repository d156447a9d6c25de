"""The scheduler's block size under state groups: vLLM's align mode keeps a state only where a
prefill step ends on a multiple of `cache_config.block_size`, so that size must stay the state
groups' block for a state to exist at a chunk boundary."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("kvtier")


class StateBlockSize:
    """Keeps `cache_config.block_size` at the state groups' block.

    vLLM 0.32's engine process re-runs its platform's config check after the handshake (the
    process `vllm serve` and a multiprocess `LLM` schedule in). On the CPU platform that check
    puts a block size the user did not set back to 128 tokens, under state groups that vLLM
    itself sized to a larger block. Align-mode prefills then stop at 128-token multiples, where
    no state is kept: the tier got every chunk and not one state, so no hit could end anywhere.
    """

    def __init__(self, cache_config: Any, block: int) -> None:
        self._cache = cache_config
        self.block = block

    def keep(self) -> None:
        """Put the block size back when vLLM changed it (checked before each admission)."""
        now = self._cache.block_size
        if now == self.block:
            return
        self._cache.block_size = self.block
        log.warning(
            "kvtier: vLLM's scheduler block size became %s tokens after startup, under state "
            "groups kept at %d-token blocks (vLLM's CPU platform resets a block size the user "
            "did not set when its engine process starts); set it back to %d so prefill steps "
            "stop where a state is kept (pass --block-size %d to vLLM to silence this)",
            now, self.block, self.block, self.block,
        )  # fmt: skip
