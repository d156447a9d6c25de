"""Workload generators are reproducible byte for byte (prefix pool, multi-turn, trace replay),
and placement puts reuse in the window."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.bench.workload import (
    BUST_TOKENS,
    FIRST_TOKEN,
    MULTI_TURN,
    NO_REUSE,
    PREFIX_POOL,
    TRACE,
    WARMUP,
    TraceRow,
    bust_marker,
    dumps,
    extend_prompt,
    multi_turn,
    no_reuse,
    place_in_window,
    poisson_arrivals,
    prefix_pool,
    read_specs,
    sent_prompts,
    trace_requests,
    with_arrivals,
    write_specs,
)
from kvtier.cachemodel.trace import read_trace_rows
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


# ---- cache bust, multi-turn, trace replay, arrivals -------------------------------------------


def test_bust_marker_appends_a_run_id_after_the_first_turn() -> None:
    plain = prefix_pool(2, 16, 4, 6, seed=1, vocab=VOCAB)
    busted = prefix_pool(2, 16, 4, 6, seed=1, vocab=VOCAB, bust=99)
    other = prefix_pool(2, 16, 4, 6, seed=1, vocab=VOCAB, bust=100)
    marker = bust_marker(99, VOCAB)
    assert len(marker) == BUST_TOKENS and marker == bust_marker(99, VOCAB)
    for p, b, o in zip(plain, busted, other, strict=True):
        # the shared prefix and the unique tail stay; only the suffix differs between runs
        assert b.prompt == p.prompt + tuple(marker)
        assert o.prompt[:-BUST_TOKENS] == p.prompt and o.prompt != b.prompt
    with pytest.raises(ConfigError, match="bust=-1"):
        bust_marker(-1, VOCAB)


def test_multi_turn_same_seed_gives_identical_token_ids() -> None:
    a = multi_turn(3, 4, 8, seed=5, vocab=VOCAB, max_tokens=3, n_prefixes=2, prefix_len=16)
    b = multi_turn(3, 4, 8, seed=5, vocab=VOCAB, max_tokens=3, n_prefixes=2, prefix_len=16)
    c = multi_turn(3, 4, 8, seed=6, vocab=VOCAB, max_tokens=3, n_prefixes=2, prefix_len=16)
    assert dumps(a) == dumps(b)
    assert dumps(a) != dumps(c)


def test_multi_turn_turns_extend_the_previous_prompt_round_robin() -> None:
    n_conv, turns, user, out = 3, 4, 8, 3
    specs = multi_turn(n_conv, turns, user, seed=2, vocab=VOCAB, max_tokens=out, bust=7)
    assert [s.index for s in specs] == list(range(n_conv * turns))
    # round robin: every conversation's turn t before any turn t + 1
    assert [(s.turn, s.conversation) for s in specs[:4]] == [(0, 0), (0, 1), (0, 2), (1, 0)]
    for s in specs:
        assert s.tag == MULTI_TURN and s.max_tokens == out
        if s.turn == 0:
            assert s.parent is None and s.new_tokens == 0
            assert len(s.prompt) == user + BUST_TOKENS
            assert s.prompt[-BUST_TOKENS:] == tuple(bust_marker(7, VOCAB))
            continue
        parent = specs[s.parent]
        assert (parent.conversation, parent.turn) == (s.conversation, s.turn - 1)
        # previous prompt + a stand-in of its output + `user` new tokens
        assert s.prompt[: len(parent.prompt)] == parent.prompt
        assert len(s.prompt) == len(parent.prompt) + out + user
        assert s.new_tokens == user
    # the conversations differ from the first token on (their markers)
    assert len({specs[c].prompt[:2] for c in range(n_conv)}) == n_conv


def test_multi_turn_shared_prefix_and_real_outputs() -> None:
    specs = multi_turn(4, 2, 6, seed=0, vocab=VOCAB, max_tokens=2, n_prefixes=1, prefix_len=16)
    assert len({s.prompt[:16] for s in specs}) == 1  # one shared system prompt
    first, second = specs[0], specs[4]
    assert second.parent == 0
    real = extend_prompt(second, first.prompt, [11, 12])
    assert real == first.prompt + (11, 12) + second.prompt[-6:]
    sent = sent_prompts(specs, {0: [11, 12]})
    assert sent[4] == real
    assert sent[0] == first.prompt
    # without outputs, the stand-in stream is what went out
    assert sent_prompts(specs, None)[4] == second.prompt
    with pytest.raises(ConfigError, match="continues request 0"):
        sent_prompts(specs[4:], {})


def test_multi_turn_rejects_bad_shapes() -> None:
    with pytest.raises(ConfigError, match="user_len=1"):
        multi_turn(2, 2, 1, seed=0, vocab=VOCAB)
    with pytest.raises(ConfigError, match="n_prefixes=2, prefix_len=0"):
        multi_turn(2, 2, 4, seed=0, vocab=VOCAB, n_prefixes=2)


ROWS = [
    {"timestamp": 1000, "input_length": 40, "output_length": 5, "hash_ids": [1, 2, 3]},
    {"timestamp": 1500, "input_length": 30, "output_length": 9, "hash_ids": [1, 2]},
    {"timestamp": 4000, "input_length": 16, "output_length": 1, "hash_ids": [7]},
]


def _trace(tmp_path: Path, rows: list[dict[str, object]] = ROWS) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_trace_replay_is_deterministic_and_shares_blocks(tmp_path: Path) -> None:
    rows = read_trace_rows(_trace(tmp_path))
    assert rows[0] == TraceRow(1000.0, 40, 5, (1, 2, 3))
    a = trace_requests(rows, seed=3, vocab=VOCAB, block=16)
    assert dumps(a) == dumps(trace_requests(rows, seed=3, vocab=VOCAB, block=16))
    assert dumps(a) != dumps(trace_requests(rows, seed=4, vocab=VOCAB, block=16))
    assert [len(s.prompt) for s in a] == [40, 30, 16]  # the last block cut to input_length
    assert [s.max_tokens for s in a] == [5, 9, 1]
    # hash ids 1, 2 are the same 32 tokens in both requests; id 7 shares nothing
    assert a[0].prompt[:30] == a[1].prompt
    assert a[2].prompt[:16] != a[0].prompt[:16]
    # the same hash id maps to the same block in any row
    again = trace_requests([TraceRow(0, 16, 1, (2,))], seed=3, vocab=VOCAB, block=16)
    assert again[0].prompt == a[0].prompt[16:32]
    assert all(s.tag == TRACE and s.parent is None for s in a)


def test_trace_time_scale_applies_to_timestamps(tmp_path: Path) -> None:
    rows = read_trace_rows(_trace(tmp_path))
    assert [s.arrival for s in trace_requests(rows, 0, VOCAB, block=16)] == [0.0, 0.5, 3.0]
    fast = trace_requests(rows, 0, VOCAB, block=16, time_scale=0.1)
    assert [s.arrival for s in fast] == pytest.approx([0.0, 0.05, 0.3])
    capped = trace_requests(rows, 0, VOCAB, block=16, max_tokens=4)
    assert [s.max_tokens for s in capped] == [4, 4, 1]


def test_trace_source_block_scales_lengths_and_a_short_trace_is_refused(tmp_path: Path) -> None:
    rows = [TraceRow(0, 1000, 4, (1, 2)), TraceRow(10, 600, 4, (1, 5))]
    scaled = trace_requests(rows, 0, VOCAB, block=16, source_block=512)
    assert [len(s.prompt) for s in scaled] == [32, 19]  # ceil(1000 / 32), ceil(600 / 32)
    assert scaled[0].prompt[:16] == scaled[1].prompt[:16]
    with pytest.raises(ConfigError, match=r"input_length 1000 .*workload\.trace_source_block"):
        trace_requests(rows, 0, VOCAB, block=16)


def test_load_trace_names_the_bad_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ROWS[0]) + "\n" + '{"timestamp": 1, "hash_ids": [1]}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: 'input_length' must be .* \(got None\)"):
        read_trace_rows(bad)
    neg = tmp_path / "neg.jsonl"
    neg.write_text('{"timestamp": 1, "input_length": 0, "hash_ids": [1]}\n')
    with pytest.raises(ConfigError, match=r"'input_length' must be an integer >= 1 \(got 0\)"):
        read_trace_rows(neg)
    assert len(read_trace_rows(_trace(tmp_path), limit=2)) == 2
    with pytest.raises(ConfigError, match="is not a file"):
        read_trace_rows(tmp_path / "missing.jsonl")


def test_poisson_arrivals_are_seeded_and_rate_shaped() -> None:
    a = poisson_arrivals(2000, rate=50.0, seed=1)
    assert a == poisson_arrivals(2000, rate=50.0, seed=1)
    assert a != poisson_arrivals(2000, rate=50.0, seed=2)
    assert a[0] == 0.0 and all(y >= x for x, y in zip(a, a[1:], strict=False))
    assert a[-1] / 1999 == pytest.approx(1 / 50.0, rel=0.1)  # mean gap 1 / rate
    specs = with_arrivals(no_reuse(3, 8, seed=0, vocab=VOCAB), [0.0, 0.1, 0.2])
    assert [s.arrival for s in specs] == [0.0, 0.1, 0.2]
    with pytest.raises(ConfigError, match="rate=0"):
        poisson_arrivals(3, 0.0, 0)


def test_specs_round_trip_through_jsonl(tmp_path: Path) -> None:
    specs = multi_turn(2, 2, 4, seed=0, vocab=VOCAB, max_tokens=2)
    specs = with_arrivals(specs, [0.0, 0.5, 1.0, 1.5])
    assert read_specs(write_specs(tmp_path / "w.jsonl", specs)) == specs
