"""Registration-level checks of hybrid models with vLLM 0.32's own classes (runs under
.venv-vllm): which KV cache groups `kvtier.vllm.groups` accepts and which it refuses by name,
kvtier's grouped pages, codec and self-test over vLLM's own hybrid allocation (groups aliasing
one pool), and the default `preferred_kv_layout` through vLLM's kernel-block split. Prints
`{"checks": {name: "ok" | "<traceback>"}, "messages": {case: error}}`."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from kvtier.config import KVTierConfig
from kvtier.errors import LayoutError
from kvtier.offload.device import ops_for
from kvtier.offload.group_codec import GroupedCodec, codec_for
from kvtier.offload.pages import KVCacheDescription, describe_pages
from kvtier.offload.selftest import codec_round_trip
from tests.vllm.drivers.common import emit

BS = 32
NB = 12
MESSAGES: dict[str, str] = {}


def attn(**kw: Any) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
                             **kw)  # fmt: skip


def sliding(window: int = 128, **kw: Any) -> Any:
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return SlidingWindowSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
                             sliding_window=window, **kw)  # fmt: skip


def chunked_local() -> Any:
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

    return ChunkedLocalAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64,
                                     dtype=torch.bfloat16, attention_chunk_size=256)  # fmt: skip


def mamba(mode: str = "align", **kw: Any) -> Any:
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(block_size=BS, shapes=((4, 64), (2, 16, 16)),
                     dtypes=(torch.bfloat16, torch.bfloat16), mamba_cache_mode=mode,
                     **kw)  # fmt: skip


def config(*groups: tuple[list[str], Any]) -> Any:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(
        num_blocks=NB,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(names, spec) for names, spec in groups],
    )


def refused(case: str, cfg: Any) -> str:
    from kvtier.vllm.groups import group_specs

    try:
        group_specs(cfg)
    except LayoutError as e:
        MESSAGES[case] = str(e)
        return str(e)
    raise AssertionError(f"{case}: group_specs accepted it")


def check_single_sliding_window_group_is_refused_by_name() -> None:
    msg = refused("single_sliding", config((["model.layers.0.attn", "model.layers.1.attn"],
                                            sliding())))  # fmt: skip
    assert "KV cache group 0 (SlidingWindowSpec, layers model.layers.0.attn, " in msg, msg
    assert "single-group sliding-window" in msg and "frees out-of-window blocks" in msg, msg


def check_chunked_local_is_refused_alone_and_in_a_hybrid() -> None:
    msg = refused("chunked_local", config((["l0"], chunked_local())))
    assert "(ChunkedLocalAttentionSpec, layers l0)" in msg and "chunked-local" in msg, msg
    msg = refused("chunked_local_hybrid", config((["l0"], attn()), (["l1"], chunked_local())))
    assert "KV cache group 1 (ChunkedLocalAttentionSpec, layers l1)" in msg, msg
    assert "--disable-hybrid-kv-cache-manager" in msg, msg


def check_state_groups_in_align_mode_are_stored_and_the_rest_refused_by_name() -> None:
    from kvtier.offload.groups import FULL, STATE
    from kvtier.vllm.groups import group_specs

    specs = group_specs(config((["attn.0"], attn()), (["mixer.1", "mixer.2"], mamba())))
    assert specs is not None
    assert [(g.kind, g.layers, g.detail) for g in specs] == [
        (FULL, ("attn.0",), ""),
        (STATE, ("mixer.1", "mixer.2"), "mamba2 4x64,2x16x16 bfloat16,bfloat16"),
    ]
    # vLLM keeps no boundary state outside "align" mode: its setting is the fix
    for mode in ("all", "none"):  # "none": prefix caching off
        cfg = config((["attn.0"], attn()), (["mixer.1"], mamba(mode)))
        msg = refused(f"mamba_{mode}_mode", cfg)
        assert "KV cache group 1 (MambaSpec, layers mixer.1)" in msg, msg
        assert f"mamba_cache_mode={mode!r}" in msg and "--mamba-cache-mode align" in msg, msg
    speculative = mamba(num_speculative_blocks=2)
    msg = refused("mamba_spec_blocks", config((["attn.0"], attn()), (["mixer.1"], speculative)))
    assert "2 speculative blocks" in msg and "without speculative decoding" in msg, msg
    msg = refused("mamba_only", config((["mixer.0"], mamba())))
    assert "(MambaSpec, layers mixer.0)" in msg and "state layers only" in msg, msg


def check_only_sliding_window_groups_are_refused() -> None:
    msg = refused("two_windows", config((["a"], sliding(128)), (["b"], sliding(512))))
    assert "next to a full-attention group" in msg, msg


def check_a_hybrid_draft_group_is_refused_by_name() -> None:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    cfg = KVCacheConfig(
        num_blocks=NB,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["s0"], sliding()),
            KVCacheGroupSpec(["f1"], attn()),
            KVCacheGroupSpec(["draft.0"], attn(), is_eagle_group=True),
        ],
    )
    msg = refused("eagle_group", cfg)
    assert "KV cache group 2 (FullAttentionSpec, layers draft.0)" in msg, msg
    assert "EAGLE/MTP draft layers" in msg, msg


def check_full_and_sliding_window_groups_are_a_hybrid_registration() -> None:
    from kvtier.offload.groups import FULL, SLIDING
    from kvtier.vllm.groups import group_specs

    specs = group_specs(config((["s0", "s2"], sliding(128, extra_retained_tokens=3)),
                               (["f1", "f3"], attn())))  # fmt: skip
    assert specs is not None
    assert [(g.kind, g.block_size, g.layers, g.reach) for g in specs] == [
        (SLIDING, BS, ("s0", "s2"), 130),
        (FULL, BS, ("f1", "f3"), 0),
    ]


def check_one_group_that_keeps_every_block_is_stored_as_before() -> None:
    from kvtier.vllm.groups import group_specs

    # HMA off: vLLM records the window on a full-attention spec and keeps every block
    assert group_specs(config((["l0", "l1"], attn(sliding_window=128)))) is None
    assert group_specs(config((["l0"], attn()))) is None


def check_connector_supports_hma() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    from kvtier.vllm import KVTierConnector

    assert supports_hma(KVTierConnector)
    assert callable(KVTierConnector.request_finished_all_groups)


def hybrid_allocation(layout_name: str, groups: list[tuple[list[str], Any]]) -> tuple[Any, dict]:
    """vLLM's own KV cache config and tensors for `groups` (its hybrid pool: groups alias)."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    layout = KVCacheLayout[layout_name]
    cache = SimpleNamespace(
        prefix_cache_retention_interval=None,
        num_gpu_blocks_override=NB,
        get_resolved_kv_cache_layout=lambda: layout,
    )
    no_hisparse = SimpleNamespace(hisparse_config=None)
    fake = SimpleNamespace(cache_config=cache, attention_config=no_hisparse)
    specs = [KVCacheGroupSpec(names, spec) for names, spec in groups]
    cfg = get_kv_cache_config_from_groups(fake, specs, 1 << 30)  # type: ignore[arg-type]
    return cfg, allocate_kv_cache(cfg, torch.device("cpu"), layout)


def check_grouped_pages_codec_and_self_test_over_vllms_hybrid_pool() -> None:
    from kvtier.vllm.groups import group_specs

    cfg, kv = hybrid_allocation("LBHNC", [(["s0", "s2"], sliding(BS)), (["f1", "f3"], attn())])
    assert kv["s0"].untyped_storage().data_ptr() == kv["f1"].untyped_storage().data_ptr()
    specs = group_specs(cfg)
    assert specs is not None
    desc = KVCacheDescription(kv, cfg.num_blocks, BS, "LBHNC", groups=specs)
    pages = describe_pages(desc)
    codec = codec_for(pages, 2, ops_for(torch.device("cpu")))
    assert isinstance(codec, GroupedCodec)
    # a 64-token chunk: 2 full-attention blocks, and the one block a 32-token window reads
    assert codec.layout.positions == (1, 2)
    page = 2 * BS * 2 * 64 * 2  # heads x tokens x (K, V) x head_size x bf16
    assert codec.chunk_bytes == (1 + 2) * 2 * page
    saved: list[torch.Tensor] = []

    def save(ids: Any) -> None:
        buf = torch.empty(codec.chunk_bytes, dtype=torch.uint8)
        codec.gather(ids, buf)
        saved.append(buf)

    def load(ids: Any) -> None:
        codec.scatter(saved[-1], ids)

    # the worker's startup self-test: disjoint blocks per group, byte-compared, restored
    codec_round_trip(desc, codec.ops, 2, save, load)
    # a codec that writes the sliding-window part into the wrong group is caught
    bad = GroupedCodec(pages, 2, codec.ops)
    bad.codecs = (bad.codecs[1], bad.codecs[0])  # type: ignore[assignment]
    try:
        codec_round_trip(desc, bad.ops, 2, save, lambda ids: bad.scatter(saved[-1], ids))
    except ValueError as e:
        MESSAGES["self_test_catches"] = str(e)
    else:
        raise AssertionError("the self-test passed a load that wrote nothing")


class _Backend16:
    """An attention backend whose kernels take 16-token blocks (vLLM splits 32-token ones)."""

    @staticmethod
    def get_supported_kernel_block_sizes(spec: Any) -> list[int]:
        return [16]

    @staticmethod
    def get_name() -> str:
        return "KERNEL16"


def check_default_layout_is_split_into_kernel_blocks_by_vllm() -> None:
    from vllm.v1.worker.utils import AttentionGroup, allocate_kv_cache, prepare_kernel_block_sizes

    default = KVTierConfig().preferred_kv_layout
    spec = attn()
    groups = [(["l0", "l1"], spec)]
    attn_groups = [[SimpleNamespace(backend=_Backend16, kv_cache_spec=spec)]]
    group = SimpleNamespace(kernel_block_size=16, kv_cache_spec=spec, backend=_Backend16)
    cfg, _ = hybrid_allocation(default, groups)
    sizes = prepare_kernel_block_sizes(cfg, attn_groups)  # type: ignore[arg-type]
    assert sizes == [16], (default, sizes)
    from vllm.v1.kv_cache_layout import KVCacheLayout

    kv = allocate_kv_cache(cfg, torch.device("cpu"), KVCacheLayout[default], sizes)
    # what vLLM binds to the layers: already in 16-token kernel blocks
    bound = AttentionGroup.map_kv_cache_to_kernel_blocks(group, kv["l0"])  # type: ignore[arg-type]
    assert bound.shape[0] == 2 * cfg.num_blocks and bound.shape[-2] == 16
    # kvtier regroups the kernel blocks into manager blocks and moves them bit-exactly
    desc = KVCacheDescription(kv, cfg.num_blocks, BS, default)
    pages = describe_pages(desc)
    codec = codec_for(pages, 2, ops_for(torch.device("cpu")))
    saved: list[torch.Tensor] = []
    codec_round_trip(
        desc,
        codec.ops,
        2,
        lambda ids: saved.append(_gathered(codec, ids)),
        lambda ids: codec.scatter(saved[-1], ids),
    )
    # the block-outermost layout (the old default) is never split, and vLLM refuses its pages
    cfg, kv = hybrid_allocation("BLHNC", groups)
    assert prepare_kernel_block_sizes(cfg, attn_groups) == [BS]  # type: ignore[arg-type]
    try:
        AttentionGroup.map_kv_cache_to_kernel_blocks(group, kv["l0"])  # type: ignore[arg-type]
    except ValueError as e:
        MESSAGES["blhnc_split"] = str(e)
        assert "cannot be split into" in str(e), e
    else:
        raise AssertionError("vLLM split BLHNC pages into kernel blocks")


def check_kv_events_carry_the_group() -> None:
    from kvtier.metrics import Metrics
    from kvtier.offload.messages import ChunkRef, TierChange
    from kvtier.vllm.events import KVEvents, event_groups
    from kvtier.vllm.request_view import VLLMRequestView

    cfg = config((["s0"], sliding(BS)), (["f1"], attn()))
    events = KVEvents(BS, 2 * BS, Metrics(rank="scheduler"), event_groups(cfg, (1, 2)))
    request = SimpleNamespace(
        request_id="r", prompt_token_ids=list(range(4 * BS)), block_hashes=[b"h0", b"h1", b"h2"]
    )
    events.learn(VLLMRequestView(request), 0, [ChunkRef(b"k" * 16, [])])
    events.changed([TierChange("stored", "memory", b"k" * 16)])
    stored = events.take()
    got = [(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window,
            len(e.block_hashes), len(e.token_ids), e.medium) for e in stored]  # fmt: skip
    assert got == [
        (0, "sliding_window", BS, 1, BS, "CPU"),
        (1, "full_attention", None, 2, 2 * BS, "CPU"),
    ], got
    # the sliding-window group's block is the chunk's last; its parent the block before it
    assert stored[0].parent_block_hash == stored[1].block_hashes[0]
    events.changed([TierChange("removed", "memory", b"k" * 16)])
    removed = events.take()
    assert [(e.group_idx, len(e.block_hashes)) for e in removed] == [(0, 1), (1, 2)]


def check_the_default_chunk_is_one_block_for_a_state_hybrid() -> None:
    from kvtier.config import KVTierConfig
    from kvtier.vllm.connector import _fitted_chunk
    from kvtier.vllm.groups import group_specs

    vllm = SimpleNamespace(cache_config=SimpleNamespace(block_size=BS))
    hybrid = group_specs(config((["attn.0"], attn()), (["mixer.1"], mamba())))
    # vLLM keeps a state per block boundary: a chunk of one block stores each of them
    assert _fitted_chunk(KVTierConfig(), vllm, hybrid).chunk_size == BS  # type: ignore[arg-type]
    # an explicit chunk stays; a model without state layers keeps the default
    chosen = KVTierConfig(chunk_size=4 * BS)
    assert _fitted_chunk(chosen, vllm, hybrid) is chosen  # type: ignore[arg-type]
    assert _fitted_chunk(KVTierConfig(), vllm, None).chunk_size == 256  # type: ignore[arg-type]


def check_kv_events_carry_the_state_group() -> None:
    from kvtier.keys import state_key
    from kvtier.metrics import Metrics
    from kvtier.offload.messages import ChunkRef, TierChange
    from kvtier.vllm.events import KVEvents, event_groups
    from kvtier.vllm.request_view import VLLMRequestView

    cfg = config((["f0"], attn()), (["m1"], mamba()))
    events = KVEvents(BS, 2 * BS, Metrics(rank="scheduler"), event_groups(cfg, (2, 0)))
    request = SimpleNamespace(
        request_id="r", prompt_token_ids=list(range(4 * BS)),
        block_hashes=[b"h0", b"h1", b"h2", b"h3"],
    )  # fmt: skip
    chunks = [ChunkRef(b"a" * 16, []), ChunkRef(b"b" * 16, [], b"a" * 16)]
    state = ChunkRef(state_key(b"b" * 16, 0), [7], b"b" * 16, 0)
    events.learn(VLLMRequestView(request), 0, [*chunks, state])
    events.changed([TierChange("stored", "memory", b"b" * 16)])
    events.changed([TierChange("stored", "memory", state.key)])
    stored = events.take()
    got = [(e.group_idx, e.kv_cache_spec_kind, list(e.block_hashes)) for e in stored]
    # the chunk record: the attention group's blocks; the state record: the state group's block
    # of the chunk's boundary (chunk 1's last block), its parent the block before it
    h2, h3 = stored[0].block_hashes
    assert got == [(0, "full_attention", [h2, h3]), (1, "mamba", [h3])], got
    assert stored[1].parent_block_hash == h2
    events.changed([TierChange("removed", "memory", state.key)])
    assert [(e.group_idx, list(e.block_hashes)) for e in events.take()] == [(1, [h3])]


def _gathered(codec: Any, ids: Any) -> torch.Tensor:
    buf = torch.empty(codec.chunk_bytes, dtype=torch.uint8)
    codec.gather(ids, buf)
    return buf


CHECKS: dict[str, Callable[[], None]] = {
    name: fn for name, fn in globals().items() if name.startswith("check_") and callable(fn)
}


def main() -> None:
    results = {}
    for name, fn in CHECKS.items():
        try:
            fn()
            results[name] = "ok"
        except Exception:  # noqa: BLE001 - each check reports its own failure
            results[name] = traceback.format_exc()
    emit({"checks": results, "messages": MESSAGES})


if __name__ == "__main__":
    main()
