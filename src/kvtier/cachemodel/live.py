"""The peak live working set of a stream: the most chunks that are referenced again and alive at
the same moment, i.e. the tier a perfect policy needs to lose no reuse. Tier sizes as fractions
of it are far smaller than fractions of all distinct chunks, most of which are never reused.

A chunk is live from its first reference to its last (a chunk referenced by one request only is
never live); at the moment between requests t and t + 1 the live chunks are those first
referenced at or before t and last referenced after t.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.cachemodel.stream import Request


def live_counts(requests: Sequence[Request]) -> list[int]:
    """For each request t, the chunks live between it and the next one."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for t, r in enumerate(requests):
        for c in r.chunks:
            first.setdefault(c, t)
            last[c] = t
    delta = [0] * (len(requests) + 1)
    for c, f in first.items():
        end = last[c]
        if end > f:  # live over the moments f .. end - 1
            delta[f] += 1
            delta[end] -= 1
    out = []
    n = 0
    for t in range(len(requests)):
        n += delta[t]
        out.append(n)
    return out


def peak_live(requests: Sequence[Request]) -> int:
    """The peak live working set, in chunks (0 for a stream without reuse)."""
    return max(live_counts(requests), default=0)
