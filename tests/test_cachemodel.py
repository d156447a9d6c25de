"""The cache model: the one trace reader's edge cases, the offline optimum against brute force,
the bounds between infinite tier, optimum and the real tiers, and the prediction that drives
the real memory and disk tiers (one policy: the same hits)."""

from __future__ import annotations

import json
import random
from functools import cache
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.cachemodel import workloads
from kvtier.cachemodel.curve import hit_curve
from kvtier.cachemodel.legacy import legacy_predict
from kvtier.cachemodel.optimum import infinite_leading, optimal_leading
from kvtier.cachemodel.predict import DISK, drive_tier, predict, tally
from kvtier.cachemodel.reuse import pool_reuse_distance
from kvtier.cachemodel.stream import Request, from_trace, hbm_floors, working_set
from kvtier.cachemodel.trace import TraceRow, parse_trace_rows, read_trace_rows
from kvtier.data import bundled_trace
from kvtier.errors import ConfigError

MOONCAKE = bundled_trace()


def _lines(*rows: dict[str, object]) -> list[str]:
    return [json.dumps(r) for r in rows]


# ---- the one trace reader --------------------------------------------------------------------


def test_output_length_defaults_to_one_and_zero_is_refused() -> None:
    rows = parse_trace_rows(_lines({"input_length": 10, "hash_ids": [1]}))
    assert rows == [TraceRow(0.0, 10, 1, (1,))]
    with pytest.raises(ConfigError, match=r"t:1: 'output_length' must be .* \(got 0\)"):
        parse_trace_rows(
            _lines({"input_length": 10, "output_length": 0, "hash_ids": [1]}), source="t"
        )


@pytest.mark.parametrize(
    ("row", "needle"),
    [
        ({"input_length": 10, "hash_ids": []}, "'hash_ids' must be a non-empty list"),
        ({"input_length": 10, "hash_ids": [1, -2]}, "'hash_ids' must be"),
        ({"input_length": 10, "hash_ids": [True]}, "'hash_ids' must be"),
        ({"input_length": 10}, "'hash_ids' must be"),
        ({"input_length": 0, "hash_ids": [1]}, r"'input_length' must be an integer >= 1 \(got 0\)"),
        ({"input_length": 2.5, "hash_ids": [1]}, "'input_length' must be"),
        ({"input_length": 5, "hash_ids": [1], "timestamp": -1}, "'timestamp' must be a finite"),
        ({"input_length": 5, "hash_ids": [1], "timestamp": "x"}, "'timestamp' must be"),
    ],
)
def test_bad_rows_name_line_field_and_fix(row: dict[str, object], needle: str) -> None:
    good = json.dumps({"input_length": 5, "hash_ids": [0]})
    with pytest.raises(ConfigError, match=f"t.jsonl:2: {needle}"):
        parse_trace_rows([good, json.dumps(row)], source="t.jsonl")


def test_rows_replay_in_timestamp_order_ties_in_file_order() -> None:
    rows = parse_trace_rows(
        _lines(
            {"timestamp": 30, "input_length": 1, "hash_ids": [3]},
            {"timestamp": 10, "input_length": 1, "hash_ids": [1]},
            {"timestamp": 30, "input_length": 1, "hash_ids": [4]},
            {"timestamp": 10, "input_length": 1, "hash_ids": [2]},
        )
    )
    assert [r.hash_ids[0] for r in rows] == [1, 2, 3, 4]
    assert [r.timestamp_ms for r in rows] == [10.0, 10.0, 30.0, 30.0]
    # the limit cuts in replay order, not file order
    assert [r.hash_ids[0] for r in parse_trace_rows(_lines(
        {"timestamp": 5, "input_length": 1, "hash_ids": [9]},
        {"timestamp": 1, "input_length": 1, "hash_ids": [8]},
    ), limit=1)] == [8]  # fmt: skip


def test_untimed_rows_keep_file_order_and_mixing_is_refused() -> None:
    rows = parse_trace_rows(["", *_lines({"input_length": 1, "hash_ids": [2]}), "  ",
                             *_lines({"input_length": 1, "hash_ids": [1]})])  # fmt: skip
    assert [(r.timestamp_ms, r.hash_ids) for r in rows] == [(0.0, (2,)), (0.0, (1,))]
    mixed = _lines(
        {"timestamp": 1, "input_length": 1, "hash_ids": [1]},
        {"input_length": 1, "hash_ids": [2]},
    )
    with pytest.raises(ConfigError, match="line 1 has a timestamp and line 2 has none"):
        parse_trace_rows(mixed)


def test_block_size_check_and_other_input_errors(tmp_path: Path) -> None:
    row = _lines({"input_length": 600, "hash_ids": [1]})
    assert parse_trace_rows(row)[0].input_length == 600  # no block size given: no check
    with pytest.raises(ConfigError, match=r"input_length 600 needs more .* 1 hash ids of 512"):
        parse_trace_rows(row, block_tokens=512)
    with pytest.raises(ConfigError, match="has no requests"):
        parse_trace_rows(["", "  "])
    with pytest.raises(ConfigError, match="t:1: not JSON"):
        parse_trace_rows(["{nope"], source="t")
    with pytest.raises(ConfigError, match="t:1: a JSON list, not an object"):
        parse_trace_rows(["[1]"], source="t")
    with pytest.raises(ConfigError, match="is not a file"):
        read_trace_rows(tmp_path / "missing.jsonl")


def test_the_mooncake_trace_reads_in_place_and_chains() -> None:
    rows = read_trace_rows(MOONCAKE, block_tokens=512)
    assert len(rows) == 3993
    assert [r.timestamp_ms for r in rows] == sorted(r.timestamp_ms for r in rows)
    # chained ids: an id always sits at the same depth under the same parent
    parent: dict[int, int | None] = {}
    for r in rows:
        for i, h in enumerate(r.hash_ids):
            assert parent.setdefault(h, r.hash_ids[i - 1] if i else None) == (
                r.hash_ids[i - 1] if i else None
            )
    requests = from_trace(rows, 512)
    assert all(len(q.chunks) - 1 <= q.usable <= len(q.chunks) for q in requests)


def test_from_trace_keeps_full_blocks_and_the_last_token_computed() -> None:
    rows = [
        TraceRow(0, 300, 1, (1, 2, 3)),
        TraceRow(0, 80, 1, (5,)),
        TraceRow(0, 350, 1, (1, 2, 3, 6)),
    ]
    assert from_trace(rows, 100) == [
        Request((1, 2, 3), 2),  # 300 tokens: 3 full blocks, the last token is computed
        Request((), 0),  # a partial block is never stored
        Request((1, 2, 3), 3),
    ]


# ---- the optimum -----------------------------------------------------------------------------


def _forest_requests(rng: random.Random, nodes: int, n_requests: int) -> list[Request]:
    parents: list[int | None] = [None] + [rng.choice([None, *range(i)]) for i in range(1, nodes)]
    out = []
    for _ in range(n_requests):
        chain: list[int] = []
        node: int | None = rng.randrange(nodes)
        while node is not None:
            chain.append(node)
            node = parents[node]
        chain.reverse()
        out.append(Request(tuple(chain), len(chain)))
    return out


def _brute_force(requests: list[Request], capacity: int) -> int:
    """The most leading hits any tier of `capacity` can serve: after each request it may keep
    any subset of what it held plus that request's chunks."""
    from itertools import combinations

    @cache
    def best(i: int, held: frozenset[int]) -> int:
        if i == len(requests):
            return 0
        chain = requests[i].chunks
        lead = 0
        for c in chain:
            if c not in held:
                break
            lead += 1
        pool = sorted(held | set(chain))
        keep = max(
            best(i + 1, frozenset(s))
            for k in range(min(capacity, len(pool)) + 1)
            for s in combinations(pool, k)
        )
        return lead + keep

    return best(0, frozenset())


@pytest.mark.parametrize("seed", range(12))
def test_the_optimum_matches_brute_force_on_small_random_streams(seed: int) -> None:
    rng = random.Random(seed)
    requests = _forest_requests(rng, nodes=rng.randint(3, 6), n_requests=rng.randint(3, 7))
    for capacity in (1, 2, 3):
        assert sum(optimal_leading(requests, capacity)) == _brute_force(requests, capacity)


def test_the_optimum_ties_go_deeper_first_so_it_stays_prefix_closed() -> None:
    # a chain used once more later: at capacity 2 the optimum keeps its head and second chunk
    a = Request((1, 2, 3), 3)
    assert optimal_leading([a, Request((9,), 1), a], 2) == [0, 0, 2]
    # never used again: nothing is worth keeping, and capacity 0 holds nothing
    assert optimal_leading([a, a], 0) == [0, 0]
    with pytest.raises(ConfigError, match="negative"):
        optimal_leading([a], -1)


@st.composite
def _streams(draw: st.DrawFn) -> tuple[list[Request], int, int]:
    rng = random.Random(draw(st.integers(0, 10**6)))
    requests = _forest_requests(rng, draw(st.integers(2, 30)), draw(st.integers(1, 60)))
    return requests, draw(st.integers(1, 12)), draw(st.integers(0, 6))


@settings(max_examples=40, deadline=None)
@given(_streams())
def test_real_tiers_never_beat_the_optimum_and_the_optimum_never_the_infinite(stream) -> None:
    requests, capacity, hbm = stream
    alone = [0] * len(requests)
    opt = tally(requests, alone, optimal_leading(requests, capacity))
    assert predict(requests, capacity, alone).served <= opt.served
    assert legacy_predict(requests, capacity, alone).served <= opt.served
    assert opt.served <= tally(requests, alone, infinite_leading(requests)).served
    # behind an HBM cache the infinite tier is still a bound on everything
    floors = hbm_floors(requests, hbm)
    inf = tally(requests, floors, infinite_leading(requests)).served
    assert predict(requests, capacity, floors).served <= inf
    assert tally(requests, floors, optimal_leading(requests, capacity)).served <= inf


# ---- predictions -----------------------------------------------------------------------------


def test_memory_and_disk_run_one_policy_and_serve_the_same_chunks() -> None:
    requests = workloads.sessions(n_sessions=60, span_s=200.0, seed=3)
    ws = working_set(requests)
    floors = hbm_floors(requests, ws // 20)
    for frac in (0.1, 0.3):
        cap = round(frac * ws)
        # memory fed one chunk at a time, as a lower tier is (no copies in flight): the same
        # calls, so the same policy serves the same chunks
        mem = drive_tier(requests, cap, floors, transfer_depth=0)
        disk = drive_tier(requests, cap, floors, tier=DISK)
        assert (mem.leads, mem.written) == (disk.leads, disk.written)
        hits = predict(requests, cap, floors, tier=DISK)
        assert 0 < hits.served <= hits.missed
    with pytest.raises(ValueError, match="is not 'memory' or 'disk'"):
        predict(requests, 4, floors, tier="tape")


def test_chain_aware_policy_beats_the_old_one_on_sessions_behind_hbm() -> None:
    requests = workloads.sessions(n_sessions=300, span_s=400.0, seed=1)
    ws = working_set(requests)
    floors = hbm_floors(requests, round(0.05 * ws))
    cap = round(0.3 * ws)
    assert predict(requests, cap, floors).served > legacy_predict(requests, cap, floors).served


def test_workloads_are_seeded_and_prompts_chain() -> None:
    assert workloads.sessions(n_sessions=20, seed=5) == workloads.sessions(n_sessions=20, seed=5)
    assert workloads.prefix_pool(n_requests=50, seed=1) != workloads.prefix_pool(
        n_requests=50, seed=2
    )
    rr = workloads.round_robin(n_conversations=3, turns=2, first_chunks=2, turn_chunks=1)
    assert [len(r.chunks) for r in rr] == [2, 2, 2, 3, 3, 3]
    assert rr[3].chunks[:2] == rr[0].chunks  # turn 1 extends turn 0


def test_the_curve_rises_to_the_infinite_tier_at_the_whole_working_set() -> None:
    requests = workloads.prefix_pool(n_prefixes=20, n_requests=400, zipf=1.0, seed=2)
    points = hit_curve(requests, hbm_chunks=10, fractions=(0.1, 0.5, 1.0))
    opt = [p.optimum.served for p in points]
    assert opt == sorted(opt)
    last = points[-1]
    assert last.kvtier.served == last.optimum.served == last.infinite.served
    with pytest.raises(ConfigError, match=r"must lie in \(0, 1\]"):
        hit_curve(requests, 0, fractions=(1.5,))


def test_reuse_distance_is_prefixes_times_prompt() -> None:
    assert pool_reuse_distance(5, 256, 32) == 5 * 288


def test_a_save_under_the_hbm_floor_passes_a_resident_chunk_over_as_the_engine_does() -> None:
    """The engine saves every admitted chunk above the tier's hit, those the HBM served too:
    an evicted one is written again, a resident one is passed over, not touched (the save lane
    skips it; tests/native/test_model_agreement.py shows the engine losing it)."""
    from kvtier.cachemodel.predict import drive_tier
    from kvtier.cachemodel.stream import Request

    a, b, c = Request((1,), 1), Request((2,), 1), Request((3,), 1)
    # A, B; A again served from HBM (floor 1: no lookup); C evicts the tier's LRU; A misses HBM
    stream, floors = [a, b, a, c, a], [0, 0, 1, 0, 0]
    done = drive_tier(stream, 2, floors, admission="all", transfer_depth=0)
    assert done.leads == [0, 0, 0, 0, 0]  # A's save under its HBM floor did not keep it warm
    assert done.written == 4  # A, B, C, and A again after its eviction
