"""Ceilings pinned on small streams computed by hand: the HBM LRU, the offline-optimal tier
behind it and the infinite cache."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from kvtier.bench.ceiling import Ceiling, ceilings, simulate
from kvtier.errors import ConfigError

BS = 16


def sim(
    prompts: Sequence[Sequence[int]],
    hbm_blocks: int | None = None,
    chunk_size: int | None = None,
    tier_chunks: int = 0,
    **kw: Any,
) -> Ceiling:
    """`simulate` with blocks of BS tokens (an unbounded HBM pool without `hbm_blocks`)."""
    return simulate(
        prompts,
        block_size=BS,
        hbm_blocks=hbm_blocks,
        chunk_size=chunk_size,
        tier_chunks=tier_chunks,
        **kw,
    )


def _tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def alternating(n: int) -> list[list[int]]:
    """Prefixes A and B (64 tokens each) taking turns, each request with a unique 16-token tail:
    80 tokens = 5 blocks, the last one unique."""
    a, b = _tokens(10_000, 64), _tokens(20_000, 64)
    return [(a if i % 2 == 0 else b) + _tokens(100 * i, 16) for i in range(n)]


N = 10


def test_two_prefixes_cycling_in_a_pool_of_one_never_hit_hbm() -> None:
    c = sim(alternating(N), 5)
    assert (c.requests, c.prompt_tokens, c.hbm_hit_tokens) == (N, N * 80, 0)
    assert c.hit_rate == 0.0


def test_two_prefixes_in_a_pool_of_two_hit_every_reuse() -> None:
    c = sim(alternating(N), 10)
    # the first A and the first B miss; every later request hits its 4 prefix blocks
    assert c.hbm_hit_tokens == (N - 2) * 64
    assert c.hit_rate == pytest.approx((N - 2) * 64 / (N * 80))


def test_tier_big_enough_serves_every_reuse_of_the_prefix() -> None:
    c = sim(alternating(N), 5, 32, 100)
    assert c.hbm_hit_tokens == 0
    assert c.external_hit_tokens == (N - 2) * 64
    # (n - 2) / n of the prefix tokens
    assert c.external_hit_tokens / (N * 64) == pytest.approx((N - 2) / N)
    assert c.hit_rate == pytest.approx((N - 2) * 64 / (N * 80))


def test_tier_one_chunk_short_keeps_one_prefix_whole_and_one_head() -> None:
    # 3 chunks for 2 prefixes of 2 chunks: the optimum drops the chunk used farthest ahead,
    # always the other prefix's second chunk, so A's reuses find 2 chunks and B's find 1
    # (an LRU of 3 would lose every second chunk: (N - 2) x 32)
    c = sim(alternating(N), 5, 32, 3)
    assert c.external_hit_tokens == (N - 2) // 2 * (64 + 32)


def test_tier_adds_nothing_where_hbm_already_hits() -> None:
    c = sim(alternating(N), 10, 32, 100)
    assert (c.hbm_hit_tokens, c.external_hit_tokens) == ((N - 2) * 64, 0)


def test_full_prompt_hit_still_computes_the_last_token() -> None:
    p = _tokens(5, 64)
    hbm = sim([p, p], 4)
    assert hbm.hbm_hit_tokens == 48  # blocks inside the first 63 tokens: 3
    tier = sim([p, p], 0, 32, 10)
    assert (tier.hbm_hit_tokens, tier.external_hit_tokens) == (0, 63)


def test_load_starts_at_the_hbm_floor_and_respects_min_load() -> None:
    p = _tokens(5, 64)
    both = sim([p, p], 4, 32, 10)
    assert (both.hbm_hit_tokens, both.external_hit_tokens) == (48, 15)
    gated = sim([p, p], 4, 32, 10, min_load_tokens=32)
    assert (gated.hbm_hit_tokens, gated.external_hit_tokens) == (48, 0)


def test_tier_counts_whole_chunks_only() -> None:
    p = _tokens(5, 100)
    tier = sim([p, p], 0, 64, 10)
    assert tier.external_hit_tokens == 64  # one full chunk; the 36-token rest is not stored
    inf = sim([p, p])
    assert inf.hbm_hit_tokens == 96  # 6 blocks inside the first 99 tokens


def test_lru_evicts_a_prefix_tail_before_its_head() -> None:
    a = _tokens(1, 80)  # 5 blocks
    c = _tokens(500, 32)  # 2 blocks
    got = sim([a, c, a], 6)
    # c pushes out one block of a: its tail block, so a's 4 prefix blocks still hit
    assert got.hbm_hit_tokens == 64


def test_infinite_bounds_every_bounded_cache() -> None:
    stream = alternating(N)
    inf = sim(stream)
    assert inf.hit_tokens == (N - 2) * 64
    for blocks in (0, 3, 5, 10):
        assert sim(stream, blocks).hit_tokens <= inf.hit_tokens
        assert sim(stream, blocks, 32, 3).hit_tokens <= inf.hit_tokens


def test_ceilings_are_named_and_need_their_sizes() -> None:
    stream = alternating(N)
    cs = ceilings(stream, BS, 5, 32, 100)
    assert {k: c.name for k, c in cs.items()} == {k: k for k in ("hbm", "hbm+tier", "infinite")}
    assert cs["hbm+tier"].hit_tokens == sim(stream, 5, 32, 100).hit_tokens
    assert list(ceilings(stream, BS, 5)) == ["hbm", "infinite"]
    assert list(ceilings(stream, BS, None, 32, 100)) == ["infinite"]


def test_json_carries_counts_and_rates() -> None:
    doc = sim(alternating(4), 5, 32, 100).to_json()
    assert doc["prompt_tokens"] == 320
    assert doc["external_hit_tokens"] == 128
    assert doc["hit_rate"] == pytest.approx(128 / 320)


def test_bad_input_is_named() -> None:
    with pytest.raises(ConfigError, match="chunk_size=24 is not a multiple of block_size=16"):
        simulate([[1, 2]], block_size=16, hbm_blocks=1, chunk_size=24, tier_chunks=1)
    with pytest.raises(ConfigError, match="a tier needs chunk_size"):
        simulate([[1, 2]], block_size=16, hbm_blocks=1, tier_chunks=1)
    with pytest.raises(ConfigError, match="empty prompt"):
        sim([[]], 1)
    with pytest.raises(ConfigError, match="block_size=0"):
        simulate([[1]], block_size=0, hbm_blocks=1)


# ---- multi-turn: turns extend the previous prompt and output ----------------------------------


def _turns(
    base: int, first: int, out: int, users: list[int]
) -> tuple[list[list[int]], list[list[int]]]:
    """One conversation: turn 0 is `first` tokens; turn t = turn t-1 + its `out` output tokens
    + `users[t-1]` new tokens. Returns (prompts, outputs)."""
    prompts = [_tokens(base, first)]
    outputs = [_tokens(base + 1000, out)]
    for t, u in enumerate(users, start=1):
        prompts.append(prompts[-1] + outputs[-1] + _tokens(base + 2000 * t, u))
        outputs.append(_tokens(base + 1000 + 100 * t, out))
    return prompts, outputs


def test_multi_turn_hbm_keeps_the_generated_blocks() -> None:
    # turn 0: 30 prompt + 4 output tokens, 33 computed -> 2 full blocks; turn 1: 30 + 4 + 30 = 64
    # turn 2: 64 + 4 + 12 = 80; after turn 1, 64 + 3 computed -> 4 blocks
    prompts, outputs = _turns(1, 30, 4, [30, 12])
    assert [len(p) for p in prompts] == [30, 64, 80]
    with_out = sim(prompts, outputs=outputs)
    assert with_out.hbm_hit_tokens == 0 + 32 + 64
    # closed form (n_{t-1} + o_{t-1}) / n_t, floored to blocks: 32/64 and 64/80
    assert with_out.hit_rate == pytest.approx((32 + 64) / (30 + 64 + 80))
    # counting only the prompts' blocks, turn 1 finds one block (16 of 30) and turn 2 four
    prompts_only = sim(prompts)
    assert prompts_only.hbm_hit_tokens == 16 + 64


def test_multi_turn_tier_stores_prompt_chunks_only() -> None:
    prompts, outputs = _turns(1, 30, 4, [30, 12])
    c = sim(prompts, 0, 16, 100, outputs=outputs)
    # turn 1 finds turn 0's one full prompt chunk; turn 2 finds turn 1's four (64 of 79)
    assert (c.hbm_hit_tokens, c.external_hit_tokens) == (0, 16 + 64)


def test_multi_turn_interleaved_conversations_need_the_tier() -> None:
    # A0, B0, A1, B1: turn 0 is 32 tokens (2 blocks), 2 output tokens, turn 1 = 32 + 2 + 30
    a, a_out = _turns(10_000, 32, 2, [30])
    b, b_out = _turns(50_000, 32, 2, [30])
    stream, outs = [a[0], b[0], a[1], b[1]], [a_out[0], b_out[0], a_out[1], b_out[1]]
    # HBM of 3 blocks: B0 evicts A0's second block (tails go first), so A1 hits one block
    # and B1 none (A1's four blocks pushed B out)
    hbm = sim(stream, 3, outputs=outs)
    assert hbm.hbm_hit_tokens == 16
    # the tier holds both turn-0 prompts: A1 loads [16, 32) above its HBM floor, B1 [0, 32)
    both = sim(stream, 3, 16, 100, outputs=outs)
    assert (both.hbm_hit_tokens, both.external_hit_tokens) == (16, 16 + 32)
    inf = sim(stream, outputs=outs)
    assert inf.hit_tokens == 32 + 32
    assert hbm.hit_tokens <= both.hit_tokens <= inf.hit_tokens
    assert both.prompt_tokens == 32 + 32 + 64 + 64


def test_counted_window_keeps_warming_the_cache() -> None:
    prompts, outputs = _turns(1, 30, 4, [30, 12])
    late = sim(prompts, outputs=outputs, counted=[False, True, True])
    assert (late.requests, late.prompt_tokens, late.hbm_hit_tokens) == (2, 64 + 80, 32 + 64)
    last = sim(prompts, outputs=outputs, counted=[False, False, True])
    assert (last.requests, last.hit_rate) == (1, 64 / 80)
    with pytest.raises(ConfigError, match="2 counted flags for 3 prompts"):
        sim(prompts, counted=[True, True])


def test_the_kvtier_model_drives_the_real_tier_between_hbm_and_the_optimum() -> None:
    """With the tier's admission mode, "kvtier" is kvtier's own tier of that size behind the
    same HBM: it serves every reuse where the tier holds everything (as the optimum does), and
    at most the optimum where it is tight, never less than HBM alone."""
    roomy = ceilings(alternating(N), BS, 5, 32, 100, policy="adaptive")
    assert roomy["kvtier"].external_hit_tokens == roomy["hbm+tier"].external_hit_tokens
    assert roomy["kvtier"].external_hit_tokens == (N - 2) * 64
    tight = ceilings(alternating(N), BS, 5, 32, 3, policy="all")
    assert tight["hbm"].hit_tokens <= tight["kvtier"].hit_tokens <= tight["hbm+tier"].hit_tokens
    # a chain-aware LRU of 3 chunks for 2 prefixes of 2: every reuse finds the other prefix's
    # head evicted last, so it reads less than the optimum
    assert tight["kvtier"].external_hit_tokens < tight["hbm+tier"].external_hit_tokens
    assert "kvtier" not in ceilings(alternating(N), BS, 5, 32, 100)  # no mode: no model
