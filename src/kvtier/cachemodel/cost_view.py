"""Tier hits weighted by the time they save, not counted: each run of hits a modelled tier serves
is priced by the product's load-or-recompute model (`kvtier.offload.cost.CostModel`, its own
`choose`, never a copy) at a tier's read speed against a model's prefill speed.

A hit from a tier slower than the prefill it replaces costs time when it is loaded anyway
(`load_policy: always`); the cost policy recomputes it and saves nothing, never less.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.cachemodel.predict import served
from kvtier.cachemodel.stream import Request
from kvtier.offload.cost import CostModel, PrefillTime, TierRead


@dataclass(frozen=True, slots=True)
class Medium:
    """A tier's read path: its rate and first-byte latency."""

    name: str
    read_gbps: float
    latency_s: float


@dataclass(frozen=True, slots=True)
class Shape:
    """The model a hit's tokens belong to: KV bytes per token and its prefill speed."""

    name: str
    bytes_per_token: int
    prefill_tokens_per_s: float

    def break_even_gbps(self) -> float:
        """The read rate at which loading a token takes as long as computing it."""
        return self.bytes_per_token * self.prefill_tokens_per_s / 1e9


@dataclass(frozen=True, slots=True)
class TimeSaved:
    """Over a stream: the prefill seconds of the chunks the HBM missed, and what loading the
    tier's hits saved of them under each policy (negative: the loads cost more than they saved)."""

    missed_s: float
    always_s: float
    cost_s: float
    runs: int  # runs of tier hits
    loaded_runs: int  # of those, loaded (at least in part) by the cost policy

    def share(self, saved_s: float) -> float:
        """`saved_s` over the missed prefill time (0.0 when nothing was missed)."""
        return saved_s / self.missed_s if self.missed_s else 0.0

    def to_json(self) -> dict[str, float | int]:
        return {
            "missed_s": self.missed_s,
            "always_s": self.always_s,
            "cost_s": self.cost_s,
            "runs": self.runs,
            "loaded_runs": self.loaded_runs,
        }


def time_saved(
    requests: Sequence[Request],
    floors: Sequence[int],
    leads: Sequence[int],
    *,
    medium: Medium,
    shape: Shape,
    chunk_tokens: int,
    min_load: int = 1,
    margin: float = 0.1,
) -> TimeSaved:
    """Price each request's tier hit (chunks [floor, lead) of its usable ones, as the engine
    loads them) at `medium`'s speed against `shape`'s prefill."""
    prefill = PrefillTime(shape.prefill_tokens_per_s)
    read = TierRead(medium.read_gbps * 1e9 / shape.bytes_per_token, medium.latency_s)
    model = CostModel(prefill, {medium.name: read}, margin=margin)
    missed = always = cost = 0.0
    runs = loaded = 0
    for r, h, n in zip(requests, floors, leads, strict=True):
        lo, hi = h * chunk_tokens, r.usable * chunk_tokens
        missed += prefill.marginal_seconds(lo, hi)
        got = served(r, h, n, min_load)
        if not got:
            continue
        runs += 1
        end = lo + got * chunk_tokens
        always += prefill.marginal_seconds(lo, end) - read.seconds(end - lo)
        # the clock stands still: the model's probes (a wrong verdict's correction) never fire
        choice = model.choose(lo, end, ((medium.name, h + got),), chunk_tokens,
                              min_load * chunk_tokens, 0.0)  # fmt: skip
        if choice.end > lo:
            loaded += 1
            cost += choice.saved_s - choice.predicted_s
    return TimeSaved(missed, always, cost, runs, loaded)
