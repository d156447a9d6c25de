"""A Llama/Qwen2-family decoder over a paged KV cache, optionally sharded over TP ranks.

Module and parameter names mirror Hugging Face's (`model.layers.{i}.self_attn.q_proj.weight`...)
so the loader copies checkpoint tensors by name. Attention heads are split over ranks (q/k/v
column-parallel, o_proj and down_proj row-parallel with an all-reduce); embeddings and lm_head
are replicated. The KV cache of one layer is `[num_blocks, 2, block_size, kv_heads, head_dim]`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.errors import ConfigError

AllReduce = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ModelConfig:
    """The architecture fields of an HF `config.json` that the forward needs."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)


@dataclass
class SeqAttention:
    """One sequence's slice of the step: its queries and the keys it attends to."""

    q_start: int  # first row of this sequence in the step's flattened tokens
    q_len: int
    ctx_len: int  # keys visible to the last query (= computed before the step + q_len)
    block_table: torch.Tensor  # long, ceil(ctx_len / block_size) block ids


@dataclass
class AttentionMetadata:
    """Where the step's new K/V go (slot = block * block_size + offset) and what each row sees."""

    slot_mapping: torch.Tensor  # long [T]
    seqs: list[SeqAttention]
    block_size: int


def _tp_split(n: int, tp_size: int, what: str) -> int:
    if n % tp_size:
        raise ConfigError(
            f"{what}={n} is not divisible by tensor_parallel_size={tp_size}; "
            f"pick a tensor_parallel_size that divides {n}"
        )
    return n // tp_size


def _row_parallel(linear: nn.Linear, x: torch.Tensor, all_reduce: AllReduce | None) -> torch.Tensor:
    # each rank holds a slice of the input features: sum the partial products, then add the
    # bias once
    y = F.linear(x, linear.weight)
    if all_reduce is not None:
        y = all_reduce(y)
    return y if linear.bias is None else y + linear.bias


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as HF's LlamaRMSNorm."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies for rotary embeddings; supports no scaling, `linear` and `llama3`."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv.float()
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv.float()
    if kind == "linear":
        return (inv / float(scaling["factor"])).float()
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = old_len / low, old_len / high
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * inv / factor + smooth * inv
        out = torch.where(wavelen > low_wl, inv / factor, inv)
        is_mid = (wavelen <= low_wl) & (wavelen >= high_wl)
        return torch.where(is_mid, mid, out).float()
    raise ConfigError(
        f"rope_scaling type {kind!r} is not supported; supported: none, 'linear', 'llama3'"
    )


class Rotary(nn.Module):
    """Precomputed cos/sin tables, applied HF-style (rotate_half over the two halves)."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None):
        super().__init__()
        inv = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1)

        def rot(x: torch.Tensor) -> torch.Tensor:
            xf = x.float()
            x1, x2 = xf.chunk(2, dim=-1)
            return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)

        return rot(q), rot(k)


class Attention(nn.Module):
    """GQA self-attention over this rank's heads, reading and writing the paged KV cache."""

    def __init__(self, cfg: ModelConfig, tp_size: int, all_reduce: AllReduce | None) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.num_heads = _tp_split(cfg.num_heads, tp_size, "num_attention_heads")
        self.num_kv_heads = _tp_split(cfg.num_kv_heads, tp_size, "num_key_value_heads")
        hd = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * hd, bias=cfg.qkv_bias)
        # o_proj is row-parallel: its bias is added once, after the all-reduce
        self.o_proj = nn.Linear(self.num_heads * hd, cfg.hidden_size, bias=cfg.o_bias)
        self.all_reduce = all_reduce
        self.scale = hd**-0.5

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: Rotary,
        cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        bs = meta.block_size
        blk = meta.slot_mapping // bs
        off = meta.slot_mapping % bs
        cache[blk, 0, off] = k.to(cache.dtype)
        cache[blk, 1, off] = v.to(cache.dtype)
        out = torch.empty_like(q)
        for s in meta.seqs:
            # gathering [nb, bs, H, D] pages gives contiguous rows: the view below is free
            keys = cache[s.block_table, 0].view(-1, self.num_kv_heads, self.head_dim)[: s.ctx_len]
            vals = cache[s.block_table, 1].view(-1, self.num_kv_heads, self.head_dim)[: s.ctx_len]
            qs = q[s.q_start : s.q_start + s.q_len].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            mask = None
            if s.q_len > 1:
                # query i sits at position ctx_len - q_len + i and sees every key up to it
                first = s.ctx_len - s.q_len
                rows = torch.arange(s.q_len, device=q.device).unsqueeze(1) + first
                mask = torch.arange(s.ctx_len, device=q.device).unsqueeze(0) <= rows
            # 4-D inputs take SDPA's fused CPU kernel; 3-D ones fall back to a slow path
            o = F.scaled_dot_product_attention(
                qs,
                keys.transpose(0, 1).unsqueeze(0).to(q.dtype),
                vals.transpose(0, 1).unsqueeze(0).to(q.dtype),
                attn_mask=mask,
                scale=self.scale,
                enable_gqa=True,
            )
            o = o.squeeze(0)
            out[s.q_start : s.q_start + s.q_len] = o.transpose(0, 1)
        return _row_parallel(self.o_proj, out.view(t, -1), self.all_reduce)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), intermediate dim split over ranks."""

    def __init__(self, cfg: ModelConfig, tp_size: int, all_reduce: AllReduce | None) -> None:
        super().__init__()
        inter = _tp_split(cfg.intermediate_size, tp_size, "intermediate_size")
        self.gate_proj = nn.Linear(cfg.hidden_size, inter, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, inter, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=cfg.mlp_bias)
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.gate_proj(x)) * self.up_proj(x)
        return _row_parallel(self.down_proj, h, self.all_reduce)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residuals."""

    def __init__(self, cfg: ModelConfig, tp_size: int, all_reduce: AllReduce | None) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, tp_size, all_reduce)
        self.mlp = MLP(cfg, tp_size, all_reduce)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: Rotary,
        cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """One layer over all tokens of the step."""
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    """Embedding, decoder layers and final norm (HF's `model.` prefix)."""

    def __init__(self, cfg: ModelConfig, tp_size: int, all_reduce: AllReduce | None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, tp_size, all_reduce) for _ in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The whole decoder: `forward` gives pre-norm hidden states, `compute_logits` the logits."""

    def __init__(
        self, cfg: ModelConfig, tp_size: int = 1, all_reduce: AllReduce | None = None
    ) -> None:
        super().__init__()
        self.config = cfg
        self.tp_size = tp_size
        self.num_kv_heads = _tp_split(cfg.num_kv_heads, tp_size, "num_key_value_heads")
        self.model = LlamaBody(cfg, tp_size, all_reduce if tp_size > 1 else None)
        self.rotary = Rotary(cfg.head_dim, cfg.max_position, cfg.rope_theta, cfg.rope_scaling)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        before_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Run all layers over the step's tokens; writes their K/V into the cache.
        `before_layer(i)` runs before layer i reads its cache (a layer-by-layer load)."""
        x = self.model.embed_tokens(input_ids)
        for i, (layer, cache) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            if before_layer is not None:
                before_layer(i)
            x = layer(x, positions, self.rotary, cache, meta)
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and lm_head on the given rows; float32 logits `[n, vocab]`."""
        h = self.model.norm(hidden)
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(h, weight).float()
