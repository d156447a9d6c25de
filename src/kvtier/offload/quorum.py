"""Exactly one terminal per operation across TP ranks.

An operation is terminal when every rank reported it; one failure fails it. Reports for unknown
operations (stale generations, duplicates after the terminal) are ignored and counted.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvtier.offload.messages import OpResult

# the reason of a terminal the scheduler gave an operation no rank reported in time: its
# report was lost (a rank ends its loads within `lease_ttl_s` and never reports a result twice)
REPORT_LOST = "report_lost"


@dataclass(frozen=True, slots=True)
class Terminal:
    """The agreed outcome of one operation."""

    op_id: str
    ok: bool
    reason: str
    nbytes: int
    seconds: float
    tier: str


class Quorum:
    """Collects per-rank results of open operations and yields each terminal once."""

    def __init__(self, world: int, tombstones: int = 4096) -> None:
        if world <= 0:
            raise ValueError(f"quorum world must be >= 1, got {world}")
        self.world = world
        self._open: dict[str, dict[int, OpResult]] = {}
        self._closed: OrderedDict[str, None] = OrderedDict()
        self._tombstones = tombstones
        self.ignored = 0

    def open(self, op_id: str) -> None:
        if op_id in self._open or op_id in self._closed:
            raise ValueError(f"operation id {op_id} was already used; ids are never reused")
        self._open[op_id] = {}

    def is_open(self, op_id: str) -> bool:
        return op_id in self._open

    def report(self, rank: int, result: OpResult) -> Terminal | None:
        """Record one rank's result; returns the terminal when this report completes the quorum."""
        votes = self._open.get(result.op_id)
        if votes is None or rank in votes or not 0 <= rank < self.world:
            self.ignored += 1
            return None
        votes[rank] = result
        if len(votes) < self.world:
            return None
        del self._open[result.op_id]
        self._tombstone(result.op_id)
        failed = [r for r in votes.values() if not r.ok]
        first = failed[0] if failed else next(iter(votes.values()))
        return Terminal(
            op_id=result.op_id,
            ok=not failed,
            reason=first.reason if failed else "",
            nbytes=sum(r.nbytes for r in votes.values()),
            # ranks work in parallel: the op took as long as its slowest rank
            seconds=max(r.seconds for r in votes.values()),
            tier=first.tier,
        )

    def abandon(self, op_id: str) -> None:
        """Forget an open operation (its host is gone); later reports for it are ignored."""
        if self._open.pop(op_id, None) is not None:
            self._tombstone(op_id)

    def _tombstone(self, op_id: str) -> None:
        """Remember a closed id (a later report for it is stale), within the cap: abandoned
        operations too, or a rank whose reports are all lost, so that no operation ever
        completes, would grow the tombstones by one per operation for good."""
        self._closed[op_id] = None
        while len(self._closed) > self._tombstones:
            self._closed.popitem(last=False)
