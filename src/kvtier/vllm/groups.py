"""vLLM's KV cache groups as kvtier's `GroupSpec`s, or a startup error naming what kvtier cannot
store yet: the group, its spec class, its layers, the reason and the fix.

With the hybrid memory allocator (HMA) vLLM keeps one block table per group over one block
pool. kvtier stores full-attention groups (every block of a chunk), sliding-window groups (the
blocks a hit at the chunk's boundary still reads) and state groups (Mamba, gated delta net,
short conv, linear attention: `MambaSpec`, in vLLM's "align" cache mode, whose boundary states
vLLM hands to connectors with their exact blocks) next to at least one full-attention group.
Everything else is refused at startup, never accepted silently: groups whose blocks vLLM frees
or rewrites while the request runs in ways kvtier does not follow (chunked-local attention,
state groups outside "align" mode or with speculative blocks, ring buffers), and group kinds no
kvtier path has run end to end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtier.errors import LayoutError
from kvtier.offload.groups import FULL, SLIDING, STATE, GroupSpec

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["group_specs", "refusal"]

_NO_HMA = "start vLLM with --disable-hybrid-kv-cache-manager (every layer then keeps full KV)"
_NO_KVTIER = "serve this model without KVTierConnector"
_ALIGN = (
    "start vLLM with --enable-prefix-caching --mamba-cache-mode align (vLLM then keeps each "
    "block boundary's state, as its own offloading connectors need)"
)


def _state_detail(spec: Any) -> str:
    """A state spec's mixer, state shapes and dtypes (part of the layout fingerprint)."""
    mixer = getattr(spec.mamba_type, "name", str(spec.mamba_type)).lower()
    shapes = ",".join("x".join(str(d) for d in shape) for shape in spec.shapes)
    dtypes = ",".join(str(d).removeprefix("torch.") for d in spec.dtypes)
    return f"{mixer} {shapes} {dtypes}"


def _inner_specs(spec: Any) -> list[Any]:
    """The per-layer specs of a group (`UniformTypeKVCacheSpecs` holds one per layer)."""
    inner = getattr(spec, "kv_cache_specs", None)
    return list(inner.values()) if inner else [spec]


def refusal(spec: Any) -> tuple[str, str] | None:
    """(reason, fix) when kvtier cannot store a group of this spec (vLLM's own classes), in any
    registration; None when it can (as a full-attention or a sliding-window group)."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        CircularBufferSpec,
        CrossAttentionSpec,
        EncoderOnlyAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        RSWASpec,
        SinkFullAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
    )

    if isinstance(spec, MambaSpec):
        if spec.mamba_cache_mode != "align":
            return (
                f"vLLM keeps a Mamba / linear-attention group's state only at the request's "
                f"end in mamba_cache_mode={spec.mamba_cache_mode!r}, so no chunk boundary has a "
                "state to store",
                _ALIGN,
            )
        if spec.num_speculative_blocks:
            return (
                f"speculative decoding relocates a state group's {spec.num_speculative_blocks} "
                "speculative blocks in place, and kvtier does not follow them",
                "serve without speculative decoding, or without KVTierConnector",
            )
        return None
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return (
            "vLLM frees a chunked-local attention group's blocks of earlier attention chunks "
            "while the request runs, and kvtier does not follow those frees yet",
            _NO_HMA,
        )
    if isinstance(spec, SlidingWindowMLASpec):
        return ("sliding-window MLA groups (DeepSeek-V4) have not run with kvtier", _NO_HMA)
    if isinstance(spec, CircularBufferSpec):
        return ("ring-buffer groups rewrite one block per request in place", _NO_KVTIER)
    if isinstance(spec, CrossAttentionSpec | EncoderOnlyAttentionSpec):
        return (
            "encoder / cross-attention KV depends on more than the prompt's token ids",
            _NO_KVTIER,
        )
    if isinstance(spec, RSWASpec | SinkFullAttentionSpec):
        return (f"{type(spec).__name__} groups have not run with kvtier", _NO_HMA)
    if isinstance(spec, SlidingWindowSpec | FullAttentionSpec):
        return None
    return (f"kvtier knows no rule for {type(spec).__name__} groups", _NO_HMA)


def _kind(spec: Any) -> tuple[str, int, str]:
    """(kind, reach, detail) of a spec `refusal` accepts: a SlidingWindowSpec is a sliding
    window (vLLM frees its blocks below the window); a MambaSpec a state group; any
    FullAttentionSpec, even one that records a sliding window (HMA off), keeps every block for
    the request's life."""
    from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

    if isinstance(spec, SlidingWindowSpec):
        return SLIDING, int(spec.sliding_window) - 1 + int(spec.extra_retained_tokens), ""
    if isinstance(spec, MambaSpec):
        return STATE, 0, _state_detail(spec)
    return FULL, 0, ""


def _where(i: int, group: Any, spec: Any) -> str:
    layers = list(group.layer_names)
    shown = ", ".join(layers[:3]) + (f", ... ({len(layers)} layers)" if len(layers) > 3 else "")
    return f"KV cache group {i} ({type(spec).__name__}, layers {shown})"


def _check_single(group: Any) -> None:
    """One group: kvtier stores every block of a chunk, as before HMA, unless vLLM frees or
    rewrites the group's blocks while the request runs (a save may still be reading them)."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        CircularBufferSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    for spec in _inner_specs(group.kv_cache_spec):
        if isinstance(spec, SlidingWindowSpec):
            raise LayoutError(
                f"kvtier cannot offload {_where(0, group, spec)}: a single-group sliding-window "
                "model (vLLM frees out-of-window blocks while a save may still read them) is "
                "supported only next to a full-attention group, the hybrid path that ran end "
                "to end; " + _NO_KVTIER
            )
        if isinstance(spec, MambaSpec):
            raise LayoutError(
                f"kvtier cannot offload {_where(0, group, spec)}: a model of state layers only "
                "has no attention KV to restore a state's prefix with; kvtier stores states "
                "next to a full-attention group; " + _NO_KVTIER
            )
        if isinstance(spec, ChunkedLocalAttentionSpec | CircularBufferSpec):
            why = refusal(spec)
            assert why is not None
            raise LayoutError(f"kvtier cannot offload {_where(0, group, spec)}: {why[0]}; {why[1]}")


def group_specs(kv_cache_config: KVCacheConfig | None) -> tuple[GroupSpec, ...] | None:
    """kvtier's groups of vLLM's KV cache config: None for one group kvtier stores as before
    (every layer one page set); a tuple for a hybrid registration; LayoutError naming the
    group, its spec class, its layers, the reason and the fix for anything else."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if not groups:
        return None
    if len(groups) == 1:
        _check_single(groups[0])
        return None
    out: list[GroupSpec] = []
    for i, group in enumerate(groups):
        kinds = set()
        for spec in _inner_specs(group.kv_cache_spec):
            why = refusal(spec)
            if why is not None:
                raise LayoutError(
                    f"kvtier cannot offload {_where(i, group, spec)}: {why[0]}; {why[1]}"
                )
            kinds.add(_kind(spec))
        if len(kinds) != 1:
            raise LayoutError(
                f"kvtier cannot offload {_where(i, group, group.kv_cache_spec)}: its layers mix "
                f"{sorted(kinds)}; {_NO_HMA}"
            )
        if getattr(group, "is_eagle_group", False):
            raise LayoutError(
                f"kvtier cannot offload {_where(i, group, group.kv_cache_spec)}: it holds "
                "EAGLE/MTP draft layers, which the drafter writes after the target model's "
                "forward and kvtier does not order a hybrid model's saves after it yet; serve "
                "without speculative decoding or without KVTierConnector"
            )
        if not getattr(group, "enable_kv_transfer", True):
            raise LayoutError(
                f"kvtier cannot offload {_where(i, group, group.kv_cache_spec)}: vLLM marks it "
                f"as rebuilt after a transfer, which kvtier does not do; {_NO_KVTIER}"
            )
        kind, reach, detail = kinds.pop()
        block = int(group.kv_cache_spec.block_size)
        out.append(GroupSpec(kind, block, tuple(group.layer_names), reach, detail))
    if not any(g.kind == FULL for g in out):
        raise LayoutError(
            f"kvtier cannot offload {_where(0, groups[0], groups[0].kv_cache_spec)}: a model "
            "whose every layer is sliding-window attention is supported only next to a "
            "full-attention group, the hybrid path that ran end to end; " + _NO_KVTIER
        )
    sizes = {g.block_size for g in out}
    if len(sizes) > 1:
        raise LayoutError(
            f"kvtier cannot offload KV cache groups of block sizes {sorted(sizes)} "
            f"({[type(g.kv_cache_spec).__name__ for g in groups]}); kvtier needs one block size "
            f"for every group; {_NO_HMA}"
        )
    return tuple(out)
