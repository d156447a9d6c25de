"""Retention in the cache model: a hinting client keeps paused conversations that recency loses,
within its budget (clipped, rejected or displaced, and counted), deadlines run on the simulated
clock, the peak live working set of a hand-made stream, timed workloads and the bench rows."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.bench import cache
from kvtier.cachemodel import workloads
from kvtier.cachemodel.hinting import DISTINCT, LIVE, base_of, hint_point
from kvtier.cachemodel.live import live_counts, peak_live
from kvtier.cachemodel.predict import DISK, MEMORY, drive_tier, key_of, tally
from kvtier.cachemodel.retention import CLIP, REJECT, SOONEST, HintingClient
from kvtier.cachemodel.stream import Request, hbm_floors, working_set
from kvtier.cachemodel.turns import Turn, hinting_share, link_next, requests_of
from kvtier.errors import ConfigError


def _r(*chunks: int) -> Request:
    return Request(tuple(chunks), len(chunks))


def _paused(flood_at: float = 1.0) -> list[Turn]:
    """Conversation A pauses 100 s while 8 one-off prompts of 2 chunks flood a 4-chunk tier."""
    turns = [Turn(_r(1, 2, 3), 0.0, 100.0, session=0)]
    for i in range(8):
        turns.append(Turn(_r(100 + 2 * i, 101 + 2 * i), flood_at + i, None, session=1 + i))
    turns.append(Turn(_r(1, 2, 3, 4), 100.0, None, session=0))
    return turns


def _served(
    turns: list[Turn], capacity: int, client: HintingClient | None, tier: str = MEMORY
) -> list[int]:
    requests = requests_of(turns)
    floors = [0] * len(requests)
    return drive_tier(requests, capacity, floors, tier=tier, hinter=client).leads


# ---- the client keeps what recency loses, within its budget -----------------------------------


@pytest.mark.parametrize("tier", [MEMORY, DISK])
def test_a_hint_keeps_a_paused_conversation_that_recency_evicts(tier: str) -> None:
    turns = _paused()
    assert _served(turns, 4, None, tier)[-1] == 0  # the flood evicted A under recency
    client = HintingClient(turns, 4, budget=0.75, audit=True)
    assert _served(turns, 4, client, tier)[-1] == 3  # A's whole prompt came back from the tier
    assert client.stats.hints == 1 and client.stats.retained == 3
    assert client.stats.last_turns == 9  # one-offs and A's last turn send no hint
    assert max(client.live_after) <= client.cap == 3


def test_a_deadline_runs_out_on_the_simulated_clock() -> None:
    turns = _paused(flood_at=30.0)
    on_time = HintingClient(turns, 4, budget=0.75, slack_s=5.0)
    assert _served(turns, 4, on_time)[-1] == 3
    # the client believed its next turn came at 20 s; it came at 100 s, after the hint ran out
    # (at 25 s) and the flood (from 30 s) took the tier
    late = [Turn(turns[0].request, 0.0, 20.0, session=0), *turns[1:]]
    assert _served(late, 4, HintingClient(late, 4, budget=0.75, slack_s=5.0))[-1] == 0
    client = HintingClient(late, 4, budget=0.75, slack_s=5.0)
    client.begin(0)
    keys = [key_of(c) for c in late[0].request.chunks]
    client.end(0, keys, held=3)
    assert client.table.until(keys[0]) == 25.0
    client.now = 24.9
    assert all(client.holds(k) for k in keys)
    client.now = 25.0  # the deadline itself is past
    assert not any(client.holds(k) for k in keys)
    assert len(client.table.live()) == 0


def test_the_budget_clips_a_hint_and_keeps_its_prefix() -> None:
    turns = [
        Turn(_r(1, 2, 3), 0.0, 50.0, session=0),
        Turn(_r(7, 8, 9), 1.0, 40.0, session=1),
        Turn(_r(1, 2, 3, 4), 50.0, None, session=0),
    ]
    keys = [key_of(c) for c in (7, 8, 9)]
    clip = HintingClient(turns, 8, budget=0.5, mode=CLIP)  # cap 4
    clip.begin(0)
    clip.end(0, [key_of(c) for c in (1, 2, 3)], held=3)
    clip.begin(1)
    clip.end(1, keys, held=3)
    assert (clip.stats.clipped, clip.stats.retained, clip.stats.asked) == (1, 4, 6)
    assert clip.holds(keys[0]) and not clip.holds(keys[1])  # the prefix is what stays
    assert len(clip.table.live()) == clip.cap

    reject = HintingClient(turns, 8, budget=0.5, mode=REJECT)
    reject.begin(0)
    reject.end(0, [key_of(c) for c in (1, 2, 3)], held=3)
    reject.begin(1)
    reject.end(1, keys, held=3)
    assert (reject.stats.rejected, reject.stats.retained) == (1, 3)
    assert not any(reject.holds(k) for k in keys)

    soonest = HintingClient(turns, 8, budget=0.5, mode=SOONEST)
    soonest.begin(0)
    soonest.end(0, [key_of(c) for c in (1, 2, 3)], held=3)
    soonest.begin(1)
    soonest.end(1, keys, held=3)  # due back at 40 s, before A's 50 s: A's deepest two go
    assert soonest.stats.displaced == 2 and soonest.stats.clipped == 0
    assert all(soonest.holds(k) for k in keys)
    assert soonest.holds(key_of(1)) and not soonest.holds(key_of(3))
    assert len(soonest.table.live()) <= soonest.cap


def test_a_sooner_hint_never_displaces_its_own_shared_prefix() -> None:
    turns = [
        Turn(_r(1, 2, 3), 0.0, 50.0, session=0),
        Turn(_r(1, 8, 9), 1.0, 40.0, session=1),  # chunk 1: a system prompt both share
    ]
    client = HintingClient(turns, 8, budget=0.5, mode=SOONEST)  # cap 4
    for i, t in enumerate(turns):
        client.begin(i)
        client.end(i, [key_of(c) for c in t.request.chunks], held=3)
    assert client.stats.displaced == 1  # A's deepest chunk, not the shared head
    assert [client.holds(key_of(c)) for c in (1, 2, 3, 8, 9)] == [True, True, False, True, True]
    assert client.table.until(key_of(1)) == 55.0  # A's later deadline on it is kept


@pytest.mark.parametrize("mode", [CLIP, REJECT, SOONEST])
def test_hints_beat_recency_on_sessions_and_never_pass_the_cap(mode: str) -> None:
    turns = workloads.session_turns(n_sessions=150, span_s=300.0, slow_s=200.0, seed=2)
    requests = requests_of(turns)
    ws = working_set(requests)
    floors = hbm_floors(requests, round(0.05 * ws))
    cap = round(0.2 * ws)
    plain = tally(requests, floors, drive_tier(requests, cap, floors).leads)
    client = HintingClient(turns, cap, budget=0.5, mode=mode, audit=True)
    hinted = tally(requests, floors, drive_tier(requests, cap, floors, hinter=client).leads)
    # 3288 chunks without hints; 3928 to 3993 with them, by mode
    assert hinted.served > plain.served * 1.15, (hinted.served, plain.served)
    assert max(client.live_after) <= client.cap
    s = client.stats
    assert s.hints > 0 and s.retained < s.asked  # the budget bound some hints ...
    assert s.clipped + s.rejected + s.displaced > 0  # ... and they were counted
    assert s.peak <= client.cap


def test_bad_client_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match="budget"):
        HintingClient(_paused(), 4, budget=1.5)
    with pytest.raises(ConfigError, match="mode"):
        HintingClient(_paused(), 4, mode="pin")


# ---- the peak live working set ----------------------------------------------------------------


def test_the_live_working_set_of_a_hand_made_stream() -> None:
    # 1 is used at 0, 1, 3; 2 at 0, 3; 4 at 2, 4; 3, 5 and 6 once (never live)
    stream = [_r(1, 2), _r(1, 3), _r(4), _r(1, 2, 5), _r(4, 6)]
    assert live_counts(stream) == [2, 2, 3, 1, 0]
    assert peak_live(stream) == 3
    assert (base_of(stream, LIVE), base_of(stream, DISTINCT)) == (3, 6)
    assert peak_live([_r(1), _r(2)]) == 0
    with pytest.raises(ConfigError, match="normalization"):
        base_of(stream, "all")


# ---- timed turns ------------------------------------------------------------------------------


def test_a_trace_turn_is_continued_by_the_first_later_prompt_holding_it() -> None:
    stream = [_r(10, 11, 12), _r(10, 20), _r(10, 11, 12, 13), _r(10, 11, 12, 13, 14)]
    turns = link_next(stream, [0.0, 1.0, 5.0, 9.0])
    assert [t.next_at for t in turns] == [5.0, None, 9.0, None]
    assert [t.session for t in turns] == [0, 1, 0, 0]  # a shared first chunk is not a turn
    with pytest.raises(ConfigError, match="non-decreasing"):
        link_next(stream, [0.0, 2.0, 1.0, 3.0])


def test_agent_loops_pause_briefly_for_tools_and_long_for_people() -> None:
    turns = workloads.agent_turns(n_agents=200, seed=4)
    gaps = sorted(t.gap for t in turns if t.gap is not None)
    assert gaps[len(gaps) // 2] < 10.0  # most pauses are tool calls
    assert sum(g > 120.0 for g in gaps) > 0.03 * len(gaps)  # some wait for a person
    nxt: dict[int, float] = {}
    for t in reversed(turns):  # each turn's next is its own conversation's next arrival
        assert t.next_at == nxt.get(t.session)
        nxt[t.session] = t.at
    assert workloads.sessions(n_sessions=30, seed=1) == requests_of(
        workloads.session_turns(n_sessions=30, seed=1)
    )
    mixed = hinting_share(turns, 0.5)
    by_session = {t.session: t.hints for t in mixed}
    assert all(t.hints == by_session[t.session] for t in mixed)  # a conversation hints or not
    assert 0.3 < sum(by_session.values()) / len(by_session) < 0.7


# ---- the point and the bench rows -------------------------------------------------------------


def test_a_point_puts_hints_between_recency_and_the_silent_floor() -> None:
    turns = workloads.session_turns(n_sessions=150, span_s=300.0, slow_s=200.0, seed=2)
    p = hint_point(turns, LIVE, 0.05, 0.3, budget=0.5)
    assert p.base == peak_live(requests_of(turns)) and p.capacity == round(0.3 * p.base)
    assert p.hinted.served > p.plain.served
    assert p.mixed_silent.rate >= p.silent_floor.rate  # silent traffic keeps >= (1 - budget)
    total = p.mixed_hinted.missed + p.mixed_silent.missed
    assert total == p.plain.missed  # the two halves are the whole stream


def test_bench_cache_prints_retention_rows_and_targets(tmp_path: Path, capsys) -> None:
    small = cache.Workload(
        cache.SESSIONS,
        "small",
        lambda: workloads.session_turns(n_sessions=150, span_s=300.0, slow_s=200.0, seed=2),
    )
    doc = cache.run(
        quick=True, trace=None, json_path=tmp_path / "c.json", workload_list=[],
        retention_list=[small],
    )  # fmt: skip
    rows = doc["meta"]["retention"]
    assert [(r["normalization"], r["tier_fraction"]) for r in rows] == [
        (DISTINCT, 0.3),
        (LIVE, 0.3),
    ]
    for r in rows:
        assert r["hinted"] > r["plain"]
    ids = {r["id"]: r for r in doc["rows"]}
    for norm in (DISTINCT, LIVE):
        t = ids[f"target.retention_{norm}"]
        assert t["target"] == ">= 0.8 x"
        assert t["pass"] is (t["value"] >= 0.8)
    assert ids["target.retention_silent_floor"]["pass"] is True
    cache.print_table(doc)
    out = capsys.readouterr().out
    assert "retention hints" in out and "hinted / optimum" in out
