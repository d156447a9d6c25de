"""The OpenAI endpoints' logic: a validated body becomes engine requests, their updates become
OpenAI responses (vLLM's shapes), streamed as SSE or gathered.

Parsing, validation and tokenization of a body run on a worker thread, so a 10 MiB prompt never
blocks the event loop (and `/health` with it). A request asks for `n` (or `best_of`) sequences
per prompt; each is its own engine request with the seed `seed + index`, as vLLM's children.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from kvtier.native.detokenizer import TextStream
from kvtier.native.engine_loop import EngineFailure, EngineLoop, EngineUnavailable, SeqUpdate
from kvtier.native.protocol import (
    APIError,
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    PromptTokenUsageInfo,
    TokenizeRequest,
    TokenizeResponse,
    UsageInfo,
    error_body,
    parse,
    random_id,
)
from kvtier.native.sampling import SamplingParamError, SamplingParams, TokenLogprobs
from kvtier.native.serve_metrics import ServeMetrics
from kvtier.native.tokenizer import ChatTemplateError, Tokenizer

log = logging.getLogger("kvtier.server")


@dataclass(frozen=True)
class ModelInfo:
    """What request validation needs to know about the served model."""

    name: str
    max_model_len: int
    vocab_size: int
    room_hint: str = ""  # how to raise max_model_len, when the KV pool limits it


@dataclass(frozen=True)
class _Prompt:
    ids: list[int]
    text: str  # the prompt's text (decoded when it came as ids), for echo


@dataclass(frozen=True)
class _Seq:
    """One engine request of an HTTP request: which choice it is, what it runs."""

    index: int  # choice index in the response (prompt * num_sequences + sequence)
    prompt: int  # which prompt of the batch
    rid: str
    params: SamplingParams


@dataclass
class _Choice:
    """The client's view of one sequence, filled from its updates."""

    seq: _Seq
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cached: int = 0
    error: str | None = None
    offsets: list[int] = field(default_factory=list)

    def add(self, u: SeqUpdate) -> None:
        # a token's text starts where the text stood before it (held-back text lands later)
        self.offsets.extend([len(self.text)] * len(u.output.new_token_ids))
        self.token_ids.extend(u.output.new_token_ids)
        self.text += u.text
        if u.output.logprobs is not None:
            self.logprobs.append(u.output.logprobs)
        self.cached = u.output.num_cached_tokens + u.output.num_external_tokens
        if u.finished:
            self.finish_reason, self.stop_reason = u.finish_reason, u.stop_reason
            self.error = u.output.error

    @property
    def cumulative_logprob(self) -> float:
        return sum(lp.logprob for lp in self.logprobs)


class _Gather:
    """The asyncio side of one HTTP request: the loop thread puts updates of every sequence."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()

    def sink(self, index: int) -> Callable[[object], bool]:
        """The loop-thread callback of sequence `index`; False once the event loop is gone."""

        def put(item: object) -> bool:
            try:
                self._loop.call_soon_threadsafe(self.queue.put_nowait, (index, item))
            except RuntimeError:  # the event loop closed: nobody will read this request
                return False
            return True

        return put

    async def updates(self, count: int) -> AsyncIterator[tuple[int, SeqUpdate]]:
        """Updates until all `count` sequences finished; an EngineFailure raises APIError."""
        left = count
        while left:
            index, item = await self.queue.get()
            if isinstance(item, EngineFailure):
                raise APIError(item.status, item.message)
            assert isinstance(item, SeqUpdate)
            yield index, item
            if item.finished:
                left -= 1


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body was read before)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _sse(payload: BaseModel | dict[str, Any]) -> str:
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json()}\n\n"
    import json

    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _json(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


class OpenAIServing:
    """Completions, chat completions, tokenize and detokenize over an `EngineLoop`."""

    def __init__(
        self,
        loop: EngineLoop,
        metrics: ServeMetrics,
        tokenizer: Tokenizer | None,
        model: ModelInfo,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.loop = loop
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.model = model
        self.clock = clock

    # ---- preparation (worker thread) -----------------------------------------------------------

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
            raise APIError(400, f"the prompt cannot be tokenized: {exc}", "prompt") from None

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

    def _seqs(
        self, req: Any, prompts: list[_Prompt], max_tokens: list[int], tag: str
    ) -> list[_Seq]:
        base = req.request_id or random_id(tag)
        per = req.num_sequences
        out = []
        for p, mt in enumerate(max_tokens):
            for i in range(per):
                index = p * per + i
                rid = base if len(prompts) * per == 1 else f"{base}-{index}"
                out.append(_Seq(index, p, rid, self._params(req, mt, i)))
        return out

    def prepare_completion(
        self, body: bytes
    ) -> tuple[CompletionRequest, list[_Prompt], list[_Seq]]:
        """Parse, validate and tokenize a `/v1/completions` body."""
        req = parse(CompletionRequest, body)
        self._check_model(req.model)
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
            prompts.append(_Prompt(ids, text))
        return req, prompts, self._seqs(req, prompts, limits, "cmpl")

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
        try:
            text = tok.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                documents=documents,
                **(kwargs or {}),
            )
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), "messages") from None
        if continue_final_message and messages:
            # the final message stays open: cut what the template put after its content
            last = str(messages[-1].get("content") or "")
            cut = text.rfind(last) if last else -1
            if cut >= 0:
                text = text[: cut + len(last)]
        return text

    def prepare_chat(self, body: bytes) -> tuple[ChatCompletionRequest, list[_Prompt], list[_Seq]]:
        """Parse, validate, render the chat template and tokenize a chat body."""
        req = parse(ChatCompletionRequest, body)
        self._check_model(req.model)
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
        prompts = [_Prompt(ids, text)]
        return req, prompts, self._seqs(req, prompts, [limit], "chatcmpl")

    # ---- running (event loop) ------------------------------------------------------------------

    def _submit(
        self, req: Any, seqs: list[_Seq], prompts: list[_Prompt], arrival: float
    ) -> _Gather:
        reason = self.loop.health()
        if reason is not None:
            raise APIError(503, f"the engine cannot serve: {reason}")
        gather = _Gather(asyncio.get_running_loop())
        self.metrics.observe_params(req.n)
        submitted: list[str] = []
        try:
            for s in seqs:
                text = TextStream(
                    self.tokenizer, req.stop_strings, include_stop=req.include_stop_str_in_output,
                    skip_special_tokens=req.skip_special_tokens,
                )  # fmt: skip
                self.loop.submit(
                    s.rid, prompts[s.prompt].ids, s.params, gather.sink(s.index), arrival, text
                )
                submitted.append(s.rid)
        except EngineUnavailable as exc:
            for rid in submitted:
                self.loop.abort(rid)
            raise APIError(503, f"the engine cannot serve: {exc}") from None
        return gather

    async def _collect(
        self, request: Request, gather: _Gather, seqs: list[_Seq]
    ) -> list[_Choice] | None:
        """Every sequence to its end; None when the client went away (all were aborted)."""
        choices = {s.index: _Choice(s) for s in seqs}

        async def run() -> None:
            async with contextlib.aclosing(gather.updates(len(seqs))) as updates:
                async for index, update in updates:
                    choices[index].add(update)

        work = asyncio.ensure_future(run())
        gone = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
                for s in seqs:
                    self.loop.abort(s.rid)
        if not work.done() or work.cancelled():
            return None
        work.result()  # raises APIError for an engine failure
        failed = [c for c in choices.values() if c.finish_reason == "error"]
        if failed:
            raise APIError(
                500, f"the request failed in the engine ({failed[0].error}); the server "
                "keeps serving other requests", None,
            )  # fmt: skip
        return [choices[s.index] for s in seqs]

    def _best(self, req: Any, choices: list[_Choice], per_prompt: int) -> list[_Choice]:
        if per_prompt == req.n:
            return choices
        out = []
        for p in range(len(choices) // per_prompt):
            group = choices[p * per_prompt : (p + 1) * per_prompt]
            out.extend(sorted(group, key=lambda c: -c.cumulative_logprob)[: req.n])
        return out

    def _usage(self, prompts: list[_Prompt], choices: list[_Choice], echo_only: bool) -> UsageInfo:
        n_prompt = sum(len(p.ids) for p in prompts)
        completion = 0 if echo_only else sum(len(c.token_ids) for c in choices)
        first = {}
        for c in choices:
            first.setdefault(c.seq.prompt, min(c.cached, len(prompts[c.seq.prompt].ids)))
        return UsageInfo(
            prompt_tokens=n_prompt,
            completion_tokens=completion,
            total_tokens=n_prompt + completion,
            prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=sum(first.values())),
        )

    # ---- logprobs -----------------------------------------------------------------------------

    def _token_str(self, token: int, as_ids: bool) -> str:
        if as_ids or self.tokenizer is None:
            return f"token_id:{token}"
        return self.tokenizer.token_text(token)

    def _completion_logprobs(
        self, req: CompletionRequest, tokens: list[int], lps: list[TokenLogprobs],
        offsets: list[int], base: int,
    ) -> CompletionLogProbs:  # fmt: skip
        as_ids = bool(req.return_tokens_as_token_ids)
        out = CompletionLogProbs()
        for i, (tok, lp) in enumerate(zip(tokens, lps, strict=False)):
            out.tokens.append(self._token_str(tok, as_ids))
            out.token_logprobs.append(lp.logprob)
            top = {self._token_str(t, as_ids): v for t, v in lp.top}
            top.setdefault(self._token_str(tok, as_ids), lp.logprob)
            out.top_logprobs.append(top)
            out.text_offset.append(base + (offsets[i] if i < len(offsets) else 0))
        return out

    def _chat_logprobs(
        self, req: ChatCompletionRequest, tokens: list[int], lps: list[TokenLogprobs]
    ) -> ChatCompletionLogProbs:
        as_ids = bool(req.return_tokens_as_token_ids)

        def entry(t: int, v: float) -> ChatCompletionLogProb:
            s = self._token_str(t, as_ids)
            return ChatCompletionLogProb(token=s, logprob=v, bytes=list(s.encode("utf-8")))

        content = []
        for tok, lp in zip(tokens, lps, strict=False):
            e = entry(tok, lp.logprob)
            content.append(
                ChatCompletionLogProbsContent(
                    token=e.token,
                    logprob=e.logprob,
                    bytes=e.bytes,
                    top_logprobs=[entry(t, v) for t, v in lp.top[: req.top_logprobs or 0]],
                )  # fmt: skip
            )
        return ChatCompletionLogProbs(content=content)

    # ---- completions ---------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        """POST /v1/completions."""
        arrival = self.clock()
        body = await request.body()
        req, prompts, seqs = await run_in_threadpool(self.prepare_completion, body)
        gather = self._submit(req, seqs, prompts, arrival)
        rid = seqs[0].rid if len(seqs) == 1 else seqs[0].rid.rsplit("-", 1)[0]
        created = int(time.time())
        if req.stream:
            return StreamingResponse(
                self._completion_stream(req, prompts, seqs, gather, rid, created),
                media_type="text/event-stream",
            )
        choices = await self._collect(request, gather, seqs)
        if choices is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        echo_only = bool(req.echo) and req.max_tokens == 0
        shown = self._best(req, choices, req.num_sequences)
        out = []
        for i, c in enumerate(shown):
            prefix = prompts[c.seq.prompt].text if req.echo else ""
            tokens = [] if echo_only else c.token_ids
            text = prefix + ("" if echo_only else c.text)
            choice = CompletionResponseChoice(
                index=i, text=text, finish_reason=c.finish_reason, stop_reason=c.stop_reason
            )
            if req.logprobs is not None:
                lps = [] if echo_only else c.logprobs
                choice.logprobs = self._completion_logprobs(
                    req, tokens, lps, c.offsets, len(prefix)
                )
            if req.return_token_ids:
                choice.token_ids = tokens
                choice.prompt_token_ids = prompts[c.seq.prompt].ids
            out.append(choice)
        usage = self._usage(prompts, choices, echo_only)
        return _json(CompletionResponse(id=rid, created=created, model=self.model.name,
                                        choices=out, usage=usage))  # fmt: skip

    async def _completion_stream(
        self, req: CompletionRequest, prompts: list[_Prompt], seqs: list[_Seq], gather: _Gather,
        rid: str, created: int,
    ) -> AsyncIterator[str]:  # fmt: skip
        choices = {s.index: _Choice(s) for s in seqs}
        done = False

        def chunk(choice: CompletionResponseChoice, usage: UsageInfo | None = None) -> str:
            return _sse(CompletionStreamResponse(
                id=rid, created=created, model=self.model.name, choices=[choice], usage=usage
            ))  # fmt: skip

        try:
            if req.echo:
                for s in seqs:
                    first = CompletionResponseChoice(index=s.index, text=prompts[s.prompt].text)
                    if req.return_token_ids:
                        first.prompt_token_ids = prompts[s.prompt].ids
                    yield chunk(first)
            async with contextlib.aclosing(gather.updates(len(seqs))) as updates:
                async for index, u in updates:
                    c = choices[index]
                    before, start = len(c.logprobs), len(c.offsets)
                    c.add(u)
                    if u.finish_reason == "error":
                        raise APIError(500, f"the request failed in the engine ({c.error})")
                    out = CompletionResponseChoice(
                        index=index, text=u.text, finish_reason=u.finish_reason,
                        stop_reason=u.stop_reason,
                    )  # fmt: skip
                    if req.logprobs is not None:
                        out.logprobs = self._completion_logprobs(
                            req, u.output.new_token_ids, c.logprobs[before:], c.offsets[start:], 0
                        )
                    if req.return_token_ids:
                        out.token_ids = list(u.output.new_token_ids)
                    usage = None
                    if req.continuous_usage:
                        usage = self._usage(prompts, list(choices.values()), False)
                    yield chunk(out, usage)
            done = True
            if req.include_usage:
                usage = self._usage(prompts, list(choices.values()), False)
                yield _sse(CompletionStreamResponse(
                    id=rid, created=created, model=self.model.name, choices=[], usage=usage
                ))  # fmt: skip
        except APIError as exc:
            yield _sse(error_body(exc.status, exc.message, exc.param))
        finally:
            if not done:  # a disconnect cancels this generator mid-stream: drop the requests
                for s in seqs:
                    self.loop.abort(s.rid)
        yield "data: [DONE]\n\n"

    # ---- chat ----------------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        """POST /v1/chat/completions."""
        arrival = self.clock()
        body = await request.body()
        req, prompts, seqs = await run_in_threadpool(self.prepare_chat, body)
        gather = self._submit(req, seqs, prompts, arrival)
        rid = seqs[0].rid if len(seqs) == 1 else seqs[0].rid.rsplit("-", 1)[0]
        created = int(time.time())
        echo = self._chat_echo(req)
        if req.stream:
            return StreamingResponse(
                self._chat_stream(req, prompts, seqs, gather, rid, created, echo),
                media_type="text/event-stream",
            )
        choices = await self._collect(request, gather, seqs)
        if choices is None:
            return Response(status_code=499)
        out = []
        for i, c in enumerate(self._best(req, choices, req.num_sequences)):
            choice = ChatCompletionResponseChoice(
                index=i, message=ChatMessage(role="assistant", content=echo + c.text),
                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
            )  # fmt: skip
            if req.logprobs:
                choice.logprobs = self._chat_logprobs(req, c.token_ids, c.logprobs)
            if req.return_token_ids:
                choice.token_ids = c.token_ids
            out.append(choice)
        resp = ChatCompletionResponse(
            id=rid, created=created, model=self.model.name, choices=out,
            usage=self._usage(prompts, choices, False),
        )  # fmt: skip
        if req.return_token_ids:
            resp.prompt_token_ids = prompts[0].ids
        return _json(resp)

    @staticmethod
    def _chat_echo(req: ChatCompletionRequest) -> str:
        # vLLM's echo: the last message's content, when it is the assistant's own
        if req.echo and req.messages and req.messages[-1].get("role") == "assistant":
            return str(req.conversation()[-1].get("content") or "")
        return ""

    async def _chat_stream(
        self, req: ChatCompletionRequest, prompts: list[_Prompt], seqs: list[_Seq],
        gather: _Gather, rid: str, created: int, echo: str,
    ) -> AsyncIterator[str]:  # fmt: skip
        choices = {s.index: _Choice(s) for s in seqs}
        done = False

        def chunk(
            choice: ChatCompletionResponseStreamChoice, usage: UsageInfo | None = None
        ) -> str:
            return _sse(ChatCompletionStreamResponse(
                id=rid, created=created, model=self.model.name, choices=[choice], usage=usage
            ))  # fmt: skip

        try:
            for s in seqs:  # vLLM's first chunk: the role (and an echo), no content yet
                yield chunk(ChatCompletionResponseStreamChoice(
                    index=s.index, delta=DeltaMessage(role="assistant", content=echo),
                ))  # fmt: skip
            async with contextlib.aclosing(gather.updates(len(seqs))) as updates:
                async for index, u in updates:
                    c = choices[index]
                    before = len(c.logprobs)
                    c.add(u)
                    if u.finish_reason == "error":
                        raise APIError(500, f"the request failed in the engine ({c.error})")
                    out = ChatCompletionResponseStreamChoice(
                        index=index, delta=DeltaMessage(content=u.text),
                        finish_reason=u.finish_reason, stop_reason=u.stop_reason,
                    )  # fmt: skip
                    if req.logprobs:
                        out.logprobs = self._chat_logprobs(
                            req, list(u.output.new_token_ids), c.logprobs[before:]
                        )
                    if req.return_token_ids:
                        out.token_ids = list(u.output.new_token_ids)
                    usage = None
                    if req.continuous_usage:
                        usage = self._usage(prompts, list(choices.values()), False)
                    yield chunk(out, usage)
            done = True
            if req.include_usage:
                yield _sse(ChatCompletionStreamResponse(
                    id=rid, created=created, model=self.model.name, choices=[],
                    usage=self._usage(prompts, list(choices.values()), False),
                ))  # fmt: skip
        except APIError as exc:
            yield _sse(error_body(exc.status, exc.message, exc.param))
        finally:
            if not done:
                for s in seqs:
                    self.loop.abort(s.rid)
        yield "data: [DONE]\n\n"

    # ---- tokenize ------------------------------------------------------------------------------

    def _tokenize(self, body: bytes) -> TokenizeResponse:
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

    async def tokenize(self, request: Request) -> Response:
        """POST /tokenize."""
        return _json(await run_in_threadpool(self._tokenize, await request.body()))

    def _detokenize(self, body: bytes) -> DetokenizeResponse:
        req = parse(DetokenizeRequest, body)
        self._check_model(req.model)
        self._check_ids(req.tokens, "tokens")
        tok = self._need_tokenizer("text cannot be decoded")
        return DetokenizeResponse(prompt=tok.decode(req.tokens))

    async def detokenize(self, request: Request) -> Response:
        """POST /detokenize."""
        return _json(await run_in_threadpool(self._detokenize, await request.body()))


def json_error(exc: APIError) -> JSONResponse:
    """The JSON response of an APIError."""
    return JSONResponse(error_body(exc.status, exc.message, exc.param), status_code=exc.status)
