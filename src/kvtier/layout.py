"""KV geometry from HF model configs: per-rank bytes per token (MHA/GQA, MLA, MLA + DSA
indexer) to size tiers before any engine exists. A running engine's geometry comes from its
registered tensors instead (`kvtier.offload.pages`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvtier.errors import LayoutError

# Short names people write in configs; anything else must be a torch dtype attribute name.
_DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp32": "float32",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


def normalize_dtype(dtype: str | torch.dtype) -> str:
    """Canonical torch dtype name ("bfloat16", "float8_e4m3fn", ...) for a name, alias or dtype."""
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    if not isinstance(dtype, str) or not dtype:
        raise LayoutError(f"dtype {dtype!r} is not a torch dtype or a dtype name like 'bfloat16'")
    name = dtype.strip().lower().removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    resolved = getattr(torch, name, None)
    if not isinstance(resolved, torch.dtype):
        raise LayoutError(
            f"dtype {dtype!r} is not a torch dtype; use a name like 'bfloat16', 'float16', "
            f"'float8_e4m3fn' or an alias among {sorted(_DTYPE_ALIASES)}"
        )
    return str(resolved).removeprefix("torch.")


def dtype_bytes(dtype: str | torch.dtype) -> int:
    """Bytes per element of `dtype` (fp8 = 1, bfloat16 = 2, ...)."""
    return getattr(torch, normalize_dtype(dtype)).itemsize


# --------------------------------------------------------------------------------------------
# Geometry from an HF-style model config
# --------------------------------------------------------------------------------------------

# The fp8 indexer key cache carries one fp32 scale per this many elements (vLLM's layout).
_INDEX_QUANT_BLOCK = 128
_INDEX_SCALE_BYTES = 4


@dataclass(frozen=True, slots=True)
class LayerGeometry:
    """Bytes per token per rank of one layer: its KV and, for DSA, its indexer key cache."""

    index: int
    kv_bytes: int
    indexer_bytes: int = 0
    mtp: bool = False

    @property
    def bytes_per_token(self) -> int:
        """KV plus indexer bytes per token per rank."""
        return self.kv_bytes + self.indexer_bytes


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """Per-rank KV bytes per token of a model, from its HF config, with the per-layer breakdown.

    `replicated_across_tp` is True when ranks hold copies of the same KV rather than disjoint
    shards: always for MLA, and for GQA when there are fewer KV heads than TP ranks.
    """

    kind: str
    num_layers: int
    tp_size: int
    kv_dtype: str
    bytes_per_token: int
    layers: tuple[LayerGeometry, ...]
    replicated_across_tp: bool
    kv_heads_per_rank: int | None = None
    num_indexer_layers: int = 0
    # a hybrid's state layers (gated delta net, Mamba2) and the bytes of one boundary's state
    # over all of them on one rank: kept per stored boundary, not per token
    state_layers: int = 0
    state_bytes: int = 0

    @property
    def total_bytes_per_token(self) -> int:
        """Bytes per token summed over every TP rank of one replica (copies included)."""
        return self.bytes_per_token * self.tp_size

    def bytes_for_tokens(self, n_tokens: int) -> int:
        """Per-rank bytes for `n_tokens` tokens."""
        return self.bytes_per_token * n_tokens


def bytes_per_token_from_hf(
    config: Mapping[str, object],
    tp_size: int = 1,
    kv_dtype: str = "bfloat16",
    index_dtype: str = "fp8",
    include_mtp: bool = False,
) -> KVGeometry:
    """Per-rank KV bytes per token for an HF config dict (MHA/GQA, MLA, MLA+DSA).

    `kv_dtype="auto"` takes the config's `torch_dtype`. MTP/nextn layers are left out unless
    `include_mtp`, matching what an engine registers without speculative decoding.
    """
    cfg = _text_config(config)
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise LayoutError(f"tp_size {tp_size!r} must be an integer >= 1")
    kv_name = _resolve_kv_dtype(cfg, kv_dtype)
    elem = dtype_bytes(kv_name)
    num_layers = _int_field(cfg, "num_hidden_layers")
    attention, n_states, mixer = cache_layers(cfg, num_layers)
    n_mtp = _int_field(cfg, "num_nextn_predict_layers", default=0) if include_mtp else 0

    if cfg.get("kv_lora_rank") is not None:
        kv_bytes = (_int_field(cfg, "kv_lora_rank") + _int_field(cfg, "qk_rope_head_dim")) * elem
        has_dsa = cfg.get("index_head_dim") is not None or "index_topk" in cfg
        owns_indexer = _indexer_layers(cfg, num_layers) if has_dsa else [False] * num_layers
        idx_bytes = _indexer_bytes(cfg, index_dtype) if has_dsa else 0
        # MTP layers always build their own indexer (they sit outside the sharing schedule).
        owns_indexer += [has_dsa] * n_mtp
        layers = tuple(
            LayerGeometry(i, kv_bytes, idx_bytes if owns else 0, i >= num_layers)
            for i, owns in enumerate(owns_indexer)
        )
        return KVGeometry(
            kind="mla+dsa" if has_dsa else "mla",
            num_layers=len(layers),
            tp_size=tp_size,
            kv_dtype=kv_name,
            bytes_per_token=sum(layer.bytes_per_token for layer in layers),
            layers=layers,
            replicated_across_tp=True,
            num_indexer_layers=sum(owns_indexer),
        )

    if cfg.get("index_head_dim") is not None:
        raise LayoutError(
            "config has index_head_dim but no kv_lora_rank: a sparse-indexer model without MLA is "
            "not sized from its config; derive the layout from the registered tensors instead"
        )
    n_heads = _int_field(cfg, "num_attention_heads")
    n_kv = _int_field(cfg, "num_key_value_heads", default=n_heads)
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        head_dim = _int_field(cfg, "hidden_size") // n_heads
    else:
        head_dim = _int_field(cfg, "head_dim")
    heads_per_rank = _kv_heads_per_rank(n_kv, tp_size)
    kv_bytes = 2 * heads_per_rank * head_dim * elem
    mtp = range(num_layers, num_layers + n_mtp)
    layers = tuple(LayerGeometry(i, kv_bytes, 0, i >= num_layers) for i in [*attention, *mtp])
    kind = "mha" if n_kv == n_heads else "gqa"
    return KVGeometry(
        kind=f"{kind}+{mixer}" if n_states else kind,
        num_layers=len(layers),
        tp_size=tp_size,
        kv_dtype=kv_name,
        bytes_per_token=kv_bytes * len(layers),
        layers=layers,
        replicated_across_tp=tp_size > 1 and n_kv < tp_size,
        kv_heads_per_rank=heads_per_rank,
        state_layers=n_states,
        state_bytes=n_states * state_bytes_per_rank(cfg, mixer, tp_size, elem) if n_states else 0,
    )


def _text_config(config: Mapping[str, object]) -> Mapping[str, object]:
    """The language-model part of a config (multimodal configs nest it under text_config)."""
    if not isinstance(config, Mapping):
        raise LayoutError(f"config is a {type(config).__name__}, not a mapping of HF fields")
    text = config.get("text_config")
    if "num_hidden_layers" not in config and isinstance(text, Mapping):
        return text
    return config


def _int_field(cfg: Mapping[str, object], key: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise LayoutError(f"config has no {key!r}; the KV geometry needs it")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise LayoutError(f"config field {key!r} = {value!r} is not a non-negative integer")
    return value


def _resolve_kv_dtype(cfg: Mapping[str, object], kv_dtype: str) -> str:
    if kv_dtype == "auto":
        model_dtype = cfg.get("torch_dtype", cfg.get("dtype"))
        if not isinstance(model_dtype, str):
            raise LayoutError(
                "kv_dtype 'auto' needs the config's torch_dtype, which is missing; "
                "pass kv_dtype explicitly, e.g. 'bfloat16' or 'fp8'"
            )
        return normalize_dtype(model_dtype)
    return normalize_dtype(kv_dtype)


_ATTENTION_TYPES = {"full_attention", "sliding_attention"}
# Nemotron-H's hybrid_override_pattern: M a Mamba2 layer, * attention, - an MLP, E an MoE
_PATTERN_KINDS = {"M": "mamba2", "*": "attention", "-": "mlp", "E": "moe"}


def cache_layers(cfg: Mapping[str, object], num_layers: int) -> tuple[list[int], int, str]:
    """(attention layer indices, state layer count, state mixer) of a config: every layer is
    attention for a plain model; a hybrid's linear-attention (gated delta net) or Mamba2 layers
    keep one state per sequence instead of paged KV. LayoutError names a kind it cannot size."""
    types = cfg.get("layer_types")
    pattern = cfg.get("hybrid_override_pattern")
    interval = cfg.get("full_attention_interval")
    if types is None and isinstance(interval, int) and interval > 0:
        # Qwen3-Next ships the interval; its config class derives layer_types from it
        types = ["linear_attention" if (i + 1) % interval else "full_attention"
                 for i in range(num_layers)]  # fmt: skip
    if isinstance(types, Sequence) and not isinstance(types, str):
        kinds = [str(t) for t in types]
        odd = sorted(set(kinds) - _ATTENTION_TYPES - {"linear_attention"})
        if odd:
            raise LayoutError(
                f"config layer_types include {odd}: kvtier sizes attention, sliding-window and "
                "linear-attention (gated delta net) layers from a config; derive this model's "
                "layout from the registered tensors instead"
            )
        attention = [i for i, k in enumerate(kinds) if k in _ATTENTION_TYPES]
        return attention, len(kinds) - len(attention), "gdn" if "linear_attention" in kinds else ""
    if isinstance(pattern, str) and pattern:
        odd = sorted(set(pattern) - set(_PATTERN_KINDS))
        if odd:
            raise LayoutError(
                f"config hybrid_override_pattern {pattern!r} has layer kinds {odd} kvtier does not "
                f"know (it knows {sorted(_PATTERN_KINDS)})"
            )
        attention = [i for i, k in enumerate(pattern) if k == "*"]
        return attention, pattern.count("M"), "mamba2" if "M" in pattern else ""
    return list(range(num_layers)), 0, ""


def state_bytes_per_rank(cfg: Mapping[str, object], mixer: str, tp_size: int, elem: int) -> int:
    """Bytes of one state layer's state on one rank, as vLLM keeps it: a gated delta net's conv
    state in the model dtype and its recurrent state in float32 (vLLM's default), a Mamba2
    layer's both in the model dtype."""
    if mixer == "gdn":
        k_heads = _int_field(cfg, "linear_num_key_heads")
        v_heads = _int_field(cfg, "linear_num_value_heads")
        k_dim = _int_field(cfg, "linear_key_head_dim")
        v_dim = _int_field(cfg, "linear_value_head_dim")
        conv_dim = 2 * k_heads * k_dim + v_heads * v_dim
        width = _int_field(cfg, "linear_conv_kernel_dim") - 1
        return conv_dim // tp_size * width * elem + v_heads // tp_size * k_dim * v_dim * 4
    heads, head_dim = _int_field(cfg, "mamba_num_heads"), _int_field(cfg, "mamba_head_dim")
    state, groups = _int_field(cfg, "ssm_state_size"), _int_field(cfg, "n_groups", default=1)
    conv_dim = heads * head_dim + 2 * groups * state
    width = _int_field(cfg, "conv_kernel") - 1
    return (conv_dim // tp_size * width + heads // tp_size * head_dim * state) * elem


def _kv_heads_per_rank(n_kv: int, tp_size: int) -> int:
    if n_kv == 0:
        raise LayoutError("config num_key_value_heads is 0; a KV cache needs at least one head")
    if n_kv >= tp_size:
        if n_kv % tp_size:
            raise LayoutError(
                f"num_key_value_heads {n_kv} does not split over tp_size {tp_size}; "
                f"use a tp_size that divides {n_kv}"
            )
        return n_kv // tp_size
    if tp_size % n_kv:
        raise LayoutError(
            f"tp_size {tp_size} is not a multiple of num_key_value_heads {n_kv}, so heads cannot "
            f"be replicated evenly; use a tp_size that is a multiple of {n_kv}"
        )
    return 1


def _indexer_bytes(cfg: Mapping[str, object], index_dtype: str) -> int:
    """Bytes per token of one layer's indexer key cache (fp8 keys + fp32 block scales)."""
    dim = _int_field(cfg, "index_head_dim")
    name = normalize_dtype(index_dtype)
    if name.startswith("float8"):
        return dim + _INDEX_SCALE_BYTES * -(-dim // _INDEX_QUANT_BLOCK)
    return dim * dtype_bytes(name)


def _indexer_layers(cfg: Mapping[str, object], num_layers: int) -> list[bool]:
    """Which of the `num_layers` main layers own an indexer (IndexShare reuses the rest).

    Follows vLLM: `index_topk_pattern` ("F"/"S" per layer) when given, else a layer skips its
    indexer iff max(i - index_skip_topk_offset + 1, 0) % index_topk_freq != 0 (defaults 1, 2).
    An `indexer_types` list is used alone when no schedule field is set, else must agree with it.
    """
    types = cfg.get("indexer_types")
    declared = _declared_indexers(types, num_layers) if types is not None else None
    scheduled = any(
        cfg.get(k) is not None
        for k in ("index_topk_pattern", "index_topk_freq", "index_skip_topk_offset")
    )
    pattern = cfg.get("index_topk_pattern")
    if declared is not None and not scheduled:
        owns = declared
    elif pattern is not None:
        if not isinstance(pattern, str) or set(pattern.upper()) - {"F", "S"}:
            raise LayoutError(f"index_topk_pattern {pattern!r} must be a string of 'F'/'S'")
        # vLLM treats layers beyond the pattern as owning an indexer.
        owns = [i >= len(pattern) or pattern[i].upper() != "S" for i in range(num_layers)]
    else:
        freq = _int_field(cfg, "index_topk_freq", default=1)
        offset = _int_field(cfg, "index_skip_topk_offset", default=2)
        if freq < 1:
            raise LayoutError(f"index_topk_freq {freq} must be >= 1")
        owns = [max(i - offset + 1, 0) % freq == 0 for i in range(num_layers)]

    if declared is not None and declared != owns:
        i = next(i for i in range(num_layers) if declared[i] != owns[i])
        raise LayoutError(
            f"indexer_types disagrees with the index_topk schedule at layer {i} "
            f"({'full' if declared[i] else 'shared'} vs {'full' if owns[i] else 'shared'}); "
            "fix the config so both describe the same layers"
        )
    if num_layers and not owns[0]:
        raise LayoutError(
            "the indexer schedule gives layer 0 no indexer, but it has no earlier layer to share "
            "from; check index_topk_pattern / index_skip_topk_offset"
        )
    return owns


def _declared_indexers(types: object, num_layers: int) -> list[bool]:
    """An `indexer_types` list ("full"/"shared" per layer) as owns-an-indexer flags."""
    if not isinstance(types, Sequence) or isinstance(types, str) or len(types) != num_layers:
        raise LayoutError(
            f"indexer_types must list one 'full'/'shared' entry per layer ({num_layers})"
        )
    for i, t in enumerate(types):
        if t not in ("full", "shared"):
            raise LayoutError(f"indexer_types[{i}] = {t!r} is not 'full' or 'shared'")
    return [t == "full" for t in types]
