"""Ceilings pinned on small streams computed by hand."""

from __future__ import annotations

import pytest

from kvtier.bench.ceiling import hbm_ceiling, infinite_ceiling, simulate, tier_ceiling
from kvtier.errors import ConfigError

BS = 16


def _tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def alternating(n: int) -> list[list[int]]:
    """Prefixes A and B (64 tokens each) taking turns, each request with a unique 16-token tail:
    80 tokens = 5 blocks, the last one unique."""
    a, b = _tokens(10_000, 64), _tokens(20_000, 64)
    return [(a if i % 2 == 0 else b) + _tokens(100 * i, 16) for i in range(n)]


N = 10


def test_two_prefixes_cycling_in_a_pool_of_one_never_hit_hbm() -> None:
    c = hbm_ceiling(alternating(N), BS, hbm_blocks=5)
    assert (c.requests, c.prompt_tokens, c.hbm_hit_tokens) == (N, N * 80, 0)
    assert c.hit_rate == 0.0


def test_two_prefixes_in_a_pool_of_two_hit_every_reuse() -> None:
    c = hbm_ceiling(alternating(N), BS, hbm_blocks=10)
    # the first A and the first B miss; every later request hits its 4 prefix blocks
    assert c.hbm_hit_tokens == (N - 2) * 64
    assert c.hit_rate == pytest.approx((N - 2) * 64 / (N * 80))


def test_tier_big_enough_serves_every_reuse_of_the_prefix() -> None:
    c = tier_ceiling(alternating(N), BS, hbm_blocks=5, chunk_size=32, tier_chunks=100)
    assert c.hbm_hit_tokens == 0
    assert c.external_hit_tokens == (N - 2) * 64
    # (n - 2) / n of the prefix tokens
    assert c.external_hit_tokens / (N * 64) == pytest.approx((N - 2) / N)
    assert c.hit_rate == pytest.approx((N - 2) * 64 / (N * 80))


def test_tier_one_chunk_short_keeps_only_the_heads() -> None:
    # 3 chunks for 2 prefixes of 2 chunks: each reuse finds its head chunk, never its second
    c = tier_ceiling(alternating(N), BS, hbm_blocks=5, chunk_size=32, tier_chunks=3)
    assert c.external_hit_tokens == (N - 2) * 32


def test_tier_adds_nothing_where_hbm_already_hits() -> None:
    c = tier_ceiling(alternating(N), BS, hbm_blocks=10, chunk_size=32, tier_chunks=100)
    assert (c.hbm_hit_tokens, c.external_hit_tokens) == ((N - 2) * 64, 0)


def test_full_prompt_hit_still_computes_the_last_token() -> None:
    p = _tokens(5, 64)
    hbm = hbm_ceiling([p, p], BS, hbm_blocks=4)
    assert hbm.hbm_hit_tokens == 48  # blocks inside the first 63 tokens: 3
    tier = tier_ceiling([p, p], BS, hbm_blocks=0, chunk_size=32, tier_chunks=10)
    assert (tier.hbm_hit_tokens, tier.external_hit_tokens) == (0, 63)


def test_load_starts_at_the_hbm_floor_and_respects_min_load() -> None:
    p = _tokens(5, 64)
    both = tier_ceiling([p, p], BS, hbm_blocks=4, chunk_size=32, tier_chunks=10)
    assert (both.hbm_hit_tokens, both.external_hit_tokens) == (48, 15)
    gated = tier_ceiling([p, p], BS, 4, 32, 10, min_load_tokens=32)
    assert (gated.hbm_hit_tokens, gated.external_hit_tokens) == (48, 0)


def test_tier_counts_whole_chunks_only() -> None:
    p = _tokens(5, 100)
    tier = tier_ceiling([p, p], BS, hbm_blocks=0, chunk_size=64, tier_chunks=10)
    assert tier.external_hit_tokens == 64  # one full chunk; the 36-token rest is not stored
    inf = infinite_ceiling([p, p], BS)
    assert inf.hbm_hit_tokens == 96  # 6 blocks inside the first 99 tokens


def test_lru_evicts_a_prefix_tail_before_its_head() -> None:
    a = _tokens(1, 80)  # 5 blocks
    c = _tokens(500, 32)  # 2 blocks
    got = hbm_ceiling([a, c, a], BS, hbm_blocks=6)
    # c pushes out one block of a: its tail block, so a's 4 prefix blocks still hit
    assert got.hbm_hit_tokens == 64


def test_infinite_bounds_every_bounded_cache() -> None:
    stream = alternating(N)
    inf = infinite_ceiling(stream, BS)
    assert inf.hit_tokens == (N - 2) * 64
    for blocks in (0, 3, 5, 10):
        assert hbm_ceiling(stream, BS, blocks).hit_tokens <= inf.hit_tokens
        assert tier_ceiling(stream, BS, blocks, 32, 3).hit_tokens <= inf.hit_tokens


def test_json_carries_counts_and_rates() -> None:
    doc = tier_ceiling(alternating(4), BS, 5, 32, 100).to_json()
    assert doc["prompt_tokens"] == 320
    assert doc["external_hit_tokens"] == 128
    assert doc["hit_rate"] == pytest.approx(128 / 320)


def test_bad_input_is_named() -> None:
    with pytest.raises(ConfigError, match="chunk_size=24 is not a multiple of block_size=16"):
        simulate([[1, 2]], block_size=16, hbm_blocks=1, chunk_size=24, tier_chunks=1)
    with pytest.raises(ConfigError, match="a tier needs chunk_size"):
        simulate([[1, 2]], block_size=16, hbm_blocks=1, tier_chunks=1)
    with pytest.raises(ConfigError, match="empty prompt"):
        hbm_ceiling([[]], BS, 1)
    with pytest.raises(ConfigError, match="block_size=0"):
        hbm_ceiling([[1]], 0, 1)
