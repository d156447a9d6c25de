"""Transfers in flight on one lane: a ring of staging buffers and the work each one carries.

A lane issues chunk after chunk without waiting (gather, copy; or copy, scatter) and retires
them in issue order: wait for the chunk's mark, then its host work (a save's checksum and
commit, a load's release of its slot). With `depth` buffers, chunk i's host work runs while
chunks i+1 .. i+depth-1 are on the link, so the copy engine is never idle behind the host.
`depth=1` is the serial design kvtier had before: each chunk waited for and committed before
the next one starts (kept for comparison: `transfer_depth: 1`).

A path keeps one ring across its lane's jobs (`transfer_ring: persistent`): a step's last
chunks stay on the link while the next step's job, already queued, issues its own, so the copy
engine is not left idle between steps while the host waits, commits, reports and wakes for the
next job. What a job left is retired as soon as it landed (`retire_landed`, before each issue),
at the latest when the next job ends, and whenever the lane runs out of work
(`WorkLane.submit(settle=...)`).

A buffer is reused only after the transfer that last used it was retired, so its bytes are
never overwritten while a copy may still read them or a scatter has not yet consumed them.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvtier.offload.device import Lane, Mark

log = logging.getLogger("kvtier")

B = TypeVar("B")
# told None when the transfer's work completed, else the device's error
Landed = Callable[[BaseException | None], None]


@dataclass(slots=True)
class Peak:
    """The most transfers a path ever had in flight at once, kept across its rings."""

    value: int = 0


@dataclass(slots=True)
class _Flight:
    mark: Mark
    landed: Landed
    number: int  # its place in issue order


class Flights(Generic[B]):
    """At most `len(buffers)` transfers in flight, one per buffer, retired in issue order."""

    def __init__(self, buffers: Sequence[B], peak: Peak | None = None) -> None:
        """`peak` is raised as transfers are pushed, not when the ring drains: a path's ops
        report as they land, and whoever they wake may read it before the lane's job ends."""
        if not buffers:
            raise ValueError("a transfer ring needs at least one buffer")
        self._buffers = list(buffers)
        self._queue: deque[_Flight] = deque()
        self._issued = 0
        self._peak = Peak() if peak is None else peak

    @property
    def depth(self) -> int:
        return len(self._buffers)

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def issued(self) -> int:
        """Transfers pushed so far (the issue number the next one gets)."""
        return self._issued

    def acquire(self) -> B:
        """The buffer of the next transfer; retires the oldest first when every one is busy."""
        if len(self._queue) >= len(self._buffers):
            self.retire()
        return self._buffers[self._issued % len(self._buffers)]

    def push(self, mark: Mark, landed: Landed) -> None:
        """The transfer just issued into the buffer `acquire` gave: `landed` runs on retire."""
        self._queue.append(_Flight(mark, landed, self._issued))
        self._issued += 1
        self._peak.value = max(self._peak.value, len(self._queue))

    def retire(self) -> None:
        """Wait for the oldest transfer and run its host work."""
        flight = self._queue.popleft()
        error: BaseException | None = None
        try:
            flight.mark.wait()
        except RuntimeError as e:  # the device failed this transfer's work: its owner reports
            error = e
        flight.landed(error)

    def drain(self) -> None:
        """Retire every transfer in flight."""
        while self._queue:
            self.retire()

    def retire_before(self, number: int) -> None:
        """Retire the transfers issued before issue number `number` (waiting for them)."""
        while self._queue and self._queue[0].number < number:
            self.retire()

    def retire_landed(self) -> None:
        """Retire, oldest first, the transfers whose work is already done (no wait): their
        owners hear of them now, not when the ring next needs their buffers."""
        while self._queue:
            try:
                reached = self._queue[0].mark.done()
            except RuntimeError:  # the device failed it: `retire` hands its owner the error
                reached = True
            if not reached:
                return
            self.retire()

    def abandon(self, error: BaseException) -> None:
        """Tell every transfer in flight it failed, without waiting (the caller waited for the
        lane already, so nothing of theirs is still landing)."""
        while self._queue:
            self._queue.popleft().landed(error)


@contextlib.contextmanager
def settling(lane: Lane, tag: str) -> Iterator[None]:
    """Settle `lane` if the block raises, before leaving it: entered inside a load's lock, a
    write queued before the raise has landed by the time a deadline expiry can take the lock
    and report the load failed (the host's recompute is never overwritten)."""
    try:
        yield
    except BaseException:
        settle(lane, tag)
        raise


def settle(lane: Lane, tag: str) -> None:
    """Wait for whatever `lane` queued (after an op failed mid-way: nothing of it may land
    once its slot is freed or its failure reported); a device that fails this wait too is
    logged (the op already reports failed)."""
    try:
        lane.finish()
    except RuntimeError:
        log.exception("%s: the device failed while copies were in flight", tag)
