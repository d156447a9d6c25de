"""CircuitBreaker: closed -> open after N failures, one probe per probe_s, close on success."""

from __future__ import annotations

import threading

import pytest

from kvtier.store.breaker import CircuitBreaker, State, Transition

from .conftest import FakeClock


def _fail(b: CircuitBreaker, n: int) -> list[Transition | None]:
    return [b.failure() for _ in range(n)]


def test_opens_after_consecutive_failures_only(clock: FakeClock) -> None:
    b = CircuitBreaker(3, 5.0, clock)
    assert _fail(b, 2) == [None, None]
    # a success in between resets the run
    assert b.success() is None
    assert _fail(b, 2) == [None, None]
    assert b.state is State.CLOSED and b.allow()
    assert b.failure() is Transition.OPENED
    assert b.state is State.OPEN and b.is_open
    assert not b.allow()
    # more failures while open neither re-announce nor extend anything
    assert _fail(b, 5) == [None] * 5


def test_one_probe_after_probe_s_and_success_closes(clock: FakeClock) -> None:
    b = CircuitBreaker(1, 5.0, clock)
    assert b.failure() is Transition.OPENED
    clock.advance(4.999)
    assert not b.allow()
    clock.advance(0.001)
    assert b.allow()  # the probe
    assert b.state is State.HALF_OPEN
    assert not b.allow()  # everyone else still shed while the probe runs
    assert b.success() is Transition.CLOSED
    assert b.state is State.CLOSED
    assert all(b.allow() for _ in range(3))


def test_failed_probe_reopens_for_another_probe_period(clock: FakeClock) -> None:
    b = CircuitBreaker(2, 1.0, clock)
    _fail(b, 2)
    clock.advance(1.0)
    assert b.allow()
    assert b.failure() is Transition.REOPENED
    assert b.state is State.OPEN
    clock.advance(0.5)
    assert not b.allow()
    clock.advance(0.5)
    assert b.allow()
    assert b.success() is Transition.CLOSED


def test_unreported_probe_is_given_up_after_probe_s(clock: FakeClock) -> None:
    b = CircuitBreaker(1, 2.0, clock)
    b.failure()
    clock.advance(2.0)
    assert b.allow()
    # the probe's caller never reports back
    clock.advance(1.0)
    assert not b.allow()
    clock.advance(1.0)
    assert b.allow()
    assert b.state is State.HALF_OPEN


def test_trip_opens_at_once(clock: FakeClock) -> None:
    b = CircuitBreaker(5, 3.0, clock)
    assert b.trip() is Transition.OPENED
    assert b.trip() is None
    assert not b.allow()
    clock.advance(3.0)
    assert b.allow()
    assert b.trip() is Transition.REOPENED
    assert not b.allow()


def test_only_one_thread_wins_the_probe(clock: FakeClock) -> None:
    b = CircuitBreaker(1, 1.0, clock)
    b.failure()
    clock.advance(1.0)
    n = 16
    barrier = threading.Barrier(n)
    results: list[bool] = []
    lock = threading.Lock()

    def worker() -> None:
        barrier.wait(timeout=5)
        got = b.allow()
        with lock:
            results.append(got)

    threads = [threading.Thread(target=worker) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=5)
    assert len(results) == n
    assert results.count(True) == 1


@pytest.mark.parametrize(
    ("failures", "probe_s", "needle"),
    [(0, 1.0, "failures=0"), (True, 1.0, "failures=True"), (3, 0.0, "probe_s=0.0")],
)
def test_bad_settings_are_named(failures: int, probe_s: float, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        CircuitBreaker(failures, probe_s)


def test_repr_shows_state(clock: FakeClock) -> None:
    b = CircuitBreaker(1, 1.0, clock)
    b.failure()
    assert repr(b) == "CircuitBreaker(state=open, failures=1, probe_s=1.0)"
