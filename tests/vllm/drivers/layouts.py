"""Build KV views with vLLM 0.32's own helpers (`compute_layout_strides`,
`create_kv_cache_views`, `KVCacheTensor`, real specs) for the whole layout matrix, compare them
with kvtier's torch rebuild (`tests/offload/vllm_views.py`), and move blocks through kvtier's
codec over vLLM's views. Args (JSON): none used."""

from __future__ import annotations

import torch

from tests.offload import vllm_views as rebuilt
from tests.vllm.drivers.common import args, emit

NB, BS = 12, 16


def vllm_specs(model: str) -> list[tuple[tuple[str, ...], object]]:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    layers = tuple(f"model.layers.{i}.self_attn.attn" for i in range(3))
    if model == "gqa":
        return [
            (
                layers,
                FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.bfloat16),
            )
        ]
    out = [
        (
            layers,
            MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=576, dtype=torch.bfloat16),
        )
    ]
    if model == "mla+dsa":
        idx = tuple(f"model.layers.{i}.self_attn.indexer.k_cache" for i in range(3))
        out.append(
            (idx, MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=132, dtype=torch.uint8))
        )
    return out


def vllm_views(model: str, layout_name: str, kb: int | None) -> dict[str, torch.Tensor]:
    from vllm.v1.kv_cache_interface import (
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout[layout_name]
    specs = vllm_specs(model)
    bpb = sum(len(names) * spec.page_size_bytes for names, spec in specs)
    raw = torch.zeros(bpb * NB, dtype=torch.int8)
    views: dict[str, torch.Tensor] = {}
    offset = 0
    for names, spec in specs:
        fixed = bpb if layout.is_block_outermost else None
        layer_stride, block_stride, *_ = compute_layout_strides(
            spec, NB, len(names), layout, fixed_strides=(None, fixed, None, None, None)
        )
        tensor = KVCacheTensor(
            size=raw.numel(),
            layers=list(names),
            layer_stride=layer_stride,
            block_stride=block_stride,
            offset=offset,
        )
        made = create_kv_cache_views(raw, spec, NB, layout, tensor, kb)
        views.update(zip(names, made, strict=True))
        page = spec.page_size_bytes
        offset += len(names) * (page if layout.is_block_outermost else layer_stride)
    return views


def geometry(t: torch.Tensor) -> list[object]:
    return [list(t.shape), list(t.stride()), t.storage_offset(), str(t.dtype)]


def main() -> None:
    args()
    from kvtier.offload.codec import PageCodec
    from kvtier.offload.device import CpuOps
    from kvtier.offload.pages import KVCacheDescription, describe_pages, manager_view

    models = {
        "gqa": rebuilt.gqa(block_size=BS),
        "mla": rebuilt.mla(block_size=BS),
        "mla+dsa": rebuilt.mla(block_size=BS, indexer=True),
    }
    cases = []
    for layout in rebuilt.SUPPORTED:
        for model in models:
            for split in (1, 2) if layout.startswith("L") else (1,):
                kb = BS // split if split > 1 else None
                ours = rebuilt.build(models[model], NB, layout, kernel_block_size=kb)[1]
                theirs = vllm_views(model, layout, kb)
                same = sorted(ours) == sorted(theirs) and all(
                    geometry(ours[n]) == geometry(theirs[n]) for n in ours
                )
                # kvtier's codec over vLLM's own views: blocks 1, 6 -> blocks 8, 3
                for v in theirs.values():
                    v.copy_(torch.arange(v.numel()).reshape(v.shape).remainder(61).to(v.dtype))
                pages = describe_pages(KVCacheDescription(theirs, NB, BS, layout))
                codec = PageCodec(pages, 2, CpuOps())
                buf = torch.empty(codec.chunk_bytes, dtype=torch.uint8)
                codec.gather([1, 6], buf)
                codec.scatter(buf, [8, 3])
                moved = all(
                    torch.equal(manager_view(v, NB)[8], manager_view(v, NB)[1])
                    and torch.equal(manager_view(v, NB)[3], manager_view(v, NB)[6])
                    for v in theirs.values()
                )
                cases.append({"case": f"{layout}/{model}/x{split}", "same": same, "moved": moved})
    emit({"cases": cases, "required_layout": required_layouts(), "replicated": replicated()})


def replicated() -> dict[str, bool]:
    """Which registrations kvtier stores once below memory at TP=2 (and never at TP=1)."""
    from types import SimpleNamespace

    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MLAAttentionSpec,
    )

    from kvtier.vllm.worker_side import replicated_across_tp

    def ask(spec: object, tp: int) -> bool:
        kvc = KVCacheConfig(
            num_blocks=4, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)]
        )
        pc = SimpleNamespace(tensor_parallel_size=tp)
        return replicated_across_tp(kvc, SimpleNamespace(parallel_config=pc))  # type: ignore[arg-type]

    mla = MLAAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, max_tp_shards=1
    )
    gqa = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    return {"mla_tp2": ask(mla, 2), "mla_tp1": ask(mla, 1), "gqa_tp2": ask(gqa, 2)}


def required_layouts() -> dict[str, str | None]:
    """What KVTierConnector asks vLLM for: on this CPU, off it, and with no preference."""
    from types import SimpleNamespace

    from vllm.platforms import current_platform

    from kvtier.vllm import KVTierConnector

    def ask(extra: dict[str, str]) -> str | None:
        ktc = SimpleNamespace(kv_connector_extra_config=extra)
        return KVTierConnector.get_required_kvcache_layout(
            SimpleNamespace(kv_transfer_config=ktc)  # type: ignore[arg-type]
        )

    out = {"cpu": ask({})}
    is_cpu = current_platform.is_cpu
    current_platform.is_cpu = lambda: False  # type: ignore[method-assign]
    try:
        out["gpu"] = ask({})
        out["gpu_no_preference"] = ask({"preferred_kv_layout": ""})
        out["gpu_blnhc"] = ask({"preferred_kv_layout": "BLNHC"})
    finally:
        current_platform.is_cpu = is_cpu  # type: ignore[method-assign]
    return out


if __name__ == "__main__":
    main()
