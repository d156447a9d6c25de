"""Reuse distances: the cache (in blocks) each reuse needs in order to hit under LRU, the reused
block itself included, so a reuse of distance `d` hits a cache of `c` blocks exactly when
`d <= c`; and how a stream's reuses fall against an HBM pool and a tier.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.errors import ConfigError


def reuse_distances(requests: Sequence[Sequence[Hashable]]) -> list[int]:
    """Exact LRU reuse distance, in blocks, of every block use that has an earlier use.

    The distance of a block in request r is 1 + the distinct blocks used after its previous use
    and before r: the smallest LRU that still holds it when r looks it up. Each request touches
    its blocks last-to-first, so its head is the most recent (engines evict tails first, as
    `ChainLRU` does); a block repeated inside one request counts once. O(N log N) through a
    Fenwick tree over use times, holding one mark per block at its latest use.
    """
    total = sum(len(r) for r in requests)
    tree = [0] * (total + 1)

    def add(i: int, v: int) -> None:
        i += 1
        while i <= total:
            tree[i] += v
            i += i & -i

    def marks_before(i: int) -> int:
        s = 0
        while i > 0:
            s += tree[i]
            i -= i & -i
        return s

    last: dict[Hashable, int] = {}
    out: list[int] = []
    t = 0
    for req in requests:
        blocks = list(dict.fromkeys(req))
        seen = marks_before(t)  # every block used so far has exactly one mark before t
        for key in blocks:
            p = last.get(key)
            if p is not None:
                out.append(seen - marks_before(p + 1) + 1)
        for key in reversed(blocks):
            p = last.get(key)
            if p is not None:
                add(p, -1)
            add(t, 1)
            last[key] = t
            t += 1
    return out


def pool_reuse_distance(n_prefixes: int, prefix_len: int, tail_len: int) -> int:
    """Distinct tokens between two uses of one prefix in a round-robin pool of `n_prefixes`
    prefixes, each request adding its own `tail_len`-token tail, the prefix itself included."""
    return n_prefixes * (prefix_len + tail_len)


def percentile(sorted_values: Sequence[int], p: float) -> int:
    """Nearest-rank percentile: the smallest value with at least p% of the values at or below it."""
    if not sorted_values:
        raise ConfigError("percentile of no values; the trace has no reuse")
    if not 0 < p <= 100:
        raise ConfigError(f"percentile p={p} must be in (0, 100]")
    return sorted_values[max(1, math.ceil(p / 100 * len(sorted_values))) - 1]


@dataclass(frozen=True, slots=True)
class ReuseProfile:
    """Reuse statistics of a trace in tokens (blocks x block size), against an HBM pool and a
    tier: how many reuses each of them can serve."""

    block_tokens: int
    block_uses: int
    distinct_blocks: int
    reusable_blocks: int
    distances: tuple[int, ...]  # tokens, sorted
    below_pool: int
    inside: int
    above_tier: int

    @property
    def reuses(self) -> int:
        """Block uses that had an earlier use."""
        return len(self.distances)

    @property
    def median(self) -> int | None:
        """Median reuse distance in tokens (None without reuse)."""
        return percentile(self.distances, 50) if self.distances else None

    @property
    def p90(self) -> int | None:
        """90th-percentile reuse distance in tokens (None without reuse)."""
        return percentile(self.distances, 90) if self.distances else None

    @property
    def reusable_tokens(self) -> int:
        """Tokens of the blocks used at least twice."""
        return self.reusable_blocks * self.block_tokens

    def to_json(self) -> dict[str, Any]:
        """Counts and percentiles as plain JSON (not the distances themselves)."""
        return {
            "block_tokens": self.block_tokens,
            "block_uses": self.block_uses,
            "distinct_blocks": self.distinct_blocks,
            "reusable_blocks": self.reusable_blocks,
            "reuses": self.reuses,
            "median_tokens": self.median,
            "p90_tokens": self.p90,
            "below_pool": self.below_pool,
            "inside": self.inside,
            "above_tier": self.above_tier,
        }


def reuse_profile(
    requests: Sequence[Sequence[Hashable]],
    block_tokens: int,
    hbm_pool_tokens: int,
    tier_tokens: int,
) -> ReuseProfile:
    """Exact reuse distances of `requests` (block ids of `block_tokens` tokens) and how many
    fall below the pool, inside the window and above the tier."""
    dist = sorted(d * block_tokens for d in reuse_distances(requests))
    uses: dict[int, int] = {}
    for req in requests:
        for h in dict.fromkeys(req):
            uses[h] = uses.get(h, 0) + 1
    below = sum(1 for d in dist if d <= hbm_pool_tokens)
    above = sum(1 for d in dist if d > max(tier_tokens, hbm_pool_tokens))
    return ReuseProfile(
        block_tokens=block_tokens,
        block_uses=sum(uses.values()),
        distinct_blocks=len(uses),
        reusable_blocks=sum(1 for n in uses.values() if n >= 2),
        distances=tuple(dist),
        below_pool=below,
        inside=len(dist) - below - above,
        above_tier=above,
    )
