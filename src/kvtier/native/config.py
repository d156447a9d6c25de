"""EngineConfig: the native engine's knobs, validated once at construction."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvtier.errors import ConfigError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class EngineConfig:
    """Sizes of the HBM block pool, the per-step batch and the parallel layout."""

    block_size: int = 16
    num_blocks: int = 1024  # the HBM pool (`--hbm-blocks`)
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 16
    max_model_len: int | None = None  # None: min(max_position_embeddings, pool capacity)
    dtype: str = "float32"
    tensor_parallel_size: int = 1
    seed: int = 0
    device: str = "cpu"  # "cpu" or "cuda"; TP rank r uses cuda:r
    enable_prefix_caching: bool = True
    # torch intra-op threads of each compute process; None keeps torch's default in process
    # (TP=1) and uses 1 per TP worker
    num_threads: int | None = None
    step_timeout_s: float = 600.0  # a TP step with no answer from a rank is an error
    startup_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"EngineConfig.{name}={value!r} must be an integer >= 1")
        if self.tensor_parallel_size < 1:
            raise ConfigError(
                f"EngineConfig.tensor_parallel_size={self.tensor_parallel_size} must be >= 1"
            )
        if self.dtype not in DTYPES:
            raise ConfigError(f"EngineConfig.dtype={self.dtype!r} must be one of {sorted(DTYPES)}")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"EngineConfig.device={self.device!r} must be 'cpu' or 'cuda'")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"EngineConfig.max_model_len={self.max_model_len} must be >= 2")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"EngineConfig.num_threads={self.num_threads} must be >= 1 or None")
        if self.step_timeout_s <= 0 or self.startup_timeout_s <= 0:
            raise ConfigError("EngineConfig step_timeout_s and startup_timeout_s must be > 0")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The compute and KV-cache dtype."""
        return DTYPES[self.dtype]

    def to_dict(self) -> dict[str, Any]:
        """Plain fields, for msgspec messages to worker processes."""
        return asdict(self)
