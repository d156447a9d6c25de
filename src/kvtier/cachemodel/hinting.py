"""What retention hints buy: one timed stream at one HBM and tier size, the real tier driven with
no hints, with every conversation hinting, and with a share hinting (the silent rest's traffic
next to its rate without anybody's hints and its floor), next to the offline optimum.

Sizes are fractions of a base, in one of two normalizations: all distinct chunks of the stream
(`distinct`, as `kvtier bench cache` sizes tiers) or its peak live working set (`live`, chunks
referenced again and alive at the same moment: `kvtier.cachemodel.live`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.cachemodel.live import peak_live
from kvtier.cachemodel.optimum import optimal_leading
from kvtier.cachemodel.predict import TierHits, drive_tier, tally
from kvtier.cachemodel.retention import SOONEST, HintingClient, HintStats
from kvtier.cachemodel.stream import Request, hbm_floors, working_set
from kvtier.cachemodel.turns import Turn, hinting_share, requests_of
from kvtier.errors import ConfigError

DISTINCT = "distinct"
LIVE = "live"
NORMALIZATIONS = (DISTINCT, LIVE)


def base_of(requests: Sequence[Request], normalization: str) -> int:
    """The chunks a size fraction is of: distinct chunks, or the peak live working set."""
    if normalization == DISTINCT:
        return working_set(requests)
    if normalization == LIVE:
        return peak_live(requests)
    raise ConfigError(f"normalization {normalization!r} is not one of {', '.join(NORMALIZATIONS)}")


@dataclass(frozen=True, slots=True)
class HintPoint:
    """One stream at one size: tier hits without hints, with hints, and mixed, and the optimum."""

    normalization: str
    base: int  # chunks the fractions are of
    hbm_fraction: float
    tier_fraction: float
    capacity: int  # tier chunks
    budget: float  # retained chunks' cap, a fraction of the tier
    share: float  # conversations hinting in the mixed run
    optimum: TierHits
    plain: TierHits  # nobody hints
    hinted: TierHits  # every conversation hints
    stats: HintStats  # the all-hinting run's hints
    mixed_hinted: TierHits  # mixed run: the hinting conversations' traffic
    mixed_silent: TierHits  # mixed run: the silent conversations' traffic
    silent_plain: TierHits  # the silent conversations' traffic when nobody hints
    silent_floor: TierHits  # ... when nobody hints and the tier is (1 - budget) of its size

    def to_json(self) -> dict[str, object]:
        """Rates in percent, sizes and the hint counts as plain JSON."""
        return {
            "normalization": self.normalization,
            "base_chunks": self.base,
            "hbm_fraction": self.hbm_fraction,
            "tier_fraction": self.tier_fraction,
            "tier_chunks": self.capacity,
            "budget": self.budget,
            "share": self.share,
            "optimum": 100 * self.optimum.rate,
            "plain": 100 * self.plain.rate,
            "hinted": 100 * self.hinted.rate,
            "mixed_hinted": 100 * self.mixed_hinted.rate,
            "mixed_silent": 100 * self.mixed_silent.rate,
            "silent_plain": 100 * self.silent_plain.rate,
            "silent_floor": 100 * self.silent_floor.rate,
            "missed_chunks": self.plain.missed,
            "hints": self.stats.to_json(),
        }


def _split(
    requests: Sequence[Request], floors: Sequence[int], leads: Sequence[int], pick: list[bool]
) -> TierHits:
    """The totals of the requests where `pick` is true."""
    return tally(
        [r for r, p in zip(requests, pick, strict=True) if p],
        [f for f, p in zip(floors, pick, strict=True) if p],
        [n for n, p in zip(leads, pick, strict=True) if p],
    )


def hint_point(
    turns: Sequence[Turn],
    normalization: str,
    hbm_fraction: float,
    tier_fraction: float,
    *,
    budget: float = 0.7,
    share: float = 0.5,
    mode: str = SOONEST,
    seed: int = 0,
) -> HintPoint:
    """Drive the real memory tier over `turns` at the sizes given as fractions of the
    `normalization`'s base: without hints, all hinting, and `share` of conversations hinting."""
    if not turns:
        raise ConfigError("a retention point needs at least one turn")
    requests = requests_of(turns)
    base = base_of(requests, normalization)
    floors = hbm_floors(requests, round(hbm_fraction * base))
    cap = max(1, round(tier_fraction * base))
    optimum = tally(requests, floors, optimal_leading(requests, cap))
    plain = drive_tier(requests, cap, floors).leads
    client = HintingClient(turns, cap, budget=budget, mode=mode)
    hinted = drive_tier(requests, cap, floors, hinter=client).leads
    mixed_turns = hinting_share(turns, share, seed)
    mixed = drive_tier(
        requests, cap, floors, hinter=HintingClient(mixed_turns, cap, budget=budget, mode=mode)
    ).leads
    floor = drive_tier(requests, max(1, round((1 - budget) * cap)), floors).leads
    speaks = [t.hints for t in mixed_turns]
    silent = [not s for s in speaks]
    return HintPoint(
        normalization,
        base,
        hbm_fraction,
        tier_fraction,
        cap,
        budget,
        share,
        optimum,
        tally(requests, floors, plain),
        tally(requests, floors, hinted),
        client.stats,
        _split(requests, floors, mixed, speaks),
        _split(requests, floors, mixed, silent),
        _split(requests, floors, plain, silent),
        _split(requests, floors, floor, silent),
    )
