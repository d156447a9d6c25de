"""KV blocks <-> chunk bytes for a hybrid registration: one `PageCodec` per attention group over
that group's own pages, the payload group-major (`[group 0's positions][group 1's]...`), and a
`StateCodec` for the state groups' boundary states.

A chunk's `ChunkRef.block_ids` lists every attention group's positions in group order
(`kvtier.offload.groups`); a sliding-window group stores fewer positions than a full-attention
group. The record holds every attention group's part, so a chunk read back restores all of them
or is a miss for all of them. A state record (a `ChunkRef` with `part` >= 0) holds one block of
every state group, cut into parts of the chunk's size so that it fits the tiers' fixed slots.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from kvtier.keys import state_key
from kvtier.offload.codec import PageCodec
from kvtier.offload.device import DeviceOps
from kvtier.offload.groups import ChunkGroups
from kvtier.offload.messages import ChunkRef
from kvtier.offload.pages import KVPages

__all__ = ["GroupedCodec", "StateCodec", "codec_for"]


class StateCodec:
    """One block of every state group as a byte stream (group-major, segment-major), cut into
    `parts` parts of `part_bytes` each; the last part is zero-padded."""

    def __init__(self, groups: Sequence[KVPages], part_bytes: int) -> None:
        self.groups = tuple(groups)
        self.state_bytes = sum(g.bytes_per_block for g in self.groups)
        self.part_bytes = part_bytes
        self.parts = -(-self.state_bytes // part_bytes)
        self.num_blocks = self.groups[0].num_blocks if self.groups else 0

    def _check(self, block_ids: Sequence[int], part: int, *, skips: bool) -> None:
        if len(block_ids) != len(self.groups):
            raise ValueError(
                f"a state record has one block of each of {len(self.groups)} state groups, got "
                f"{len(block_ids)} block ids"
            )
        low = -1 if skips else 0
        bad = [b for b in block_ids if not low <= b < self.num_blocks]
        if bad:
            raise ValueError(
                f"state block ids {list(block_ids)} have {bad} outside [{low}, {self.num_blocks})"
            )
        if not 0 <= part < self.parts:
            raise ValueError(f"state part {part} is outside [0, {self.parts})")

    def _pieces(self, block_ids: Sequence[int], part: int) -> Iterator[tuple[torch.Tensor, slice]]:
        """(bytes of a block's segment row, where they sit in the part) for each row that
        overlaps part `part`; rows of a -1 block are left out."""
        lo, hi = part * self.part_bytes, (part + 1) * self.part_bytes
        off = 0
        for pages, b in zip(self.groups, block_ids, strict=True):
            for seg in pages.segments:
                n = seg.nbytes
                a, z = max(off, lo), min(off + n, hi)
                if a < z and b >= 0:
                    yield seg.view[b, a - off : z - off], slice(a - lo, z - lo)
                off += n

    def gather(self, block_ids: Sequence[int], dst: torch.Tensor, part: int) -> None:
        """Copy part `part` of the state blocks into `dst` (uint8, `part_bytes`)."""
        self._check(block_ids, part, skips=False)
        for row, where in self._pieces(block_ids, part):
            dst[where].copy_(row)
        tail = self.state_bytes - part * self.part_bytes
        if tail < self.part_bytes:
            dst[max(tail, 0) :].zero_()  # never another record's stale bytes in a slot

    def scatter(self, src: torch.Tensor, block_ids: Sequence[int], part: int) -> int:
        """Copy part `part` of a state record into the blocks named (-1: left alone); the
        number of state blocks this part wrote into."""
        self._check(block_ids, part, skips=True)
        wrote = False
        for row, where in self._pieces(block_ids, part):
            row.copy_(src[where])
            wrote = True
        return sum(1 for b in block_ids if b >= 0) if wrote else 0


class GroupedCodec:
    """Gathers one chunk of every attention group into a flat uint8 buffer and scatters one
    back, and a boundary's state parts the same way; the same interface as `PageCodec` (its
    `blocks_per_chunk` counts every attention group's positions)."""

    def __init__(self, pages: KVPages, blocks_per_chunk: int, ops: DeviceOps) -> None:
        if not pages.groups:
            raise ValueError("GroupedCodec needs a hybrid registration (KVPages.groups)")
        self.pages = pages
        self.ops = ops
        self.layout = ChunkGroups(pages.group_specs, blocks_per_chunk * pages.block_size)
        states = set(self.layout.states)
        self.codecs = tuple(
            PageCodec(g, n, ops)
            for i, (g, n) in enumerate(zip(pages.groups, self.layout.positions, strict=True))
            if i not in states
        )
        self.blocks_per_chunk = self.layout.total_positions
        self.num_blocks = pages.num_blocks
        self.chunk_bytes = sum(c.chunk_bytes for c in self.codecs)
        # bytes one written position moves (groups hold equal pages in vLLM's hybrid pool);
        # only load byte counters read it
        self.bytes_per_block = self.chunk_bytes // self.blocks_per_chunk
        self.device = pages.device
        self.states = StateCodec([pages.groups[i] for i in self.layout.states], self.chunk_bytes)

    def _parts(
        self, block_ids: Sequence[int], buf: torch.Tensor
    ) -> list[tuple[PageCodec, Sequence[int], torch.Tensor]]:
        if len(block_ids) != self.blocks_per_chunk:
            raise ValueError(
                f"a chunk has {self.blocks_per_chunk} positions over {len(self.codecs)} KV cache "
                f"groups ({self.layout.describe()}), got {len(block_ids)} block ids"
            )
        if buf.dtype != torch.uint8 or buf.numel() != self.chunk_bytes:
            raise ValueError(
                f"chunk buffer must be uint8 of {self.chunk_bytes} bytes, got {buf.dtype} of "
                f"{buf.numel()}"
            )
        out = []
        pos = off = 0
        for codec in self.codecs:
            n = codec.blocks_per_chunk
            out.append((codec, block_ids[pos : pos + n], buf[off : off + codec.chunk_bytes]))
            pos += n
            off += codec.chunk_bytes
        return out

    def records(self, chunks: Sequence[ChunkRef]) -> list[ChunkRef]:
        """The records an op's chunks are in the tiers: a state record's ref (part 0, its
        parent the chunk it ends) becomes one ref per part. Part 0 is the leaf of the parts'
        chain (part j's parent is part j + 1, the last part's the chunk): it is evicted first,
        and it is the key a lookup asks for (`ChunkLayout.ends`)."""
        out: list[ChunkRef] = []
        for ref in chunks:
            if ref.part < 0:
                out.append(ref)
                continue
            keys = [state_key(ref.parent, j) for j in range(self.states.parts)]
            for j, key in enumerate(keys):
                up = keys[j + 1] if j + 1 < len(keys) else ref.parent
                out.append(ChunkRef(key, ref.block_ids, up, j))
        return out

    def refs(self, key: bytes, per_group: Sequence[int]) -> list[ChunkRef]:
        """The records of one chunk keyed `key` whose blocks are given group by group (each
        attention group's positions, one block per state group): the chunk, then its
        boundary's state record (the self-test moves both through the real paths)."""
        chunk: list[int] = []
        state: list[int] = []
        pos = 0
        for i, n in enumerate(self.layout.positions):
            if i in self.layout.states:
                state.append(per_group[pos])
                pos += 1
            else:
                chunk.extend(per_group[pos : pos + n])
                pos += n
        out = [ChunkRef(key, chunk)]
        if state:
            out.append(ChunkRef(state_key(key, 0), state, key, 0))
        return out

    def regions(self, block_ids: Sequence[int], buf: torch.Tensor, *, skips: bool = False) -> None:
        """No 2-D copy plan: groups alias one pool, so their pages go by gather and scatter."""
        return None

    def gather(self, block_ids: Sequence[int], dst: torch.Tensor, part: int = -1) -> None:
        """Copy every group's positions of the chunk into `dst` (uint8, `chunk_bytes`); with
        `part` >= 0, that part of the state groups' blocks `block_ids`."""
        if part >= 0:
            self.states.gather(block_ids, dst, part)
            return
        for codec, ids, piece in self._parts(block_ids, dst):
            codec.gather(ids, piece)

    def scatter(self, src: torch.Tensor, block_ids: Sequence[int], part: int = -1) -> int:
        """Copy `src` into every group's blocks named; -1 positions are left alone. Returns the
        number of blocks written (with `part` >= 0: a state part into the state blocks)."""
        if part >= 0:
            return self.states.scatter(src, block_ids, part)
        return sum(codec.scatter(piece, ids) for codec, ids, piece in self._parts(block_ids, src))


def codec_for(pages: KVPages, blocks_per_chunk: int, ops: DeviceOps) -> PageCodec | GroupedCodec:
    """The codec of a registration: grouped for a hybrid one, one PageCodec otherwise."""
    if pages.groups:
        return GroupedCodec(pages, blocks_per_chunk, ops)
    return PageCodec(pages, blocks_per_chunk, ops)


def state_parts(codec: PageCodec | GroupedCodec) -> int:
    """The parts of a boundary state record under `codec` (0: no state groups)."""
    return codec.states.parts if isinstance(codec, GroupedCodec) else 0
