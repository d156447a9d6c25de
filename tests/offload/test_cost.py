"""The load-or-recompute cost model: read and prefill times learnt from samples, the choice of
where a load ends, its hysteresis band, its probes of a turned-away tier, and its check of
predictions against measured loads."""

from __future__ import annotations

import pytest

from kvtier.offload.cost import (
    LOAD,
    PROBE,
    RECOMPUTE,
    CostModel,
    PrefillTime,
    TierRead,
    segments_of,
)

CHUNK = 256


def test_a_tier_learns_its_latency_and_rate_from_loads_of_different_sizes() -> None:
    t = TierRead(5e6)  # a seed 100x off the truth
    for i in range(60):
        tokens = 256 * (1 + i % 8)
        t.observe(tokens, 0.005 + tokens / 50_000)  # 5 ms first byte, 50k tokens/s
    assert t.latency_s == pytest.approx(0.005, rel=0.1)
    assert t.tokens_per_s == pytest.approx(50_000, rel=0.05)
    assert t.seconds(4096) == pytest.approx(0.005 + 4096 / 50_000, rel=0.02)


def test_a_faster_first_read_is_a_faster_rate_never_a_negative_latency() -> None:
    t = TierRead(1e5)
    t.observe(256, 0.25 * 256 / 1e5)  # 4x faster than the seed
    assert t.latency_s >= 0
    assert t.seconds(256) == pytest.approx(0.25 * 256 / 1e5, rel=0.05)


def test_the_fit_follows_a_link_that_slows_down_after_long_steady_traffic() -> None:
    t = TierRead(1e6)
    for _ in range(2000):  # one size for long: the covariance must not wind up or freeze
        t.observe(1024, 1024 / 1e6)
    for _ in range(60):
        t.observe(1024, 1024 / 1e5)  # the link is 10x slower now
    assert t.seconds(1024) == pytest.approx(1024 / 1e5, rel=0.1)


def test_a_tier_whose_speed_changed_is_followed_within_two_reads() -> None:
    """`bench load-cost`'s sweep on a real store: after 10 loads at 72 ms the store slowed to
    160 ms, and forgetting alone took 10 loads (each slower than recompute) to predict it.
    Two reads in a row over 1.5x off on the same side drop the past."""
    t = TierRead(1e6)
    for _ in range(10):
        t.observe(256, 0.072)
    t.observe(256, 0.160)
    assert t.seconds(256) < 0.120  # one read moves the prediction no further than forgetting
    t.observe(256, 0.160)
    assert t.seconds(256) == pytest.approx(0.160, rel=0.1)
    assert t.shifts == 1
    for _ in range(3):  # and back: a store that recovered
        t.observe(256, 0.060)
    assert t.seconds(256) == pytest.approx(0.060, rel=0.1)
    assert t.shifts == 2


def test_a_noisy_tier_keeps_its_past() -> None:
    """Reads scattered up to 1.4x either way around one speed, or single outliers between them,
    never drop the fit's past."""
    t = TierRead(1e6)
    for _ in range(10):  # a steady past (an outlier among a tier's first reads may drop it)
        t.observe(256, 0.1)
    for i in range(500):
        t.observe(256, 0.1 * (1.4, 0.75, 1.0, 1.3, 0.72)[i % 5] * (3.0 if i % 17 == 0 else 1.0))
        assert 0.07 < t.seconds(256) < 0.2
    assert t.shifts == 0


def test_prefill_time_grows_with_the_context_it_attends_to() -> None:
    p = PrefillTime(2000.0)
    for i in range(80):
        tokens, ctx = 512 * (1 + i % 4), 1024 * (i % 5)
        # 2 ms a step, 20k tokens/s, and attention: 1e-8 s per token per context token
        p.observe(tokens, 0.002 + tokens / 20_000 + tokens * ctx * 1e-8, context=tokens * ctx)
    assert p.marginal_seconds(0, 1000) == pytest.approx(1000 / 20_000 + 1000 * 500 * 1e-8, rel=0.1)
    assert p.marginal_seconds(8000, 9000) > 1.5 * p.marginal_seconds(0, 1000)


def model(remote_tokens_per_s: float, margin: float = 0.1) -> CostModel:
    """Prefill at 10k tokens/s; memory reads at 1M tokens/s; the remote store as given."""
    m = CostModel(
        PrefillTime(10_000.0),
        {"memory": TierRead(1e6), "remote": TierRead(remote_tokens_per_s)},
        margin=margin,
        probe_s=10.0,
    )
    return m


def test_every_run_from_a_fast_tier_is_loaded() -> None:
    c = model(1e6).choose(0, 4 * CHUNK, [("memory", 2), ("remote", 2)], CHUNK, 16, now=0.0)
    assert c.end == 4 * CHUNK
    assert [s.decision for s in c.segments] == [LOAD, LOAD]
    assert c.predicted_s == pytest.approx(2 * CHUNK / 1e6 * 2, rel=0.01)


def test_a_store_slower_than_the_prefill_is_recomputed() -> None:
    c = model(2_000.0).choose(0, 4 * CHUNK, [("remote", 4)], CHUNK, 16, now=0.0)
    assert c.end == 0
    assert [s.decision for s in c.segments] == [RECOMPUTE]


def test_a_run_is_split_head_from_memory_tail_recomputed() -> None:
    c = model(2_000.0).choose(CHUNK // 2, 6 * CHUNK, [("memory", 3), ("remote", 3)], CHUNK, 16, 0.0)
    assert c.end == 3 * CHUNK  # the memory run's end, a chunk boundary
    assert c.reads() == (("memory", 3 * CHUNK - CHUNK // 2),)
    assert [(s.tier, s.decision) for s in c.segments] == [("memory", LOAD), ("remote", RECOMPUTE)]


def test_min_load_is_kept() -> None:
    c = model(1e6).choose(0, 2 * CHUNK, [("memory", 2)], CHUNK, min_load=4 * CHUNK, now=0.0)
    assert c.end == 0


def test_near_break_even_the_decision_holds_inside_the_hysteresis_band() -> None:
    """With a 10% margin the break-even is a store at 11k tokens/s (prefill 10k); the band is
    10% either side of it: 9.9k..12.1k, so a rate wobbling inside it never flips."""
    m = model(8_000.0)
    hit = [("remote", 4)]

    def decide(rate: float) -> int:
        m.tiers["remote"] = TierRead(rate)
        return m.choose(0, 4 * CHUNK, hit, CHUNK, 16, now=0.0).end

    assert decide(8_000.0) == 0  # clearly slower: recompute
    for rate in (11_500.0, 12_000.0, 10_500.0):  # inside the band: stays recompute
        assert decide(rate) == 0, rate
    assert decide(12_500.0) == 4 * CHUNK  # beyond it: load
    for rate in (11_000.0, 10_200.0, 10_500.0):  # inside the band: stays load
        assert decide(rate) == 4 * CHUNK, rate
    assert decide(9_500.0) == 0


def test_a_turned_away_tier_is_probed_once_per_interval() -> None:
    m = model(2_000.0)
    hit = [("remote", 4)]
    decisions = [m.choose(0, 4 * CHUNK, hit, CHUNK, 16, now=t).segments[0].decision
                 for t in (0.0, 5.0, 9.9, 10.0, 10.5, 19.0, 20.1)]  # fmt: skip
    assert decisions == [RECOMPUTE, RECOMPUTE, RECOMPUTE, PROBE, RECOMPUTE, RECOMPUTE, PROBE]


def test_a_mixed_read_teaches_its_slowest_tier() -> None:
    m = model(1e5)
    before = m.tiers["memory"].seconds(CHUNK)
    # 2 memory chunks (predicted ~0.5 ms) and 2 remote chunks that took 0.2 s
    m.observe_read([("memory", 2 * CHUNK), ("remote", 2 * CHUNK)], 0.2 + 2 * CHUNK / 1e6)
    assert m.tiers["memory"].seconds(CHUNK) == before
    assert m.tiers["remote"].seconds(2 * CHUNK) == pytest.approx(0.2, rel=0.05)


def test_predictions_off_by_over_2x_are_counted_and_their_recent_share_kept() -> None:
    m = model(1e5)
    assert not m.observe_outcome(0.1, 0.15)
    assert m.observe_outcome(0.1, 0.25)
    assert m.observe_outcome(0.1, 0.04)
    assert m.predictions == 3
    for _ in range(100):
        m.observe_outcome(0.1, 0.1)
    assert m.mispredicted_share < 0.05


def test_segments_clip_to_the_load_and_cover_an_unreported_tail() -> None:
    assert segments_of([("memory", 2), ("disk", 1)], CHUNK, 100, 3 * CHUNK) == [
        ("memory", 100, 2 * CHUNK),
        ("disk", 2 * CHUNK, 3 * CHUNK),
    ]
    assert segments_of([("memory", 1)], CHUNK, 0, 2 * CHUNK) == [("memory", 0, 2 * CHUNK)]


def test_a_tier_whose_loads_fail_is_recomputed_though_its_reads_look_fast() -> None:
    """A read cut by the store's timeout is a failed load: it cost the wait and then the
    recompute. Its time alone (under the prefill's) would keep the model loading forever."""
    m = model(1e6)
    hit = [("remote", 4)]
    assert m.choose(0, 4 * CHUNK, hit, CHUNK, 16, now=0.0).end == 4 * CHUNK
    for _ in range(4):  # each waited out a 50 ms timeout, then the prompt was recomputed
        m.observe_read([("remote", 4 * CHUNK)], 0.050, ok=False)
    assert m.tiers["remote"].fail_share > 0.5
    assert m.choose(0, 4 * CHUNK, hit, CHUNK, 16, now=1.0).end == 0
    for _ in range(10):  # probes that succeed bring it back
        m.observe_read([("remote", 4 * CHUNK)], 0.001, ok=True)
    assert m.choose(0, 4 * CHUNK, hit, CHUNK, 16, now=2.0).end == 4 * CHUNK


def test_one_timed_out_load_turns_a_store_near_the_break_even_away() -> None:
    """`bench load-cost` restored 3 prompts through timed-out loads before the model turned a
    slow store away: each wait (half the prefill) was learnt as the store's read time, and one
    failure weighed 0.2. A failed load costs its wait and then the whole prefill: after one,
    a store whose every read would wait that long is not worth it."""
    m = model(1e6)
    hit = [("remote", 4)]
    assert m.choose(0, 4 * CHUNK, hit, CHUNK, 16, now=0.0).end == 4 * CHUNK
    # 1024 tokens are 102 ms of prefill; the load waited out a 55 ms timeout
    m.observe_read([("remote", 4 * CHUNK)], 0.055, ok=False)
    assert m.choose(0, 4 * CHUNK, hit, CHUNK, 16, now=1.0).end == 0
    # a fast tier's single failure (a corrupt record) leaves it loaded
    m.observe_read([("memory", 4 * CHUNK)], 0.001, ok=False)
    assert m.choose(0, 4 * CHUNK, [("memory", 4)], CHUNK, 16, now=2.0).end == 4 * CHUNK
