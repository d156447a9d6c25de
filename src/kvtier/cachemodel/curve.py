"""Hit rate against tier capacity: the real tier's prediction, the offline optimum and the
infinite tier over one request stream, behind one HBM cache, and a PNG of them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtier.cachemodel.optimum import infinite_leading, optimal_leading
from kvtier.cachemodel.predict import MEMORY, TierHits, predict, tally
from kvtier.cachemodel.stream import Request, hbm_floors, working_set
from kvtier.errors import ConfigError

FRACTIONS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0)


@dataclass(frozen=True, slots=True)
class CurvePoint:
    """One tier capacity and what each cache served there."""

    capacity: int  # chunks
    fraction: float  # of the working set
    kvtier: TierHits
    optimum: TierHits
    infinite: TierHits

    def to_json(self) -> dict[str, object]:
        """Plain JSON fields."""
        return {
            "capacity_chunks": self.capacity,
            "fraction_of_working_set": self.fraction,
            "kvtier": self.kvtier.to_json(),
            "optimum": self.optimum.to_json(),
            "infinite": self.infinite.to_json(),
        }


def hit_curve(
    requests: Sequence[Request],
    hbm_chunks: int,
    fractions: Sequence[float] = FRACTIONS,
    *,
    tier: str = MEMORY,
) -> list[CurvePoint]:
    """Tier hits at each fraction of the working set, behind an HBM cache of `hbm_chunks`."""
    if not requests:
        raise ConfigError("a hit curve needs at least one request")
    floors = hbm_floors(requests, hbm_chunks)
    infinite = tally(requests, floors, infinite_leading(requests))
    ws = working_set(requests)
    out = []
    for f in fractions:
        if not 0 < f <= 1:
            raise ConfigError(f"capacity fraction {f} must lie in (0, 1]")
        cap = max(1, round(f * ws))
        opt = tally(requests, floors, optimal_leading(requests, cap))
        out.append(CurvePoint(cap, f, predict(requests, cap, floors, tier=tier), opt, infinite))
    return out


def plot_curve(
    points: Sequence[CurvePoint], path: str | Path, title: str, mark: float | None = None
) -> Path:
    """Draw the curve as a PNG at `path` (parents created), with a vertical line at the tier
    size `mark` (a fraction of the working set) when given; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    out = Path(path)
    if out.is_dir():
        raise ConfigError(
            f"the hit curve's PNG path {str(out)!r} is a directory; give a file path such as "
            f"{str(out / 'hit-curve.png')!r}"
        )
    xs = [100 * p.fraction for p in points]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    try:
        for label, pick, style in (
            ("infinite tier (bound)", lambda p: p.infinite, ":"),
            ("offline optimum (Belady)", lambda p: p.optimum, "--"),
            ("kvtier (real tier, predicted)", lambda p: p.kvtier, "-"),
        ):
            ax.plot(xs, [100 * pick(p).rate for p in points], style, marker="o", label=label)
        if mark is not None:
            ax.axvline(100 * mark, color="grey", linewidth=1, label="this tier")
        ax.set_xlabel("tier capacity (% of the working set)")
        ax.set_ylabel("tier hits (% of chunks the HBM missed)")
        ax.set_title(title, fontsize=10)
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            # the format named, so the file is `out` itself (matplotlib would append .png to a
            # path without an extension, and the report would name a file that is not there)
            fig.savefig(out, format="png")
        except OSError as exc:
            raise ConfigError(
                f"cannot write the hit curve's PNG at {str(out)!r} ({exc.strerror or exc}); "
                "give a writable file path"
            ) from None
    finally:
        plt.close(fig)
    return out
