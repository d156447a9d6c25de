"""KV cache groups of a hybrid model: which block positions of a chunk each group stores and
loads (torch-free; the scheduler and the page description both read it).

A hybrid model keeps one block table per group over one block pool (vLLM's hybrid memory
allocator). kvtier stores, per chunk, what a later hit at that chunk's boundary needs from
every group, in one record, so a chunk is a hit for every group or for none:

- a full-attention group: every block of the chunk;
- a sliding-window group: only the chunk's last blocks that a hit ending at the chunk's
  boundary (or one token before it: a whole-prompt hit gives one token back) still reads.
  vLLM frees a sliding-window group's blocks below `tokens - (window - 1 + retained)` while the
  request runs, so the older blocks are neither needed by a hit nor safe to read;
- a state group (Mamba, gated delta net, short conv, linear attention): nothing in the chunk's
  record. Its state at a chunk's boundary is a record of its own (`state_key`), stored only
  where the host materialized that state, and a hit may end only at a boundary whose state
  the tier holds (`ChunkLayout.ends`): a state is one block per group, written in place while
  the request runs, so only the host's hand-off names the block that holds a boundary's state.

A chunk's `ChunkRef.block_ids` is the groups' positions in group order: group 0's positions,
then group 1's, ...; -1 marks a position a load must not write. A state record's block ids are
the state groups' blocks, one per group in group order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

FULL = "full_attention"
SLIDING = "sliding_window"
STATE = "state"
KINDS = (FULL, SLIDING, STATE)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One KV cache group: its kind, the tokens a block holds, its layers and, for a sliding
    window, `reach`: the tokens before the next token that the host keeps (window - 1 plus any
    tokens it retains beyond the window). `detail` names what else tells two groups' bytes
    apart (a state group's kind of mixer, state shapes and dtypes); it is in the fingerprint."""

    kind: str
    block_size: int
    layers: tuple[str, ...] = ()
    reach: int = 0
    detail: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"GroupSpec.kind {self.kind!r} is not one of {KINDS}")
        if self.block_size <= 0:
            raise ValueError(f"GroupSpec.block_size {self.block_size} must be positive")
        if self.kind == SLIDING and self.reach < 0:
            raise ValueError(f"GroupSpec.reach {self.reach} of a sliding window must be >= 0")

    def describe(self) -> str:
        """`full_attention`, `sliding_window(reach=127)` or `state(gdn_attention ...)`, for logs
        and fingerprints."""
        if self.kind == SLIDING:
            return f"{self.kind}(reach={self.reach})"
        if self.kind == STATE:
            return f"{self.kind}({self.detail})"
        return self.kind

    def skipped_blocks(self, tokens: int) -> int:
        """Leading blocks the host no longer holds once `tokens` are computed (0 for full
        attention): vLLM's `SlidingWindowManager.get_num_skipped_tokens` in whole blocks."""
        if self.kind != SLIDING:
            return 0
        return max(0, tokens - self.reach) // self.block_size

    def positions(self, blocks_per_chunk: int) -> int:
        """Block positions of a chunk this group stores: all of them for full attention; for a
        sliding window the last ones a hit at the boundary, or one token before it, reads;
        none for a state group (its boundary state is a record of its own)."""
        if self.kind == FULL:
            return blocks_per_chunk
        if self.kind == STATE:
            return 0
        return min(blocks_per_chunk, _cdiv(self.reach + 1, self.block_size))


class ChunkGroups:
    """The chunk layout of a hybrid registration: per group, which of a chunk's blocks a save
    reads and a load writes. Every group has the chunk's block size."""

    def __init__(self, groups: Sequence[GroupSpec], chunk_size: int) -> None:
        if not groups:
            raise ValueError("ChunkGroups needs at least one group")
        sizes = {g.block_size for g in groups}
        if len(sizes) != 1:
            raise ValueError(
                f"KV cache groups have block sizes {sorted(sizes)}; kvtier needs one block "
                "size for every group"
            )
        self.groups = tuple(groups)
        self.block_size = sizes.pop()
        if chunk_size % self.block_size:
            raise ValueError(
                f"chunk_size={chunk_size} is not a multiple of block_size={self.block_size}"
            )
        self.chunk = chunk_size
        self.blocks_per_chunk = chunk_size // self.block_size
        self.positions = tuple(g.positions(self.blocks_per_chunk) for g in self.groups)
        self.total_positions = sum(self.positions)
        self.windowed = tuple(i for i, g in enumerate(self.groups) if g.kind == SLIDING)
        self.states = tuple(i for i, g in enumerate(self.groups) if g.kind == STATE)

    def describe(self) -> str:
        """One line: each group's kind and stored positions per chunk."""
        parts = [
            f"{g.describe()} x{len(g.layers)} layers: "
            + (
                "its state at the chunk's boundary, a record of its own"
                if g.kind == STATE
                else f"{p}/{self.blocks_per_chunk} blocks"
            )
            for g, p in zip(self.groups, self.positions, strict=True)
        ]
        return "; ".join(parts)

    def state_ids(self, tables: Sequence[Sequence[int]], end: int) -> list[int] | None:
        """The state groups' blocks a load ending at token `end` (a boundary) writes: each
        group's block of the state after `end` tokens (its table's position `end // block - 1`);
        None when a group's table does not hold one there."""
        out: list[int] = []
        j = end // self.block_size - 1
        for g in self.states:
            table = tables[g]
            if j < 0 or j >= len(table) or table[j] < 0:
                return None
            out.append(table[j])
        return out

    def _first_stored(self, g: int, c: int) -> int:
        """Index (in the request's block table) of the first block group `g` stores of chunk c."""
        return (c + 1) * self.blocks_per_chunk - self.positions[g]

    def first_saveable(self, computed_before: int) -> int:
        """The first chunk whose stored blocks the host still holds in every group while a step
        starts from `computed_before` computed tokens (blocks are freed from below only)."""
        first = 0
        for g in self.windowed:
            skipped = self.groups[g].skipped_blocks(computed_before)
            # smallest c with (c + 1) * bpc - positions >= skipped
            c = max(0, _cdiv(skipped + self.positions[g], self.blocks_per_chunk) - 1)
            first = max(first, c)
        return first

    def save_ids(self, tables: Sequence[Sequence[int]], c: int) -> list[int] | None:
        """Chunk c's positions in every group, or None when a position's block is not held
        (a table too short, or a block the host already dropped, marked -1)."""
        out: list[int] = []
        for g, table in enumerate(tables):
            if g in self.states:
                continue  # a boundary's state is saved from the host's hand-off
            start = self._first_stored(g, c)
            end = (c + 1) * self.blocks_per_chunk
            if len(table) < end:
                return None
            ids = list(table[start:end])
            if any(b < 0 for b in ids):
                return None
            out.extend(ids)
        return out

    def window_ids(self, ids: Sequence[int]) -> list[int]:
        """The sliding-window groups' block ids among one chunk's positions (`save_ids`)."""
        out: list[int] = []
        off = 0
        for g, n in enumerate(self.positions):
            if g in self.windowed:
                out.extend(b for b in ids[off : off + n] if b >= 0)
            off += n
        return out

    def load_ids(
        self, tables: Sequence[Sequence[int]], c: int, floor: int, end: int
    ) -> list[int] | None:
        """Chunk c's positions for a load of tokens [floor, end): the block of every position
        the load writes, -1 where it must not (below the HBM floor, past the claim, below what
        a sliding window keeps at `end`). None when the run needs a block this chunk does not
        store (a claim cut short of the chunk's boundary, deeper than the stored window)."""
        out: list[int] = []
        bs = self.block_size
        for g, table in enumerate(tables):
            if g in self.states:
                continue  # the state of the load's end is a record of its own
            group = self.groups[g]
            first = self._first_stored(g, c)
            keep_from = group.skipped_blocks(end)
            # a block is written when its first token lies in [floor, end) and the host keeps it
            lo = max(_cdiv(floor, bs), keep_from)
            hi = _cdiv(end, bs)
            if max(lo, c * self.blocks_per_chunk) < min(hi, first):
                return None  # the run needs a block of this chunk the record does not hold
            for j in range(first, (c + 1) * self.blocks_per_chunk):
                b = table[j] if lo <= j < hi and j < len(table) else -1
                out.append(b if b >= 0 else -1)
        return out

    def claimed(self, tables: Sequence[Sequence[int]], floor: int, end: int) -> list[int]:
        """Every block a load of tokens [floor, end) writes, over every group (what the host
        recomputes when the load fails)."""
        out: list[int] = []
        bs = self.block_size
        for g, table in enumerate(tables):
            if g in self.states:
                j = end // bs - 1
                if 0 <= j < len(table) and table[j] >= 0:
                    out.append(table[j])
                continue
            lo = max(_cdiv(floor, bs), self.groups[g].skipped_blocks(end))
            out.extend(b for b in table[lo : _cdiv(end, bs)] if b >= 0)
        return out
