"""What a rank has to tell the scheduler between two reports: op results, finished and invalid
ids, delayed frees, tier changes (KV events), the self-test's load and whether its metrics
changed. The worker fills it under its own lock and empties it into one `WorkerReport`."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable

import msgspec

from kvtier.metrics import Metrics
from kvtier.offload.messages import OpResult, TierChange, WorkerReport

# tier changes buffered between two reports (KV events); more are dropped and counted
MAX_CHANGES = 65536


class Outbox:
    """One rank's news since its last report. The worker's lock guards it, except `change`,
    which tiers call under their own locks."""

    def __init__(self, rank: int, metrics: Metrics) -> None:
        self.rank = rank
        self._m = metrics
        self.results: list[OpResult] = []
        self.recving: list[str] = []
        self.invalid: list[int] = []
        self.sending: list[str] = []
        self.delayed: set[str] = set()  # finished requests whose blocks wait for their ops
        self.changes: deque[TierChange] = deque()
        # the self-test's load (tokens, seconds), for the scheduler's gate (sent once)
        self.selftest_load: tuple[int, float] | None = None
        self.metrics_dirty = False
        self.last_snapshot = 0.0

    def record(self, result: OpResult, req_id: str, *, recv: bool, invalid: Iterable[int]) -> None:
        """An op ended: its result, its request's blocks if it was parked, suspect blocks."""
        self.results.append(result)
        if recv:
            self.recving.append(req_id)
        self.invalid.extend(invalid)

    def overrule(self, op_ids: set[str], reason: str) -> list[str]:
        """Turn the unsent successful results of `op_ids` into failures for `reason`; the ids
        turned (a result already sent cannot be taken back)."""
        turned = []
        for i, r in enumerate(self.results):
            if r.op_id in op_ids and r.ok:
                self.results[i] = msgspec.structs.replace(r, ok=False, reason=reason, nbytes=0)
                turned.append(r.op_id)
        return turned

    def change(self, change: TierChange) -> None:
        """A tier stored or dropped a chunk; past `MAX_CHANGES` unsent ones, counted and lost."""
        if len(self.changes) >= MAX_CHANGES:
            self._m.dropped_tier_changes.inc()
            return
        self.changes.append(change)

    def take(self, inflight: Counter[str]) -> WorkerReport:
        """Everything gathered, as one report, and the outbox emptied; a delayed request is
        finished sending once none of its ops is in flight."""
        for req_id in list(self.delayed):
            if not inflight.get(req_id):
                self.delayed.discard(req_id)
                self.sending.append(req_id)
        # popped one by one: tiers append from their own threads meanwhile (a deque's append
        # and popleft are atomic; a copy then clear() could drop one)
        changes = []
        while self.changes:
            changes.append(self.changes.popleft())
        report = WorkerReport(
            rank=self.rank,
            results=self.results,
            finished_sending=self.sending,
            finished_recving=self.recving,
            invalid_block_ids=self.invalid,
            changes=changes,
            selftest_load=self.selftest_load,
        )
        self.results, self.sending, self.recving, self.invalid = [], [], [], []
        self.selftest_load = None
        return report

    def carry(self, results: list[OpResult]) -> None:
        """Results of a report that could not be sent go first in the next one."""
        self.results[:0] = results
