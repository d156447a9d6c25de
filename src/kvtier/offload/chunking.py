"""How a request's blocks map to chunk records, chosen once at wiring time: a dense model's one
block table, or a hybrid model's tables of every KV cache group (`kvtier.offload.groups`). The
scheduler asks its layout and never branches on the model's kind.

A load claims `[hbm, end)`: positions below the HBM floor are shared blocks it must not write,
positions past the claim are not its own (both -1 in a chunk's block ids). A save covers whole
chunks `[first, end)` past the emitted frontier.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvtier.keys import state_key
from kvtier.offload.groups import ChunkGroups
from kvtier.offload.messages import ChunkRef
from kvtier.offload.protocols import RequestView, StepRequest

Tables = list[list[int]]


class Claim(Protocol):
    """The blocks a load may write: the flat table (or the largest group's), every group's
    tables (hybrid only), and the tokens `[hbm, end)` it claims (a scheduler's load record)."""

    block_ids: list[int] | None
    tables: Tables | None
    hbm: int
    end: int


@dataclass(frozen=True, slots=True)
class SaveChunks:
    """What one save of a request writes: `chunks` from chunk `first`, the new emitted frontier
    `end` (chunks passed over count as done), and the sliding-window blocks it reads."""

    chunks: list[ChunkRef]
    first: int
    end: int
    window: set[int] = field(default_factory=set)


class ChunkLayout(Protocol):
    """Per-model answers about chunks and blocks (dense or hybrid)."""

    # a sync load fails by failing its whole step's forward; only a dense host can take back a
    # part of a request's blocks (a hybrid host gives back whole requests: failed_recving)
    sync_loads: bool
    # a load must end where the lookup said (a state layout: the boundary whose state is held),
    # never cut short at another chunk boundary by the load-or-recompute choice
    exact_end: bool

    def ends(self, keys: Sequence[bytes], prompt_len: int) -> list[bytes] | None:
        """Per chunk, the key the tier must hold for a hit to end after it (None: any chunk)."""
        ...

    def tables(self, view: RequestView) -> Tables | None:
        """The request's per-group block tables at allocation (None: dense)."""
        ...

    def load_chunks(self, keys: Sequence[bytes], claim: Claim) -> list[ChunkRef] | None:
        """The chunks a load writes, with the positions it may write; None when a chunk's
        blocks are not held (a sliding window's blocks the host cut short of the chunk)."""
        ...

    def claimed(self, claim: Claim) -> list[int]:
        """Every block the claim covers (what a failing load reports invalid)."""
        ...

    def save_chunks(
        self, keys: Sequence[bytes], item: StepRequest, emitted: int, aligned: int
    ) -> SaveChunks:
        """The chunks of `[emitted, aligned)` the request's blocks hold now."""
        ...

    def counted_claim(
        self, block_ids: Sequence[int] | Sequence[Sequence[int]]
    ) -> tuple[list[int], Tables | None]:
        """A table a host handed to a failing hook, as (flat ids, per-group tables)."""
        ...


def _ids(claim: Claim) -> list[int]:
    assert claim.block_ids is not None, "a load's blocks are known once they are allocated"
    return claim.block_ids


def parent(keys: Sequence[bytes], c: int) -> bytes:
    """The key of the chunk before chunk `c` (b"" for the first)."""
    return keys[c - 1] if c else b""


class DenseLayout:
    """One block table: a chunk is `blocks_per_chunk` consecutive entries of it."""

    sync_loads = True
    exact_end = False

    def __init__(self, chunk: int, block_size: int) -> None:
        self.chunk = chunk
        self.block_size = block_size
        self.blocks_per_chunk = chunk // block_size

    def tables(self, view: RequestView) -> Tables | None:
        return None

    def ends(self, keys: Sequence[bytes], prompt_len: int) -> list[bytes] | None:
        return None

    def load_chunks(self, keys: Sequence[bytes], claim: Claim) -> list[ChunkRef] | None:
        chunks = []
        for c in range(claim.hbm // self.chunk, -(-claim.end // self.chunk)):
            ids = []
            for b in range(self.blocks_per_chunk):
                token = c * self.chunk + b * self.block_size
                # below the floor: shared HBM blocks; past the claim: not ours to write
                inside = claim.hbm <= token < claim.end
                ids.append(_ids(claim)[token // self.block_size] if inside else -1)
            chunks.append(ChunkRef(keys[c], ids, parent(keys, c)))
        return chunks

    def claimed(self, claim: Claim) -> list[int]:
        bs = self.block_size
        return list(_ids(claim)[claim.hbm // bs : -(-claim.end // bs)])

    def save_chunks(
        self, keys: Sequence[bytes], item: StepRequest, emitted: int, aligned: int
    ) -> SaveChunks:
        blocks = item.view.block_ids
        if len(blocks) * self.block_size < aligned:
            raise ValueError(
                f"request {item.view.request_id}: {len(blocks)} blocks cannot hold {aligned} "
                "computed tokens"
            )
        first = emitted // self.chunk
        chunks = []
        for c in range(first, aligned // self.chunk):
            b0 = c * self.blocks_per_chunk
            chunk_blocks = list(blocks[b0 : b0 + self.blocks_per_chunk])
            chunks.append(ChunkRef(keys[c], chunk_blocks, parent(keys, c)))
        return SaveChunks(chunks, first, aligned)

    def counted_claim(
        self, block_ids: Sequence[int] | Sequence[Sequence[int]]
    ) -> tuple[list[int], Tables | None]:
        return list(block_ids), None  # type: ignore[arg-type]


class GroupLayout:
    """Every KV cache group's table: a chunk holds each group's positions in group order."""

    sync_loads = False

    def __init__(self, groups: ChunkGroups, chunk: int, block_size: int) -> None:
        if groups.block_size != block_size:
            raise ValueError(
                f"the KV cache groups' block size {groups.block_size} is not block_size="
                f"{block_size}"
            )
        self.groups = groups
        self.chunk = chunk
        self.exact_end = bool(groups.states)

    def ends(self, keys: Sequence[bytes], prompt_len: int) -> list[bytes] | None:
        """A state layout: a hit may end only after a chunk whose boundary state the tier
        holds (its part 0), and at most at `prompt_len - 1` (the host computes one token)."""
        if not self.groups.states:
            return None
        n = min(len(keys), max(0, prompt_len - 1) // self.chunk)
        return [state_key(keys[c], 0) for c in range(n)]

    def tables(self, view: RequestView) -> Tables | None:
        tables = getattr(view, "group_block_ids", None)
        if tables is None:
            raise TypeError(
                f"{type(view).__name__} has no group_block_ids; a hybrid registration needs "
                "every KV cache group's block table from the host"
            )
        return [list(t) for t in tables]

    def load_chunks(self, keys: Sequence[bytes], claim: Claim) -> list[ChunkRef] | None:
        assert claim.tables is not None
        chunks = []
        for c in range(claim.hbm // self.chunk, -(-claim.end // self.chunk)):
            ids = self.groups.load_ids(claim.tables, c, claim.hbm, claim.end)
            if ids is None:
                return None
            chunks.append(ChunkRef(keys[c], ids, parent(keys, c)))
        if self.groups.states:
            # the state after the load's last token: the load ends on a chunk boundary whose
            # state the lookup found
            if claim.end % self.chunk:
                return None
            state = self.groups.state_ids(claim.tables, claim.end)
            if state is None:
                return None
            c = claim.end // self.chunk - 1
            chunks.append(ChunkRef(state_key(keys[c], 0), state, keys[c], 0))
        return chunks

    def claimed(self, claim: Claim) -> list[int]:
        if claim.tables is None:  # a failing hook's flat table: the host recomputes it all
            return DenseLayout(self.chunk, self.groups.block_size).claimed(claim)
        return self.groups.claimed(claim.tables, claim.hbm, claim.end)

    def save_chunks(
        self, keys: Sequence[bytes], item: StepRequest, emitted: int, aligned: int
    ) -> SaveChunks:
        """Every group's positions of each chunk. Leading chunks whose sliding-window blocks
        the host no longer holds (freed below its window, or null blocks under an HBM hit) are
        passed over for good."""
        tables = self.tables(item.view)
        assert tables is not None
        before = item.computed_before_step
        if before is None:
            before = item.view.num_computed_tokens
        first = max(emitted // self.chunk, self.groups.first_saveable(before))
        chunks: list[ChunkRef] = []
        window: set[int] = set()
        end = aligned
        for c in range(first, aligned // self.chunk):
            ids = self.groups.save_ids(tables, c)
            if ids is None:
                if chunks:
                    end = c * self.chunk  # the table ends here: the rest waits for a step
                    break
                first = c + 1
                continue
            chunks.append(ChunkRef(keys[c], ids, parent(keys, c)))
            window.update(self.groups.window_ids(ids))
        if self.groups.states and chunks:
            chunks += self._state_records(keys, item.view, first, end // self.chunk, window)
        return SaveChunks(chunks, first, end, window)

    def _state_records(
        self, keys: Sequence[bytes], view: RequestView, first: int, last: int, window: set[int]
    ) -> list[ChunkRef]:
        """The boundary states of chunks [first, last) the host handed over this step (a
        state's block is the host's to reuse once the step ends: the save reads it as a window
        block, cancelled when the host hands the block to another request)."""
        handed = getattr(view, "state_blocks", None) or {}
        out = []
        for c in range(first, last):
            ids = handed.get((c + 1) * self.chunk)
            if ids is None or len(ids) != len(self.groups.states) or min(ids) < 0:
                continue
            out.append(ChunkRef(state_key(keys[c], 0), list(ids), keys[c], 0))
            window.update(ids)
        return out

    def counted_claim(
        self, block_ids: Sequence[int] | Sequence[Sequence[int]]
    ) -> tuple[list[int], Tables | None]:
        if block_ids and not isinstance(block_ids[0], int):
            # every group's table: the failing load claims the largest (all groups recompute)
            tables = [list(t) for t in block_ids]  # type: ignore[union-attr]
            return max(tables, key=len), tables
        return list(block_ids), None  # type: ignore[arg-type]


def layout_for(groups: ChunkGroups | None, chunk: int, block_size: int) -> ChunkLayout:
    """The layout of a registration: hybrid with `groups`, dense without."""
    if groups is None:
        return DenseLayout(chunk, block_size)
    return GroupLayout(groups, chunk, block_size)
