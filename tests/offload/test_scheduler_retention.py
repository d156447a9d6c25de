"""Retention hints through the OffloadScheduler: a hinted prompt is retained on the ranks and
always saved, the budget clips and rejects (per tenant too), deadlines pass on a controllable
clock, and a conversation can be found again by its key to prefetch or forget."""

from __future__ import annotations

from kvtier.config import KVTierConfig
from kvtier.metrics import Metrics
from kvtier.offload.messages import OpResult, WorkerReport
from kvtier.offload.protocols import StepRequest
from kvtier.offload.retention import CLIPPED, REJECTED, RETAINED, RetentionHint, RetentionLedger
from kvtier.offload.scheduler import OffloadScheduler
from tests.offload.fakes import FakeLookup, SlotView
from tests.store.conftest import FakeClock

CHUNK = 32
BLOCK = 16
BYTES_PER_TOKEN = 1024


class HintedView(SlotView):
    """A request view carrying a client's retention hint."""

    __slots__ = ("retention",)

    def __init__(self, req_id: str, prompt: list[int], hint: RetentionHint | None) -> None:
        super().__init__(req_id, prompt)
        self.retention = hint


def make(chunks: int = 200, **kw: object) -> tuple[OffloadScheduler, FakeLookup, Metrics]:
    metrics = Metrics(rank=0)
    lookup = FakeLookup(0)
    memory = chunks * CHUNK * BYTES_PER_TOKEN
    cfg = {"chunk_size": CHUNK, "load_gate": False, "memory_bytes": memory}
    sched = OffloadScheduler(
        KVTierConfig(**{**cfg, **kw}),
        lookup,
        model_id="m",
        block_size=BLOCK,
        world=1,
        metrics=metrics,
        bytes_per_token=BYTES_PER_TOKEN,
        cold_misses=False,
    )
    return sched, lookup, metrics


def prompt(i: int, chunks: int) -> list[int]:
    return [i * 10_000 + t for t in range(chunks * CHUNK + 1)]


def serve(sched: OffloadScheduler, view: SlotView, tokens: int) -> int:
    """One request through lookup, one step and its save terminal; chunks it saved."""
    sched.get_num_new_matched_tokens(view, 0)
    view.advance(0, list(range(100, 100 + -(-tokens // BLOCK))))
    saves = sched.build_meta([StepRequest(view, tokens)]).saves
    sched.process_reports([WorkerReport(0, [OpResult(s.op_id, True) for s in saves])])
    sched.request_finished(view)
    sched.build_meta([])
    return sum(len(s.chunks) for s in saves)


def test_a_hinted_prompt_is_retained_on_the_ranks_and_always_saved() -> None:
    sched, lookup, metrics = make(admission="adaptive")
    tokens = prompt(1, 4)
    hint = RetentionHint(ttl_s=120.0, upto_tokens=3 * CHUNK + 5, session="conv-1")
    view = HintedView("r1", tokens, hint)
    assert serve(sched, view, len(tokens)) == 4
    [(op, keys, until, waited)] = lookup.admins
    assert (op, waited) == ("retain", False)  # from a hook: never waits for the ranks
    assert keys == sched.planner.keys_for(tokens)[:3]  # up to the marked message, whole chunks
    decision = sched.planner.retention_decision("r1")
    assert decision is not None and decision.status == RETAINED
    assert (decision.tokens, decision.ttl_s) == (3 * CHUNK, 120.0)
    assert sched.planner.retention_decision("r1") is None  # read once
    assert metrics.value("retention_total", status="retained") == 1
    assert metrics.value("retained_chunks") == 3
    # the conversation is found again by its key
    assert sched.planner.keys_for(session="conv-1") == sched.planner.keys_for(tokens)


def test_the_budget_clips_then_rejects_and_a_ttl_past_the_maximum_is_clipped() -> None:
    # 20 chunks of tier, a budget of half: 10 chunks may be retained
    sched, lookup, metrics = make(chunks=20, retention_budget=0.5, retention_tenant_share=1.0)
    first = HintedView("a", prompt(1, 8), RetentionHint())
    serve(sched, first, 8 * CHUNK)
    assert sched.planner.retention_decision("a").status == RETAINED
    second = HintedView("b", prompt(2, 8), RetentionHint())
    serve(sched, second, 8 * CHUNK)
    clipped = sched.planner.retention_decision("b")
    assert (clipped.status, clipped.tokens, clipped.reason) == (CLIPPED, 2 * CHUNK, "budget")
    assert lookup.admins[-1][1] == sched.planner.keys_for(prompt(2, 8))[:2]  # the leading chunks
    third = HintedView("c", prompt(3, 2), RetentionHint())
    serve(sched, third, 2 * CHUNK)
    rejected = sched.planner.retention_decision("c")
    assert (rejected.status, rejected.tokens) == (REJECTED, 0)
    assert len(lookup.admins) == 2  # nothing sent for a rejected hint
    long = HintedView("d", prompt(1, 8), RetentionHint(ttl_s=10**9))
    serve(sched, long, 8 * CHUNK)  # already retained chunks cost no budget
    ttl = sched.planner.retention_decision("d")
    assert (ttl.status, ttl.reason, ttl.ttl_s) == (CLIPPED, "ttl", 86400.0)
    assert metrics.value("retention_total", status="rejected") == 1
    assert metrics.value("retention_total", status="clipped") == 2


def test_deadlines_pass_on_the_clock_and_one_tenant_gets_its_share() -> None:
    clock = FakeClock()
    ledger = RetentionLedger(10, tenant_share=0.5, default_ttl_s=60, max_ttl_s=600, clock=clock)
    keys = [bytes([i]) * 16 for i in range(12)]
    d, granted, until = ledger.decide(keys[:8], RetentionHint(tenant="t1"), 1)
    assert (d.status, d.reason, len(granted), until) == (CLIPPED, "tenant_budget", 5, 1060.0)
    d, granted, _ = ledger.decide(keys[8:], RetentionHint(tenant="t2", ttl_s=10), 1)
    assert (d.status, len(granted)) == (RETAINED, 4)
    assert ledger.retained_chunks() == 9
    clock.advance(11)  # t2's deadline passed: its room is back
    assert ledger.retained_chunks() == 5
    d, granted, _ = ledger.decide(keys[8:10], RetentionHint(tenant="t2"), 1)
    assert (d.status, len(granted)) == (RETAINED, 2)
    clock.advance(60)
    assert ledger.retained_chunks() == 0


def test_admin_forget_and_prefetch_go_to_the_ranks_and_free_the_budget() -> None:
    sched, lookup, _ = make()
    tokens = prompt(4, 3)
    serve(sched, HintedView("x", tokens, RetentionHint(session="s", tenant="u")), len(tokens))
    keys = sched.planner.keys_for(session="s", tenant="u")
    assert keys == sched.planner.keys_for(tokens) and sched.planner.retention.retained_chunks() == 3
    answers = sched.planner.admin("prefetch", keys)
    assert answers[0].count == 3 and lookup.admins[-1][0] == "prefetch"
    sched.planner.admin("forget", keys)
    assert lookup.admins[-1][:2] == ("forget", keys) and lookup.admins[-1][3]
    assert sched.planner.retention.retained_chunks() == 0
    # a key without a retention ask only tags the conversation
    tag = RetentionHint(session="s2", tenant="u", retain=False)
    serve(sched, HintedView("y", prompt(5, 2), tag), 2 * CHUNK)
    assert sched.planner.retention_decision("y") is None
    assert sched.planner.keys_for(session="s2", tenant="u") == sched.planner.keys_for(prompt(5, 2))
    other = sched.planner.keys_for(prompt(5, 2))
    assert set(sched.planner.keys_for(tenant="u")) == set(keys) | set(other)


def test_a_hinted_prompt_is_saved_even_where_admission_rejects_its_kind() -> None:
    from tests.offload.test_scheduler_admission import one_off, returning

    sched, _, _ = make()
    for i in range(300):
        serve(sched, SlotView(f"o{i}", one_off(i)), len(one_off(i)))
        serve(sched, SlotView(f"r{i}", returning(i)), len(returning(i)))
    assert serve(sched, SlotView("plain", one_off(10_000)), len(one_off(10_000))) == 0
    hinted = HintedView("hinted", one_off(10_001), RetentionHint(session="agent"))
    assert serve(sched, hinted, len(one_off(10_001))) == 8


def test_hints_from_request_parameters_in_openais_names() -> None:
    import pytest

    from kvtier.offload.retention import hint_from_params

    assert hint_from_params({}) is None
    assert hint_from_params({"prompt_cache_key": "c", "user": "u"}) == RetentionHint(
        session="c", tenant="u", retain=False
    )
    day = hint_from_params({"prompt_cache_retention": "24h", "prompt_cache_key": "c"})
    assert (day.ttl_s, day.session, day.retain) == (86400.0, "c", True)
    assert hint_from_params({"prompt_cache_retention": "in_memory"}).ttl_s is None  # default
    custom = hint_from_params({"retain_ttl_s": 42, "retain_tokens": 128})
    assert (custom.ttl_s, custom.upto_tokens) == (42.0, 128)
    for bad, word in (
        ({"prompt_cache_retention": "forever"}, "prompt_cache_retention"),
        ({"retain_ttl_s": -1}, "retain_ttl_s"),
        ({"retain_tokens": "all"}, "retain_tokens"),
        ({"prompt_cache_key": "k" * 257}, "prompt_cache_key"),
    ):
        with pytest.raises(ValueError, match=word):
            hint_from_params(bad)


def test_a_chunk_two_conversations_retain_stays_until_both_let_go() -> None:
    clock = FakeClock()
    ledger = RetentionLedger(10, tenant_share=1.0, default_ttl_s=60, max_ttl_s=600, clock=clock)
    system = [bytes([1]) * 16, bytes([2]) * 16]  # a shared system prompt
    a, b = [*system, bytes([3]) * 16], [*system, bytes([4]) * 16]
    ledger.decide(a, RetentionHint(session="a", tenant="t"), 1)
    ledger.decide(b, RetentionHint(session="b", tenant="t"), 1)
    assert ledger.retained_chunks() == 4
    # a lets go: only its own chunk leaves; the shared ones stay for b
    assert ledger.release(a, ("t", "a")) == [bytes([3]) * 16]
    assert ledger.retained_chunks() == 3
    assert ledger.release(b, ("t", "b")) == b
    assert ledger.retained_chunks() == 0


def test_releasing_a_conversation_sends_the_ranks_only_what_nobody_holds() -> None:
    sched, lookup, _ = make()
    shared = prompt(9, 2)
    a = [*shared, *range(50_000, 50_000 + CHUNK)]
    b = [*shared, *range(60_000, 60_000 + CHUNK)]
    serve(sched, HintedView("a", a, RetentionHint(session="a")), len(a))
    serve(sched, HintedView("b", b, RetentionHint(session="b")), len(b))
    keys_a = sched.planner.keys_for(session="a")
    sched.planner.admin("release", keys_a, ("", "a"))
    op, keys, _, _ = lookup.admins[-1]
    assert op == "release" and keys == keys_a[2:]  # the shared two chunks stay retained
    assert sched.planner.retention.retained_chunks() == 3  # b's three


def test_soonest_takes_the_room_of_chunks_due_back_later_and_tells_the_ranks() -> None:
    clock = FakeClock()
    ledger = RetentionLedger(
        4, tenant_share=1.0, default_ttl_s=60, max_ttl_s=600, full="soonest", clock=clock
    )
    later = [bytes([i]) * 16 for i in range(1, 5)]
    sooner = [bytes([i]) * 16 for i in range(11, 14)]
    assert ledger.decide(later, RetentionHint(ttl_s=500), 1)[0].status == "retained"
    # due back in 30 s: it takes the room of chunks due back later
    d, granted, _ = ledger.decide(sooner, RetentionHint(ttl_s=30), 1)
    assert (d.status, granted) == ("retained", sooner)
    # the latest-due chain loses its tail first: its head stays a usable prefix
    assert ledger.take_displaced() == [later[3], later[2], later[1]]
    assert ledger.retained_chunks() == 4
    # a hint due later than everything held finds no room and is clipped as before
    d, granted, _ = ledger.decide([bytes([99]) * 16], RetentionHint(ttl_s=590), 1)
    assert (d.status, granted) == ("rejected", [])
    # clip mode never displaces
    clip = RetentionLedger(4, tenant_share=1.0, default_ttl_s=60, max_ttl_s=600, clock=clock)
    clip.decide(later, RetentionHint(ttl_s=500), 1)
    assert clip.decide(sooner, RetentionHint(ttl_s=30), 1)[0].status == "rejected"
    assert clip.take_displaced() == []


def test_a_scheduler_in_soonest_mode_releases_what_it_displaced_on_the_ranks() -> None:
    sched, lookup, metrics = make(chunks=8, retention_budget=0.5, retention_full="soonest")
    late = HintedView("late", prompt(1, 4), RetentionHint(ttl_s=3000))
    serve(sched, late, 4 * CHUNK)
    soon = HintedView("soon", prompt(2, 2), RetentionHint(ttl_s=10))
    serve(sched, soon, 2 * CHUNK)
    assert sched.planner.retention_decision("soon").status == "retained"
    releases = [keys for op, keys, _, _ in lookup.admins if op == "release"]
    assert len(releases) == 1 and set(releases[0]) <= set(sched.planner.keys_for(prompt(1, 4)))
    assert len(releases[0]) == 2
    assert metrics.value("retention_displaced_chunks_total") == 2
