"""Load or recompute: the predicted time of reading a run of hits from each tier that holds it,
against the time of recomputing its tokens; both learnt online from the engine's own loads and
steps.

A tier's read time is `latency + tokens x seconds_per_token`; the prefill's time in a step is
`overhead + tokens x (b + c x context)`. Each is fitted by recursive least squares with
forgetting (a few floats of state; old samples decay, so the model follows a link whose speed
changes), starting from seeds (the startup self-test's load, the config's rates) that the first
real samples outweigh. Two reads in a row far off a tier's prediction on the same side drop most
of its past, so a changed speed is followed within two loads rather than ten.

A tier the model turns away keeps being sampled (one probe load per `probe_s`), so a wrong
verdict corrects itself; a hysteresis band keeps the decision from flapping at break-even.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

# each sample weighs about as much as the 4 before it together: a store that slowed down or
# recovered is followed within a few loads (or probes); the hysteresis band absorbs the noise
# this lets through
FORGET = 0.8
# a failed load that waited longer than predicted was cut short (a timeout): its read would
# have taken longer still, so it is learnt as this many times its wait (a faster read after it,
# a probe's, is learnt as it is and corrects the fit within a few loads)
CUT_SHORT = 2.0
# the band around the break-even inside which a tier keeps its last decision
HYSTERESIS = 0.1
# a read this many times slower (or faster) than predicted is a surprise; two in a row on the
# same side mean the tier's speed changed (a store that slowed down, a link that recovered),
# and its fit then keeps only SHIFT_KEEP of its past: the forgetting above takes 5-10 loads to
# follow a 2.5x change, each a load from a tier already slower than recompute (measured on a
# real store behind a throttling proxy, `kvtier bench load-cost`'s sweep); a single outlier
# moves nothing more than FORGET lets it
SHIFT = 1.5
SHIFT_KEEP = 0.05
LOAD, RECOMPUTE, PROBE = "load", "recompute", "probe"


class LinearFit:
    """`y ~ theta . x` by least squares over exponentially decayed samples (each weighs
    `forget` times the one after it), pulled toward a prior `theta` by a ridge of standard
    deviations `spread` against samples of standard deviation `noise`; each parameter is kept
    >= its `lower`. The state is the decayed sums: n x n + n floats."""

    def __init__(
        self,
        theta: Sequence[float],
        spread: Sequence[float],
        lower: Sequence[float],
        noise: float,
        forget: float = FORGET,
    ) -> None:
        n = len(theta)
        self.theta = [float(t) for t in theta]
        self.lower = [float(v) for v in lower]
        self._prior = list(self.theta)
        # the prior as evidence, in units of samples: weak where `spread` is wide
        self._ridge = [(noise / s) ** 2 for s in spread]
        self._xx = [[0.0] * n for _ in range(n)]
        self._xy = [0.0] * n
        self.forget = forget
        self.samples = 0

    def predict(self, x: Sequence[float]) -> float:
        return sum(t * v for t, v in zip(self.theta, x, strict=True))

    def discount(self, keep: float) -> None:
        """Keep only `keep` of every past sample's weight (the prior's stays whole)."""
        self._xx = [[keep * v for v in row] for row in self._xx]
        self._xy = [keep * v for v in self._xy]
        self.theta = self._solve()

    def observe(self, x: Sequence[float], y: float) -> None:
        if not math.isfinite(y) or not all(math.isfinite(v) for v in x):
            return
        n, f = len(x), self.forget
        self._xx = [[f * self._xx[i][j] + x[i] * x[j] for j in range(n)] for i in range(n)]
        self._xy = [f * self._xy[i] + x[i] * y for i in range(n)]
        self.samples += 1
        self.theta = self._solve()

    def _solve(self) -> list[float]:
        """The ridge solution; a parameter it puts below its bound is pinned there and the
        rest solved again (a faster read is a faster rate, never a negative latency)."""
        n = len(self.theta)
        pinned: dict[int, float] = {}
        while True:
            free = [i for i in range(n) if i not in pinned]
            a = [[self._xx[i][j] + (self._ridge[i] if i == j else 0.0) for j in free] for i in free]
            b = [
                self._xy[i]
                + self._ridge[i] * self._prior[i]
                - sum(self._xx[i][k] * v for k, v in pinned.items())
                for i in free
            ]
            sol = dict(zip(free, _gauss(a, b), strict=True))
            low = [i for i in free if sol[i] < self.lower[i]]
            if not low:
                return [pinned[i] if i in pinned else sol[i] for i in range(n)]
            for i in low:
                pinned[i] = self.lower[i]


def _gauss(a: list[list[float]], b: list[float]) -> list[float]:
    """Solve a x = b (a small, symmetric positive definite: the ridge keeps it so)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        piv = max(range(c, n), key=lambda r: abs(m[r][c]))
        m[c], m[piv] = m[piv], m[c]
        for r in range(c + 1, n):
            k = m[r][c] / m[c][c]
            for j in range(c, n + 1):
                m[r][j] -= k * m[c][j]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        out[r] = (m[r][n] - sum(m[r][j] * out[j] for j in range(r + 1, n))) / m[r][r]
    return out


class TierRead:
    """One tier's read time: first-byte latency plus tokens over its rate; and the recent
    share of its loads that failed (a failed load costs its wait and then the recompute)."""

    fail_share: float = 0.0
    # the side (+1 slower, -1 faster, 0 neither) of the last read's surprise (`SHIFT`)
    surprise: int = 0
    shifts: int = 0  # how often the fit dropped its past for a changed speed

    def __init__(self, tokens_per_s: float, latency_s: float = 0.0) -> None:
        per_ktok = max(1e3 / tokens_per_s, 1e-9)  # an unknown (infinite) rate reads as free
        # the prior is loose (several times its value): the first real loads replace it
        self.fit = LinearFit(
            (latency_s, per_ktok), (0.05, max(per_ktok * 4, 0.01)), (0.0, 1e-9), noise=2e-4
        )

    @property
    def samples(self) -> int:
        return self.fit.samples

    @property
    def latency_s(self) -> float:
        return self.fit.theta[0]

    @property
    def tokens_per_s(self) -> float:
        return 1e3 / self.fit.theta[1]

    def seconds(self, tokens: int) -> float:
        """Predicted seconds to read `tokens` (first byte included)."""
        return self.fit.predict((1.0, tokens / 1e3)) if tokens > 0 else 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or not seconds > 0:
            return
        ratio = seconds / max(self.seconds(tokens), 1e-12)
        side = 1 if ratio > SHIFT else -1 if ratio < 1 / SHIFT else 0
        if side and side == self.surprise:
            self.fit.discount(SHIFT_KEEP)
            self.shifts += 1
        self.surprise = side
        self.fit.observe((1.0, tokens / 1e3), seconds)

    def observe_outcome(self, ok: bool) -> None:
        self.fail_share += (1 - FORGET) * (float(not ok) - self.fail_share)


class PrefillTime:
    """The engine's prefill time per step: overhead + tokens x (b + c x context)."""

    def __init__(self, tokens_per_s: float) -> None:
        per_ktok = 1e3 / tokens_per_s
        self.fit = LinearFit(
            (0.0, per_ktok, 0.0), (0.05, per_ktok * 4, per_ktok * 4), (0.0, 1e-9, 0.0),
            noise=1e-3,
        )  # fmt: skip

    @property
    def samples(self) -> int:
        return self.fit.samples

    def observe(self, tokens: int, seconds: float, context: float = 0.0) -> None:
        """One step: `tokens` prompt tokens computed in `seconds`; `context` is the sum over
        its requests of their new tokens times the context they attend to (0 when unknown)."""
        if tokens > 0 and seconds > 0:
            self.fit.observe((1.0, tokens / 1e3, context / 1e6), seconds)

    def marginal_seconds(self, start: int, end: int) -> float:
        """What computing prompt tokens [start, end) adds to a step (its overhead is paid
        whether they are loaded or not)."""
        n = end - start
        if n <= 0:
            return 0.0
        _, b, c = self.fit.theta
        return n * b / 1e3 + n * (start + end) / 2 * c / 1e6


@dataclass(frozen=True)
class Segment:
    """Tokens [start, end) of a hit that one tier serves, and what was decided for them."""

    tier: str
    start: int
    end: int
    decision: str


@dataclass(frozen=True)
class LoadChoice:
    """Load [hbm, end) (end == hbm: recompute the whole hit), the load's predicted seconds, the
    prefill seconds it saves, and the decision per tier run."""

    end: int
    predicted_s: float
    saved_s: float
    segments: tuple[Segment, ...]

    def reads(self) -> tuple[tuple[str, int], ...]:
        """(tier, tokens) the load reads from each tier, in prompt order."""
        return tuple(
            (s.tier, min(s.end, self.end) - s.start) for s in self.segments if s.start < self.end
        )


def segments_of(
    runs: Iterable[tuple[str, int]], chunk: int, hbm: int, end: int
) -> list[tuple[str, int, int]]:
    """The hit's runs of chunks per tier, as token ranges clipped to [hbm, end)."""
    out: list[tuple[str, int, int]] = []
    pos = 0
    for tier, chunks in runs:
        lo, hi = max(pos, hbm), min(pos + chunks * chunk, end)
        pos += chunks * chunk
        if hi > lo:
            if out and out[-1][0] == tier and out[-1][2] == lo:
                out[-1] = (tier, out[-1][1], hi)
            else:
                out.append((tier, lo, hi))
    if out and out[-1][2] < end:  # the runs did not cover the hit: the rest as the last tier
        out[-1] = (out[-1][0], out[-1][1], end)
    return out


@dataclass
class CostModel:
    """Per-tier read models and the prefill model, and the load-or-recompute choice."""

    prefill: PrefillTime
    tiers: dict[str, TierRead]
    margin: float = 0.1
    probe_s: float = 10.0
    # the tier whose decision stands (load or recompute), for the hysteresis band
    state: dict[str, str] = field(default_factory=dict)
    last_probe: dict[str, float] = field(default_factory=dict)
    predictions: int = 0
    mispredicted_share: float = 0.0  # recent share of loads off by more than 2x (EWMA)

    def tier(self, name: str) -> TierRead:
        """The read model of `name` (an unknown or unnamed tier reads as memory's, else the
        slowest known)."""
        found = self.tiers.get(name)
        if found is not None:
            return found
        if not name and "memory" in self.tiers:
            return self.tiers["memory"]
        return min(self.tiers.values(), key=lambda t: t.tokens_per_s)

    def _weight(self, tier: str) -> float:
        """1 + the margin a load from `tier` must win by, shifted by the hysteresis band
        toward the tier's standing decision."""
        shift = HYSTERESIS if self.state.get(tier) == RECOMPUTE else -HYSTERESIS
        return max(0.0, 1.0 + self.margin + shift)

    def choose(
        self,
        hbm: int,
        end: int,
        runs: Sequence[tuple[str, int]],
        chunk: int,
        min_load: int,
        now: float,
    ) -> LoadChoice:
        """The end of the load above `hbm` that saves the most predicted time: a chunk boundary
        (or `end`) up to which every tier read beats recomputing, by the margin."""
        segs = segments_of(runs, chunk, hbm, end)
        ends = sorted({b for _, _, hi in segs for b in _boundaries(hbm, hi, chunk)} | {end})
        best_end, best_gain, best_saved = hbm, 0.0, 0.0
        for e in ends:
            if e - hbm < min_load:
                continue
            cost, works = 0.0, 1.0
            for tier, lo, hi in segs:
                if lo >= e:
                    break
                read = self.tier(tier)
                cost += read.seconds(min(hi, e) - lo) * self._weight(tier)
                works *= 1.0 - read.fail_share
            # a load that fails has cost its wait and saves nothing: the prompt is recomputed
            saved = self.prefill.marginal_seconds(hbm, e) * works
            if saved - cost > best_gain:
                best_end, best_gain, best_saved = e, saved - cost, saved
        turned_away = [t for t, lo, _ in segs if lo >= best_end]
        probed = next((t for t in turned_away if self._probe_due(t, now)), None)
        if probed is not None:
            self.last_probe[probed] = now
            best_end = end
            best_saved = self.prefill.marginal_seconds(hbm, end)
        out = []
        predicted = 0.0
        for tier, lo, hi in segs:
            loaded = lo < best_end
            if loaded:
                predicted += self.tier(tier).seconds(min(hi, best_end) - lo)
            decision = (PROBE if tier == probed else LOAD) if loaded else RECOMPUTE
            if probed is None:
                self.state[tier] = LOAD if loaded else RECOMPUTE
            out.append(Segment(tier, lo, hi, decision))
        return LoadChoice(best_end, predicted, best_saved, tuple(out))

    def load_all(
        self, hbm: int, end: int, runs: Sequence[tuple[str, int]], chunk: int
    ) -> LoadChoice:
        """Every hit loaded (`load_policy: always`), with its prediction for the record."""
        segs = segments_of(runs, chunk, hbm, end)
        predicted = sum(self.tier(t).seconds(hi - lo) for t, lo, hi in segs)
        out = tuple(Segment(t, lo, hi, LOAD) for t, lo, hi in segs)
        return LoadChoice(end, predicted, self.prefill.marginal_seconds(hbm, end), out)

    def _probe_due(self, tier: str, now: float) -> bool:
        last = self.last_probe.get(tier)
        if last is None or now < last:
            # the first turn-away starts the clock (no probe right after it); a clock that
            # went back restarts it, or no probe would come until it caught up
            self.last_probe[tier] = now
            return False
        return now - last >= self.probe_s

    def observe_read(
        self,
        reads: Sequence[tuple[str, int]],
        seconds: float,
        tokens: int | None = None,
        ok: bool = True,
    ) -> None:
        """A finished load that read `reads` (tier, tokens; the first `tokens` of them where
        the host granted less) in `seconds`: one tier's read teaches that tier; a mixed one
        teaches its slowest tier what the others' predicted reads leave of the time. A failed
        load counts against every tier it read, and teaches its time only where it waited
        longer than predicted, as `CUT_SHORT` times its wait (a read cut by a timeout would have
        taken longer still)."""
        for tier in {t for t, _ in reads}:
            self.tier(tier).observe_outcome(ok)
        if not ok:
            if seconds <= self.predicted_seconds(reads):
                return
            seconds *= CUT_SHORT
        if not reads or seconds <= 0:
            return
        left = sum(n for _, n in reads) if tokens is None else tokens
        by_tier: dict[str, int] = {}
        for tier, n in reads:
            n = min(n, left)
            left -= n
            if n > 0:
                by_tier[tier] = by_tier.get(tier, 0) + n
        if not by_tier:
            return
        slowest = max(by_tier, key=lambda t: self.tier(t).seconds(by_tier[t]))
        others = sum(self.tier(t).seconds(n) for t, n in by_tier.items() if t != slowest)
        # the others' share is a prediction: never leave the slowest less than a tenth
        self.tier(slowest).observe(by_tier[slowest], max(seconds - others, seconds / 10))

    def clipped(
        self, reads: Sequence[tuple[str, int]], drop_head: int, keep: int
    ) -> tuple[tuple[str, int], ...]:
        """`reads` (tier, tokens in prompt order) less `drop_head` leading tokens, then cut to
        `keep` tokens: what a load reads once the host moved its floor or granted less."""
        out: list[tuple[str, int]] = []
        skip, left = drop_head, keep
        for tier, n in reads:
            gone = min(skip, n)
            skip -= gone
            take = min(n - gone, left)
            left -= take
            if take > 0:
                out.append((tier, take))
        return tuple(out)

    def predicted_seconds(self, reads: Sequence[tuple[str, int]]) -> float:
        """The predicted time of a load reading `reads` (tier, tokens)."""
        return sum(self.tier(t).seconds(n) for t, n in reads)

    def observe_outcome(self, predicted_s: float, measured_s: float) -> bool:
        """A finished load's predicted against measured seconds; True when off by over 2x."""
        if predicted_s <= 0 or measured_s <= 0:
            return False
        self.predictions += 1
        missed = not 0.5 <= measured_s / predicted_s <= 2.0
        alpha = max(0.05, 1.0 / self.predictions)
        self.mispredicted_share += alpha * (float(missed) - self.mispredicted_share)
        return missed


def _boundaries(lo: int, hi: int, chunk: int) -> Iterable[int]:
    """Chunk boundaries in (lo, hi]."""
    first = (lo // chunk + 1) * chunk
    return range(first, hi + 1, chunk)
