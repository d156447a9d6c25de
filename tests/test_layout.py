"""KV geometry from registered tensors and from HF configs (invariant 4: whole chunks)."""

from __future__ import annotations

import pytest
import torch

from kvtier.errors import LayoutError
from kvtier.layout import (
    FoldRule,
    KVLayout,
    TensorSpec,
    bytes_per_token_from_hf,
    dtype_bytes,
    from_tensors,
    normalize_dtype,
)

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
    with pytest.raises(LayoutError, match="hybrid models"):
        bytes_per_token_from_hf({**LLAMA_31_8B, "layer_types": ["linear_attention"] * 32})
    with pytest.raises(LayoutError, match="dtype 'half7'"):
        bytes_per_token_from_hf(LLAMA_31_8B, kv_dtype="half7")
    with pytest.raises(LayoutError, match="kv_dtype 'auto' needs"):
        bytes_per_token_from_hf(
            {k: v for k, v in LLAMA_31_8B.items() if k != "torch_dtype"}, kv_dtype="auto"
        )


def test_text_config_is_read_from_multimodal_configs() -> None:
    wrapped = {"architectures": ["LlavaForConditionalGeneration"], "text_config": LLAMA_31_8B}
    assert bytes_per_token_from_hf(wrapped).bytes_per_token == 131_072


# --------------------------------------------------------------------------------------------
# Layout from registered tensors
# --------------------------------------------------------------------------------------------

NB = 100
BS = 64


def glm_registration(
    n_layers: int, indexer_layers: set[int], nb: int = NB
) -> dict[str, TensorSpec]:
    """vLLM-style registration: one MLA cache per layer, an indexer cache on some layers."""
    specs: dict[str, TensorSpec] = {}
    for i in range(n_layers):
        p = f"model.layers.{i}.self_attn"
        specs[f"{p}.attn"] = TensorSpec((nb, BS, 576), torch.uint8)
        if i in indexer_layers:
            specs[f"{p}.indexer.k_cache"] = TensorSpec((nb, BS, 132), torch.uint8)
    return specs


def test_indexer_folds_onto_attn_and_layer_count_excludes_it() -> None:
    specs = glm_registration(6, {0, 4})
    assert len(specs) == 8
    layout = from_tensors(specs, block_size=BS)
    assert layout.num_layers == 6
    assert [layer.name for layer in layout.layers] == [
        f"model.layers.{i}.self_attn.attn" for i in range(6)
    ]
    assert [s.name for s in layout.layers[4].segments] == [
        "model.layers.4.self_attn.attn",
        "model.layers.4.self_attn.indexer.k_cache",
    ]
    assert len(layout.layers[3].segments) == 1
    assert layout.bytes_per_block == 6 * BS * 576 + 2 * BS * 132
    assert layout.bytes_per_token == 6 * 576 + 2 * 132
    assert layout.num_blocks == NB
    assert layout.dtype == "uint8"


def test_full_glm_registration_matches_the_config_geometry() -> None:
    owners = {i for i, t in enumerate(GLM_INDEXER_TYPES) if t == "full"}
    layout = from_tensors(glm_registration(78, owners), block_size=BS)
    geometry = bytes_per_token_from_hf(GLM_5X, tp_size=4, kv_dtype="fp8")
    assert layout.num_layers == 78
    assert sum(len(layer.segments) for layer in layout.layers) == 99
    assert layout.bytes_per_block == BS * geometry.bytes_per_token == BS * 47_700
    assert layout.bytes_per_token == 47_700
    census = layout.census()
    assert "78 layers" in census[0]
    assert "kvtier layout:   78 x tail_shape=(64, 576) dtype=uint8" in census
    assert "kvtier layout:   21 x tail_shape=(64, 132) dtype=uint8" in census


def test_orphan_indexer_is_an_error() -> None:
    specs = glm_registration(2, {1})
    del specs["model.layers.1.self_attn.attn"]
    with pytest.raises(LayoutError, match=r"'model\.layers\.1\.self_attn\.indexer\.k_cache' folds"):
        from_tensors(specs, block_size=BS)


def test_minimax_style_index_cache_folds_onto_its_prefix() -> None:
    specs = {
        "model.layers.0.self_attn": TensorSpec((NB, 2, BS, 1, 128), "bfloat16"),
        "model.layers.0.self_attn.index_cache": TensorSpec((NB, BS, 128), "fp8"),
        "model.layers.1.self_attn": TensorSpec((NB, 2, BS, 1, 128), "bfloat16"),
    }
    layout = from_tensors(specs, block_size=BS)
    assert layout.num_layers == 2
    assert layout.layers[0].bytes_per_block == 2 * BS * 128 * 2 + BS * 128
    assert layout.dtype == "bfloat16"


def test_custom_fold_rule_groups_native_k_and_v() -> None:
    rule = FoldRule(r"layers\.(\d+)\.(k|v)_cache", r"layers.\1", requires_owner=False)
    specs = {
        "layers.0.k_cache": TensorSpec((2, NB, 8, BS, 16), torch.bfloat16, block_dim=1),
        "layers.0.v_cache": TensorSpec((2, NB, 8, BS, 16), torch.bfloat16, block_dim=1),
        "layers.1.k_cache": TensorSpec((2, NB, 8, BS, 16), torch.bfloat16, block_dim=1),
        "layers.1.v_cache": TensorSpec((2, NB, 8, BS, 16), torch.bfloat16, block_dim=1),
    }
    layout = from_tensors(specs, block_size=BS, fold_rules=[rule])
    assert [layer.name for layer in layout.layers] == ["layers.0", "layers.1"]
    assert [s.name for s in layout.layers[1].segments] == ["layers.1.k_cache", "layers.1.v_cache"]
    assert layout.layers[0].segments[0].block_shape == (2, 8, BS, 16)
    assert layout.bytes_per_block == 4 * 2 * 8 * BS * 16 * 2
    assert layout.bytes_per_token == 4 * 2 * 8 * 16 * 2


def test_fingerprint_ignores_num_blocks() -> None:
    a = from_tensors(glm_registration(4, {0}, nb=100), block_size=BS)
    b = from_tensors(glm_registration(4, {0}, nb=7000), block_size=BS)
    assert (a.num_blocks, b.num_blocks) == (100, 7000)
    assert a.fingerprint == b.fingerprint
    assert len(a.fingerprint) == 16
    assert a.fingerprint_hex == a.fingerprint.hex()


def _fp(specs: dict[str, TensorSpec], block_size: int = BS) -> bytes:
    return from_tensors(specs, block_size=block_size).fingerprint


def test_fingerprint_changes_with_dtype_shape_block_size_names_and_block_dim() -> None:
    base = {
        "l0": TensorSpec((NB, BS, 576), "bfloat16"),
        "l1": TensorSpec((NB, BS, 576), "bfloat16"),
    }
    fps = {
        _fp(base),
        _fp({**base, "l1": TensorSpec((NB, BS, 576), "float8_e4m3fn")}),
        _fp({**base, "l1": TensorSpec((NB, BS, 512), "bfloat16")}),
        _fp({**base, "l1": TensorSpec((NB, 576, BS), "bfloat16")}),
        _fp({"l0": base["l0"], "l2": base["l1"]}),
        _fp({"l1": base["l1"], "l0": base["l0"]}),
        _fp({"l0": TensorSpec((NB, BS, 576), "bfloat16")}),
        _fp(base, block_size=32),
        _fp({k: TensorSpec((BS, NB, 576), "bfloat16", block_dim=1) for k in base}),
    }
    assert len(fps) == 9


def test_known_answer_layout_fingerprint_is_pinned() -> None:
    # Computed once; a change here orphans every stored record of every deployment.
    layout = from_tensors({"l0": TensorSpec((NB, BS, 576), "bfloat16")}, block_size=BS)
    assert layout.fingerprint_hex == "4d29a192e021918b8c8573d59138974a"


def test_mismatched_block_counts_name_both_tensors() -> None:
    specs = glm_registration(2, {1})
    specs["model.layers.1.self_attn.indexer.k_cache"] = TensorSpec((NB // 2, BS, 132), "uint8")
    with pytest.raises(LayoutError, match="do not share a block count") as err:
        from_tensors(specs, block_size=BS)
    msg = str(err.value)
    assert "'model.layers.0.self_attn.attn' has 100 blocks" in msg
    assert "'model.layers.1.self_attn.indexer.k_cache' has 50" in msg


def test_chunk_check_names_both_values_and_the_fix() -> None:
    layout = from_tensors({"l0": TensorSpec((NB, 128, 576), "bfloat16")}, block_size=128)
    with pytest.raises(LayoutError) as err:
        layout.check_chunk(200)
    assert str(err.value) == (
        "chunk_size 200 is not a multiple of block_size 128: "
        "set chunk_size to a multiple of 128, such as 256"
    )
    with pytest.raises(LayoutError, match="such as 128"):
        layout.check_chunk(100)
    with pytest.raises(LayoutError, match="chunk_size 0 must be a positive multiple"):
        layout.check_chunk(0)
    layout.check_chunk(512)
    assert layout.chunk_bytes(512) == 4 * 128 * 576 * 2


def test_tensor_spec_normalises_dtypes_and_validates() -> None:
    assert TensorSpec((4, 2), torch.bfloat16) == TensorSpec((4, 2), "bf16")
    assert TensorSpec((4, 2), "torch.float16").dtype == "float16"
    assert normalize_dtype("fp8") == "float8_e4m3fn"
    assert dtype_bytes("fp8") == 1 and dtype_bytes(torch.float32) == 4
    spec = TensorSpec.of(torch.zeros(3, 5, 7, dtype=torch.float16), block_dim=-1)
    assert (spec.block_dim, spec.num_blocks, spec.bytes_per_block) == (2, 7, 3 * 5 * 2)
    with pytest.raises(LayoutError, match="block_dim 3 is outside"):
        TensorSpec((4, 2, 2), "uint8", block_dim=3)
    with pytest.raises(LayoutError, match="not a torch dtype"):
        TensorSpec((4,), "float9")


def test_from_tensors_rejects_empty_input_and_bad_block_size() -> None:
    with pytest.raises(LayoutError, match="no KV tensors"):
        from_tensors({}, block_size=BS)
    with pytest.raises(LayoutError, match="block_size 0"):
        from_tensors(glm_registration(1, set()), block_size=0)
    with pytest.raises(LayoutError, match="0 bytes per block"):
        from_tensors({"l0": TensorSpec((NB, 0, 576), "uint8")}, block_size=BS)


def test_layout_is_frozen() -> None:
    layout = from_tensors(glm_registration(1, set()), block_size=BS)
    assert isinstance(layout, KVLayout)
    with pytest.raises(AttributeError):
        layout.block_size = 1  # type: ignore[misc]
