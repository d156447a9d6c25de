"""Circuit breaker for a tier that lives behind a network: stop paying timeouts to a dead store.

closed --(N consecutive failures)--> open --(probe_s later)--> half-open --(one probe)-->
closed on success, open again on failure. The breaker only keeps state; its owner logs and
publishes the transitions it reports (so the owner's name and metrics label them).
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable


class State(enum.Enum):
    """Where a breaker stands."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Transition(enum.Enum):
    """A change a call to `success()`/`failure()`/`trip()` caused, for the owner to report."""

    OPENED = "opened"  # closed -> open: the store just went bad
    REOPENED = "reopened"  # half-open probe failed: still bad, not news
    CLOSED = "closed"  # half-open probe succeeded: the store is back


class CircuitBreaker:
    """Counts consecutive failures and, once open, lets one probe call through every `probe_s`.

    Thread-safe. `allow()` is the gate before each call; report the outcome with `success()`
    or `failure()`. A probe whose outcome is never reported is given up after another
    `probe_s`, so a lost report cannot wedge the breaker half-open.
    """

    def __init__(
        self, failures: int, probe_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if isinstance(failures, bool) or not isinstance(failures, int) or failures <= 0:
            raise ValueError(
                f"breaker failures={failures!r} must be a positive int; use 5 (the default)"
            )
        if not probe_s > 0:
            raise ValueError(f"breaker probe_s={probe_s!r} must be > 0; use 5.0 (the default)")
        self.failures = failures
        self.probe_s = float(probe_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._state = State.CLOSED
        self._consecutive = 0
        self._opened_at = 0.0
        self._probe_started: float | None = None

    @property
    def state(self) -> State:
        """The current state (an open breaker whose probe time has come still reads OPEN until
        `allow()` hands out the probe)."""
        with self._lock:
            return self._state

    @property
    def is_open(self) -> bool:
        """True unless closed: while open or probing, callers are being shed."""
        return self.state is not State.CLOSED

    def allow(self) -> bool:
        """Whether the caller may try the store now. Closed: always. Open: no, except the one
        caller that becomes the half-open probe once `probe_s` has passed."""
        with self._lock:
            if self._state is State.CLOSED:
                return True
            now = self._clock()
            if self._state is State.OPEN:
                if now - self._opened_at < self.probe_s:
                    return False
                self._state = State.HALF_OPEN
                self._probe_started = now
                return True
            # half-open: one probe at a time, unless the last one was never reported back
            started = self._probe_started
            if started is not None and now - started < self.probe_s:
                return False
            self._probe_started = now
            return True

    def success(self) -> Transition | None:
        """Report a call that completed; closes a half-open breaker."""
        with self._lock:
            self._consecutive = 0
            if self._state is State.CLOSED:
                return None
            # a success while open (a call let in before the trip finished late) also proves
            # the store answers
            self._state = State.CLOSED
            self._probe_started = None
            return Transition.CLOSED

    def failure(self) -> Transition | None:
        """Report a call that failed or timed out; may open the breaker."""
        with self._lock:
            self._consecutive += 1
            if self._state is State.CLOSED:
                if self._consecutive < self.failures:
                    return None
                return self._open(Transition.OPENED)
            if self._state is State.HALF_OPEN:
                return self._open(Transition.REOPENED)
            # already open: a straggler let in before the trip; the open period stands
            return None

    def trip(self) -> Transition | None:
        """Open now, whatever the count (e.g. the store was unreachable at startup)."""
        with self._lock:
            if self._state is State.CLOSED:
                return self._open(Transition.OPENED)
            if self._state is State.HALF_OPEN:
                return self._open(Transition.REOPENED)
            return None

    def _open(self, transition: Transition) -> Transition:
        self._state = State.OPEN
        self._opened_at = self._clock()
        self._probe_started = None
        return transition

    def __repr__(self) -> str:
        return (
            f"CircuitBreaker(state={self.state.value}, failures={self.failures}, "
            f"probe_s={self.probe_s})"
        )


class ShardBreakers:
    """One `CircuitBreaker` per shard of a store, made on first use with the same settings, so
    a dead shard is shed while the others keep serving.

    A shard is named by its owner's address; after a failover the promoted replica is a new
    shard with a closed breaker. `retain()` forgets shards no longer in the topology (bounded).
    """

    def __init__(
        self, failures: int, probe_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        # validates the settings once, up front, with the breaker's own messages
        CircuitBreaker(failures, probe_s, clock)
        self.failures = failures
        self.probe_s = float(probe_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._by_shard: dict[str, CircuitBreaker] = {}

    def __getitem__(self, shard: str) -> CircuitBreaker:
        with self._lock:
            breaker = self._by_shard.get(shard)
            if breaker is None:
                breaker = CircuitBreaker(self.failures, self.probe_s, self._clock)
                self._by_shard[shard] = breaker
            return breaker

    def retain(self, shards: set[str]) -> None:
        """Drop the breakers of shards not in `shards` (they left the topology)."""
        with self._lock:
            for gone in set(self._by_shard) - shards:
                del self._by_shard[gone]

    def open_shards(self) -> list[str]:
        """Shards whose breaker is open or probing, sorted."""
        with self._lock:
            items = list(self._by_shard.items())
        return sorted(shard for shard, b in items if b.is_open)

    @property
    def is_open(self) -> bool:
        """True while any shard's breaker is open or probing."""
        return bool(self.open_shards())

    @property
    def state(self) -> State:
        """OPEN when any shard is open, HALF_OPEN when any probes and none is open, else
        CLOSED (one word for the whole store, as a single-server breaker reports)."""
        with self._lock:
            states = {b.state for b in self._by_shard.values()}
        if State.OPEN in states:
            return State.OPEN
        if State.HALF_OPEN in states:
            return State.HALF_OPEN
        return State.CLOSED

    def __repr__(self) -> str:
        return (
            f"ShardBreakers(open={self.open_shards()}, failures={self.failures}, "
            f"probe_s={self.probe_s})"
        )
