"""The OpenAI-compatible protocol of the native server, shaped like vLLM's
(`vllm/entrypoints/openai/*/protocol.py`): OpenAI's error object, the base model every body
shares (unknown fields accepted and ignored, logged once per name, as vLLM does), the one body
parser, and the response bodies. The request bodies are `protocol_requests`.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_serializer,
    model_validator,
)

from kvtier.native.sequence import loggable

log = logging.getLogger("kvtier.server")


_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    409: "ConflictError",
    413: "RequestEntityTooLargeError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An HTTP error answered as OpenAI's error object; `param` names the offending field,
    `headers` go on the response (`Retry-After` on 503 when the queue is full)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object (vLLM's `ErrorResponse`)."""
    kind = _ERROR_TYPES.get(status, "APIError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    err = exc.errors(include_url=False)[0]
    loc = ".".join(str(p) for p in err.get("loc", ()))
    shown = repr(err.get("input"))
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    where = f"{loc}: " if loc else ""
    param = str(err["loc"][0]) if err.get("loc") else None
    extra = f" (got {shown})" if err.get("type") not in ("json_invalid", "missing") else ""
    return f"{where}{err['msg']}{extra}", param


# unknown field names already warned about: clients choose them, so the set is bounded, and
# once it is full further names go unlogged (one line says so)
MAX_WARNED = 256
_SHOWN_NAMES = 8  # names one warning line shows


class _WarnedNames:
    """The unknown field names logged so far, at most `cap` of them."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.names: set[str] = set()
        self.full = False
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.names)

    def warn(self, model: str, names: Iterable[str]) -> None:
        """Log the names not logged before (the first `cap` distinct names ever seen)."""
        if self.full:
            return
        new: list[str] = []
        filled = False
        with self._lock:
            for name in names:
                if name in self.names:
                    continue
                if len(self.names) >= self.cap:
                    filled, self.full = not self.full, True
                    break
                self.names.add(name)
                new.append(name)
        if new:
            more = f" and {len(new) - _SHOWN_NAMES} more" if len(new) > _SHOWN_NAMES else ""
            shown = ", ".join(loggable(n) for n in new[:_SHOWN_NAMES])
            log.warning("ignoring unknown %s fields %s%s", model, shown, more)
        if filled:
            log.warning(
                "ignoring unknown fields: %d names were logged, later ones are not", self.cap
            )


_warned = _WarnedNames(MAX_WARNED)


class OpenAIBaseModel(BaseModel):
    """Extra fields are allowed and ignored, as OpenAI's API and vLLM do."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _log_extra_fields(self) -> OpenAIBaseModel:
        if self.model_extra:
            _warned.warn(type(self).__name__, self.model_extra)
        return self


def parse(model: type[BaseModel], body: bytes) -> Any:
    """Validate a JSON body; every failure (bad JSON, bad UTF-8, a lone surrogate, nesting too
    deep, a field out of range) becomes an `APIError(400)` naming the field."""
    if not body.strip():
        raise APIError(400, "the body is empty; send a JSON object")
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        message, param = _validation_message(exc)
        raise APIError(400, message, param) from None


# ---- response bodies --------------------------------------------------------------------------


def random_id(prefix: str) -> str:
    """`prefix-` and 32 hex digits."""
    return f"{prefix}-{uuid.uuid4().hex}"


class PromptTokenUsageInfo(OpenAIBaseModel):
    """Prompt tokens served from a cache (HBM prefix hit plus what the tier loaded)."""

    cached_tokens: int | None = None


class UsageInfo(OpenAIBaseModel):
    """Token counts of a response."""

    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None
    # kvtier's extension: what the request's retention hint was granted (status, tokens, ttl)
    kvtier_retention: dict[str, Any] | None = None

    @model_serializer(mode="wrap")
    def _without_empty_extension(self, handler: Any) -> Any:
        # a request without a hint gets OpenAI's usage object exactly
        data = handler(self)
        if isinstance(data, dict) and data.get("kvtier_retention") is None:
            data.pop("kvtier_retention", None)
        return data


class CompletionLogProbs(OpenAIBaseModel):
    """Completions' logprobs: parallel lists over the generated tokens."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    """One completion."""

    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(OpenAIBaseModel):
    """The body of a non-streaming completion."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo


class CompletionStreamResponse(OpenAIBaseModel):
    """One SSE chunk of a streaming completion."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


class ChatCompletionLogProb(OpenAIBaseModel):
    """One token's logprob in chat's format."""

    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    """A generated token's logprob and its top alternatives."""

    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    """Chat's logprobs."""

    content: list[ChatCompletionLogProbsContent] | None = None


class ChatMessage(OpenAIBaseModel):
    """The assistant's message."""

    role: str
    content: str | None = None


class DeltaMessage(OpenAIBaseModel):
    """What one stream chunk adds to the message."""

    role: str | None = None
    content: str | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    """One chat completion."""

    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    """The body of a non-streaming chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    """One choice of a chat stream chunk."""

    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    """One SSE chunk of a streaming chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None


class ModelCard(OpenAIBaseModel):
    """`GET /v1/models` entry."""

    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvtier"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    """`GET /v1/models`."""

    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeResponse(OpenAIBaseModel):
    """`POST /tokenize`."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(OpenAIBaseModel):
    """`POST /detokenize`."""

    prompt: str
