"""The load gate: skip a tier load whose predicted time exceeds recomputing the same tokens, and
choose where a load runs: inside the forward of its step (synchronous) when it is predicted to
take a small share of a step, else on the load lane while its request waits (asynchronous).

The rates and the step time are running estimates (exponentially weighted), seeded from the
config and updated from every finished load and every step the host reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Rate:
    """An exponentially weighted tokens-per-second estimate."""

    value: float
    alpha: float = 0.2
    samples: int = 0

    def observe(self, tokens: float, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        # the first real measurement replaces the seed outright
        self.value = rate if self.samples == 0 else self.value + self.alpha * (rate - self.value)
        self.samples += 1


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
    """Compares predicted load time with predicted recompute time for a token count."""

    prefill: Rate
    load: Rate
    # per-op fixed cost (dispatch, lookup round trip, wake-up step), measured as the residual
    overhead_s: float = 0.002
    per_tier: dict[str, Rate] = field(default_factory=dict)
    step: Duration = field(default_factory=Duration)  # one busy engine step, sync loads left out

    @classmethod
    def seeded(
        cls,
        prefill_tokens_per_s: float,
        load_tokens_per_s: float | None,
        tier_seeds: dict[str, float] | None = None,
    ) -> LoadGate:
        """A gate seeded from config; an unknown load rate never blocks until measured."""
        per_tier = {name: Rate(v) for name, v in (tier_seeds or {}).items()}
        return cls(
            Rate(prefill_tokens_per_s), Rate(load_tokens_per_s or float("inf")), per_tier=per_tier
        )

    def load_seconds(self, tokens: int) -> float:
        return self.overhead_s + tokens / self.load.value

    def recompute_seconds(self, tokens: int) -> float:
        return tokens / self.prefill.value

    def worth_loading(self, tokens: int) -> bool:
        """True when loading `tokens` is predicted to be no slower than recomputing them."""
        return self.load_seconds(tokens) <= self.recompute_seconds(tokens)

    def transfer_seconds(self, tokens: int, tier: str | None = None) -> float:
        """Predicted time to move `tokens` from `tier` (the blend of every tier when unknown)
        into KV blocks, without the per-op overhead an asynchronous load adds."""
        rate = self.per_tier.get(tier, self.load) if tier else self.load
        return tokens / rate.value

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
        self.load.observe(tokens, seconds)
        if tier:
            self.per_tier.setdefault(tier, Rate(self.load.value)).observe(tokens, seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        self.prefill.observe(tokens, seconds)
