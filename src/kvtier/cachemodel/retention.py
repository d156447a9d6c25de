"""A client that sends retention hints, in the model: at each turn of a conversation that hints,
"retain this prompt until my next turn" (the real gap plus slack), within a budget of the tier.

The hint covers the prompt's leading chunks the tier holds after the request's saves. The
budget is the product's own: the scheduler's `RetentionLedger` grants it (`clip` keeps what
fits; `soonest` first releases chunks retained for conversations due back later, latest and
deepest first, then clips) and the rank's `RetentionTable` holds what it granted, as the
engine runs them. `reject`, a hint refused whole when it does not fit, is the model's alone
(a comparison the product does not offer).

A last turn sends no hint: its previous hint runs out after the slack, and a release would also
drop chunks other conversations retained (a shared system prompt), which the table does not
count per holder.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from kvtier.cachemodel.turns import Turn
from kvtier.errors import ConfigError
from kvtier.offload.retention import CLIP, REJECTED, SOONEST, RetentionHint, RetentionLedger
from kvtier.store.retention import RetentionTable

REJECT = "reject"  # the model's alone
MODES = (CLIP, REJECT, SOONEST)


@dataclass(slots=True)
class HintStats:
    """What the client asked for and what the budget let through."""

    hints: int = 0  # hints sent
    asked: int = 0  # chunks those hints named
    retained: int = 0  # of those, chunks retained
    clipped: int = 0  # hints cut short by the budget (their prefix kept)
    rejected: int = 0  # hints refused whole by the budget
    displaced: int = 0  # chunks released for a hint due back sooner (`soonest`)
    last_turns: int = 0  # turns with no next turn: no hint
    peak: int = 0  # most chunks in the table at once (expired ones not yet dropped included)

    def to_json(self) -> dict[str, int]:
        """The counts as plain JSON."""
        return asdict(self)


class HintingClient:
    """The clients of every hinting conversation in `turns`, on the turns' own clock, with a
    retention budget of `budget` x `capacity` chunks."""

    def __init__(
        self,
        turns: Sequence[Turn],
        capacity: int,
        *,
        budget: float = 0.5,
        slack_s: float = 5.0,
        mode: str = CLIP,
        audit: bool = False,
    ) -> None:
        if not 0 <= budget <= 1:
            raise ConfigError(f"retention budget {budget} must lie in [0, 1] of the tier")
        if mode not in MODES:
            raise ConfigError(f"retention mode {mode!r} is not one of {', '.join(MODES)}")
        if slack_s < 0:
            raise ConfigError(f"retention slack {slack_s} s must be >= 0")
        self.turns = turns
        self.cap = int(budget * capacity)
        self.slack_s = slack_s
        self.mode = mode
        self.now = turns[0].at if turns else 0.0
        self.table = RetentionTable(self.cap, clock=self._clock)
        self.ledger = RetentionLedger(
            self.cap, tenant_share=1.0, default_ttl_s=slack_s, max_ttl_s=math.inf,
            full=CLIP if mode == REJECT else mode, clock=self._clock,
        )  # fmt: skip
        self.stats = HintStats()
        # with `audit`, the live retained count after every hint (for tests: O(table) a hint)
        self.audit = audit
        self.live_after: list[int] = []

    def _clock(self) -> float:
        return self.now

    def holds(self, key: bytes) -> bool:
        """Whether `key` is retained at the simulated now."""
        return self.table.holds(key)

    def begin(self, i: int) -> bool:
        """Turn `i` arrives; a hinting conversation's saves are forced past admission."""
        self.now = self.turns[i].at
        return self.turns[i].hints

    def end(self, i: int, keys: Sequence[bytes], held: int) -> None:
        """Turn `i` was saved and the tier holds the first `held` of `keys`: hint them, through
        the scheduler's ledger to the rank's table."""
        turn = self.turns[i]
        if not turn.hints:
            return
        if turn.next_at is None:
            self.stats.last_turns += 1
            return
        want = list(keys[:held])
        if not want:
            return
        self.stats.hints += 1
        self.stats.asked += len(want)
        if self.mode == REJECT and not self._fits(want):
            self.stats.rejected += 1
        else:
            hint = RetentionHint(ttl_s=turn.next_at + self.slack_s - self.now,
                                 session=str(turn.session))  # fmt: skip
            decision, granted, until = self.ledger.decide(want, hint, chunk=1)
            displaced = self.ledger.take_displaced()
            self.table.release(displaced)
            self.stats.displaced += len(displaced)
            kept = self.table.retain(granted, until) if granted else 0
            self.stats.retained += kept
            if decision.status == REJECTED:
                self.stats.rejected += 1
            elif kept < len(want):
                self.stats.clipped += 1
        self.stats.peak = max(self.stats.peak, len(self.table))
        if self.audit:
            self.live_after.append(len(self.table.live()))

    def _fits(self, keys: Sequence[bytes]) -> bool:
        """Whether retaining `keys` whole stays within the budget."""
        new = sum(1 for k in keys if self.table.until(k) is None)
        if len(self.table) + new <= self.cap:
            return True
        return len(self.table.live()) + new <= self.cap  # live() drops the expired
