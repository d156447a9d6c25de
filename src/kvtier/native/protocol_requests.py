"""The request bodies of the native server's OpenAI endpoints: pydantic models shaped like
vLLM's, with vLLM's defaults and validation ranges. Fields the native engine cannot honour are
accepted at their neutral value and otherwise refused with a 400 that says why (`REFUSED`,
listed in docs/native-server.md's endpoint table too).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Annotated, Any, ClassVar

from pydantic import Field, model_validator

from kvtier.native.protocol import APIError, OpenAIBaseModel
from kvtier.native.sampling import INT64_MAX, INT64_MIN, MAX_LOGPROBS, SamplingParams

MAX_N = 128  # vLLM's VLLM_MAX_N_SEQUENCES default
MAX_PROMPTS = 1024  # vLLM's VLLM_MAX_COMPLETION_PROMPTS default


# ---- refused fields ---------------------------------------------------------------------------


def _off(*neutral: object) -> Callable[[object], bool]:
    return lambda v: v in neutral


# field -> (is it at its neutral value?, why the native server refuses anything else)
REFUSED: dict[str, tuple[Callable[[object], bool], str]] = {
    "use_beam_search": (_off(None, False), "beam search is not implemented by the native engine"),
    "prompt_logprobs": (
        _off(None),
        "prompt logprobs need every prompt position computed, and the native engine serves "
        "prompts from its prefix cache and the tier",
    ),
    "logprob_token_ids": (_off(None, []), "per-token logprob selection is not implemented"),
    "allowed_token_ids": (_off(None, []), "allowed_token_ids is not implemented; use logit_bias"),
    "bad_words": (_off(None, []), "bad_words is not implemented; use logit_bias"),
    "response_format": (
        lambda v: v is None or (isinstance(v, Mapping) and v.get("type") == "text"),
        "structured output (json_object, json_schema) needs a grammar backend the native "
        "engine does not have",
    ),
    "structured_outputs": (_off(None), "structured output needs a grammar backend"),
    "guided_json": (_off(None), "structured output needs a grammar backend"),
    "guided_regex": (_off(None), "structured output needs a grammar backend"),
    "guided_choice": (_off(None), "structured output needs a grammar backend"),
    "prompt_embeds": (_off(None), "prompt embeddings are not accepted; send text or token ids"),
    "suffix": (_off(None, ""), "suffix (fill-in-the-middle) is not supported"),
    "priority": (_off(None, 0), "priority scheduling is not implemented (the engine is FCFS)"),
    "watermarking": (_off(None, False), "watermarking is not implemented"),
    "cache_salt": (_off(None), "salted prefix caching is not implemented"),
    "tools": (
        _off(None, []),
        "tool calling needs a tool-call parser the native server does not have",
    ),
    "tool_choice": (_off(None, "none", "auto"), "tool calling is not supported"),
    "functions": (_off(None, []), "function calling is not supported"),
    "audio": (_off(None), "audio output is not supported"),
    "modalities": (_off(None, ["text"]), "only the text modality is supported"),
    "kv_transfer_params": (_off(None, {}), "disaggregated KV transfer is not supported"),
}


def _check_refused(data: Any) -> Any:
    if isinstance(data, Mapping):
        for name, value in data.items():
            rule = REFUSED.get(name)
            if rule is not None and not rule[0](value):
                raise APIError(
                    400, f"{name} is not supported by the native server: {rule[1]}", name
                )
    return data


# ---- request bodies ---------------------------------------------------------------------------


class StreamOptions(OpenAIBaseModel):
    """What a stream carries besides tokens."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _SamplingRequest(OpenAIBaseModel):
    """The sampling and output fields both generation endpoints share (vLLM's names)."""

    _DEFAULT_MAX_TOKENS: ClassVar[int | None] = None

    model: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    n: int = 1
    best_of: int | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = []  # how many: ServerLimits.max_stop_strings
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    top_k: int | None = Field(None, le=INT64_MAX)
    min_p: float | None = None
    repetition_penalty: float | None = None
    length_penalty: float = 1.0
    stop_token_ids: list[int] | None = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    request_id: str | None = None
    # retention hints in OpenAI's words (native/retention_hints.py)
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        data = _check_refused(data)
        if isinstance(data, Mapping) and data.get("stream_options") and not data.get("stream"):
            raise APIError(
                400, "Stream options can only be defined when `stream=True`.", "stream_options"
            )
        return data

    @model_validator(mode="after")
    def _check_choices(self) -> _SamplingRequest:
        if not 1 <= self.n <= MAX_N:
            raise APIError(400, f"n must be in [1, {MAX_N}], got {self.n}.", "n")
        if self.best_of is not None:
            if not self.n <= self.best_of <= MAX_N:
                raise APIError(
                    400, f"best_of must be in [n={self.n}, {MAX_N}], got {self.best_of}.",
                    "best_of",
                )  # fmt: skip
            if self.stream and self.best_of != self.n:
                raise APIError(400, "best_of cannot be used with stream=True.", "best_of")
        greedy = self.temperature is not None and self.temperature < 1e-5
        if greedy and self.num_sequences > 1:
            raise APIError(
                400, f"n must be 1 when using greedy sampling, got {self.num_sequences}.", "n"
            )
        if self.stop is not None and any(not s for s in self.stop_strings):
            raise APIError(400, "stop cannot contain an empty string.", "stop")
        for name in ("temperature", "top_p", "frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise APIError(400, f"{name} must be a finite number, got {value}.", name)
        return self

    @property
    def num_sequences(self) -> int:
        """Sequences generated per prompt (best_of, else n)."""
        return self.best_of or self.n

    @property
    def stop_strings(self) -> list[str]:
        """`stop` as a list."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Whether every stream chunk carries usage."""
        opts = self.stream_options
        return bool(self.include_usage and opts and opts.continuous_usage_stats)

    def _num_logprobs(self) -> int | None:
        raise NotImplementedError

    def logit_bias_ids(self) -> dict[int, float]:
        """`logit_bias` with integer keys (vLLM's error for a key that is not one)."""
        out: dict[int, float] = {}
        for key, bias in (self.logit_bias or {}).items():
            try:
                out[int(key)] = bias
            except ValueError:
                raise APIError(
                    400, f"logit_bias contains key {key!r} that cannot be converted to int.",
                    "logit_bias",
                ) from None  # fmt: skip
        return out

    def sampling_params(self, max_tokens: int, index: int) -> SamplingParams:
        """Engine parameters of sequence `index` (vLLM's child seeds: seed + index)."""
        num_logprobs = self._num_logprobs()
        if self.best_of is not None and self.best_of > self.n and num_logprobs is None:
            num_logprobs = 0  # ranking by cumulative logprob needs the sampled tokens' logprobs
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=self.logit_bias_ids(),
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            seed=None if self.seed is None else (self.seed + index) & INT64_MAX,
            ignore_eos=self.ignore_eos,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            logprobs=num_logprobs,
        )


class CompletionRequest(_SamplingRequest):
    """`POST /v1/completions` (vLLM's `CompletionRequest`)."""

    prompt: (
        list[Annotated[int, Field(ge=0)]]
        | list[list[Annotated[int, Field(ge=0)]]]
        | str
        | list[str]
        | None
    ) = None
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    suffix: str | None = None
    add_special_tokens: bool = True

    @model_validator(mode="before")
    @classmethod
    def _completion_rules(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        if data.get("echo") and data.get("logprobs") is not None:
            raise APIError(
                400,
                "echo with logprobs asks for prompt logprobs, which the native server does "
                f"not compute: {REFUSED['prompt_logprobs'][1]}",
                "echo",
            )
        prompt = data.get("prompt")
        if prompt is None or prompt == "" or prompt == []:
            raise APIError(400, "Either prompt or prompt_embeds must be provided and non-empty.",
                           "prompt")  # fmt: skip
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) > MAX_PROMPTS:
                raise APIError(
                    400, f"prompt list length {len(prompt)} exceeds the maximum allowed count "
                    f"of {MAX_PROMPTS}.", "prompt",
                )  # fmt: skip
        return data

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.max_tokens is None:
            self.max_tokens = 16  # vLLM: a null max_tokens means the default
        if self.max_tokens < 0 or (self.max_tokens == 0 and not self.echo):
            raise APIError(400, f"max_tokens must be at least 1, got {self.max_tokens}.",
                           "max_tokens")  # fmt: skip
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise APIError(
                400, f"logprobs must be in [0, {MAX_LOGPROBS}] (the server's max_logprobs), "
                f"got {self.logprobs}.", "logprobs",
            )  # fmt: skip
        return self

    def _num_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The batch: one entry per prompt (a string, or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        assert p is not None
        if p and isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        out: list[str | list[int]] = list(p)  # type: ignore[arg-type]
        if any(x == "" or x == [] for x in out):
            raise APIError(400, "prompt contains an empty prompt; every prompt needs a token",
                           "prompt")  # fmt: skip
        return out


class ChatCompletionRequest(_SamplingRequest):
    """`POST /v1/chat/completions` (vLLM's `ChatCompletionRequest`, text content only)."""

    messages: list[dict[str, Any]]
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    include_reasoning: bool = True
    parallel_tool_calls: bool | None = True

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if not self.messages:
            raise APIError(400, "messages is empty; send at least one message", "messages")
        for i, msg in enumerate(self.messages):
            if not isinstance(msg.get("role"), str):
                raise APIError(400, f"messages[{i}] has no role; send e.g. 'user'", "messages")
        if self.continue_final_message and self.add_generation_prompt:
            raise APIError(
                400, "Cannot set both `continue_final_message` and `add_generation_prompt` to "
                "True.", "continue_final_message",
            )  # fmt: skip
        for name in ("max_tokens", "max_completion_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise APIError(400, f"{name} must be at least 1, got {value}.", name)
        top = self.top_logprobs or 0
        if not 0 <= top <= MAX_LOGPROBS:
            raise APIError(
                400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}.", "top_logprobs"
            )
        if top and not self.logprobs:
            raise APIError(400, "when using `top_logprobs`, `logprobs` must be set to true.",
                           "top_logprobs")  # fmt: skip
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens, else the deprecated max_tokens (None: fill the context)."""
        return self.max_completion_tokens or self.max_tokens

    def _num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict[str, Any]]:
        """Messages with text content as strings (content parts joined), as templates expect."""
        out = []
        for i, msg in enumerate(self.messages):
            content = msg.get("content")
            if isinstance(content, list):
                texts = []
                for part in content:
                    kind = part.get("type") if isinstance(part, Mapping) else None
                    if kind not in ("text", "input_text"):
                        raise APIError(
                            400, f"messages[{i}] has a content part of type {kind!r}; the "
                            "native server takes text parts only", "messages",
                        )  # fmt: skip
                    texts.append(str(part.get("text", "")))
                content = "\n".join(texts)
            elif content is not None and not isinstance(content, str):
                raise APIError(400, f"messages[{i}].content must be a string or a list of "
                               "text parts", "messages")  # fmt: skip
            out.append({**msg, "content": content if content is not None else ""})
        return out


class TokenizeRequest(OpenAIBaseModel):
    """`POST /tokenize`: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "send exactly one of prompt or messages", "prompt")
        return self


class DetokenizeRequest(OpenAIBaseModel):
    """`POST /detokenize`."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=INT64_MAX)]]
