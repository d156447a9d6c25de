"""A client that sends retention hints, in the model: at each turn of a conversation that hints,
"retain this prompt until my next turn" (the real gap plus slack), within a budget of the tier.

The hint covers the prompt's leading chunks the tier holds after the request's saves. The
budget caps retained chunks at a fraction of the tier (the real `RetentionTable`'s limit, which
keeps a hint's prefix and refuses its deepest chunks past it); `clip` takes what fits, `reject`
refuses a hint that does not fit whole, and `soonest` makes room for a hint by releasing chunks
retained for conversations due back later than it (latest first, deepest first), then clips:
the budget then holds the conversations that return soonest, as the optimum would.

A last turn sends no hint: its previous hint runs out after the slack, and a release would also
drop chunks other conversations retained (a shared system prompt), which the table does not
count per holder.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from kvtier.cachemodel.turns import Turn
from kvtier.errors import ConfigError
from kvtier.store.retention import RetentionTable

CLIP = "clip"
REJECT = "reject"
SOONEST = "soonest"
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
        self.stats = HintStats()
        # with `audit`, the live retained count after every hint (for tests: O(table) a hint)
        self.audit = audit
        self.live_after: list[int] = []
        # (-deadline, -depth, key) of every retain, for `soonest`; stale entries are skipped
        self._latest: list[tuple[float, int, bytes]] = []

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
        """Turn `i` was saved and the tier holds the first `held` of `keys`: hint them."""
        turn = self.turns[i]
        if not turn.hints:
            return
        if turn.next_at is None:
            self.stats.last_turns += 1
            return
        want = keys[:held]
        if not want:
            return
        self.stats.hints += 1
        self.stats.asked += len(want)
        if self.mode == REJECT and not self._fits(want):
            self.stats.rejected += 1
        else:
            until = turn.next_at + self.slack_s
            kept = self.table.retain(want, until)
            if kept < len(want) and self.mode == SOONEST:
                self._displace(len(want) - kept, until, set(want))
                # the kept prefix stays retained; only the rest is asked again
                kept += self.table.retain(want[kept:], until)
            if self.mode == SOONEST:
                for depth, key in enumerate(want[:kept]):
                    heapq.heappush(self._latest, (-until, -depth, key))
            self.stats.retained += kept
            if kept < len(want):
                self.stats.clipped += 1
        self.stats.peak = max(self.stats.peak, len(self.table))
        if self.audit:
            self.live_after.append(len(self.table.live()))

    def _displace(self, need: int, until: float, mine: set[bytes]) -> None:
        """Release up to `need` retained chunks due back after `until`, latest first, none of
        `mine` (the hint's own prefix, a shared system prompt among it)."""
        freed = 0
        spared = []
        while freed < need and self._latest:
            top = self._latest[0]
            if -top[0] <= until:
                break
            heapq.heappop(self._latest)
            if self.table.until(top[2]) != -top[0]:
                continue  # released, expired or re-retained since: a stale entry
            if top[2] in mine:
                spared.append(top)
            elif self.table.release([top[2]]):
                freed += 1
        for top in spared:
            heapq.heappush(self._latest, top)
        self.stats.displaced += freed

    def _fits(self, keys: Sequence[bytes]) -> bool:
        """Whether retaining `keys` whole stays within the budget."""
        new = sum(1 for k in keys if self.table.until(k) is None)
        if len(self.table) + new <= self.cap:
            return True
        return len(self.table.live()) + new <= self.cap  # live() drops the expired
