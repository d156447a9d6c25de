"""LeaseTable: pins per key under lease ids, deadlines, a cap, and counted double releases."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvtier.metrics import Metrics
from kvtier.store.lease import LeaseTable

from .conftest import FakeClock

A, B, C = b"a" * 16, b"b" * 16, b"c" * 16


def _table(metrics: Metrics, clock: FakeClock, ttl: float = 10.0, cap: int = 8) -> LeaseTable:
    return LeaseTable(metrics, ttl_s=ttl, max_leases=cap, clock=clock)


def _counts(m: Metrics) -> tuple[float, float, float]:
    return (
        m.value("lease_releases_total"),
        m.value("lease_expiries_total"),
        m.value("lease_double_releases_total"),
    )


@pytest.mark.parametrize(("ttl", "cap"), [(0.0, 1), (-1.0, 1), (1.0, 0), (1.0, -3)])
def test_bad_limits_name_both_values(metrics: Metrics, ttl: float, cap: int):
    with pytest.raises(ValueError, match=rf"ttl_s \({ttl}\) and max_leases \({cap}\)"):
        LeaseTable(metrics, ttl_s=ttl, max_leases=cap)


def test_release_unpins_and_returns_freed_keys(metrics: Metrics, clock: FakeClock):
    t = _table(metrics, clock)
    t.acquire("x", [A, B])
    assert t.is_pinned(A) and t.is_pinned(B) and not t.is_pinned(C)
    assert len(t) == 1
    assert sorted(t.release("x")) == [A, B]
    assert not t.is_pinned(A) and not t.is_pinned(B)
    assert len(t) == 0
    assert _counts(metrics) == (1, 0, 0)


def test_key_held_by_two_leases_stays_pinned_until_both_go(metrics: Metrics, clock: FakeClock):
    t = _table(metrics, clock)
    t.acquire("x", [A, B])
    t.acquire("y", [B, C])
    assert t.release("x") == [A]
    assert t.is_pinned(B)
    assert sorted(t.release("y")) == [B, C]
    assert not t.is_pinned(B)


def test_double_release_is_counted_and_never_frees_early(metrics: Metrics, clock: FakeClock):
    t = _table(metrics, clock)
    t.acquire("x", [A])
    t.acquire("y", [A])
    assert t.release("x") == []
    assert t.release("x") == []  # the second release must not drop y's pin on A
    assert t.release("never-held") == []
    assert t.is_pinned(A)
    assert _counts(metrics) == (1, 0, 2)
    assert t.release("y") == [A]
    assert not t.is_pinned(A)


def test_lease_expires_at_its_deadline_and_is_counted(metrics: Metrics, clock: FakeClock):
    t = _table(metrics, clock, ttl=10.0)
    t.acquire("x", [A])
    clock.advance(9.999)
    assert t.expire() == []
    assert t.is_pinned(A)
    clock.advance(0.001)  # deadline == now counts as expired
    assert t.expire() == [A]
    assert not t.is_pinned(A)
    assert len(t) == 0
    # releasing after expiry is a double release, not a second expiry
    assert t.release("x") == []
    assert _counts(metrics) == (0, 1, 1)


def test_expire_stops_at_the_first_live_lease(metrics: Metrics, clock: FakeClock):
    t = _table(metrics, clock, ttl=10.0)
    t.acquire("old", [A])
    clock.advance(5)
    t.acquire("new", [B])
    clock.advance(5)
    assert t.expire() == [A]
    assert t.is_pinned(B)
    clock.advance(5)
    assert t.expire() == [B]
    assert _counts(metrics) == (0, 2, 0)


def test_reacquire_merges_keys_and_refreshes_the_deadline(metrics: Metrics, clock: FakeClock):
    t = _table(metrics, clock, ttl=10.0)
    t.acquire("x", [A])
    t.acquire("y", [C])
    clock.advance(8)
    t.acquire("x", [B])  # refreshed to 18; y still ends at 10
    assert len(t) == 2
    clock.advance(2)
    assert t.expire() == [C]
    assert t.is_pinned(A) and t.is_pinned(B)
    clock.advance(8)
    assert sorted(t.expire()) == [A, B]
    assert _counts(metrics) == (0, 2, 0)


def test_acquire_collects_expired_leases_first(metrics: Metrics, clock: FakeClock):
    t = _table(metrics, clock, ttl=1.0)
    t.acquire("x", [A])
    clock.advance(1)
    t.acquire("y", [B])
    assert not t.is_pinned(A)
    assert len(t) == 1
    assert metrics.value("lease_expiries_total") == 1


def test_cap_drops_the_oldest_lease_counted_as_expiry(metrics: Metrics, clock: FakeClock):
    t = _table(metrics, clock, cap=2)
    t.acquire("x", [A])
    t.acquire("y", [B])
    t.acquire("y", [C])  # adding to a held id needs no room
    assert len(t) == 2 and t.is_pinned(A)
    t.acquire("z", [C])
    assert len(t) == 2
    assert not t.is_pinned(A)
    assert t.is_pinned(B) and t.is_pinned(C)
    assert _counts(metrics) == (0, 1, 0)
    assert t.release("x") == []  # it already went
    assert metrics.value("lease_double_releases_total") == 1


def test_duplicate_keys_and_generators(metrics: Metrics, clock: FakeClock):
    t = _table(metrics, clock)
    t.acquire("x", (k for k in [A, A, B]))
    t.acquire("y", [A])
    assert t.release("y") == []
    assert t.is_pinned(A)
    assert sorted(t.release("x")) == [A, B]
    assert not t.is_pinned(A)


def test_empty_lease_is_held_and_released_once(metrics: Metrics, clock: FakeClock):
    t = _table(metrics, clock)
    t.acquire("x", [])
    assert len(t) == 1
    assert t.release("x") == []
    assert _counts(metrics) == (1, 0, 0)


KEYS = [bytes([i]) * 16 for i in range(5)]
IDS = ["l0", "l1", "l2", "l3", "l4"]
TTL = 10.0
CAP = 3


class LeaseMachine(RuleBasedStateMachine):
    """LeaseTable against a plain model: live leases with deadlines, pins derived from them."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock(0.0)
        self.m = Metrics()
        self.t = LeaseTable(self.m, ttl_s=TTL, max_leases=CAP, clock=self.clock)
        self.leases: OrderedDict[str, tuple[float, list[bytes]]] = OrderedDict()
        self.released = self.expired = self.doubles = 0

    def _expire(self) -> set[bytes]:
        gone: list[bytes] = []
        for lid in [lid for lid, (d, _) in self.leases.items() if d <= self.clock.now]:
            gone += self.leases.pop(lid)[1]
            self.expired += 1
        return set(gone) - self._pinned()

    def _pinned(self) -> set[bytes]:
        return {k for _, keys in self.leases.values() for k in keys}

    @rule(lid=st.sampled_from(IDS), keys=st.lists(st.sampled_from(KEYS), max_size=4))
    def acquire(self, lid: str, keys: list[bytes]) -> None:
        self.t.acquire(lid, keys)
        self._expire()
        if lid in self.leases:
            held = self.leases.pop(lid)[1] + keys
        else:
            held = list(keys)
            while len(self.leases) >= CAP:
                self.leases.popitem(last=False)
                self.expired += 1
        self.leases[lid] = (self.clock.now + TTL, held)

    @rule(lid=st.sampled_from(IDS))
    def release(self, lid: str) -> None:
        before = self._pinned()
        freed = self.t.release(lid)
        if lid in self.leases:
            self.leases.pop(lid)
            self.released += 1
        else:
            self.doubles += 1
        assert set(freed) == before - self._pinned()

    @rule(dt=st.sampled_from([0.5, 2.0, 5.0, 10.0]))
    def advance(self, dt: float) -> None:
        self.clock.advance(dt)

    @rule()
    def expire(self) -> None:
        before = self._pinned()
        freed = self.t.expire()
        self._expire()
        assert set(freed) == before - self._pinned()

    @invariant()
    def agrees_with_model(self) -> None:
        live = {k for d, keys in self.leases.values() if d > self.clock.now for k in keys}
        held = self._pinned()  # also past-deadline leases nobody has collected yet
        pinned = {k for k in KEYS if self.t.is_pinned(k)}
        assert live <= pinned <= held
        assert len(self.t) == len(self.leases)
        assert _counts(self.m) == (self.released, self.expired, self.doubles)


LeaseMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestLeaseMachine = LeaseMachine.TestCase
