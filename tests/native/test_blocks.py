"""BlockManager: chained hashes, prefix hits on full blocks, ref counts, LRU reuse of freed
cached blocks, reset, and the prefix-cache counters."""

from __future__ import annotations

import pytest

from kvtier.native.blocks import BlockManager, hash_block
from kvtier.native.sampling import SamplingParams
from kvtier.native.sequence import Sequence

BS = 4


def seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, tokens, SamplingParams(), seed=0, arrival=0)


def admit(bm: BlockManager, s: Sequence) -> list[int]:
    """Allocate the whole sequence after a lookup and publish its computed blocks."""
    hits = bm.lookup(s)
    bm.allocate(s, hits, s.num_tokens)
    bm.cache_blocks(s, s.num_tokens)
    return hits


def test_hashes_are_chained_and_stable():
    # a golden value: nothing here depends on Python's hash() or PYTHONHASHSEED
    h0 = hash_block(None, [1, 2, 3, 4])
    assert h0.hex() == "c97947e1a01b11650d8a794b84127ede"
    assert hash_block(h0, [5, 6, 7, 8]) != hash_block(None, [5, 6, 7, 8])
    assert hash_block(None, [1, 2, 3, 5]) != h0


def test_prefix_hit_is_full_blocks_and_leaves_the_last_token():
    bm = BlockManager(16, BS)
    a = seq(list(range(100, 112)), "a")  # 3 full blocks
    assert admit(bm, a) == []
    b = seq(list(range(100, 112)), "b")  # same prompt: 2 blocks hit, the last token recomputed
    hits = admit(bm, b)
    assert hits == a.block_ids[:2]
    assert b.num_computed_tokens == 8
    assert [bm.ref_counts[x] for x in a.block_ids] == [2, 2, 1]
    c = seq([*range(100, 106), 999, 998, 997], "c")  # diverges inside block 1
    assert bm.lookup(c) == a.block_ids[:1]
    assert bm.prefix_cache_queries == 24 and bm.prefix_cache_hits == 8


def test_freed_cached_blocks_stay_reusable_until_reclaimed_lru():
    bm = BlockManager(6, BS)
    a = seq(list(range(8)) + [50], "a")  # 2 full blocks + 1 partial
    admit(bm, a)
    blocks_a = list(a.block_ids)
    bm.free(a)
    assert bm.num_free_blocks() == 6 and all(bm.ref_counts[x] == 0 for x in blocks_a)
    # the freed prefix still hits
    again = seq(list(range(8)) + [60], "again")
    assert bm.lookup(again) == blocks_a[:2]
    # allocating fresh blocks takes never-used ones first, then the tail of a's prefix first
    filler = seq(list(range(1000, 1012)), "filler")
    bm.allocate(filler, [], 12)
    assert not set(filler.block_ids) & set(blocks_a)
    more = seq(list(range(2000, 2004)), "more")
    bm.allocate(more, [], 4)
    assert more.block_ids == [blocks_a[2]]  # the partial block (tail) goes first
    other = seq(list(range(3000, 3004)), "other")
    bm.allocate(other, [], 4)
    assert other.block_ids == [blocks_a[1]]  # then block 1; block 0 still cached
    assert bm.lookup(again) == blocks_a[:1]


def test_can_allocate_counts_revived_blocks():
    bm = BlockManager(3, BS)
    a = seq(list(range(8)) + [1], "a")
    admit(bm, a)
    bm.free(a)
    b = seq(list(range(8)) + [2, 3, 4, 5], "b")  # needs 3 blocks, 2 of them cached hits
    hits = bm.lookup(b)
    assert len(hits) == 2
    assert bm.can_allocate(hits, 12)
    assert not bm.can_allocate(hits, 13)  # a 4th block does not exist
    bm.allocate(b, hits, 12)
    assert bm.num_free_blocks() == 0
    with pytest.raises(RuntimeError, match="no room"):
        bm.append_slots(b, 13)


def test_reset_and_uncache_drop_hashes():
    bm = BlockManager(8, BS)
    a = seq(list(range(12)) + [7], "a")
    admit(bm, a)
    assert len(bm.lookup(seq(list(range(12)) + [9]))) == 3
    bm.uncache([a.block_ids[1]])
    assert len(bm.lookup(seq(list(range(12)) + [9]))) == 1  # the chain breaks at block 1
    bm.reset_prefix_cache()
    assert bm.lookup(seq(list(range(12)) + [9])) == []
    assert not bm.hash_to_block


def test_duplicate_content_keeps_the_first_block_canonical():
    bm = BlockManager(8, BS)
    a, b = seq(list(range(5)), "a"), seq(list(range(5)), "b")
    bm.allocate(a, [], 5)
    bm.allocate(b, [], 5)  # computed concurrently: no hit yet
    bm.cache_blocks(a, 5)
    bm.cache_blocks(b, 5)
    assert bm.hash_to_block[a.block_hashes[0]] == a.block_ids[0]
    assert bm.block_hash[b.block_ids[0]] is None
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks() == 8
    with pytest.raises(RuntimeError, match="freed twice"):
        a.block_ids = [0]
        bm.free(a)


def test_prefix_caching_off_never_hits():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    admit(bm, seq(list(range(9)), "a"))
    assert bm.lookup(seq(list(range(9)), "b")) == [] and not bm.hash_to_block
