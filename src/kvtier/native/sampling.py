"""Sampling parameters and the sampler: greedy at temperature 0, else temperature + top-p with
a seeded generator per request, so sampled output is reproducible too."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from kvtier.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops (vLLM's names and defaults)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    seed: int | None = None  # None: derived from the engine seed and the request's arrival
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ConfigError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p} must be in (0, 1]")
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens={self.max_tokens} must be >= 1")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclass(frozen=True, slots=True)
class SampleSpec:
    """What the sampler needs of one row: the request, its temperature, top-p and seed."""

    req_id: str
    temperature: float
    top_p: float
    seed: int


class Sampler:
    """Turns the logits of the step's sampling rows into token ids."""

    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, req_ids: Iterable[str]) -> None:
        """Drop the generators of finished requests."""
        for r in req_ids:
            self._generators.pop(r, None)

    def sample(self, logits: torch.Tensor, specs: Sequence[SampleSpec]) -> list[int]:
        """One token per row of `logits` (float32 `[n, vocab]`)."""
        greedy = logits.argmax(dim=-1).tolist()
        out = []
        for row, spec in enumerate(specs):
            if spec.temperature == 0:
                out.append(int(greedy[row]))
                continue
            gen = self._generators.get(spec.req_id)
            if gen is None:
                gen = torch.Generator(device=logits.device).manual_seed(spec.seed)
                self._generators[spec.req_id] = gen
            probs = torch.softmax(logits[row] / spec.temperature, dim=-1)
            if spec.top_p < 1:
                sorted_p, order = probs.sort(descending=True)
                # keep the smallest prefix whose mass reaches top_p (always the first token)
                drop = sorted_p.cumsum(0) - sorted_p >= spec.top_p
                sorted_p = sorted_p.masked_fill(drop, 0.0)
                probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
            out.append(int(torch.multinomial(probs, 1, generator=gen).item()))
        return out
