"""KV blocks <-> chunk bytes for a hybrid registration: one `PageCodec` per KV cache group over
that group's own pages, the payload group-major (`[group 0's positions][group 1's]...`).

A chunk's `ChunkRef.block_ids` lists every group's positions in group order
(`kvtier.offload.groups`); a sliding-window group stores fewer positions than a full-attention
group. The record holds every group's part, so a chunk read back restores all groups or is a
miss for all of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.offload.codec import PageCodec
from kvtier.offload.device import DeviceOps
from kvtier.offload.groups import ChunkGroups
from kvtier.offload.pages import KVPages

__all__ = ["GroupedCodec", "codec_for"]


class GroupedCodec:
    """Gathers one chunk of every group into a flat uint8 buffer and scatters one back; the
    same interface as `PageCodec` (its `blocks_per_chunk` counts every group's positions)."""

    def __init__(self, pages: KVPages, blocks_per_chunk: int, ops: DeviceOps) -> None:
        if not pages.groups:
            raise ValueError("GroupedCodec needs a hybrid registration (KVPages.groups)")
        self.pages = pages
        self.ops = ops
        self.layout = ChunkGroups(pages.group_specs, blocks_per_chunk * pages.block_size)
        self.codecs = tuple(
            PageCodec(g, n, ops) for g, n in zip(pages.groups, self.layout.positions, strict=True)
        )
        self.blocks_per_chunk = self.layout.total_positions
        self.num_blocks = pages.num_blocks
        self.chunk_bytes = sum(c.chunk_bytes for c in self.codecs)
        # bytes one written position moves (groups hold equal pages in vLLM's hybrid pool);
        # only load byte counters read it
        self.bytes_per_block = self.chunk_bytes // self.blocks_per_chunk
        self.device = pages.device

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

    def gather(self, block_ids: Sequence[int], dst: torch.Tensor) -> None:
        """Copy every group's positions of the chunk into `dst` (uint8, `chunk_bytes`)."""
        for codec, ids, part in self._parts(block_ids, dst):
            codec.gather(ids, part)

    def scatter(self, src: torch.Tensor, block_ids: Sequence[int]) -> int:
        """Copy `src` into every group's blocks named; -1 positions are left alone. Returns the
        number of blocks written."""
        return sum(codec.scatter(part, ids) for codec, ids, part in self._parts(block_ids, src))


def codec_for(pages: KVPages, blocks_per_chunk: int, ops: DeviceOps) -> PageCodec | GroupedCodec:
    """The codec of a registration: grouped for a hybrid one, one PageCodec otherwise."""
    if pages.groups:
        return GroupedCodec(pages, blocks_per_chunk, ops)
    return PageCodec(pages, blocks_per_chunk, ops)
