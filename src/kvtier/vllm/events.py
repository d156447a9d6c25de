"""What kvtier's tiers hold, as vLLM KV-cache events, so KV-event routers (llm-d's precise
prefix routing, Dynamo's KV router) learn the tier and do not route as if it were empty.

A chunk is announced in vLLM's own terms: the vLLM block hashes of its blocks, the parent
block's hash, its token ids and the block size, with the medium (`CPU` for host memory,
`STORAGE` for disk and the shared store, the latter with locality `REMOTE`). Stores and drops
come from rank 0's tiers (TP ranks mirror each other); the chunk's vLLM identity is recorded
when the scheduler emits the save or load that brings it in, in a bounded table. Events are
batched into the scheduler's step (vLLM publishes them with its own).

A hybrid model's chunk is announced once per KV cache group, with vLLM's `group_idx`, spec kind
and sliding window on each event, and for a sliding-window group only the blocks the record
holds (the window before the chunk's boundary): a router never takes one group's blocks for
another's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_events import (
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvtier.metrics import Metrics
from kvtier.offload.messages import ChunkRef, TierChange
from kvtier.store import registry
from kvtier.vllm.request_view import VLLMRequestView

__all__ = ["KVEvents", "kv_events_enabled"]

def _medium(tier: str) -> tuple[str, str] | None:
    """`tier`'s (medium, locality) in vLLM's event vocabulary, from the tier registry."""
    kind = registry.kind(tier)
    return None if kind is None else (kind.medium, kind.locality)


# chunks whose vLLM identity is kept (about 1 KiB each for 256-token chunks)
MAX_CHUNKS = 32768


@dataclass(frozen=True, slots=True)
class EventGroup:
    """One KV cache group as its events name it: vLLM's group index, spec kind and sliding
    window, and how many of a chunk's last blocks the tier holds for it."""

    group_idx: int
    kind: str
    sliding_window: int | None
    positions: int


def event_groups(kv_cache_config: Any, positions: Sequence[int]) -> list[EventGroup]:
    """The EventGroups of vLLM's KV cache groups (`positions` per group: kvtier's layout)."""
    from vllm.v1.kv_cache_interface import (
        get_kv_cache_spec_kind,
        get_kv_cache_spec_sliding_window,
    )

    return [
        EventGroup(
            i,
            get_kv_cache_spec_kind(g.kv_cache_spec).value,
            get_kv_cache_spec_sliding_window(g.kv_cache_spec),
            n,
        )
        for i, (g, n) in enumerate(zip(kv_cache_config.kv_cache_groups, positions, strict=True))
    ]


@dataclass(slots=True)
class _Chunk:
    hashes: list[object]
    parent: object | None
    tokens: list[int]
    tiers: set[str] = field(default_factory=set)
    state: bool = False  # a boundary-state record: the state groups' block at the chunk's end


def kv_events_enabled(vllm_config: Any) -> bool:
    """Whether vLLM publishes KV-cache events (`--kv-events-config`)."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(cfg is not None and getattr(cfg, "enable_kv_cache_events", False))


class KVEvents:
    """Turns rank 0's tier changes into BlockStored / BlockRemoved events, bounded."""

    def __init__(
        self,
        block_size: int,
        chunk_size: int,
        metrics: Metrics,
        groups: Sequence[EventGroup] = (),
    ) -> None:
        self.groups = tuple(groups)
        self.block_size = block_size
        self.chunk_size = chunk_size
        self._per_chunk = chunk_size // block_size
        self._m = metrics
        self._chunks: OrderedDict[bytes, _Chunk] = OrderedDict()
        self._events: list[KVCacheEvent] = []

    def learn(self, view: VLLMRequestView, first_chunk: int, chunks: Sequence[ChunkRef]) -> None:
        """Record the vLLM identity of `chunks` (chunk `first_chunk` on) of `view`'s prompt."""
        hashes = getattr(view.request, "block_hashes", None) or ()
        tokens = view.prompt_token_ids
        k = self._per_chunk
        index: dict[bytes, int] = {}
        for i, ref in enumerate(r for r in chunks if r.part < 0):
            index[ref.key] = first_chunk + i
        for ref in chunks:
            # a state record follows the chunks of its op and names the chunk it ends
            c = index.get(ref.parent if ref.part >= 0 else ref.key, -1)
            if c < 0 or ref.key in self._chunks or len(hashes) < (c + 1) * k:
                continue
            blocks = [maybe_convert_block_hash(h) for h in hashes[c * k : (c + 1) * k]]
            parent = maybe_convert_block_hash(hashes[c * k - 1]) if c else None
            span = list(tokens[c * self.chunk_size : (c + 1) * self.chunk_size])
            self._chunks[ref.key] = _Chunk(blocks, parent, span, state=ref.part >= 0)
            while len(self._chunks) > MAX_CHUNKS:
                self._chunks.popitem(last=False)
                self._m.dropped_tier_changes.inc()

    def changed(self, changes: Sequence[TierChange]) -> None:
        """Events for what rank 0's tiers stored and dropped since its last report."""
        for ch in changes:
            chunk = self._chunks.get(ch.key)
            medium = _medium(ch.tier)
            if chunk is None or medium is None:
                continue  # not a chunk this engine brought in (or a tier without a medium)
            if ch.change == "stored":
                chunk.tiers.add(ch.tier)
                self._chunks.move_to_end(ch.key)
                self._events.extend(self._stored(chunk, *medium))
            elif ch.tier in chunk.tiers:
                chunk.tiers.discard(ch.tier)
                self._events.extend(self._removed(chunk, *medium))

    def clear(self) -> None:
        """Every announced chunk leaves every tier (a cache reset made them unreachable)."""
        for chunk in self._chunks.values():
            for tier in sorted(chunk.tiers):
                medium = _medium(tier)
                if medium is not None:
                    self._events.extend(self._removed(chunk, *medium))
        self._chunks.clear()

    def take(self) -> list[KVCacheEvent]:
        """The events since the last call."""
        out, self._events = self._events, []
        return out

    def _stored(self, chunk: _Chunk, medium: str, locality: str) -> list[BlockStored]:
        if not self.groups:
            return [
                BlockStored(
                    block_hashes=chunk.hashes,
                    parent_block_hash=chunk.parent,
                    token_ids=chunk.tokens,
                    block_size=self.block_size,
                    lora_id=None,
                    medium=medium,
                    lora_name=None,
                    locality=locality,
                )
            ]
        out = []
        for g in self._groups_of(chunk):
            # the chunk's last `positions` blocks: what the record holds for this group (a
            # state record: the block whose state it holds, the chunk's last)
            skip = len(chunk.hashes) - (1 if chunk.state else g.positions)
            out.append(
                BlockStored(
                    block_hashes=chunk.hashes[skip:],
                    parent_block_hash=chunk.hashes[skip - 1] if skip else chunk.parent,
                    token_ids=chunk.tokens[skip * self.block_size :],
                    block_size=self.block_size,
                    lora_id=None,
                    medium=medium,
                    lora_name=None,
                    group_idx=g.group_idx,
                    kv_cache_spec_kind=g.kind,
                    kv_cache_spec_sliding_window=g.sliding_window,
                    locality=locality,
                )
            )
        return out

    def _removed(self, chunk: _Chunk, medium: str, locality: str) -> list[BlockRemoved]:
        if not self.groups:
            return [BlockRemoved(chunk.hashes, medium, locality=locality)]
        return [
            BlockRemoved(
                chunk.hashes[len(chunk.hashes) - (1 if chunk.state else g.positions) :],
                medium,
                group_idx=g.group_idx,
                locality=locality,
            )
            for g in self._groups_of(chunk)
        ]

    def _groups_of(self, chunk: _Chunk) -> list[EventGroup]:
        """The groups a record holds: the state groups (no position in a chunk record) for a
        state record, the others for a chunk record."""
        return [g for g in self.groups if (g.positions == 0) == chunk.state]
