"""Where a workload falls against the window (HBM pool, tier] a tier can serve, and, for a
trace, what each cache serves of it (`kvtier.cachemodel`): the ceilings and the hit curve."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.cachemodel.curve import CurvePoint, hit_curve, plot_curve
from kvtier.cachemodel.optimum import infinite_leading, optimal_leading
from kvtier.cachemodel.predict import TierHits, predict, tally
from kvtier.cachemodel.stream import hbm_floors, working_set
from kvtier.errors import ConfigError
from kvtier.plan.workload import MAX_TRACE_BLOCKS, Trace

GiB = 1 << 30

# Above this many trace blocks the pure-Python ceiling replay takes minutes; say so instead.
MAX_SIM_BLOCKS = MAX_TRACE_BLOCKS

BELOW_POOL = "below_pool"
INSIDE = "inside"
ABOVE_TIER = "above_tier"
NO_REUSE = "no_reuse"


@dataclass(frozen=True, slots=True)
class Verdict:
    """Where a reuse distance falls against the window (HBM pool, tier]."""

    kind: str
    message: str
    needed_tier_bytes: int | None = None

    @property
    def bad(self) -> bool:
        """True when the tier cannot win hits on this workload."""
        return self.kind != INSIDE

    def to_json(self) -> dict[str, Any]:
        """Plain JSON fields."""
        return {
            "kind": self.kind,
            "message": self.message,
            "needed_tier_bytes": self.needed_tier_bytes,
        }


def window_verdict(
    reuse_distance_tokens: int | None,
    hbm_pool_tokens: int,
    tier_tokens: int,
    bytes_per_token: int,
) -> Verdict:
    """The verdict for one reuse distance: HBM already hits it, the tier can, or the tier is too
    small (with the per-rank bytes a tier would need to hold it)."""
    d, h, t = reuse_distance_tokens, hbm_pool_tokens, tier_tokens
    if d is None:
        return Verdict(NO_REUSE, "no reuse: no block is used twice, so no cache can hit")
    if d <= h:
        return Verdict(
            BELOW_POOL,
            f"HBM already hits; the tier cannot add hits (reuse distance {d:,} <= HBM pool "
            f"{h:,} tokens)",
        )
    if d <= t:
        return Verdict(
            INSIDE, f"tier can hit (HBM pool {h:,} < reuse distance {d:,} <= tier {t:,} tokens)"
        )
    need = d * bytes_per_token
    return Verdict(
        ABOVE_TIER,
        f"tier too small: reuse distance exceeds it; need {need:,} bytes ({need / GiB:.2f} GiB) "
        f"per rank (reuse distance {d:,} > tier {t:,} tokens)",
        needed_tier_bytes=need,
    )


@dataclass(frozen=True, slots=True)
class TraceCeilings:
    """What each cache serves of a trace, one chunk per trace block (`kvtier.cachemodel`): the
    HBM pool alone (an LRU, tail first), and behind it the real tier driven as the engine does,
    the offline optimum at the tier's capacity (Belady) and an infinite tier (cold misses only).
    Tier rates are of the blocks the HBM missed."""

    usable_blocks: int  # blocks a hit could cover, summed over requests
    hbm_hit_blocks: int
    kvtier: TierHits
    optimum: TierHits
    infinite: TierHits
    hbm_blocks: int
    tier_blocks: int

    @property
    def hbm_rate(self) -> float:
        """HBM hits over usable blocks."""
        return self.hbm_hit_blocks / self.usable_blocks if self.usable_blocks else 0.0

    def to_json(self) -> dict[str, Any]:
        """The ceilings as plain JSON."""
        return {
            "unit": "trace blocks",
            "hbm_blocks": self.hbm_blocks,
            "tier_blocks": self.tier_blocks,
            "usable_blocks": self.usable_blocks,
            "hbm_hit_blocks": self.hbm_hit_blocks,
            "hbm_rate": self.hbm_rate,
            "kvtier": self.kvtier.to_json(),
            "optimum": self.optimum.to_json(),
            "infinite": self.infinite.to_json(),
        }


def trace_ceilings(
    trace: Trace, hbm_pool_tokens: int, tier_tokens: int
) -> tuple[TraceCeilings | None, str]:
    """HBM-alone hits, and the kvtier, optimal and infinite tier behind it (or None and why
    not), with a note. Mooncake hash ids chain their prefixes, so one chunk per block replays
    the same sharing as the full token stream at 1/block_tokens of the cost."""
    if trace.num_blocks > MAX_SIM_BLOCKS:
        return None, (
            f"not simulated: {trace.num_blocks:,} trace blocks exceed {MAX_SIM_BLOCKS:,} (the "
            "pure-Python replay would take minutes); cut the trace, e.g. with head -n"
        )
    requests = trace.chunk_requests
    hbm_blocks = hbm_pool_tokens // trace.block_tokens
    tier_blocks = tier_tokens // trace.block_tokens
    floors = hbm_floors(requests, hbm_blocks)
    # a tier that holds every distinct block never evicts: replay it at the working set, whose
    # hits are the same, rather than build (and allocate) the tier the flags name
    replayed = min(tier_blocks, working_set(requests))
    result = TraceCeilings(
        usable_blocks=sum(r.usable for r in requests),
        hbm_hit_blocks=sum(floors),
        kvtier=predict(requests, replayed, floors),
        optimum=tally(requests, floors, optimal_leading(requests, replayed)),
        infinite=tally(requests, floors, infinite_leading(requests)),
        hbm_blocks=hbm_blocks,
        tier_blocks=tier_blocks,
    )
    note = (
        f"whole {trace.block_tokens}-token trace blocks: HBM {hbm_blocks:,} blocks (LRU), tier "
        f"{tier_blocks:,} blocks; tier rates are of the blocks the HBM missed, a request's last "
        "token never hits"
    )
    return result, note


def trace_curve(
    trace: Trace, hbm_pool_tokens: int, tier_tokens: int, png: str | Path | None
) -> tuple[list[CurvePoint], Path | None]:
    """Tier hits against tier capacity behind the HBM pool (kvtier, optimum, infinite), drawn
    as a PNG at `png` when given, the tier of `tier_tokens` marked."""
    if trace.num_blocks > MAX_SIM_BLOCKS:
        raise ConfigError(
            f"--trace has {trace.num_blocks:,} blocks, more than the {MAX_SIM_BLOCKS:,} a hit "
            "curve replays; cut the trace, e.g. with head -n"
        )
    requests = trace.chunk_requests
    points = hit_curve(requests, hbm_pool_tokens // trace.block_tokens)
    if png is None:
        return points, None
    name = Path(trace.source).name if trace.source else "trace"
    title = f"{name}: tier hits behind an HBM pool of {hbm_pool_tokens:,} tokens"
    mark = min(1.0, tier_tokens // trace.block_tokens / max(1, working_set(requests)))
    return points, plot_curve(points, png, title, mark)
