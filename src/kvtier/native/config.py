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


def device_kind(device: str) -> tuple[str, int]:
    """("cpu", 0) or ("cuda", N) for "cpu", "cuda" (N = 0) and "cuda:N"; ConfigError otherwise.
    Parsed without touching a GPU, so a CPU run checks what a CUDA run will be given."""
    kind, sep, index = device.partition(":")
    if kind == "cpu" and not sep:
        return "cpu", 0
    if kind == "cuda" and (not sep or (index.isdigit() and index.isascii())):
        return "cuda", int(index) if sep else 0
    raise ConfigError(
        f"EngineConfig.device={device!r} must be 'cpu', 'cuda' or 'cuda:N' (N the first GPU; "
        "TP rank r runs on GPU N + r)"
    )


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
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N"; TP rank r uses cuda:(N + r), N = 0 for "cuda"
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
        device_kind(self.device)
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"EngineConfig.max_model_len={self.max_model_len} must be >= 2")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"EngineConfig.num_threads={self.num_threads} must be >= 1 or None")
        if self.step_timeout_s <= 0 or self.startup_timeout_s <= 0:
            raise ConfigError("EngineConfig step_timeout_s and startup_timeout_s must be > 0")

    @property
    def is_cuda(self) -> bool:
        """Whether the engine's ranks run on CUDA devices."""
        return device_kind(self.device)[0] == "cuda"

    def rank_device(self, rank: int) -> torch.device:
        """TP rank `rank`'s device: the CPU, or the `rank`-th CUDA device from the first one
        named (`cuda` and `cuda:0` start at 0, `cuda:1` at 1)."""
        kind, first = device_kind(self.device)
        return torch.device("cpu") if kind == "cpu" else torch.device("cuda", first + rank)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The compute and KV-cache dtype."""
        return DTYPES[self.dtype]

    def to_dict(self) -> dict[str, Any]:
        """Plain fields, for msgspec messages to worker processes."""
        return asdict(self)
