"""Admission in front of the tiers' writes: save a request's new chunks when chunks like them come
back in time to be read, adapting between "write everything" and "write what returns" from what
it measures.

A request the scheduler saves for is decided once, as a whole: a chunk is reachable only under
its parents, so a decision is prefix-shaped (the request's candidate chunks, those past the
tier's hit, are all admitted or all rejected). The policy keeps a bounded history of the chunk
keys it decided, admitted or not, with the class of their request: whether it was *returning*
(its first chunk seen before: a later turn, a shared system prompt) and its prompt length in
chunks (a log2 bucket). A remembered key in a later prompt, past that prompt's HBM hit, is a
*return* that needed the tier, at an *age* counted in chunks decided since.

Per class, returns over chunks decided is its reuse. Admitting a class shortens how long every
admitted chunk stays: a tier of C chunks that takes a share f of the decided chunks keeps one
for about C / f decided chunks. With F the measured distribution of return ages, the policy
admits the classes (most reused first) that maximise the expected tier hits
sum(decided_c x reuse_c) x F(C / f). Returns within C at f = 1 make write-through the answer;
long returns and a few reused classes make it selective. Unknown C (a shared store) falls back to
rejecting only classes below `pressure x` the mean reuse, where pressure is how often an
admitted chunk that came back was already gone. Classes with few samples are admitted, rejected
chunks are still measured (a class rejected in error comes back), and saves a host needs for
correctness (a P/D producer's, a retained session's) are `forced`.

**Room first.** While the tiers (C chunks known) have room for a request's chunks, with a
margin, every request is written: a write into free slots evicts nothing, so rejecting it can
only lose hits. The plan decides only once the written chunks fill the tiers. A rejected chunk
that comes back although it was rejected with room is a defect, counted apart
(`rejected_roomy`: `kvtier_admission_rejected_with_room_total`, a `kvtier doctor` FAIL).
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.config import ADMISSION_MODES

ADAPTIVE, ALL = ADMISSION_MODES
MODES = ADMISSION_MODES

# the `decision` label of kvtier_admission_total and kvtier_admission_returns_total
ADMITTED = "admitted"
REJECTED = "rejected"
FORCED = "forced"
DECISIONS = (ADMITTED, REJECTED, FORCED)

Class = tuple[bool, int]

# a class's reuse is believed once this many of its chunks were decided
MIN_SAMPLES = 64
# counts are halved past this many decided chunks, so classes follow a workload that changes
_DECAY_AT = 8192
_LENGTH_BUCKETS = 8
# return ages kept for the age distribution, and how many decided chunks between two plans
_AGES = 4096
_REPLAN = 256
# a plan admits the fewest classes whose expected hits are within this share of the best
_GAIN_SLACK = 0.03
# the share of the tiers kept free of the room rule: past (1 - this) x capacity written, the
# plan decides (LRU-like tiers start evicting somewhat before they are full)
ROOM_MARGIN = 0.1


@dataclass(slots=True)
class _ClassStats:
    decided: float = 0.0  # chunks decided (admitted or not)
    returned: float = 0.0  # of those, chunks that came back needing the tier

    @property
    def reuse(self) -> float:
        # chunks still pending count as not returned: a slight underestimate, alike per class
        return min(1.0, self.returned / self.decided) if self.decided else 0.0

    def add(self, decided: int = 0, returned: int = 0) -> None:
        self.decided += decided
        self.returned += returned
        if self.decided > _DECAY_AT:
            self.decided /= 2
            self.returned /= 2


@dataclass(frozen=True, slots=True)
class Decision:
    """One request's admission: how many of its chunks may be saved (from chunk 0) and the
    label its candidate chunks are counted under."""

    limit: int
    decision: str
    candidates: int  # chunks past the tier's hit: what the decision was about
    cls: Class


@dataclass(frozen=True, slots=True)
class Observed:
    """What one request brought back: remembered chunks past its HBM hit, by the decision made
    for them, and admitted ones the tier served (found) or had lost."""

    returns: dict[str, int]
    found: int
    lost: int
    rejected_roomy: int = 0  # rejected with room in the tier, and back: a defect


class AdmissionPolicy:
    """The admission decisions of one scheduler. `capacity` is the tiers' size in chunks (None:
    unknown); `history` bounds the chunk keys remembered."""

    def __init__(
        self,
        mode: str = ADAPTIVE,
        *,
        capacity: int | None = None,
        history: int = 65536,
        room_first: bool = True,
    ) -> None:
        """`room_first=False` lets the plan reject while the tiers have room (the policy before
        the room rule, kept for comparisons; its rejections with room are counted defects)."""
        if mode not in MODES:
            raise ValueError(f"admission={mode!r} is not one of {', '.join(MODES)}")
        if history < 1:
            raise ValueError(f"admission history={history} must be >= 1 chunk keys")
        if capacity is not None and capacity < 1:
            raise ValueError(f"admission capacity={capacity} must be >= 1 chunks or None")
        self.mode = mode
        self.capacity = capacity
        self.history = history
        self.room_first = room_first
        self.written = 0  # chunks admitted (or forced) so far: what the tiers were asked to hold
        # key -> (class, decision, chunks decided before it, decided with room): decided, not
        # yet back or expired
        self._ghost: OrderedDict[bytes, tuple[Class, str, int, bool]] = OrderedDict()
        self._heads: OrderedDict[bytes, None] = OrderedDict()  # first chunks seen
        self._classes: dict[Class, _ClassStats] = {}
        self._all = _ClassStats()
        self._ages: deque[int] = deque(maxlen=_AGES)
        self._clock = 0  # chunks decided so far
        self._found = 0.0
        self._lost = 0.0
        self._rejected: frozenset[Class] = frozenset()
        self._planned_at = 0

    # ---- what it measured ---------------------------------------------------------------------

    @property
    def pressure(self) -> float:
        """Share of the admitted chunks that came back needing the tier and were gone."""
        total = self._found + self._lost
        return self._lost / total if total else 0.0

    @property
    def rejected_classes(self) -> frozenset[Class]:
        """The classes the current plan rejects."""
        return self._rejected

    def has_room(self, chunks: int) -> bool:
        """Whether the tiers hold `chunks` more without evicting (capacity known, margin kept)."""
        if self.capacity is None:
            return False
        return self.written + chunks <= self.capacity * (1 - ROOM_MARGIN)

    def reuse(self, cls: Class) -> float | None:
        """A class's measured reuse, or None while it has too few samples."""
        s = self._classes.get(cls)
        return s.reuse if s is not None and s.decided >= MIN_SAMPLES else None

    # ---- deciding -----------------------------------------------------------------------------

    def decide(
        self,
        keys: Sequence[bytes],
        *,
        hbm_chunks: int,
        tier_chunks: int,
        forced: bool = False,
    ) -> tuple[Decision, Observed]:
        """Decide a request whose prompt has the chained `keys` (its full chunks), the first
        `hbm_chunks` in the HBM prefix cache and the first `tier_chunks` found in the tier;
        learn from the keys it brings back. Call once per request, before its first save."""
        observed = self._observe(keys, hbm_chunks, tier_chunks)
        returning = bool(keys) and (hbm_chunks > 0 or tier_chunks > 0 or keys[0] in self._heads)
        cls = (returning, min(len(keys).bit_length(), _LENGTH_BUCKETS - 1))
        if keys:
            self._heads[keys[0]] = None
            self._heads.move_to_end(keys[0])
            while len(self._heads) > self.history:
                self._heads.popitem(last=False)
        fresh = keys[tier_chunks:]
        roomy = self.has_room(len(fresh))
        if forced:
            decision = FORCED
        elif self.mode == ALL or cls not in self._rejected or (roomy and self.room_first):
            decision = ADMITTED
        else:
            decision = REJECTED
        if decision != REJECTED:
            self.written += len(fresh)
        for key in fresh:
            self._remember(key, cls, decision, roomy)
        self._stats(cls).add(decided=len(fresh))
        self._all.add(decided=len(fresh))
        self._clock += len(fresh)
        if self.mode == ADAPTIVE and self._clock - self._planned_at >= _REPLAN:
            self._rejected = self._plan()
            self._planned_at = self._clock
        limit = len(keys) if decision != REJECTED else min(tier_chunks, len(keys))
        return Decision(limit, decision, len(fresh), cls), observed

    def _observe(self, keys: Sequence[bytes], hbm_chunks: int, tier_chunks: int) -> Observed:
        returns = dict.fromkeys(DECISIONS, 0)
        found = lost = roomy_back = 0
        for c, key in enumerate(keys):
            needed = c >= hbm_chunks
            if needed and c < tier_chunks:
                found += 1  # the tier served it, whoever decided it
            entry = self._ghost.pop(key, None)
            if entry is None or not needed:
                continue
            cls, decision, born, roomy = entry
            returns[decision] += 1
            roomy_back += decision == REJECTED and roomy
            self._stats(cls).add(returned=1)
            self._all.add(returned=1)
            self._ages.append(self._clock - born)
            if decision != REJECTED and c >= tier_chunks:
                lost += 1  # admitted, back, needed, and gone
        self._found += found
        self._lost += lost
        if self._found + self._lost > _DECAY_AT:
            self._found /= 2
            self._lost /= 2
        return Observed(returns, found, lost, roomy_back)

    def _plan(self) -> frozenset[Class]:
        """The classes to reject: those left out of the admitted set with the most expected
        tier hits (or, with no capacity known, those below pressure x mean reuse)."""
        measured = {c: r for c in self._classes if (r := self.reuse(c)) is not None}
        if not measured:
            return frozenset()
        if self.capacity is None or not self._ages:
            floor = self.pressure * self._all.reuse
            return frozenset(c for c, r in measured.items() if r < floor)
        ages = sorted(self._ages)
        total = sum(s.decided for s in self._classes.values())
        if total <= 0:
            return frozenset()
        # unmeasured classes are always admitted; measured ones join most reused first
        base = sum(s.decided for c, s in self._classes.items() if c not in measured)
        order = sorted(measured, key=lambda c: measured[c], reverse=True)
        gains: list[float] = []
        admitted = base
        value = sum(s.decided * s.reuse for c, s in self._classes.items() if c not in measured)
        for k in range(len(order) + 1):
            if k:
                s = self._classes[order[k - 1]]
                admitted += s.decided
                value += s.decided * s.reuse
            share = admitted / total
            horizon = self.capacity / share if share > 0 else math.inf
            gains.append(value * bisect.bisect_right(ages, horizon) / len(ages))
        # writes cost copies and slots: the fewest classes within a few percent of the best
        best = max(gains)
        k = next(i for i, g in enumerate(gains) if g >= (1 - _GAIN_SLACK) * best)
        return frozenset(order[k:])

    def _remember(self, key: bytes, cls: Class, decision: str, roomy: bool) -> None:
        if key in self._ghost:
            self._ghost.move_to_end(key)
        self._ghost[key] = (cls, decision, self._clock, roomy)
        while len(self._ghost) > self.history:
            self._ghost.popitem(last=False)  # expired: it stays counted as not returned

    def _stats(self, cls: Class) -> _ClassStats:
        s = self._classes.get(cls)
        if s is None:
            s = self._classes[cls] = _ClassStats()
        return s
