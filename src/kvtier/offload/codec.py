"""KV blocks <-> chunk bytes, on the KV device. Blocks are copied whole and opaque, so any page
layout round-trips bit-exactly. A chunk payload is segment-major then block-major:
`[seg0 blk0..blkN-1][seg1 blk0..]...`, a segment being adjacent page runs of one allocation
(`kvtier.offload.pages`). Segments of one allocation spaced evenly apart (a layer-outer layout's
layers) move as one 3-D stack, so a chunk costs one copy per stack and run of blocks, not one per
layer. Both directions touch device tensors only: `gather` fills a buffer on the KV device
(device staging, or the host slot itself when the device is the host) and `scatter` reads one;
crossing to the host is the caller's explicit copy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvtier.offload.device import DeviceOps
from kvtier.offload.dma import Span
from kvtier.offload.messages import ChunkRef
from kvtier.offload.pages import KVPages
from kvtier.offload.waves import Waves

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
        self._stacks = _stacks(pages)
        self._geometry = _geometry(self._stacks, blocks_per_chunk)

    def records(self, chunks: Sequence[ChunkRef]) -> list[ChunkRef]:
        """The records an op's chunks are in the tiers: one each (no state records here)."""
        return list(chunks)

    def refs(self, key: bytes, per_group: Sequence[int]) -> list[ChunkRef]:
        """The records of one chunk keyed `key` over blocks `per_group`: the chunk alone."""
        return [ChunkRef(key, list(per_group))]

    def _check(self, block_ids: Sequence[int], *, skips: bool) -> None:
        if len(block_ids) != self.blocks_per_chunk:
            raise ValueError(f"a chunk has {self.blocks_per_chunk} blocks, got {len(block_ids)}")
        low = -1 if skips else 0
        bad = [b for b in block_ids if not low <= b < self.num_blocks]
        if bad:
            raise ValueError(
                f"block ids {list(block_ids)} have {bad} outside [{low}, {self.num_blocks})"
            )

    def _check_buffer(self, buf: torch.Tensor) -> None:
        if buf.dtype != torch.uint8 or buf.numel() != self.chunk_bytes or not buf.is_contiguous():
            raise ValueError(
                f"chunk buffer must be contiguous uint8 of {self.chunk_bytes} bytes, got "
                f"{buf.dtype} of {buf.numel()}"
            )

    def _rows(self, buf: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(stack view `(S, num_blocks, nbytes)`, this chunk's rows of it in `buf` as
        `(S, blocks_per_chunk, nbytes)`) per stack, in payload order."""
        self._check_buffer(buf)
        n = self.blocks_per_chunk
        out = []
        off = 0
        for view in self._stacks:
            count, _, sb = view.shape
            out.append((view, buf[off : off + count * n * sb].view(count, n, sb)))
            off += count * n * sb
        return out

    def regions(
        self, block_ids: Sequence[int], buf: torch.Tensor, *, skips: bool = False
    ) -> list[Span] | None:
        """The chunk as 2-D copies between the KV cache and `buf`: per stack and run of
        consecutive ids, the run's bytes of every segment (rows = segments, pitch = the stack's
        stride) and the same bytes of `buf`. None when the ids form more than a few runs, or a
        stack's blocks are not adjacent in memory: a gather or scatter kernel moves those. With
        `skips`, -1 positions are left out (a load's HBM blocks)."""
        stacked = self._stacked_regions(block_ids, buf, skips=skips)
        return None if stacked is None else [span for _, span in stacked]

    def wave_regions(
        self, block_ids: Sequence[int], buf: torch.Tensor, waves: Waves
    ) -> list[list[Span]] | None:
        """`regions` (a load's, -1 positions left out) split by the wave each stack row lands
        in: one list of spans per wave, a row range of a span being a span of its own."""
        stacked = self._stacked_regions(block_ids, buf, skips=True)
        if stacked is None:
            return None
        out: list[list[Span]] = [[] for _ in range(waves.count)]
        for si, span in stacked:
            for w, r0, r1 in waves.rows[si]:
                out[w].append(span.rows(r0, r1))
        return out

    def stack_sizes(self) -> list[int]:
        """The segments in each stack (its rows), in payload order."""
        return [int(v.shape[0]) for v in self._stacks]

    def _stacked_regions(
        self, block_ids: Sequence[int], buf: torch.Tensor, *, skips: bool
    ) -> list[tuple[int, Span]] | None:
        # integer arithmetic on geometry taken once: no torch call per chunk, each of which
        # lets a thread running Python beside the lane take the GIL (issue 41, item 6)
        self._check(block_ids, skips=skips)
        runs = [r for r in _runs(block_ids) if r[1] >= 0]
        if len(runs) > _MAX_RUNS:
            return None
        self._check_buffer(buf)
        addr, keep, per_chunk = buf.data_ptr(), (buf, self._stacks), self.blocks_per_chunk
        out = []
        for si, g in enumerate(self._geometry):
            for p, b, n in runs:
                if n > 1 and not g.adjacent:
                    return None  # the run's blocks are not adjacent in this stack
                span = Span(
                    g.base + b * g.block_stride, g.pitch,
                    addr + g.offset + p * g.row_bytes, per_chunk * g.row_bytes,
                    n * g.row_bytes, g.rows, keep,
                )  # fmt: skip
                out.append((si, span))
        return out

    def gather(self, block_ids: Sequence[int], dst: torch.Tensor, part: int = -1) -> None:
        """Copy the chunk's blocks into `dst` (uint8, `chunk_bytes`, on the KV device)."""
        _no_state(part)
        self._check(block_ids, skips=False)
        runs = _runs(block_ids)
        if len(runs) <= _MAX_RUNS:
            for view, rows in self._rows(dst):
                for p, b, n in runs:
                    rows[:, p : p + n].copy_(view[:, b : b + n])
            return
        idx = self.ops.index(block_ids)
        for view, rows in self._rows(dst):
            torch.index_select(view, 1, idx, out=rows)

    def scatter(self, src: torch.Tensor, block_ids: Sequence[int], part: int = -1) -> int:
        """Copy `src` (uint8 chunk bytes on the KV device) into the blocks named; -1 positions
        are left alone. Returns the number of blocks written."""
        _no_state(part)
        self._check(block_ids, skips=True)
        keep = [i for i, b in enumerate(block_ids) if b >= 0]
        if not keep:
            return 0
        runs = [r for r in _runs(block_ids) if r[1] >= 0]
        if len(runs) <= _MAX_RUNS:
            for view, rows in self._rows(src):
                for p, b, n in runs:
                    view[:, b : b + n].copy_(rows[:, p : p + n])
            return len(keep)
        whole = len(keep) == len(block_ids)
        targets = self.ops.index([block_ids[i] for i in keep])
        positions = None if whole else self.ops.index(keep)
        for view, rows in self._rows(src):
            view.index_copy_(1, targets, rows if positions is None else rows[:, positions])
        return len(keep)


def gather_call(
    codec: PageCodec, ids: Sequence[int], dst: torch.Tensor, part: int
) -> Callable[[], None]:
    """The gather of one record for a lane: a chunk's blocks, or part `part` of a boundary's
    state (a codec without state records is called as it always was)."""
    if part < 0:
        return lambda: codec.gather(ids, dst)
    return lambda: codec.gather(ids, dst, part)


def scatter_call(
    codec: PageCodec, src: torch.Tensor, ids: Sequence[int], part: int
) -> Callable[[], int]:
    """The scatter of one record for a lane (`gather_call`'s other direction)."""
    if part < 0:
        return lambda: codec.scatter(src, ids)
    return lambda: codec.scatter(src, ids, part)


def _no_state(part: int) -> None:
    if part >= 0:
        raise ValueError(
            f"state part {part} sent to a registration without state groups; only a hybrid "
            "registration with Mamba / linear-attention groups stores boundary states"
        )


@dataclass(frozen=True, slots=True)
class _Geometry:
    """A stack's layout in bytes, taken once: a run's 2-D copy is arithmetic on it."""

    base: int  # the address of segment 0's block 0
    rows: int  # segments
    pitch: int  # from one segment to the next
    block_stride: int  # from one block to the next within a segment
    row_bytes: int  # one block's bytes in one segment
    adjacent: bool  # consecutive blocks are contiguous: a run of them is one row of bytes
    offset: int  # where the stack's rows start in a chunk buffer


def _geometry(stacks: Sequence[torch.Tensor], blocks_per_chunk: int) -> list[_Geometry]:
    out, offset = [], 0
    for v in stacks:
        count, nb, sb = v.shape
        if v.dtype != torch.uint8 or (sb > 1 and v.stride(2) != 1):
            raise ValueError(f"a stack must be uint8 rows of contiguous bytes, got {v.dtype} "
                             f"{tuple(v.shape)} strides {v.stride()}")  # fmt: skip
        out.append(_Geometry(v.data_ptr(), count, v.stride(0), v.stride(1), sb, v.stride(1) == sb,
                             offset))  # fmt: skip
        offset += count * blocks_per_chunk * sb
    return out


def _stacks(pages: KVPages) -> list[torch.Tensor]:
    """Consecutive segments of one allocation with one row size and block stride, each the
    same distance after the one before, as `(S, num_blocks, nbytes)` views (payload order)."""
    segs = pages.segments
    out: list[torch.Tensor] = []
    i = 0
    while i < len(segs):
        first = segs[i].view
        j = i + 1
        step = 0
        while j < len(segs):
            v = segs[j].view
            gap = v.storage_offset() - segs[j - 1].view.storage_offset()
            same = (
                v.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                and v.shape == first.shape
                and v.stride() == first.stride()
                and gap > 0
                and (step == 0 or gap == step)
            )
            if not same:
                break
            step = gap
            j += 1
        count = j - i
        nb, sb = first.shape
        stride = step if count > 1 else nb * first.stride(0)
        out.append(
            first.as_strided((count, nb, sb), (stride, first.stride(0), 1), first.storage_offset())
        )
        i = j
    return out
