"""BlockManager: a fixed pool of KV blocks with hash-based prefix caching over full blocks.

A full block is named by a chained blake3 hash of (parent hash, its token ids), so equal hashes
mean equal prefixes. Freed blocks keep their hash and stay reusable, least recently freed first
to be taken, until a new allocation reclaims them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq

import blake3
import numpy as np

from kvtier.native.sequence import Sequence

_ROOT = b"kvtier.native.blocks.v1"


def hash_block(parent: bytes | None, token_ids: Seq[int]) -> bytes:
    """16-byte chained hash of one full block; `parent` is the previous block's hash."""
    h = blake3.blake3(parent if parent is not None else _ROOT)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest(length=16)


class BlockManager:
    """Allocates blocks to sequences, shares cached prefix blocks, counts prefix-cache hits."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        # ref-count-0 blocks; the first is taken first (cached ones stay until then)
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.prefix_cache_queries = 0  # prompt tokens looked up at first admissions
        self.prefix_cache_hits = 0  # of which found in the cache
        # the same for admissions after a preemption (vLLM's PrefixCacheStats keeps them apart)
        self.preempted_queries = 0
        self.preempted_hits = 0

    # ---- hashing ------------------------------------------------------------------------------

    def block_hashes(self, seq: Sequence, num_tokens: int) -> list[bytes]:
        """Hashes of the full blocks among the first `num_tokens` tokens (cached on the seq)."""
        bs = self.block_size
        hashes = seq.block_hashes
        tokens = seq.token_ids
        for i in range(len(hashes), num_tokens // bs):
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i * bs : (i + 1) * bs]))
        return hashes[: num_tokens // bs]

    # ---- lookup and allocation ----------------------------------------------------------------

    def lookup(self, seq: Sequence) -> list[int]:
        """Cached blocks of the longest prefix hit, leaving at least the last token to compute."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for h in self.block_hashes(seq, seq.num_tokens - 1):
            b = self.hash_to_block.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def num_free_blocks(self) -> int:
        """Blocks with no owner (cached or not)."""
        return len(self.free_queue)

    def can_allocate(self, hits: list[int], num_tokens: int, reserve: int = 0) -> bool:
        """Whether `num_tokens` tokens fit when the first blocks are the cached `hits`, leaving
        `reserve` free blocks untouched."""
        new = self._blocks_for(num_tokens) - len(hits)
        revived = sum(1 for b in hits if self.ref_counts[b] == 0)
        return new + reserve <= len(self.free_queue) - revived

    def blocks_short(self, seq: Sequence) -> int:
        """Blocks `seq` still needs to hold all of its tokens."""
        return max(0, self._blocks_for(seq.num_tokens) - len(seq.block_ids))

    def allocate(self, seq: Sequence, hits: list[int], num_tokens: int) -> None:
        """Give `seq` the hit blocks plus fresh blocks for `num_tokens` tokens; counts the lookup.

        Sets `seq.num_computed_tokens` to the HBM hit.
        """
        if seq.block_ids:
            raise RuntimeError(f"{seq.request_id} already holds blocks {seq.block_ids[:8]}...")
        if not self.can_allocate(hits, num_tokens):
            raise RuntimeError(f"no room for {num_tokens} tokens of {seq.request_id}")
        for b in hits:
            if self.ref_counts[b] == 0:
                del self.free_queue[b]
            self.ref_counts[b] += 1
        seq.block_ids = list(hits)
        seq.num_hashed_blocks = len(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        self._grow(seq, num_tokens)
        if seq.preempted:
            self.preempted_queries += seq.num_tokens
            self.preempted_hits += seq.num_computed_tokens
        else:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += seq.num_computed_tokens

    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `seq` can grow to hold `num_tokens` tokens."""
        return self._blocks_for(num_tokens) - len(seq.block_ids) <= len(self.free_queue)

    def append_slots(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq`'s block table to hold `num_tokens` tokens."""
        if not self.can_append(seq, num_tokens):
            raise RuntimeError(f"no room to grow {seq.request_id} to {num_tokens} tokens")
        self._grow(seq, num_tokens)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        for _ in range(self._blocks_for(num_tokens) - len(seq.block_ids)):
            b, _ = self.free_queue.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:  # evict: the block is about to hold other tokens
                if self.hash_to_block.get(h) == b:
                    del self.hash_to_block[h]
                self.block_hash[b] = None
            self.ref_counts[b] = 1
            seq.block_ids.append(b)

    # ---- caching and freeing ------------------------------------------------------------------

    def cache_blocks(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Publish the full blocks among the first `num_computed_tokens` tokens for reuse.

        The first block registered under a hash stays canonical; a duplicate stays private.
        """
        if not self.enable_prefix_caching:
            return
        hashes = self.block_hashes(seq, num_computed_tokens)
        for i in range(seq.num_hashed_blocks, len(hashes)):
            b = seq.block_ids[i]
            h = hashes[i]
            if h not in self.hash_to_block and self.block_hash[b] is None:
                self.hash_to_block[h] = b
                self.block_hash[b] = h
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, len(hashes))

    def uncache(self, block_ids: Seq[int]) -> None:
        """Withdraw blocks from the prefix cache (their content is no longer trusted)."""
        for b in block_ids:
            h = self.block_hash[b]
            if h is not None:
                if self.hash_to_block.get(h) == b:
                    del self.hash_to_block[h]
                self.block_hash[b] = None

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s claim on its blocks; unowned blocks join the free queue, tail first, so
        the end of a prefix is reclaimed before its start."""
        for b in reversed(seq.block_ids):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_queue[b] = None
            elif self.ref_counts[b] < 0:
                raise RuntimeError(f"block {b} freed twice (last owner {seq.request_id})")
        seq.block_ids = []
        seq.num_hashed_blocks = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash; blocks in use keep their content, nothing is reused."""
        self.hash_to_block.clear()
        self.block_hash = [None] * self.num_blocks

    def usage(self) -> float:
        """Fraction of blocks owned by a sequence."""
        return 1.0 - len(self.free_queue) / self.num_blocks
