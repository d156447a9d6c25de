"""Sampling parameters and the sampler (vLLM's semantics and validation ranges).

Each row goes: raw logprobs (what `logprobs` reports, vLLM's `raw_logprobs` mode) -> logit
bias, stop tokens banned until `min_tokens` -> repetition/frequency/presence penalties ->
greedy argmax, or temperature, min-p, top-k, top-p and a draw from the request's seeded
generator (sampled output is reproducible too). A row whose sampling raises fails alone: the
sampler reports its error and the other rows of the step keep their tokens.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import msgspec
import torch

from kvtier.errors import ConfigError

# vLLM's constants: below GREEDY_EPS a temperature means greedy; a temperature in
# [GREEDY_EPS, MIN_TEMPERATURE) is raised to MIN_TEMPERATURE (dividing by less overflows float32)
GREEDY_EPS = 1e-5
MIN_TEMPERATURE = 1e-2
MAX_TEMPERATURE = 2.0
MAX_LOGPROBS = 20
LOGIT_BIAS_LIMIT = 100.0
# what a step carries per request is encoded as 64-bit integers: a client's larger one would
# fail the whole step's encoding, every request of it and the engine with them
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class SamplingParamError(ConfigError):
    """A sampling parameter outside vLLM's range; `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops (vLLM's names, defaults and ranges)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    seed: int | None = None  # None: derived from the engine seed and the request's arrival
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    top_k: int = 0  # 0 (or -1): every token
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    logprobs: int | None = None  # top logprobs per sampled token (0: the sampled token only)

    def __post_init__(self) -> None:
        checks = (
            (math.isfinite(self.temperature), "must be a finite number", "temperature"),
            (0.0 <= self.temperature <= MAX_TEMPERATURE, "must be in [0, 2]", "temperature"),
            (0.0 < self.top_p <= 1.0, "must be in (0, 1]", "top_p"),
            (-1 <= self.top_k <= INT64_MAX, "must be 0 (disable), or at least 1", "top_k"),
            (0.0 <= self.min_p <= 1.0, "must be in [0, 1]", "min_p"),
            (-2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]", "presence_penalty"),
            (-2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]", "frequency_penalty"),
            (
                math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
                "must be a finite number greater than zero",
                "repetition_penalty",
            ),
            (self.max_tokens >= 1, "must be at least 1", "max_tokens"),
            (0 <= self.min_tokens <= self.max_tokens, "must be in [0, max_tokens]", "min_tokens"),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                f"must be in [0, {MAX_LOGPROBS}]",
                "logprobs",
            ),
        )
        for ok, rule, name in checks:
            if not ok:
                raise SamplingParamError(name, f"{name}={getattr(self, name)!r} {rule}")
        bad = [t for t, b in self.logit_bias.items() if not math.isfinite(float(b))]
        if bad:
            raise SamplingParamError(
                "logit_bias", f"logit_bias of token {bad[0]} must be a finite number"
            )
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        bias = {int(t): min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, float(b)))
                for t, b in self.logit_bias.items()}  # fmt: skip
        object.__setattr__(self, "logit_bias", bias)
        if GREEDY_EPS <= self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)

    @property
    def greedy(self) -> bool:
        """Temperatures below 1e-5 sample the argmax (vLLM's rule)."""
        return self.temperature < GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        """Whether sampling needs the request's token history."""
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )


class SampleSpec(msgspec.Struct, array_like=True, frozen=True):
    """What the sampler needs of one row (sent to rank 0 with the step).

    `history` (prompt then output, `prompt_len` of it the prompt) travels only when a penalty
    needs it; `banned` holds the stop tokens while `min_tokens` is not reached.
    """

    req_id: str
    temperature: float  # 0: greedy
    top_p: float
    seed: int
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: list[tuple[int, float]] = msgspec.field(default_factory=list)
    banned: list[int] = msgspec.field(default_factory=list)
    logprobs: int = -1  # -1: none
    history: list[int] = msgspec.field(default_factory=list)
    prompt_len: int = 0


def sample_spec(
    req_id: str,
    params: SamplingParams,
    seed: int,
    token_ids: Sequence[int],
    prompt_len: int,
    eos_token_ids: Iterable[int],
) -> SampleSpec:
    """The wire spec of one sampling row of a request (`token_ids`: prompt plus output)."""
    banned: list[int] = []
    if len(token_ids) - prompt_len < params.min_tokens:
        eos = () if params.ignore_eos else tuple(eos_token_ids)
        banned = sorted({*params.stop_token_ids, *eos})
    return SampleSpec(
        req_id,
        0.0 if params.greedy else params.temperature,
        params.top_p,
        seed,
        top_k=params.top_k,
        min_p=params.min_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        logit_bias=sorted(params.logit_bias.items()),
        banned=banned,
        logprobs=-1 if params.logprobs is None else params.logprobs,
        history=list(token_ids) if params.has_penalties else [],
        prompt_len=prompt_len if params.has_penalties else 0,
    )


class TokenLogprobs(msgspec.Struct, array_like=True, frozen=True):
    """The sampled token's logprob and rank (1 = likeliest) and the top alternatives."""

    logprob: float
    rank: int
    top: list[tuple[int, float]]


class SampleOutcome(msgspec.Struct, array_like=True, frozen=True):
    """One row's result: a token (with logprobs when asked), or the error that failed it."""

    token: int = -1
    logprobs: TokenLogprobs | None = None
    error: str = ""


def _errmsg(exc: Exception) -> str:
    # one line, no traceback or source path: this text reaches the HTTP client
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first[:300]}"


class Sampler:
    """Turns the logits of the step's sampling rows into token ids."""

    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}
        self._before: dict[str, torch.Tensor] = {}  # each generator's state before its last draw

    def forget(self, req_ids: Iterable[str]) -> None:
        """Drop the generators of finished requests."""
        for r in req_ids:
            self._generators.pop(r, None)
            self._before.pop(r, None)

    def rewind(self, req_ids: Iterable[str]) -> None:
        """Undo the latest draw of these requests (the scheduler threw the token away: it was
        sampled from KV a failed synchronous load had written), so the token drawn again is the
        one a clean run draws."""
        for r in req_ids:
            gen, state = self._generators.get(r), self._before.get(r)
            if gen is not None and state is not None:
                gen.set_state(state)

    def sample(self, logits: torch.Tensor, specs: Sequence[SampleSpec]) -> list[SampleOutcome]:
        """One outcome per row of `logits` (float32 `[n, vocab]`); a failing row fails alone."""
        out = []
        for row, spec in enumerate(specs):
            try:
                out.append(self._row(logits[row], spec))
            except (RuntimeError, ValueError, IndexError) as exc:
                out.append(SampleOutcome(error=_errmsg(exc)))
        return out

    def _row(self, logits: torch.Tensor, spec: SampleSpec) -> SampleOutcome:
        raw = logits
        logits = logits.clone()
        if spec.logit_bias:
            ids, bias = zip(*spec.logit_bias, strict=True)
            logits[list(ids)] += torch.tensor(bias, dtype=logits.dtype, device=logits.device)
        if spec.banned:
            logits[spec.banned] = -math.inf
        if spec.history:
            _penalise(logits, spec)
        if spec.temperature == 0:
            token = int(logits.argmax())
        else:
            token = self._draw(logits, spec)
        lp = _logprobs(raw, token, spec.logprobs) if spec.logprobs >= 0 else None
        return SampleOutcome(token, lp)

    def _draw(self, logits: torch.Tensor, spec: SampleSpec) -> int:
        gen = self._generators.get(spec.req_id)
        if gen is None:
            gen = torch.Generator(device=logits.device).manual_seed(spec.seed)
            self._generators[spec.req_id] = gen
        self._before[spec.req_id] = gen.get_state()
        probs = torch.softmax(logits / spec.temperature, dim=-1)
        if spec.min_p > 0:
            probs = probs.masked_fill(probs < spec.min_p * probs.max(), 0.0)
        if 0 < spec.top_k < probs.numel():
            kth = probs.topk(spec.top_k).values[-1]
            probs = probs.masked_fill(probs < kth, 0.0)
        if spec.top_p < 1:
            # vLLM's rule: drop the least likely tokens whose mass stays within 1 - top_p; the
            # likeliest always stays, so a tiny top_p (1e-300 is 0 in float32) is still a choice
            sorted_p, order = probs.sort()
            drop = sorted_p.cumsum(0) <= (1 - spec.top_p) * sorted_p.sum()
            drop[-1] = False
            probs = probs.scatter(0, order, sorted_p.masked_fill(drop, 0.0))
        return int(torch.multinomial(probs, 1, generator=gen).item())


def _penalise(logits: torch.Tensor, spec: SampleSpec) -> None:
    vocab = logits.numel()
    hist = torch.tensor(spec.history, dtype=torch.long, device=logits.device)
    out_counts = torch.bincount(hist[spec.prompt_len :], minlength=vocab)[:vocab]
    if spec.repetition_penalty != 1:
        seen = torch.bincount(hist, minlength=vocab)[:vocab] > 0
        p = spec.repetition_penalty
        scaled = torch.where(logits > 0, logits / p, logits * p)
        logits.copy_(torch.where(seen, scaled, logits))
    if spec.frequency_penalty:
        logits -= spec.frequency_penalty * out_counts.to(logits.dtype)
    if spec.presence_penalty:
        logits -= spec.presence_penalty * (out_counts > 0).to(logits.dtype)


def _logprobs(raw: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    logp = torch.log_softmax(raw.float(), dim=-1)
    chosen = float(logp[token])
    rank = int((logp > logp[token]).sum()) + 1
    top: list[tuple[int, float]] = []
    if k > 0:
        values, ids = logp.topk(min(k, logp.numel()))
        top = [(int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    return TokenLogprobs(chosen, rank, top)
