"""Tier bytes per cached token of a sliding-window hybrid (gpt-oss, Gemma 3): a chunk's record
holds every block of a full-attention layer but only the blocks a sliding-window layer's window
reads at the chunk's boundary (`kvtier.offload.groups`), so those layers cost window bytes per
chunk, not chunk bytes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvtier.errors import ConfigError
from kvtier.layout import KVGeometry
from kvtier.offload.groups import SLIDING, GroupSpec

__all__ = ["tier_bytes_per_token"]


def _layer_types(config: Mapping[str, object]) -> list[str] | None:
    cfg = config.get("text_config", config)
    types = cfg.get("layer_types") if isinstance(cfg, Mapping) else None
    if isinstance(types, Sequence) and not isinstance(types, str):
        return [str(t) for t in types]
    return None


def tier_bytes_per_token(
    config: Mapping[str, object], geometry: KVGeometry, *, chunk_size: int, block_size: int
) -> int:
    """Per-rank bytes the tier stores per cached token: the geometry's bytes for a model
    without sliding-window layers (or whose window covers the chunk), less for one with them."""
    types = _layer_types(config)
    cfg = config.get("text_config", config)
    window = cfg.get("sliding_window") if isinstance(cfg, Mapping) else None
    if not types or "sliding_attention" not in types or not isinstance(window, int):
        return geometry.bytes_per_token
    if chunk_size < block_size or chunk_size % block_size:
        fit = max(1, 256 // block_size) * block_size
        raise ConfigError(
            f"--chunk-size {chunk_size} is not a whole number of --block-size {block_size} "
            f"blocks; give a multiple of {block_size}, e.g. {fit}"
        )
    blocks = chunk_size // block_size
    stored = GroupSpec(SLIDING, block_size, reach=window - 1).positions(blocks)
    total = 0
    for layer in geometry.layers:
        kind = types[layer.index] if layer.index < len(types) else "full_attention"
        share = stored / blocks if kind == "sliding_attention" else 1.0
        total += round(layer.bytes_per_token * share)
    return total
