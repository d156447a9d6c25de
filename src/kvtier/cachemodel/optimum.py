"""Ceilings of a tier over a request stream: the infinite cache (cold misses only) and the
offline optimum at a capacity.

The optimum is Belady's: every request references its whole chain in order, and when the tier
is over capacity the chunk whose next use is farthest goes, a deeper chunk before a shallower one
on a tie (a chunk's use comes after its parent's in the same request). A parent is then never
evicted before its children, so the optimal contents stay prefix-closed and its page hits are
exactly the leading runs a chained lookup serves: for a tier alone it is the true maximum. With
an HBM cache in front the hits counted are those beyond the HBM floor, which it does not weigh,
so there it is the reference point rather than a proven bound.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from kvtier.cachemodel.stream import Request
from kvtier.errors import ConfigError

_NEVER = 1 << 62


def optimal_leading(requests: Sequence[Request], capacity: int) -> list[int]:
    """For each request, the leading chunks the optimal tier of `capacity` chunks holds when
    the request looks it up (before the request stores its own chunks)."""
    if capacity < 0:
        raise ConfigError(f"tier capacity {capacity} is negative; use 0 or more chunks")
    n = len(requests)
    # next use of each chunk of each request, by a backward pass
    upcoming: dict[int, int] = {}
    next_use: list[list[int]] = [[]] * n
    for i in range(n - 1, -1, -1):
        chunks = requests[i].chunks
        next_use[i] = [upcoming.get(c, _NEVER) for c in chunks]
        for c in chunks:
            upcoming[c] = i
    resident: dict[int, int] = {}  # chunk -> its next use, as last pushed
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, chunk)
    out = []
    for i, r in enumerate(requests):
        lead = 0
        for c in r.chunks:
            if c not in resident:
                break
            lead += 1
        out.append(lead)
        if capacity == 0:
            continue
        for depth, c in enumerate(r.chunks):
            nu = next_use[i][depth]
            resident[c] = nu
            heapq.heappush(heap, (-nu, -depth, c))
        while len(resident) > capacity:
            neg_nu, _, c = heapq.heappop(heap)
            if resident.get(c) == -neg_nu:
                del resident[c]
    return out


def infinite_leading(requests: Sequence[Request]) -> list[int]:
    """For each request, the leading chunks some earlier request stored: an infinite tier."""
    seen: set[int] = set()
    out = []
    for r in requests:
        lead = 0
        for c in r.chunks:
            if c not in seen:
                break
            lead += 1
        out.append(lead)
        seen.update(r.chunks)
    return out
