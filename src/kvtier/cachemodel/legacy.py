"""The tier policy kvtier shipped before chain-aware eviction, kept only so `kvtier bench cache`
can print it next to today's: segmented LRU (80% protected) with no chain awareness, driven as
the old engine drove it. A lookup only leased (no recency change); a load read upward from the
HBM floor, each read a hit; a save committed new chunks in ascending order and skipped resident
ones without touching them; the victim was the first key in probation, then in protected.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvtier.cachemodel.predict import TierHits, looks_up, served, tally
from kvtier.cachemodel.stream import Request

PROTECTED_FRACTION = 0.8


class _SLRU:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.protected_cap = int(PROTECTED_FRACTION * capacity)
        self.probation: OrderedDict[int, None] = OrderedDict()
        self.protected: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, key: int) -> bool:
        return key in self.probation or key in self.protected

    def hit(self, key: int) -> None:
        if key in self.protected:
            self.protected.move_to_end(key)
            return
        del self.probation[key]
        self.protected[key] = None
        while len(self.protected) > self.protected_cap:
            self.probation[self.protected.popitem(last=False)[0]] = None

    def put(self, key: int) -> None:
        if len(self.probation) + len(self.protected) >= self.capacity:
            (self.probation or self.protected).popitem(last=False)
        self.probation[key] = None


def legacy_predict(
    requests: Sequence[Request], capacity: int, floors: Sequence[int], *, min_load: int = 1
) -> TierHits:
    """Tier hits of the old policy at `capacity` chunks, behind the given HBM floors."""
    leads = []
    tier = _SLRU(capacity) if capacity > 0 else None
    for r, h in zip(requests, floors, strict=True):
        start = n = 0
        if tier is not None and looks_up(r, h, min_load):
            for c in r.chunks:
                if c not in tier:
                    break
                n += 1
            start = n
            if served(r, h, n, min_load):
                for c in r.chunks[h : min(n, r.usable)]:
                    tier.hit(c)
        if tier is not None:
            for c in r.chunks[start:]:
                if c not in tier:
                    tier.put(c)
        leads.append(n)
    return tally(requests, floors, leads, min_load)
