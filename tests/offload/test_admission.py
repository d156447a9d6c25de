"""The admission policy in front of the tiers' writes (kvtier.offload.admission): write-through
while the tier keeps what returns, selective when it cannot, never for a forced save, and back
to admitting a class whose rejected chunks come back."""

from __future__ import annotations

import pytest

from kvtier.cachemodel import workloads
from kvtier.cachemodel.predict import predict
from kvtier.cachemodel.stream import Request, hbm_floors, working_set
from kvtier.offload.admission import (
    ADAPTIVE,
    ADMITTED,
    ALL,
    FORCED,
    REJECTED,
    AdmissionPolicy,
)


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def decide(
    policy: AdmissionPolicy, chunks: list[int], tier: int = 0, hbm: int = 0, forced: bool = False
) -> str:
    d, _ = policy.decide([key(c) for c in chunks], hbm_chunks=hbm, tier_chunks=tier, forced=forced)
    return d.decision


def test_a_tier_that_keeps_what_returns_admits_everything_that_returns() -> None:
    # conversations whose every turn comes back, well inside the tier: write-through's hits,
    # nothing rejected, no pressure
    requests = workloads.round_robin(n_conversations=40, turns=12)
    cap = 2 * working_set(requests)
    floors = [0] * len(requests)
    through = predict(requests, cap, floors)
    adaptive = predict(requests, cap, floors, admission=ADAPTIVE)
    assert adaptive.served == through.served
    assert adaptive.written == through.written
    assert adaptive.regret == 0


def test_one_off_tails_of_a_pool_are_rejected_and_the_prefixes_still_admitted() -> None:
    requests = workloads.prefix_pool(zipf=1.0, seed=1)
    cap = round(0.3 * working_set(requests))
    floors = [0] * len(requests)
    through = predict(requests, cap, floors)
    adaptive = predict(requests, cap, floors, admission=ADAPTIVE)
    # the same hits or more for far fewer writes: the tails that never come back stay out
    assert adaptive.served >= through.served
    assert adaptive.written < 0.5 * through.written


def test_round_robin_conversations_longer_than_the_tier_get_hits_only_with_admission() -> None:
    # every conversation returns after all the others: write-through evicts each before its
    # next turn; admitting a subset keeps that subset
    requests = workloads.round_robin()
    cap = round(0.1 * working_set(requests))
    floors = hbm_floors(requests, 0)
    through = predict(requests, cap, floors)
    adaptive = predict(requests, cap, floors, admission=ADAPTIVE)
    assert through.served == 0
    assert adaptive.served > 0.5 * adaptive.missed * 0.14  # > half the optimum's 14.3 %
    assert adaptive.written < through.written / 4
    assert adaptive.regret > 0  # what it rejected and later came back is counted


def test_a_forced_save_is_never_rejected_and_all_mode_admits_everything() -> None:
    policy = AdmissionPolicy(capacity=10)
    # teach it a rejected class: long one-off prompts that never return, beyond a tiny tier
    for i in range(400):
        decide(policy, [100_000 + 8 * i + d for d in range(8)])
        # and a returning short prompt that does come back, so there is pressure and reuse
        decide(policy, [i % 50, 50 + i % 50])
    assert (False, 4) in policy.rejected_classes
    fresh = [900_000 + d for d in range(8)]
    assert decide(policy, fresh) == REJECTED
    assert decide(policy, [800_000 + d for d in range(8)], forced=True) == FORCED
    everything = AdmissionPolicy(ALL, capacity=10)
    for i in range(400):
        assert decide(everything, [100_000 + 8 * i + d for d in range(8)]) == ADMITTED


def test_a_class_rejected_in_error_comes_back_once_its_chunks_return() -> None:
    policy = AdmissionPolicy(capacity=10)
    for i in range(400):
        decide(policy, [100_000 + 8 * i + d for d in range(8)])
        decide(policy, [i % 50, 50 + i % 50])
    assert (False, 4) in policy.rejected_classes
    # the workload changes: 8-chunk prompts now come back right away, and keep coming back
    for i in range(600):
        chunks = [200_000 + 8 * (i // 2) + d for d in range(8)]
        decide(policy, chunks)
    assert (False, 4) not in policy.rejected_classes


def test_what_it_remembers_is_bounded() -> None:
    policy = AdmissionPolicy(capacity=100, history=500)
    for i in range(2000):
        decide(policy, [10 * i + d for d in range(5)])
    assert len(policy._ghost) <= 500
    assert len(policy._heads) <= 500


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"mode": "lfu"}, "admission='lfu'"),
        ({"history": 0}, "history=0"),
        ({"capacity": 0}, "capacity=0"),
    ],
)
def test_bad_settings_name_the_value(kwargs: dict[str, object], needle: str) -> None:
    mode = kwargs.pop("mode", ADAPTIVE)
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        AdmissionPolicy(str(mode), **kwargs)  # type: ignore[arg-type]


def test_requests_without_chunks_decide_nothing() -> None:
    policy = AdmissionPolicy(capacity=10)
    d, seen = policy.decide([], hbm_chunks=0, tier_chunks=0)
    assert (d.limit, d.candidates) == (0, 0)
    assert seen.found == seen.lost == 0
    assert Request((), 0).usable == 0


def _teach_a_rejected_class(policy: AdmissionPolicy) -> None:
    """Long one-off prompts that never return, next to short ones that do."""
    for i in range(400):
        decide(policy, [100_000 + 8 * i + d for d in range(8)])
        decide(policy, [i % 50, 50 + i % 50])


def test_while_the_tiers_have_room_nothing_is_rejected() -> None:
    """A plan that rejects a class still writes it while the tiers hold it without evicting
    (a write into free slots costs no hit); it decides once the written chunks fill them."""
    roomy = AdmissionPolicy(capacity=1_000_000)
    _teach_a_rejected_class(roomy)
    assert (False, 4) in roomy.rejected_classes  # the plan would reject these prompts
    assert roomy.has_room(8)
    assert decide(roomy, [900_000 + d for d in range(8)]) == ADMITTED
    # the same plan with the tiers nearly full: the rejection applies
    full = AdmissionPolicy(capacity=1000)
    _teach_a_rejected_class(full)
    assert (False, 4) in full.rejected_classes and not full.has_room(8)
    assert decide(full, [900_000 + d for d in range(8)]) == REJECTED
    # the margin: room means at most 90% of the capacity written
    edge = AdmissionPolicy(capacity=100)
    decide(edge, list(range(88)))
    assert edge.written == 88 and edge.has_room(2) and not edge.has_room(3)


def test_a_rejection_with_room_that_comes_back_is_counted_as_a_defect() -> None:
    """The defect signal: `room_first=False` (the policy before the room rule) rejects while
    the tiers have room; each such chunk that comes back is counted (doctor FAILs on it). The
    room-first policy never makes one."""
    for room_first, defects in ((False, 8), (True, 0)):
        policy = AdmissionPolicy(capacity=1_000_000, room_first=room_first)
        _teach_a_rejected_class(policy)
        chunks = [key(900_000 + d) for d in range(8)]
        first, _ = policy.decide(chunks, hbm_chunks=0, tier_chunks=0)
        assert first.decision == (ADMITTED if room_first else REJECTED)
        # the prompt comes back: its chunks were needed
        _, seen = policy.decide(chunks, hbm_chunks=0, tier_chunks=8 if room_first else 0)
        assert seen.rejected_roomy == defects
