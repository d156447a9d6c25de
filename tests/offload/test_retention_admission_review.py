"""Review of retention and admission: defects found (each test failed before its fix) and
behaviours no other test pinned. Deadlines run on a controllable clock; nothing sleeps."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvtier.metrics import Metrics
from kvtier.offload import retention as ledger_module
from kvtier.offload.admission import ADAPTIVE, FORCED, REJECTED, AdmissionPolicy
from kvtier.offload.planner import _UNBOUNDED
from kvtier.offload.retention import REJECTED as HINT_REJECTED
from kvtier.offload.retention import (
    RETAINED,
    SOONEST,
    RetentionHint,
    RetentionLedger,
)
from kvtier.offload.retention_api import run_admin
from kvtier.store.memory import MemoryTier
from kvtier.store.retention import RETENTION_FILE, RetentionTable
from kvtier.store.stack import TierStack
from tests.offload.fakes import FakeAnswer, FakeLookup
from tests.offload.test_scheduler_retention import CHUNK, HintedView, make, prompt, serve
from tests.store.conftest import FakeClock, key_of, payload_of

SIZE = 1024


def keys(base: int, n: int) -> list[bytes]:
    return [key_of(base + i) for i in range(n)]


def ledger(budget: int, share: float = 1.0, **kw: object) -> tuple[RetentionLedger, FakeClock]:
    clock = FakeClock()
    return (
        RetentionLedger(
            budget, tenant_share=share, default_ttl_s=60, max_ttl_s=600, clock=clock, **kw
        ),
        clock,
    )


# ---- defects -------------------------------------------------------------------------------


def _memory_stack(slots: int, clock: FakeClock) -> TierStack:
    """A memory-only rank stack of `slots` chunks, retention on (8 chunks) on `clock`."""
    metrics = Metrics(rank=0)
    memory = MemoryTier(SIZE, slots * SIZE, bytes(range(16)), metrics, pin_memory=False)
    return TierStack(memory, [], metrics, retention_limit=8, clock=clock)


def test_soonest_never_displaces_other_grants_for_room_the_tenants_share_refuses() -> None:
    # budget 10, each tenant at most 5: both tenants hold their whole share, the budget is full
    led, _ = ledger(10, 0.5, full=SOONEST)
    a, b = keys(0, 5), keys(100, 5)
    assert led.decide(a, RetentionHint(ttl_s=5, tenant="a"), 1)[0].status == "retained"
    assert led.decide(b, RetentionHint(ttl_s=500, tenant="b"), 1)[0].status == "retained"
    # a hint of tenant a due at 10 s: a's share is spent (and none of its grants is due later),
    # so nothing of it can be granted...
    d, granted, _ = led.decide(keys(200, 3), RetentionHint(ttl_s=10, tenant="a"), 1)
    assert (d.status, granted) == (HINT_REJECTED, [])
    # ...and b's grants, due later, must not have been taken for it
    assert led.take_displaced() == []
    assert led.retained_chunks() == 10
    assert led.stats()["per_tenant"] == {"a": 5, "b": 5}
    assert all(led.release([k]) == [k] for k in b)  # b's five were all still retained


def test_soonest_takes_a_tenants_own_later_grants_before_it_would_waste_anothers() -> None:
    # as above, but a's grants are due back later than its new hint: they make its room
    led, _ = ledger(10, 0.5, full=SOONEST)
    led.decide(keys(0, 5), RetentionHint(ttl_s=100, tenant="a"), 1)
    led.decide(keys(100, 5), RetentionHint(ttl_s=500, tenant="b"), 1)
    d, granted, _ = led.decide(keys(200, 3), RetentionHint(ttl_s=10, tenant="a"), 1)
    assert (d.status, granted) == (RETAINED, keys(200, 3))
    # b's chunks are due latest but a could not use their room: a's own tail went instead
    assert led.take_displaced() == [key_of(4), key_of(3), key_of(2)]
    assert led.stats()["per_tenant"] == {"a": 5, "b": 5}


def test_soonest_displaces_only_what_the_tenant_may_still_take() -> None:
    # budget 10, tenant share 6: a holds 4, b holds 6, the budget is full
    led, _ = ledger(10, 0.6, full=SOONEST)
    assert led.decide(keys(0, 4), RetentionHint(ttl_s=100, tenant="a"), 1)[1] == keys(0, 4)
    assert led.decide(keys(100, 6), RetentionHint(ttl_s=500, tenant="b"), 1)[1] == keys(100, 6)
    d, granted, _ = led.decide(keys(200, 4), RetentionHint(ttl_s=10, tenant="a"), 1)
    assert (d.status, granted) == (RETAINED, keys(200, 4))
    # a may take 2 more of the budget: exactly 2 of b's latest-due chunks (its tail) make that
    # room; the other 2 come from a's own grants due later than the hint
    assert led.take_displaced() == [key_of(105), key_of(104), key_of(3), key_of(2)]
    assert led.retained_chunks() == 10
    assert led.stats()["per_tenant"] == {"a": 6, "b": 4}


def test_a_ledger_whose_budget_the_scheduler_cannot_size_stays_bounded(monkeypatch) -> None:
    # chunk bytes unknown: the planner hands the ledger an "unbounded" budget (the ranks bound
    # what they retain), but the ledger's own tables grow with every client's hint
    monkeypatch.setattr(ledger_module, "_MAX_RETAINED", 50, raising=False)
    led, _ = ledger(_UNBOUNDED)
    for i in range(10):
        led.decide(keys(1000 * i, 20), RetentionHint(session=f"s{i}"), 1)
    assert led.retained_chunks() == 50
    assert led.stats()["budget_chunks"] == 50
    d, granted, _ = led.decide(keys(99_000, 5), RetentionHint(), 1)
    assert (d.status, d.reason, granted) == (HINT_REJECTED, "budget", [])


def test_the_keys_remembered_over_all_conversations_are_bounded(monkeypatch) -> None:
    # each conversation is capped, and so is their number, but not their product (2^32 keys)
    monkeypatch.setattr(ledger_module, "_KEYS_TOTAL", 100, raising=False)
    led, _ = ledger(0)
    for i in range(20):
        led.note(keys(1000 * i, 10), f"s{i}", tenant=f"t{i % 3}")
    remembered = {i: led.keys_of(f"s{i}", f"t{i % 3}") for i in range(20)}
    assert sum(len(k) for k in remembered.values()) == 100
    # the least recently noted conversations went first, the newest are whole
    assert not led.known("s0", "t0") and not led.known("s9", "t0")
    assert led.known("s10", "t1") and remembered[19] == keys(19_000, 10)
    # forgetting gives the room back: ten more conversations all fit again
    for i in range(10, 20):
        led.forget(f"s{i}", f"t{i % 3}")
    for i in range(20, 30):
        led.note(keys(1000 * i, 10), f"s{i}", tenant="t")
    assert all(led.keys_of(f"s{i}", "t") == keys(1000 * i, 10) for i in range(20, 30))


def test_an_admin_retain_of_an_unknown_conversation_says_so_and_retains_nothing() -> None:
    sched, lookup, metrics = make()
    out = run_admin(sched.planner, "retain", session="never-seen", tenant="u")
    assert out["keys"] == 0
    assert "'never-seen'" in out["error"] and "name its prompt" in out["error"]
    assert out["retention"] == {
        "status": "rejected", "retained_tokens": 0, "ttl_s": 0.0, "reason": "unknown",
    }  # fmt: skip
    # the made-up name was not taken as a conversation, and nothing went to the ranks
    assert not sched.planner.retention.known("never-seen", "u")
    assert sched.planner.retention.stats()["conversations"] == 0
    assert lookup.admins == []
    assert metrics.value("retention_total", status="retained") == 0


class _SilentOnce(FakeLookup):
    """A lookup port whose rank does not answer the first waited-for forget."""

    def __init__(self) -> None:
        super().__init__(0)
        self.silent = True

    def admin(
        self, op: str, keys: Sequence[bytes], until: float = 0.0, *, timeout_ms: int | None = None
    ) -> dict[int, FakeAnswer]:
        answers = super().admin(op, keys, until, timeout_ms=timeout_ms)
        if op == "forget" and self.silent:
            self.silent = False
            return {0: FakeAnswer(None, "timed out")}
        return answers


def test_a_forget_a_rank_did_not_answer_can_be_retried_by_the_conversation_key() -> None:
    sched, _, _ = make()
    lookup = _SilentOnce()
    sched.planner._lookup = lookup  # the port the planner's admin calls go through
    tokens = prompt(4, 3)
    serve(sched, HintedView("r", tokens, RetentionHint(session="c", tenant="u")), len(tokens))
    want = sched.planner.keys_for(tokens)
    first = run_admin(sched.planner, "forget", session="c", tenant="u")
    assert first["unanswered"] == {"0": "timed out"} and first["ranks"] == {"0": None}
    # the rank may still hold the chunks: the conversation stays named for the retry
    assert sched.planner.retention.known("c", "u")
    again = run_admin(sched.planner, "forget", session="c", tenant="u")
    assert "error" not in again and "unanswered" not in again
    assert again["ranks"] == {"0": len(want)}
    assert [k for op, k, _, _ in lookup.admins if op == "forget"] == [want, want]
    assert not sched.planner.retention.known("c", "u")


@pytest.mark.parametrize("until", [math.inf, -math.inf, math.nan])
def test_a_rank_refuses_a_deadline_that_is_not_a_finite_number(until: float) -> None:
    clock = FakeClock()
    table = RetentionTable(8, clock)
    a = key_of(1)
    with pytest.raises(ValueError, match=r"until=(inf|-inf|nan) is not a finite number"):
        table.retain([a], until)
    assert len(table) == 0 and not table.holds(a)
    # through the rank's admin entry (the lookup server answers the error to the sender), the
    # memory tier still evicts the chunk as an ordinary one
    stack = _memory_stack(1, clock)
    try:
        assert stack.put(a, payload_of(1, SIZE))
        with pytest.raises(ValueError, match="not a finite number"):
            stack.admin("retain", [a], until)
        assert stack.put(key_of(2), payload_of(2, SIZE))
        assert not stack.memory.contains(a) and stack.memory.contains(key_of(2))
    finally:
        stack.close()


# ---- behaviours pinned ---------------------------------------------------------------------


def test_a_release_that_shortens_a_shared_chunks_deadline_is_sent_as_release_then_retain() -> None:
    # ledger: a shared chunk held by a (long) and b (short); a lets go -> b's deadline
    led, clock = ledger(10)
    shared = keys(0, 2)
    led.decide([*shared, key_of(50)], RetentionHint(ttl_s=500, session="a"), 1)
    led.decide([*shared, key_of(60)], RetentionHint(ttl_s=50, session="b"), 1)
    assert led.release([*shared, key_of(50)], ("", "a")) == [key_of(50)]
    assert led.take_shortened() == {k: clock() + 50 for k in shared}
    clock.advance(51)
    assert led.retained_chunks() == 0  # b's hold ended: nothing retained past it
    # the rank keeps the later of two deadlines: release-then-retain is how it is shortened
    table = RetentionTable(8, clock)
    table.retain(shared, clock() + 500)
    table.retain(shared, clock() + 50)
    assert table.until(shared[0]) == clock() + 500
    table.release(shared)
    table.retain(shared, clock() + 50)
    assert [table.until(k) for k in shared] == [clock() + 50] * 2


def test_retaining_a_chains_tail_keeps_its_whole_prefix_in_memory() -> None:
    clock = FakeClock()
    stack = _memory_stack(4, clock)
    try:
        head, tail = key_of(1), key_of(2)
        assert stack.put(head, payload_of(1, SIZE))
        assert stack.put(tail, payload_of(2, SIZE), parent=head)
        assert stack.admin("retain", [tail], clock() + 100) == 1
        # unretained traffic cycles through the other two slots, never the retained chain's
        for i in range(10, 20):
            assert stack.put(key_of(i), payload_of(i, SIZE))
        assert stack.memory.contains(head) and stack.memory.contains(tail)
        assert bytes(stack.memory.get(head)) == payload_of(1, SIZE)
        assert bytes(stack.memory.get(tail)) == payload_of(2, SIZE)
        clock.advance(101)  # past the deadline the tail is an ordinary chunk: the oldest leaf
        assert stack.put(key_of(20), payload_of(20, SIZE))
        assert not stack.memory.contains(tail) and stack.memory.contains(key_of(19))
    finally:
        stack.close()


def test_a_saved_table_is_taken_within_the_limit_and_without_expired_entries(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    path = tmp_path / RETENTION_FILE
    live = {key_of(i).hex(): clock() + 100 + i for i in range(5)}
    doc = {
        "version": 1,
        "until": {
            **live,
            key_of(9).hex(): clock() - 1,  # expired
            "zz" * 16: clock() + 100,  # not hex
            key_of(8).hex(): "soon",  # not a number
        },
    }
    path.write_text(json.dumps(doc))
    os.chmod(path, 0o600)
    small = RetentionTable(3, clock)
    assert small.load(path) == 3 and len(small) == 3
    # the three taken are live entries at the deadlines saved
    assert all(small.until(k) == live[k.hex()] for k in small.live())
    # with room for all: the five live ones, nothing expired or malformed
    table = RetentionTable(10, clock)
    assert table.load(path) == 5
    assert {k.hex(): u for k, u in table.live().items()} == live
    assert not table.holds(key_of(9)) and not table.holds(key_of(8))


def test_forced_and_rejected_chunks_are_counted_under_their_decision_when_they_return() -> None:
    policy = AdmissionPolicy(ADAPTIVE, capacity=None)
    forced = keys(0, 4)
    d, _ = policy.decide(forced, hbm_chunks=0, tier_chunks=0, forced=True)
    assert (d.decision, d.limit, d.candidates) == (FORCED, 4, 4)
    # it comes back: 1 chunk in HBM (not a return that needed the tier), 3 from the tier
    _, seen = policy.decide(forced, hbm_chunks=1, tier_chunks=4)
    assert seen.returns == {"admitted": 0, "rejected": 0, "forced": 3}
    assert (seen.found, seen.lost) == (3, 0)
    # a class the plan rejects: its chunks past the tier hit are not saved but are remembered
    policy._rejected = frozenset({(False, 3)})
    fresh = keys(100, 5)
    d, _ = policy.decide(fresh, hbm_chunks=0, tier_chunks=0)
    assert (d.decision, d.limit) == (REJECTED, 0)
    _, seen = policy.decide(fresh, hbm_chunks=0, tier_chunks=0)
    assert seen.returns["rejected"] == 5 and seen.lost == 0  # rejected: not the tier's loss
    assert seen.rejected_roomy == 0  # capacity unknown: never "rejected with room"


def test_a_hint_shorter_than_a_chunk_retains_nothing_and_sends_nothing() -> None:
    sched, lookup, _ = make()
    tokens = prompt(6, 2)
    hint = RetentionHint(upto_tokens=CHUNK - 1, session="short")
    serve(sched, HintedView("r", tokens, hint), len(tokens))
    decision = sched.planner.retention_decision("r")
    assert decision is not None and decision.tokens == 0
    assert [op for op, *_ in lookup.admins] == []
    assert sched.planner.retention.retained_chunks() == 0
    # the conversation is still named, with every chunk of its prompt
    assert sched.planner.keys_for(session="short") == sched.planner.keys_for(tokens)
