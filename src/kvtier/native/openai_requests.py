"""The OpenAI endpoints' input side: a request body is parsed, validated (model, vocabulary,
context length, sampling parameters) and tokenized (the chat template rendered) into the engine
requests it asks for, with vLLM's limits and error messages. It runs on a worker thread, so a
10 MiB prompt never blocks the event loop. A request asks for `n` (or `best_of`) sequences per
prompt; each is its own engine request with the seed `seed + index`, as vLLM's children.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.native.chat_template import ChatTemplateError, RenderLimits
from kvtier.native.protocol import (
    APIError,
    DetokenizeResponse,
    TokenizeResponse,
    parse,
    random_id,
)
from kvtier.native.protocol_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from kvtier.native.retention_hints import cache_mark, hint_of
from kvtier.native.sampling import SamplingParamError, SamplingParams
from kvtier.native.tokenizer import Tokenizer
from kvtier.offload.retention import RetentionHint

MiB = 2**20
# vLLM's own error when a request brings a template the server was not told to trust
UNTRUSTED_TEMPLATE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)


@dataclass(frozen=True)
class ServerLimits:
    """What one client may make the server hold or do; each is a `kvtier serve` flag
    (docs/native-server.md lists them with their status codes)."""

    max_body_bytes: int = 16 * MiB  # --max-request-body-size: 413 over it
    max_logit_bias: int = 1024  # --max-logit-bias: entries of logit_bias
    max_stop_strings: int = 4  # --max-stop-strings: vLLM's VLLM_MAX_STOP_STRINGS default
    max_stop_token_ids: int = 1024  # --max-stop-token-ids
    max_queued_seqs: int = 1024  # --max-queued-seqs: sequences in the engine, all requests
    trust_request_chat_template: bool = False  # --trust-request-chat-template (vLLM's flag)
    render: RenderLimits = field(default_factory=RenderLimits)  # --chat-template-timeout, ...

    def __post_init__(self) -> None:
        # (value, its flag, the least it may be: 0 turns a list off, a body or queue needs 1)
        for value, flag, low in (
            (self.max_body_bytes, "--max-request-body-size", 1),
            (self.max_logit_bias, "--max-logit-bias", 0),
            (self.max_stop_strings, "--max-stop-strings", 0),
            (self.max_stop_token_ids, "--max-stop-token-ids", 0),
            (self.max_queued_seqs, "--max-queued-seqs", 1),
        ):
            if value < low:
                raise ValueError(f"{flag} {value} must be >= {low}")


@dataclass(frozen=True)
class ModelInfo:
    """What request validation needs to know about the served model."""

    name: str
    max_model_len: int
    vocab_size: int
    room_hint: str = ""  # how to raise max_model_len, when the KV pool limits it


@dataclass(frozen=True)
class Prompt:
    """One prompt of a request: its token ids and its text (for echo)."""

    ids: list[int]
    text: str  # the prompt's text (decoded when it came as ids), for echo
    retention: RetentionHint | None = None  # the client's retention hint


@dataclass(frozen=True)
class Seq:
    """One engine request of an HTTP request: which choice it is, what it runs."""

    index: int  # choice index in the response (prompt * num_sequences + sequence)
    prompt: int  # which prompt of the batch
    params: SamplingParams


class RequestBuilder:
    """Bodies of the OpenAI endpoints into validated engine requests, for one served model."""

    def __init__(
        self, tokenizer: Tokenizer | None, model: ModelInfo, limits: ServerLimits | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.model = model
        self.limits = limits or ServerLimits()

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model.name:
            raise APIError(
                404, f"The model `{name}` does not exist; this server serves "
                f"{self.model.name!r} (GET /v1/models)", "model",
            )  # fmt: skip

    def _need_tokenizer(self, what: str) -> Tokenizer:
        if self.tokenizer is None:
            raise APIError(400, f"the model directory has no tokenizer.json, so {what}", "prompt")
        return self.tokenizer

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        tok = self._need_tokenizer("prompts must be token ids")
        try:
            return tok.encode(text, add_special_tokens=add_special_tokens)
        except (TypeError, ValueError) as exc:
            # the tokenizer's own words stay in the log's domain: the kind is enough here
            raise APIError(
                400, f"the prompt cannot be tokenized ({type(exc).__name__})", "prompt"
            ) from None

    def _check_ids(self, ids: Sequence[int], param: str) -> None:
        vocab = self.model.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(
                400, f"{param} token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param
            )

    def _max_tokens(self, n_prompt: int, requested: int | None) -> int:
        limit = self.model.max_model_len
        if n_prompt >= limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens, and the prompt has "
                f"{n_prompt} (prompt plus at least one generated token must fit); shorten the "
                f"prompt{self.model.room_hint}",
                "prompt",
            )
        if requested is None:
            return limit - n_prompt
        if n_prompt + requested > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n_prompt + requested} tokens ({n_prompt} in the prompt, {requested} in the "
                f"completion); set max_tokens <= {limit - n_prompt}",
                "max_tokens",
            )
        return requested

    def _truncate(self, ids: list[int], keep: int | None) -> list[int]:
        if keep is None or keep < 0 or len(ids) <= keep:
            return ids  # -1: the model's limit (checked next), as vLLM
        return ids[-keep:] if keep else []

    def _params(self, req: Any, max_tokens: int, index: int) -> SamplingParams:
        try:
            params = req.sampling_params(max_tokens, index)
        except SamplingParamError as exc:
            raise APIError(400, str(exc), exc.param) from None
        self._check_ids(params.stop_token_ids, "stop_token_ids")
        self._check_ids(list(params.logit_bias), "logit_bias")
        return params

    def _check_sizes(self, req: Any) -> None:
        """The lists a client sizes, against the server's limits (vLLM's where it has one)."""
        lim = self.limits
        for param, count, limit, flag in (
            ("logit_bias", len(req.logit_bias or {}), lim.max_logit_bias, "--max-logit-bias"),
            ("stop", len(req.stop_strings), lim.max_stop_strings, "--max-stop-strings"),
            ("stop_token_ids", len(req.stop_token_ids or ()), lim.max_stop_token_ids,
             "--max-stop-token-ids"),
        ):  # fmt: skip
            if count > limit:
                raise APIError(
                    400, f"{param} has {count} entries; this server takes at most {limit} "
                    f"(kvtier serve {flag})", param,
                )  # fmt: skip

    def _seqs(self, req: Any, max_tokens: list[int]) -> list[Seq]:
        per = req.num_sequences
        total = len(max_tokens) * per
        if total > self.limits.max_queued_seqs:
            # could never be admitted, however long the client waits
            raise APIError(
                400, f"the request asks for {total} sequences ({len(max_tokens)} prompts x "
                f"{per}); this server holds at most {self.limits.max_queued_seqs} at once "
                "(kvtier serve --max-queued-seqs): send fewer prompts or a smaller n/best_of",
                "n",
            )  # fmt: skip
        out = []
        for p, mt in enumerate(max_tokens):
            for i in range(per):
                out.append(Seq(p * per + i, p, self._params(req, mt, i)))
        return out

    @staticmethod
    def request_id(req: Any, tag: str) -> str:
        """The request's id: the client's `request_id`, else `tag-` and 32 hex digits."""
        return req.request_id if req.request_id is not None else random_id(tag)

    def completion(self, body: bytes) -> tuple[CompletionRequest, list[Prompt], list[Seq]]:
        """Parse, validate and tokenize a `/v1/completions` body."""
        req = parse(CompletionRequest, body)
        self._check_model(req.model)
        self._check_sizes(req)
        prompts = []
        limits = []
        for p in req.prompts():
            if isinstance(p, str):
                ids = self._encode(p, req.add_special_tokens)
                text = p
            else:
                self._check_ids(p, "prompt")
                ids = list(p)
                text = self.tokenizer.decode(ids) if self.tokenizer is not None else ""
            ids = self._truncate(ids, req.truncate_prompt_tokens)
            if not ids:
                raise APIError(400, "the prompt has no tokens; send at least one", "prompt")
            echo_only = bool(req.echo) and req.max_tokens == 0
            limits.append(self._max_tokens(len(ids), 1 if echo_only else req.max_tokens))
            prompts.append(Prompt(ids, text, hint_of(req)))
        return req, prompts, self._seqs(req, limits)

    def _render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool,
        chat_template: str | None,
        kwargs: dict[str, Any] | None,
        documents: list[dict[str, str]] | None = None,
    ) -> str:
        tok = self._need_tokenizer("chat requests cannot be served")
        untrusted = chat_template is not None or (kwargs or {}).get("chat_template") is not None
        if untrusted and not self.limits.trust_request_chat_template:
            param = "chat_template" if chat_template is not None else "chat_template_kwargs"
            raise APIError(400, UNTRUSTED_TEMPLATE, param)
        try:
            text = tok.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                documents=documents,
                template_kwargs=kwargs,
                limits=self.limits.render,
            )
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), exc.param) from None
        if continue_final_message and messages:
            # the final message stays open: cut what the template put after its content
            last = str(messages[-1].get("content") or "")
            cut = text.rfind(last) if last else -1
            if cut >= 0:
                text = text[: cut + len(last)]
        return text

    def chat(self, body: bytes) -> tuple[ChatCompletionRequest, list[Prompt], list[Seq]]:
        """Parse, validate, render the chat template and tokenize a chat body."""
        req = parse(ChatCompletionRequest, body)
        self._check_model(req.model)
        self._check_sizes(req)
        text = self._render_chat(
            req.conversation(),
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            chat_template=req.chat_template,
            kwargs=req.chat_template_kwargs,
            documents=req.documents,
        )
        ids = self._truncate(self._encode(text, req.add_special_tokens), req.truncate_prompt_tokens)
        limit = self._max_tokens(len(ids), req.requested_max_tokens)
        mark = cache_mark(req.messages)

        def upto(i: int) -> int:
            # the prompt through message i: the conversation rendered up to there
            head = self._render_chat(
                req.conversation()[: i + 1],
                add_generation_prompt=False,
                continue_final_message=False,
                chat_template=req.chat_template,
                kwargs=req.chat_template_kwargs,
                documents=req.documents,
            )
            return min(len(self._encode(head, req.add_special_tokens)), len(ids))

        prompts = [Prompt(ids, text, hint_of(req, upto, mark))]
        return req, prompts, self._seqs(req, [limit])

    def tokenize(self, body: bytes) -> TokenizeResponse:
        """A `/tokenize` body's token ids (a prompt, or messages through the chat template)."""
        req = parse(TokenizeRequest, body)
        self._check_model(req.model)
        if req.messages is not None:
            chat = ChatCompletionRequest(messages=req.messages)
            text = self._render_chat(
                chat.conversation(),
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                chat_template=req.chat_template,
                kwargs=req.chat_template_kwargs,
            )
            ids = self._encode(text, bool(req.add_special_tokens))
        else:
            assert req.prompt is not None
            add = True if req.add_special_tokens is None else req.add_special_tokens
            ids = self._encode(req.prompt, add)
        strs = None
        if req.return_token_strs and self.tokenizer is not None:
            strs = [self.tokenizer.token_text(t) for t in ids]
        return TokenizeResponse(
            count=len(ids), max_model_len=self.model.max_model_len, tokens=ids, token_strs=strs
        )

    def detokenize(self, body: bytes) -> DetokenizeResponse:
        """A `/detokenize` body's text."""
        req = parse(DetokenizeRequest, body)
        self._check_model(req.model)
        self._check_ids(req.tokens, "tokens")
        tok = self._need_tokenizer("text cannot be decoded")
        return DetokenizeResponse(prompt=tok.decode(req.tokens))
