"""KV blocks <-> chunk bytes, on the KV device. Blocks are copied whole and opaque, so any page
layout round-trips bit-exactly. A chunk payload is segment-major then block-major:
`[seg0 blk0..blkN-1][seg1 blk0..]...`, a segment being adjacent page runs of one allocation
(`kvtier.offload.pages`). Both directions touch device tensors only: `gather` fills a buffer on
the KV device (device staging, or the host slot itself when the device is the host) and
`scatter` reads one; crossing to the host is the caller's explicit copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.offload.device import DeviceOps
from kvtier.offload.pages import KVPages

# a chunk whose blocks form at most this many runs of consecutive ids moves run by run (one
# slice copy per run and segment: memcpy speed); more scattered ids use one indexed op per
# segment (on the CPU index_copy_ runs at a fraction of memcpy speed, on CUDA it is one kernel)
_MAX_RUNS = 4


def _runs(ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first position, first id, length) of each run of consecutive ids."""
    out: list[tuple[int, int, int]] = []
    for pos, b in enumerate(ids):
        last = out[-1] if out else None
        if last is not None and b >= 0 and last[1] >= 0 and last[1] + last[2] == b:
            p0, b0, n = out[-1]
            out[-1] = (p0, b0, n + 1)
        else:
            out.append((pos, b, 1))
    return out


class PageCodec:
    """Gathers the blocks of one chunk into a flat uint8 buffer and scatters one back."""

    def __init__(self, pages: KVPages, blocks_per_chunk: int, ops: DeviceOps) -> None:
        if blocks_per_chunk <= 0:
            raise ValueError(f"blocks_per_chunk must be >= 1, got {blocks_per_chunk}")
        self.pages = pages
        self.ops = ops
        self.blocks_per_chunk = blocks_per_chunk
        self.num_blocks = pages.num_blocks
        self.bytes_per_block = pages.bytes_per_block
        self.chunk_bytes = pages.chunk_bytes(blocks_per_chunk)
        self.device = pages.device

    def _check(self, block_ids: Sequence[int], *, skips: bool) -> None:
        if len(block_ids) != self.blocks_per_chunk:
            raise ValueError(f"a chunk has {self.blocks_per_chunk} blocks, got {len(block_ids)}")
        low = -1 if skips else 0
        bad = [b for b in block_ids if not low <= b < self.num_blocks]
        if bad:
            raise ValueError(
                f"block ids {list(block_ids)} have {bad} outside [{low}, {self.num_blocks})"
            )

    def _rows(self, buf: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(segment view, this chunk's rows of it in `buf`) per segment, in payload order."""
        if buf.dtype != torch.uint8 or buf.numel() != self.chunk_bytes:
            raise ValueError(
                f"chunk buffer must be uint8 of {self.chunk_bytes} bytes, got {buf.dtype} of "
                f"{buf.numel()}"
            )
        n = self.blocks_per_chunk
        out = []
        off = 0
        for seg in self.pages.segments:
            sb = seg.nbytes
            out.append((seg.view, buf[off : off + n * sb].view(n, sb)))
            off += n * sb
        return out

    def gather(self, block_ids: Sequence[int], dst: torch.Tensor) -> None:
        """Copy the chunk's blocks into `dst` (uint8, `chunk_bytes`, on the KV device)."""
        self._check(block_ids, skips=False)
        runs = _runs(block_ids)
        if len(runs) <= _MAX_RUNS:
            for view, rows in self._rows(dst):
                for p, b, n in runs:
                    rows[p : p + n].copy_(view[b : b + n])
            return
        idx = self.ops.index(block_ids)
        for view, rows in self._rows(dst):
            torch.index_select(view, 0, idx, out=rows)

    def scatter(self, src: torch.Tensor, block_ids: Sequence[int]) -> int:
        """Copy `src` (uint8 chunk bytes on the KV device) into the blocks named; -1 positions
        are left alone. Returns the number of blocks written."""
        self._check(block_ids, skips=True)
        keep = [i for i, b in enumerate(block_ids) if b >= 0]
        if not keep:
            return 0
        runs = [r for r in _runs(block_ids) if r[1] >= 0]
        if len(runs) <= _MAX_RUNS:
            for view, rows in self._rows(src):
                for p, b, n in runs:
                    view[b : b + n].copy_(rows[p : p + n])
            return len(keep)
        whole = len(keep) == len(block_ids)
        targets = self.ops.index([block_ids[i] for i in keep])
        positions = None if whole else self.ops.index(keep)
        for view, rows in self._rows(src):
            view.index_copy_(0, targets, rows if positions is None else rows[positions])
        return len(keep)
