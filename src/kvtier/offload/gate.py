"""The load gate: where a load runs, inside the forward of its step (synchronous) when it is
predicted to take a small share of a step, else on the load lane while its request waits
(asynchronous); and, through its cost model (`offload/cost.py`), whether a hit is loaded at all.

The step time is a running estimate (exponentially weighted) of the steps the host reports; the
read and prefill times are the cost model's, learnt from every finished load and every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.offload.cost import CostModel, PrefillTime, TierRead


@dataclass
class Duration:
    """An exponentially weighted duration in seconds; unknown (None) until observed."""

    value: float | None = None
    alpha: float = 0.2
    samples: int = 0

    def observe(self, seconds: float) -> None:
        if seconds <= 0:
            return
        self.value = (
            seconds if self.value is None else self.value + self.alpha * (seconds - self.value)
        )
        self.samples += 1


@dataclass
class LoadGate:
    """The cost model of loads and prefill, and the measured step a sync load must fit in."""

    cost: CostModel
    step: Duration = field(default_factory=Duration)  # one busy engine step, sync loads left out
    # False: memory's read rate was unknown at startup (seeded as free until measured)
    memory_seeded: bool = True

    @classmethod
    def seeded(
        cls,
        prefill_tokens_per_s: float,
        load_tokens_per_s: float | None,
        tier_seeds: dict[str, float] | None = None,
        *,
        margin: float = 0.1,
        probe_s: float = 10.0,
    ) -> LoadGate:
        """A gate seeded from config: `load_tokens_per_s` is memory's read rate (unknown: a
        load never loses to recompute until measured); `tier_seeds` the other tiers'."""
        seeds = dict(tier_seeds or {})
        known = load_tokens_per_s or seeds.get("memory")
        seeds["memory"] = known or float("inf")
        tiers = {name: TierRead(rate) for name, rate in seeds.items()}
        cost = CostModel(PrefillTime(prefill_tokens_per_s), tiers, margin, probe_s)
        return cls(cost, memory_seeded=bool(known))

    def transfer_seconds(self, tokens: int, tier: str | None = None) -> float:
        """Predicted time to move `tokens` from `tier` into KV blocks (the fitted latency
        included: with loads of one size the fit cannot tell it from the rate, and a sync
        load that overruns its share of the forward costs every request in the step)."""
        return self.cost.tier(tier or "").seconds(tokens)

    def runs_in_forward(
        self, tokens: int, fraction: float, booked_s: float = 0.0, tier: str | None = None
    ) -> bool:
        """True when loading `tokens` inside the coming forward, after `booked_s` of other
        synchronous loads, is predicted to take at most `fraction` of a step. False while no
        step has been measured, and always when `fraction` is 0."""
        step = self.step.value
        if fraction <= 0 or step is None:
            return False
        return booked_s + self.transfer_seconds(tokens, tier) <= fraction * step

    def observe_step(self, seconds: float) -> None:
        self.step.observe(seconds)

    def observe_load(self, tokens: int, seconds: float, tier: str = "") -> None:
        self.cost.tier(tier).observe(tokens, seconds)

    def seed_from_selftest(self, tokens: int, seconds: float) -> None:
        """A rank's startup self-test loaded one chunk through the real path: before any real
        load was timed, the memory rate starts from it where it is faster than the config's
        seed (one chunk's time holds a lane's wake-up too, so it only ever errs low: a slower
        reading keeps the seed rather than turn loads away)."""
        memory = self.cost.tier("memory")
        if seconds <= 0 or tokens <= 0 or memory.samples > 0:
            return
        if not self.memory_seeded:
            # no rate was known: the self-test's is the cold start (an unknown rate reads as
            # free, and every memory load, however large, would run inside the forward)
            self.cost.tiers["memory"] = TierRead(tokens / seconds)
            self.memory_seeded = True
        elif memory.seconds(tokens) > seconds:
            self.observe_load(tokens, seconds, "memory")

    def observe_prefill(self, tokens: int, seconds: float, context: float = 0.0) -> None:
        self.cost.prefill.observe(tokens, seconds, context)
