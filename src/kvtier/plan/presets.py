"""Named model presets for `kvtier plan`: HF `config.json` contents, as the checkpoints ship them.

Only fields are stored, never byte counts: the planner derives every size from these fields
through `kvtier.layout.bytes_per_token_from_hf`, exactly as it does for a config file on disk.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from kvtier.errors import ConfigError

_LLAMA_31_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}

_LLAMA_31_70B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}

_QWEN25_7B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "use_sliding_window": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 152064,
}

_DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "first_k_dense_replace": 3,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "num_nextn_predict_layers": 1,
    "max_position_embeddings": 163840,
    "torch_dtype": "bfloat16",
    "vocab_size": 129280,
}

# GLM-5.x (GlmMoeDsaForCausalLM): MLA plus a DSA indexer that IndexShare gives to one layer in
# four (index_topk_freq=4 from index_skip_topk_offset=3); indexer_types spells the same schedule.
_GLM_INDEXER_TYPES = ["full"] * 3 + (["shared"] * 3 + ["full"]) * 18 + ["shared"] * 3
_GLM_5_DSA: dict[str, Any] = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "hidden_size": 6144,
    "num_hidden_layers": 78,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "head_dim": 192,
    "kv_lora_rank": 512,
    "q_lora_rank": 2048,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "first_k_dense_replace": 3,
    "index_head_dim": 128,
    "index_n_heads": 32,
    "index_topk": 2048,
    "index_topk_freq": 4,
    "index_skip_topk_offset": 3,
    "index_topk_pattern": None,
    "index_share_for_mtp_iteration": True,
    "indexer_types": _GLM_INDEXER_TYPES,
    "num_nextn_predict_layers": 1,
    "moe_router_dtype": "float32",
    "max_position_embeddings": 1048576,
    "torch_dtype": "bfloat16",
}

# every 4th layer full attention, the rest gated delta nets (one state per sequence)
_QWEN3_NEXT_80B: dict[str, Any] = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "max_position_embeddings": 262144,
    "torch_dtype": "bfloat16",
}

PRESETS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        "llama-3.1-8b": _LLAMA_31_8B,
        "llama-3.1-70b": _LLAMA_31_70B,
        "qwen2.5-7b": _QWEN25_7B,
        "deepseek-v3": _DEEPSEEK_V3,
        "glm-5-dsa": _GLM_5_DSA,
        "qwen3-next-80b": _QWEN3_NEXT_80B,
    }
)


def preset_names() -> list[str]:
    """The preset names, in a stable order."""
    return list(PRESETS)


def is_preset(name: str) -> bool:
    """Whether `name` (any case) names a preset."""
    return name.strip().lower() in PRESETS


def preset(name: str) -> dict[str, Any]:
    """A fresh copy of the HF config of preset `name` (any case); ConfigError lists the presets."""
    key = name.strip().lower()
    if key not in PRESETS:
        raise ConfigError(
            f"--model {name!r} is not a preset; use one of {', '.join(PRESETS)} "
            "or the path of a model's config.json"
        )
    return copy.deepcopy(dict(PRESETS[key]))
