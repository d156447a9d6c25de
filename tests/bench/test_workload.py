"""Workload generators are reproducible byte for byte, and placement puts reuse in the window."""

from __future__ import annotations

import pytest

from kvtier.bench.workload import (
    FIRST_TOKEN,
    NO_REUSE,
    PREFIX_POOL,
    WARMUP,
    dumps,
    no_reuse,
    place_in_window,
    prefix_pool,
    reuse_distance,
)
from kvtier.errors import ConfigError

VOCAB = 2048


def test_prefix_pool_same_seed_gives_identical_bytes() -> None:
    a = dumps(prefix_pool(4, 64, 16, 50, seed=7, vocab=VOCAB))
    b = dumps(prefix_pool(4, 64, 16, 50, seed=7, vocab=VOCAB))
    c = dumps(prefix_pool(4, 64, 16, 50, seed=8, vocab=VOCAB))
    assert a == b
    assert a != c


def test_no_reuse_same_seed_gives_identical_bytes() -> None:
    a = dumps(no_reuse(20, 48, seed=3, vocab=VOCAB))
    assert a == dumps(no_reuse(20, 48, seed=3, vocab=VOCAB))
    assert a != dumps(no_reuse(20, 48, seed=4, vocab=VOCAB))
    # the warmup stream of the same seed is another stream
    assert a != dumps(no_reuse(20, 48, seed=3, vocab=VOCAB, tag=WARMUP))


def test_prefix_pool_shape_shares_prefixes_and_keeps_tails_unique() -> None:
    specs = prefix_pool(3, 32, 8, 40, seed=1, vocab=VOCAB, max_tokens=5)
    assert [s.index for s in specs] == list(range(40))
    assert all(s.tag == PREFIX_POOL and s.max_tokens == 5 for s in specs)
    assert all(len(s.prompt) == 40 for s in specs)
    by_prefix: dict[int, set[tuple[int, ...]]] = {}
    for s in specs:
        assert s.prefix_id is not None and 0 <= s.prefix_id < 3
        by_prefix.setdefault(s.prefix_id, set()).add(s.prompt[:32])
    # one prefix per id, three distinct prefixes, all of them used by 40 random picks
    assert sorted(by_prefix) == [0, 1, 2]
    assert all(len(v) == 1 for v in by_prefix.values())
    assert len({next(iter(v)) for v in by_prefix.values()}) == 3
    # every tail (and so every prompt) is unique: the marker is the request index
    assert len({s.prompt[32:] for s in specs}) == 40
    base = VOCAB - FIRST_TOKEN
    assert specs[5].prompt[32:34] == (FIRST_TOKEN + 5 // base, FIRST_TOKEN + 5 % base)
    assert min(t for s in specs for t in s.prompt) >= FIRST_TOKEN
    assert max(t for s in specs for t in s.prompt) < VOCAB


def test_no_reuse_first_blocks_are_all_distinct() -> None:
    specs = no_reuse(64, 40, seed=0, vocab=VOCAB)
    assert all(s.tag == NO_REUSE and s.prefix_id is None for s in specs)
    assert all(len(s.prompt) == 40 for s in specs)
    assert len({s.prompt[:16] for s in specs}) == 64


def test_generators_reject_bad_input_by_name() -> None:
    with pytest.raises(ConfigError, match="tail_len=1"):
        prefix_pool(2, 16, 1, 4, seed=0, vocab=VOCAB)
    with pytest.raises(ConfigError, match="n_prefixes=0"):
        prefix_pool(0, 16, 4, 4, seed=0, vocab=VOCAB)
    with pytest.raises(ConfigError, match="seed=-1"):
        no_reuse(4, 16, seed=-1, vocab=VOCAB)
    with pytest.raises(ConfigError, match="prompt_len=2"):
        no_reuse(4, 2, seed=0, vocab=VOCAB)


def test_reuse_distance_is_prefixes_times_prompt() -> None:
    assert reuse_distance(5, 256, 32) == 5 * 288


def test_place_in_window_picks_smallest_pool_above_margin() -> None:
    # HBM 2048 tokens, margin 3: need >= 6144 tokens; 288 per prefix -> ceil(6144/288) = 22
    p = place_in_window(2048, 131072, 256, 32, low_margin=3.0)
    assert p.n_prefixes == 22
    assert p.reuse_distance == 22 * 288 == 6336
    assert p.low == 6144 and p.high == 65536
    assert p.low <= p.reuse_distance <= p.high
    # exactly on the boundary: 2 x 512 = 1024 = 8 x 128
    assert place_in_window(512, 10_000, 112, 16).n_prefixes == 8
    # a tiny HBM pool still uses at least two prefixes
    assert place_in_window(16, 10_000, 64, 16).n_prefixes == 2


def test_place_in_window_raises_when_tier_is_too_small() -> None:
    # needs 2 x 4096 = 8192 tokens of reuse distance; the tier holds 10000 / 2 = 5000
    with pytest.raises(ConfigError, match=r"raise the tier .*--hbm-blocks"):
        place_in_window(4096, 10_000, 256, 0)
    with pytest.raises(ConfigError, match="margins must be >= 1.0"):
        place_in_window(1024, 100_000, 64, 0, low_margin=0.5)
