"""KV geometry from HF configs (the registered-tensor side is tests/offload/test_pages.py)."""

from __future__ import annotations

import pytest
import torch

from kvtier.errors import LayoutError
from kvtier.layout import bytes_per_token_from_hf, dtype_bytes, normalize_dtype

# --------------------------------------------------------------------------------------------
# HF configs, written as the checkpoints ship them (KV-relevant fields plus some context).
# --------------------------------------------------------------------------------------------

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}

DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
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
    "num_nextn_predict_layers": 1,
    "torch_dtype": "bfloat16",
}

# GLM-5.2 / 5.3 (GlmMoeDsaForCausalLM): IndexShare gives a layer its own indexer on the
# schedule index_topk_freq=4, index_skip_topk_offset=3; indexer_types spells the same schedule.
GLM_INDEXER_TYPES = ["full"] * 3 + (["shared"] * 3 + ["full"]) * 18 + ["shared"] * 3
GLM_5X = {
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
    "indexer_types": GLM_INDEXER_TYPES,
    "num_nextn_predict_layers": 1,
    "moe_router_dtype": "float32",
    "max_position_embeddings": 1048576,
    "torch_dtype": "bfloat16",
}

DEEPSEEK_V32 = {
    **DEEPSEEK_V3,
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "index_head_dim": 128,
    "index_n_heads": 64,
    "index_topk": 2048,
}

BF16 = 2
FP8 = 1
INDEX_SCALE = 4  # one fp32 scale per 128 fp8 indexer elements


def test_llama31_8b_bf16_bytes_per_token_tp1_and_tp4() -> None:
    c = LLAMA_31_8B
    per_layer = 2 * c["num_key_value_heads"] * c["head_dim"] * BF16
    g1 = bytes_per_token_from_hf(c, tp_size=1, kv_dtype="bfloat16")
    assert g1.bytes_per_token == c["num_hidden_layers"] * per_layer == 131_072
    assert (g1.kind, g1.num_layers, g1.kv_heads_per_rank) == ("gqa", 32, 8)
    assert g1.replicated_across_tp is False

    g4 = bytes_per_token_from_hf(c, tp_size=4, kv_dtype="bfloat16")
    assert g4.bytes_per_token == c["num_hidden_layers"] * per_layer // 4 == 32_768
    assert g4.total_bytes_per_token == 131_072
    assert g4.kv_heads_per_rank == 2
    assert [layer.bytes_per_token for layer in g4.layers] == [1024] * 32
    assert g4.bytes_for_tokens(1000) == 32_768_000


def test_gqa_heads_replicate_when_fewer_than_tp_ranks() -> None:
    g = bytes_per_token_from_hf(LLAMA_31_8B, tp_size=16)
    assert g.kv_heads_per_rank == 1
    assert g.replicated_across_tp is True
    assert g.bytes_per_token == 32 * 2 * 1 * 128 * BF16
    with pytest.raises(LayoutError, match="num_key_value_heads 8 does not split over tp_size 3"):
        bytes_per_token_from_hf(LLAMA_31_8B, tp_size=3)
    with pytest.raises(LayoutError, match="tp_size 12 is not a multiple"):
        bytes_per_token_from_hf(LLAMA_31_8B, tp_size=12)


def test_mha_head_dim_falls_back_to_hidden_over_heads_and_auto_dtype() -> None:
    cfg = {
        "num_hidden_layers": 12,
        "hidden_size": 768,
        "num_attention_heads": 12,
        "torch_dtype": "float32",
    }
    g = bytes_per_token_from_hf(cfg, kv_dtype="auto")
    assert g.kind == "mha"
    assert g.kv_dtype == "float32"
    assert g.bytes_per_token == 12 * 2 * 12 * (768 // 12) * 4
    fp8 = bytes_per_token_from_hf(cfg, kv_dtype="fp8")
    assert fp8.bytes_per_token == g.bytes_per_token // 4


def test_deepseek_v3_mla_bf16_is_70272_per_rank_at_any_tp() -> None:
    c = DEEPSEEK_V3
    latent = (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * BF16
    for tp in (1, 4, 8):
        g = bytes_per_token_from_hf(c, tp_size=tp, kv_dtype="bfloat16")
        assert g.bytes_per_token == c["num_hidden_layers"] * latent == 61 * 576 * 2 == 70_272
        assert g.kind == "mla"
        assert g.replicated_across_tp is True
        assert g.num_layers == 61
        assert g.num_indexer_layers == 0
        assert g.total_bytes_per_token == 70_272 * tp


def test_glm_dsa_fp8_bytes_per_token_is_47700() -> None:
    c = GLM_5X
    g = bytes_per_token_from_hf(c, tp_size=4, kv_dtype="fp8")
    latent = (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * FP8
    indexer = c["index_head_dim"] * FP8 + INDEX_SCALE
    n_indexers = c["indexer_types"].count("full")
    assert (latent, indexer, n_indexers) == (576, 132, 21)
    assert g.bytes_per_token == c["num_hidden_layers"] * latent + n_indexers * indexer
    assert g.bytes_per_token == 78 * 576 + 21 * 132 == 47_700
    assert g.kind == "mla+dsa"
    assert g.num_layers == 78
    assert g.num_indexer_layers == 21
    owning = [layer.index for layer in g.layers if layer.indexer_bytes]
    assert owning == [i for i, t in enumerate(c["indexer_types"]) if t == "full"]
    assert owning[:4] == [0, 1, 2, 6] and owning[-1] == 74
    # A 28,672-token prefix is 1.2737 GiB per rank (the figure the LMCache log reports).
    assert round(g.bytes_for_tokens(28_672) / 2**30, 4) == 1.2737


def test_glm_schedule_from_freq_and_offset_alone() -> None:
    cfg = {k: v for k, v in GLM_5X.items() if k != "indexer_types"}
    assert bytes_per_token_from_hf(cfg, kv_dtype="fp8").bytes_per_token == 47_700
    types_only = {
        k: v
        for k, v in GLM_5X.items()
        if k not in ("index_topk_freq", "index_skip_topk_offset", "index_topk_pattern")
    }
    assert bytes_per_token_from_hf(types_only, kv_dtype="fp8").num_indexer_layers == 21
    pattern = {
        **cfg,
        "index_topk_pattern": "".join("F" if t == "full" else "S" for t in GLM_INDEXER_TYPES),
    }
    assert bytes_per_token_from_hf(pattern, kv_dtype="fp8").bytes_per_token == 47_700


def test_glm_mtp_layers_are_counted_only_when_asked_and_own_an_indexer() -> None:
    g = bytes_per_token_from_hf(GLM_5X, kv_dtype="fp8", include_mtp=True)
    assert g.num_layers == 78 + GLM_5X["num_nextn_predict_layers"]
    assert g.layers[-1].mtp is True and g.layers[-1].indexer_bytes == 132
    assert g.bytes_per_token == 47_700 + 576 + 132


def test_deepseek_v32_indexes_every_layer_by_default() -> None:
    g = bytes_per_token_from_hf(DEEPSEEK_V32, kv_dtype="fp8")
    assert g.kind == "mla+dsa"
    assert g.num_indexer_layers == 61
    assert g.bytes_per_token == 61 * (576 + 132)


def test_indexer_schedule_contradictions_fail() -> None:
    wrong = {**GLM_5X, "index_skip_topk_offset": 1}
    disagree = r"indexer_types disagrees .* at layer 1 \(full vs shared\)"
    with pytest.raises(LayoutError, match=disagree):
        bytes_per_token_from_hf(wrong, kv_dtype="fp8")
    no_first = {**GLM_5X, "indexer_types": None, "index_topk_pattern": "S" + "F" * 77}
    with pytest.raises(LayoutError, match="layer 0 no indexer"):
        bytes_per_token_from_hf(no_first, kv_dtype="fp8")
    short = {**GLM_5X, "indexer_types": ["full"] * 5}
    with pytest.raises(LayoutError, match=r"one 'full'/'shared' entry per layer \(78\)"):
        bytes_per_token_from_hf(short, kv_dtype="fp8")


def test_bad_configs_name_the_field() -> None:
    with pytest.raises(LayoutError, match="no 'num_hidden_layers'"):
        bytes_per_token_from_hf({"num_attention_heads": 8})
    with pytest.raises(LayoutError, match="no 'qk_rope_head_dim'"):
        bytes_per_token_from_hf({"num_hidden_layers": 2, "kv_lora_rank": 512})
    with pytest.raises(LayoutError, match=r"layer_types include \['conv'\]"):
        bytes_per_token_from_hf({**LLAMA_31_8B, "layer_types": ["conv"] * 32})
    with pytest.raises(LayoutError, match=r"kinds \['Q'\] kvtier does not know"):
        bytes_per_token_from_hf({**LLAMA_31_8B, "hybrid_override_pattern": "M*Q-"})
    with pytest.raises(LayoutError, match="dtype 'half7'"):
        bytes_per_token_from_hf(LLAMA_31_8B, kv_dtype="half7")
    with pytest.raises(LayoutError, match="kv_dtype 'auto' needs"):
        bytes_per_token_from_hf(
            {k: v for k, v in LLAMA_31_8B.items() if k != "torch_dtype"}, kv_dtype="auto"
        )


def test_text_config_is_read_from_multimodal_configs() -> None:
    wrapped = {"architectures": ["LlavaForConditionalGeneration"], "text_config": LLAMA_31_8B}
    assert bytes_per_token_from_hf(wrapped).bytes_per_token == 131_072


def test_normalize_dtype_and_its_sizes() -> None:
    assert normalize_dtype(torch.bfloat16) == normalize_dtype("bf16") == "bfloat16"
    assert normalize_dtype("torch.float16") == "float16"
    assert normalize_dtype("fp8") == "float8_e4m3fn"
    assert dtype_bytes("fp8") == 1 and dtype_bytes(torch.float32) == 4
    with pytest.raises(LayoutError, match="not a torch dtype"):
        normalize_dtype("float9")


def test_state_hybrids_size_their_attention_layers_per_token_and_their_states_per_boundary():
    from kvtier.plan.presets import preset

    # Qwen3-Next-80B: 12 of 48 layers full attention, 36 gated delta nets
    g = bytes_per_token_from_hf(preset("qwen3-next-80b"), kv_dtype="auto")
    assert (g.kind, g.num_layers, g.state_layers) == ("gqa+gdn", 12, 36)
    assert g.bytes_per_token == 12 * 2 * 2 * 256 * 2
    # per layer: conv (2*16*128 + 32*128) x 3 in bf16, recurrent 32 x 128 x 128 in float32
    assert g.state_bytes == 36 * (8192 * 3 * 2 + 32 * 128 * 128 * 4)
    # TP=4 shards both the KV heads and the state
    g4 = bytes_per_token_from_hf(preset("qwen3-next-80b"), tp_size=4, kv_dtype="auto")
    assert (g4.bytes_per_token, g4.state_bytes) == (g.bytes_per_token // 2, g.state_bytes // 4)
    # Nemotron-H-shaped: its pattern's M layers are Mamba2, * attention, - MLP
    nemo = {**LLAMA_31_8B, "num_hidden_layers": 4, "hybrid_override_pattern": "M*M-",
            "mamba_num_heads": 8, "mamba_head_dim": 32, "ssm_state_size": 16, "n_groups": 1,
            "conv_kernel": 4}  # fmt: skip
    g = bytes_per_token_from_hf(nemo, kv_dtype="bfloat16")
    assert (g.kind, g.num_layers, g.state_layers) == ("gqa+mamba2", 1, 2)
    assert g.state_bytes == 2 * ((256 + 32) * 3 + 8 * 32 * 16) * 2
