"""The layout matrix: KV views built the way vLLM 0.32 builds them (every layout, MHA/GQA, MLA,
MLA + DSA indexer, with and without a kernel-block split), blocks A saved, loaded into blocks B
of a second cache: B's bytes (and FlashAttention's K/V split of B) equal A's, nothing else moves.

`KVTIER_TEST_DEVICE=cuda:0` runs the matrix on a GPU (scripts/gpu-check.sh); the default CPU run
goes through the device-separation harness, which refuses any op mixing device and host.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvtier.errors import LayoutError
from kvtier.offload.codec import PageCodec
from kvtier.offload.device import ops_for
from kvtier.offload.pages import KVCacheDescription, describe_pages, manager_view
from tests.offload.separation import DeviceMixError, DeviceSeparation, TaggedOps
from tests.offload.vllm_views import REFUSED, SUPPORTED, Spec, build, gqa, mla

DEVICE = torch.device(os.environ.get("KVTIER_TEST_DEVICE", "cpu"))
NB = 12
BS = 16
K = 2  # blocks per chunk


def models() -> dict[str, list[Spec]]:
    return {
        "gqa": gqa(block_size=BS),
        "mla": mla(block_size=BS),
        "mla+dsa": mla(block_size=BS, indexer=True),
    }


def cases() -> list[tuple[str, str, int]]:
    out = []
    for layout in SUPPORTED:
        for model in models():
            # vLLM splits manager blocks into kernel blocks only where blocks are dense pages
            for split in (1, 2) if layout.startswith("L") else (1,):
                out.append((layout, model, split))
    return out


def describe(views: dict[str, torch.Tensor], layout: str) -> KVCacheDescription:
    return KVCacheDescription(views, NB, BS, layout, "set VLLM_KV_CACHE_LAYOUT=LBHNC")


def filled(raw: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # small integers: exact in bf16, so the K/V views compare by value as well
    raw.copy_(torch.randint(0, 64, raw.shape, generator=g, dtype=torch.int8).to(raw.device))
    return raw


def block_bytes(view: torch.Tensor, block: int) -> torch.Tensor:
    return manager_view(view, NB)[block].contiguous().view(torch.uint8).cpu()


@pytest.mark.parametrize(("layout", "model", "split"), cases())
def test_blocks_a_load_into_blocks_b_bit_exactly(layout: str, model: str, split: int) -> None:
    specs = models()[model]
    kb = BS // split if split > 1 else None
    raw_a, views_a = build(specs, NB, layout, DEVICE, kernel_block_size=kb)
    raw_b, views_b = build(specs, NB, layout, DEVICE, kernel_block_size=kb)
    filled(raw_a, 1)
    filled(raw_b, 2)
    before = {n: v.clone() for n, v in views_b.items()}
    ops = ops_for(DEVICE)
    pa, pb = describe_pages(describe(views_a, layout)), describe_pages(describe(views_b, layout))
    assert pa.fingerprint == pb.fingerprint
    if layout.startswith("B"):
        # cross-layer: one contiguous page per block for every layer (indexer included)
        assert len(pa.segments) == 1
    a, b = PageCodec(pa, K, ops), PageCodec(pb, K, ops)
    staging = torch.empty(a.chunk_bytes, dtype=torch.uint8, device=DEVICE)
    src, dst = [7, 2], [4, 9]
    a.gather(src, staging)
    assert b.scatter(staging, dst) == K
    for name in views_a:
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(block_bytes(views_b[name], d), block_bytes(views_a[name], s)), name
        others = [i for i in range(NB) if i not in dst]
        vb, old = manager_view(views_b[name], NB), manager_view(before[name], NB)
        assert torch.equal(vb[others], old[others]), f"{name}: a block outside {dst} changed"
    if model == "gqa":
        head = views_a[next(iter(views_a))].shape[-1] // 2
        for name in views_a:
            ga, gb = manager_view(views_a[name], NB), manager_view(views_b[name], NB)
            # FlashAttention reads K and V as the two halves of C
            assert torch.equal(gb[4][..., :head], ga[7][..., :head])
            assert torch.equal(gb[9][..., head:], ga[2][..., head:])


@pytest.mark.parametrize("layout", SUPPORTED)
def test_matrix_runs_clean_under_the_device_separation_harness(layout: str) -> None:
    mode = DeviceSeparation()
    ops = TaggedOps(mode)
    raw_a, views_a = build(mla(block_size=BS, indexer=True), NB, layout)
    raw_b, views_b = build(mla(block_size=BS, indexer=True), NB, layout)
    filled(raw_a, 3)
    mode.tag(raw_a)
    mode.tag(raw_b)
    with mode:
        a = PageCodec(describe_pages(describe(views_a, layout)), K, ops)
        b = PageCodec(describe_pages(describe(views_b, layout)), K, ops)
        staging = ops.staging(a.chunk_bytes)
        assert staging is not None
        a.gather([0, 5], staging)
        b.scatter(staging, [3, -1])
    assert mode.checked > 0
    for name in views_a:
        assert torch.equal(block_bytes(views_b[name], 3), block_bytes(views_a[name], 0))


def test_the_harness_refuses_a_gather_into_a_host_slot() -> None:
    """Today's defect: index_select(device KV, idx, out=host slot); CUDA raises, so must we."""
    mode = DeviceSeparation()
    raw, views = build(gqa(block_size=BS), NB, "LBHNC")
    mode.tag(raw)
    seg = next(iter(views.values())).reshape(NB, -1).view(torch.uint8)
    host_slot = torch.empty(2, seg.shape[1], dtype=torch.uint8)
    with mode, pytest.raises(DeviceMixError, match="index_select"):
        torch.index_select(seg, 0, TaggedOps(mode).index([0, 1]), out=host_slot)


def test_layouts_in_another_memory_order_or_split_never_share_a_fingerprint() -> None:
    seen = {}
    for layout in SUPPORTED:
        for split in (1, 2) if layout.startswith("L") else (1,):
            _, views = build(gqa(block_size=BS), NB, layout, kernel_block_size=BS // split)
            seen[(layout, split)] = describe_pages(describe(views, layout)).fingerprint
    assert len(set(seen.values())) == len(seen), seen


@pytest.mark.parametrize("layout", REFUSED)
def test_a_layout_whose_page_is_not_one_run_fails_naming_it(layout: str) -> None:
    _, views = build(gqa(block_size=BS), NB, layout)
    with pytest.raises(LayoutError, match=rf"layout {layout}.*not one contiguous run.*LBHNC"):
        describe_pages(describe(views, layout))


def test_a_view_whose_dim0_is_not_the_blocks_fails_naming_it() -> None:
    with pytest.raises(LayoutError, match="'odd'.*dim 0 must hold the 12 blocks"):
        describe_pages(describe({"odd": torch.zeros(7, 4)}, "LBHNC"))


def test_bad_block_ids_are_errors() -> None:
    _, views = build(gqa(block_size=BS), NB, "LBHNC")
    codec = PageCodec(describe_pages(describe(views, "LBHNC")), K, ops_for(torch.device("cpu")))
    buf = torch.empty(codec.chunk_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="outside"):
        codec.gather([0, NB], buf)
    with pytest.raises(ValueError, match="2 blocks"):
        codec.gather([0], buf)
    with pytest.raises(ValueError, match="outside"):
        codec.gather([-1, 0], buf)


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        ([0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]),  # runs: one slice copy per segment
        ([11, 0, 5, 3, 9, 1], [2, 10, 4, 8, -1, 6]),  # scattered: one indexed op per segment
    ],
)
def test_consecutive_and_scattered_block_ids_move_the_same_bytes(src, dst) -> None:
    mode = DeviceSeparation()
    ops = TaggedOps(mode)
    raw_a, views_a = build(gqa(block_size=BS), NB, "LBNHC")
    raw_b, views_b = build(gqa(block_size=BS), NB, "LBNHC")
    filled(raw_a, 7)
    filled(raw_b, 8)
    before = {n: v.clone() for n, v in views_b.items()}
    mode.tag(raw_a)
    mode.tag(raw_b)
    with mode:
        a = PageCodec(describe_pages(describe(views_a, "LBNHC")), 6, ops)
        b = PageCodec(describe_pages(describe(views_b, "LBNHC")), 6, ops)
        staging = ops.staging(a.chunk_bytes)
        assert staging is not None
        a.gather(src, staging)
        assert b.scatter(staging, dst) == sum(1 for d in dst if d >= 0)
    for name in views_a:
        for s, d in zip(src, dst, strict=True):
            if d >= 0:
                assert torch.equal(block_bytes(views_b[name], d), block_bytes(views_a[name], s))
        untouched = [i for i in range(NB) if i not in dst]
        vb, old = manager_view(views_b[name], NB), manager_view(before[name], NB)
        assert torch.equal(vb[untouched], old[untouched])
