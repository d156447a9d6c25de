"""Page geometry from registered tensors: sizes that agree with the HF-config sizing, a format
fingerprint that ignores pool size and changes with everything that changes the bytes, and
clear errors for registrations kvtier cannot address."""

from __future__ import annotations

import pytest
import torch

from kvtier.errors import LayoutError
from kvtier.layout import bytes_per_token_from_hf
from kvtier.offload.pages import KVCacheDescription, describe_pages
from tests.test_layout import GLM_5X, GLM_INDEXER_TYPES

BS = 64


def glm(n_layers: int, indexers: set[int], nb: int = 4) -> dict[str, torch.Tensor]:
    """vLLM-style registration: an fp8 MLA cache per layer, an indexer cache on some layers."""
    views: dict[str, torch.Tensor] = {}
    for i in range(n_layers):
        p = f"model.layers.{i}.self_attn"
        views[f"{p}.attn"] = torch.zeros(nb, 1, BS, 576, dtype=torch.uint8)
        if i in indexers:
            views[f"{p}.indexer.k_cache"] = torch.zeros(nb, 1, BS, 132, dtype=torch.uint8)
    return views


def pages(views: dict[str, torch.Tensor], block_size: int = BS, layout: str = "LBHNC"):
    nb = next(iter(views.values())).shape[0]
    return describe_pages(KVCacheDescription(views, nb, block_size, layout))


def test_a_full_glm_registration_matches_the_config_geometry() -> None:
    owners = {i for i, t in enumerate(GLM_INDEXER_TYPES) if t == "full"}
    p = pages(glm(78, owners))
    geometry = bytes_per_token_from_hf(GLM_5X, tp_size=4, kv_dtype="fp8")
    assert sum(len(s.runs) for s in p.segments) == 78 + 21
    assert p.bytes_per_block == BS * geometry.bytes_per_token == BS * 47_700
    assert p.bytes_per_token == 47_700
    assert p.dtype == "uint8"


def test_the_fingerprint_ignores_the_pool_size() -> None:
    a, b = pages(glm(4, {0}, nb=4)), pages(glm(4, {0}, nb=9))
    assert (a.num_blocks, b.num_blocks) == (4, 9)
    assert a.fingerprint == b.fingerprint and len(a.fingerprint) == 16


def test_the_fingerprint_changes_with_everything_that_changes_the_bytes() -> None:
    def reg(**over: torch.Tensor) -> dict[str, torch.Tensor]:
        base = {n: torch.zeros(4, 2, BS, 288, dtype=torch.bfloat16) for n in ("l0", "l1")}
        return {**base, **over}

    fps = {
        pages(reg()).fingerprint,
        pages(reg(l1=torch.zeros(4, 2, BS, 288, dtype=torch.float16))).fingerprint,
        pages(reg(l1=torch.zeros(4, 2, BS, 256, dtype=torch.bfloat16))).fingerprint,
        pages({"l0": reg()["l0"], "l2": reg()["l1"]}).fingerprint,
        pages({"l1": reg()["l1"], "l0": reg()["l0"]}).fingerprint,
        pages({"l0": reg()["l0"]}).fingerprint,
        pages(reg(), block_size=32).fingerprint,
        # the same shape in another memory order (tokens outside heads)
        pages(
            reg(l1=torch.zeros(4, BS, 2, 288, dtype=torch.bfloat16).transpose(1, 2))
        ).fingerprint,
    }
    assert len(fps) == 8


def test_the_known_answer_fingerprint_is_pinned() -> None:
    # computed once; a change here orphans every stored record of every deployment
    p = pages({"l0": torch.zeros(4, 1, BS, 576, dtype=torch.bfloat16)})
    assert p.fingerprint.hex() == "b5da61121013b6594b8b9dd2d8d303ae"


def test_views_on_other_block_counts_name_the_view() -> None:
    views = glm(2, {1})
    views["model.layers.1.self_attn.indexer.k_cache"] = torch.zeros(3, 1, BS, 132)
    with pytest.raises(LayoutError, match=r"'model\.layers\.1\.self_attn\.indexer\.k_cache'"):
        pages(views)


def test_an_empty_registration_is_an_error() -> None:
    with pytest.raises(LayoutError, match="no KV cache tensors"):
        describe_pages(KVCacheDescription({}, 4, BS, "LBHNC"))
