"""The sampler's vLLM semantics: greedy below 1e-5, tiny top_p, top-k, min-p, logit bias,
stop tokens banned until min_tokens, penalties, raw logprobs, a failing row failing alone, and
vLLM's validation ranges."""

from __future__ import annotations

import math

import pytest
import torch

from kvtier.native.sampling import (
    Sampler,
    SampleSpec,
    SamplingParamError,
    SamplingParams,
    _penalise,
    sample_spec,
)

LOGITS = torch.tensor([[0.0, 3.0, 1.0, 2.9, -1.0]])


def tokens(spec: SampleSpec, draws: int = 20, logits: torch.Tensor = LOGITS) -> set[int]:
    sampler = Sampler()
    return {sampler.sample(logits, [spec])[0].token for _ in range(draws)}


def spec_of(params: SamplingParams, history: list[int] = (), prompt_len: int = 0) -> SampleSpec:
    return sample_spec("r", params, 7, list(history), prompt_len, eos_token_ids=[4])


@pytest.mark.parametrize("temperature", [1e-39, 1e-45, 1e-300, 5e-6, 0.0])
def test_temperatures_below_1e_5_are_greedy(temperature):
    params = SamplingParams(temperature=temperature)
    assert params.greedy
    assert tokens(spec_of(params)) == {1}


def test_small_temperatures_are_raised_to_vllms_floor_and_tiny_top_p_keeps_the_likeliest():
    assert SamplingParams(temperature=1e-3).temperature == 1e-2
    assert tokens(spec_of(SamplingParams(top_p=1e-300))) == {1}  # 1e-300 is 0.0 in float32
    assert tokens(spec_of(SamplingParams(temperature=2.0, top_k=1))) == {1}
    assert tokens(spec_of(SamplingParams(temperature=2.0, min_p=1.0))) == {1}
    # top_k=2 at a high temperature: only the two likeliest ever come out
    assert tokens(spec_of(SamplingParams(temperature=2.0, top_k=2)), draws=60) == {1, 3}


def test_logit_bias_forces_and_bans_tokens():
    assert tokens(spec_of(SamplingParams(temperature=0, logit_bias={4: 100}))) == {4}
    assert tokens(spec_of(SamplingParams(temperature=0, logit_bias={1: -100}))) == {3}
    # vLLM clamps biases to [-100, 100]
    assert SamplingParams(logit_bias={1: 1e9}).logit_bias == {1: 100.0}


def test_stop_tokens_are_banned_until_min_tokens():
    eos_first = torch.tensor([[0.0, 1.0, 0.0, 0.0, 9.0]])
    params = SamplingParams(temperature=0, min_tokens=2, max_tokens=4)
    early = spec_of(params, history=[1, 2, 3], prompt_len=2)  # 1 output token so far
    late = spec_of(params, history=[1, 2, 3, 1], prompt_len=2)  # 2: min_tokens reached
    assert early.banned == [4] and late.banned == []
    assert tokens(early, logits=eos_first) == {1}
    assert tokens(late, logits=eos_first) == {4}


def test_penalties_follow_vllms_definitions():
    sampler = Sampler()
    row = torch.tensor([2.0, 2.0, -2.0, 1.0, 0.5])
    history = [0, 2, 3, 3]  # prompt [0], output [2, 3, 3]

    def penalised(**kw: float) -> torch.Tensor:
        spec = spec_of(SamplingParams(temperature=0, **kw), history, prompt_len=1)
        out = row.clone()
        _penalise(out, spec)
        return out

    torch.testing.assert_close(
        penalised(repetition_penalty=2.0), torch.tensor([1.0, 2.0, -4.0, 0.5, 0.5])
    )
    torch.testing.assert_close(
        penalised(frequency_penalty=0.5), torch.tensor([2.0, 2.0, -2.5, 0.0, 0.5])
    )
    torch.testing.assert_close(
        penalised(presence_penalty=0.5), torch.tensor([2.0, 2.0, -2.5, 0.5, 0.5])
    )
    spec = spec_of(SamplingParams(temperature=0, frequency_penalty=2.0), history, prompt_len=1)
    assert sampler.sample(row[None], [spec])[0].token in (0, 1)


def test_logprobs_are_the_raw_distribution_with_rank_and_top_alternatives():
    logp = torch.log_softmax(LOGITS[0], dim=-1)
    biased = SamplingParams(temperature=0, logprobs=2, logit_bias={2: 100})
    out = Sampler().sample(LOGITS, [spec_of(biased)])[0]
    assert out.token == 2 and out.logprobs is not None
    assert math.isclose(out.logprobs.logprob, float(logp[2]), rel_tol=1e-6)
    assert out.logprobs.rank == 3  # before the bias: 3.0 and 2.9 were likelier
    assert [t for t, _ in out.logprobs.top] == [1, 3]
    none = Sampler().sample(LOGITS, [spec_of(SamplingParams(temperature=0))])[0]
    assert none.logprobs is None
    zero = Sampler().sample(LOGITS, [spec_of(SamplingParams(temperature=0, logprobs=0))])[0]
    assert zero.logprobs is not None and zero.logprobs.top == []


def test_a_row_whose_sampling_raises_fails_alone():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9, -1.0], [math.nan] * 5])
    good, bad = Sampler().sample(
        logits, [SampleSpec("a", 0.0, 1.0, 0), SampleSpec("b", 1.0, 1.0, 0)]
    )
    assert good.token == 1 and not good.error
    assert bad.token == -1 and bad.error.startswith("RuntimeError: ")
    assert "\n" not in bad.error and ".py" not in bad.error


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("temperature", 2.5, "must be in [0, 2]"),
        ("temperature", math.inf, "finite"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_k", -2, "at least 1"),
        ("min_p", 1.5, "[0, 1]"),
        ("presence_penalty", -3.0, "[-2, 2]"),
        ("frequency_penalty", 3.0, "[-2, 2]"),
        ("repetition_penalty", 0.0, "greater than zero"),
        ("min_tokens", 17, "[0, max_tokens]"),
        ("logprobs", 21, "[0, 20]"),
    ],
)
def test_values_outside_vllms_ranges_are_refused_naming_the_field(field, value, words):
    with pytest.raises(SamplingParamError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field and words in str(info.value)


def test_the_wire_spec_carries_history_only_when_a_penalty_needs_it():
    assert spec_of(SamplingParams(), [1, 2, 3], 2).history == []
    spec = spec_of(SamplingParams(presence_penalty=0.5), [1, 2, 3], 2)
    assert spec.history == [1, 2, 3] and spec.prompt_len == 2


@pytest.mark.parametrize("bias", [float("nan"), float("inf"), -float("inf")])
def test_a_logit_bias_that_is_no_number_is_refused_naming_the_token(bias: float) -> None:
    """NaN was clamped to -100 (`max(-100, nan)` is -100): a client's NaN banned a token with
    a 200 answer, where a NaN temperature is a 400."""
    with pytest.raises(SamplingParamError, match="logit_bias of token 7 must be a finite number"):
        SamplingParams(logit_bias={7: bias})
