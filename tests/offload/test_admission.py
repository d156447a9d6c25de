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
