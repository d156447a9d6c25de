"""KV blocks <-> chunk bytes. Blocks are copied whole and opaque, so any page layout round-trips
bit-exactly. A chunk payload is segment-major then block-major:
`[seg0 blk0..blkN-1][seg1 blk0..]...` where a segment is one registered tensor's block slice."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kvtier.errors import LayoutError


class BlockCodec:
    """Packs the blocks of one chunk into a flat uint8 buffer and unpacks it back."""

    def __init__(
        self, kv_caches: Mapping[str, torch.Tensor], blocks_per_chunk: int, num_blocks: int
    ) -> None:
        if not kv_caches:
            raise LayoutError("no KV cache tensors were registered; nothing can be offloaded")
        self.blocks_per_chunk = blocks_per_chunk
        self.num_blocks = num_blocks
        self._segs: list[torch.Tensor] = []
        for name, t in kv_caches.items():
            if t.shape[0] != num_blocks:
                raise LayoutError(
                    f"KV tensor {name} has {t.shape[0]} blocks on dim 0, expected {num_blocks}; "
                    "register block-major tensors with one shared block count"
                )
            if not t.is_contiguous():
                raise LayoutError(f"KV tensor {name} is not contiguous; register contiguous caches")
            self._segs.append(t.view(num_blocks, -1).view(torch.uint8))
        self.seg_bytes = [s.shape[1] for s in self._segs]
        self.bytes_per_block = sum(self.seg_bytes)
        self.chunk_bytes = self.bytes_per_block * blocks_per_chunk
        self.device = self._segs[0].device

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        if len(block_ids) != self.blocks_per_chunk:
            raise ValueError(f"a chunk has {self.blocks_per_chunk} blocks, got {len(block_ids)}")
        return torch.tensor(block_ids, dtype=torch.long, device=self.device)

    def pack(self, block_ids: Sequence[int], dst: torch.Tensor) -> None:
        """Copy the chunk's blocks into `dst` (uint8, `chunk_bytes` long)."""
        idx = self._index(block_ids)
        if int(idx.min()) < 0 or int(idx.max()) >= self.num_blocks:
            raise ValueError(f"block ids {list(block_ids)} outside [0, {self.num_blocks})")
        off = 0
        n = self.blocks_per_chunk
        for seg, sb in zip(self._segs, self.seg_bytes, strict=True):
            torch.index_select(seg, 0, idx, out=dst[off : off + n * sb].view(n, sb))
            off += n * sb

    def unpack(self, src: torch.Tensor, block_ids: Sequence[int]) -> int:
        """Copy chunk bytes into the blocks named in `block_ids`; -1 positions are left alone.

        Returns the number of blocks written.
        """
        idx = self._index(block_ids)
        keep = idx >= 0
        if int(idx.max()) >= self.num_blocks:
            raise ValueError(f"block ids {list(block_ids)} outside [0, {self.num_blocks})")
        if not bool(keep.any()):
            return 0
        whole = bool(keep.all())
        positions = keep.nonzero().squeeze(1)
        targets = idx if whole else idx[keep]
        off = 0
        n = self.blocks_per_chunk
        for seg, sb in zip(self._segs, self.seg_bytes, strict=True):
            rows = src[off : off + n * sb].view(n, sb)
            seg.index_copy_(0, targets, rows if whole else rows.index_select(0, positions))
            off += n * sb
        return int(targets.numel())
