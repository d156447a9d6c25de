"""The load gate: skip a tier load whose predicted time exceeds recomputing the same tokens.

Both rates are running estimates (exponentially weighted), seeded from the config and updated
from every finished load and every prefill step the host reports.
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
class LoadGate:
    """Compares predicted load time with predicted recompute time for a token count."""

    prefill: Rate
    load: Rate
    # per-op fixed cost (dispatch, lookup round trip, wake-up step), measured as the residual
    overhead_s: float = 0.002
    per_tier: dict[str, Rate] = field(default_factory=dict)

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

    def observe_load(self, tokens: int, seconds: float, tier: str = "") -> None:
        self.load.observe(tokens, seconds)
        if tier:
            self.per_tier.setdefault(tier, Rate(self.load.value)).observe(tokens, seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        self.prefill.observe(tokens, seconds)
