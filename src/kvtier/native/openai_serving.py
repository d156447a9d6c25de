"""The OpenAI endpoints' output side: the engine requests a body became (`openai_requests`, on
a worker thread, so `/health` never waits behind a 10 MiB prompt) are submitted to the engine
loop, and their updates become OpenAI responses (vLLM's shapes), streamed as SSE or gathered;
`n` of `best_of` sequences are picked by cumulative logprob.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from kvtier.native.detokenizer import TextStream
from kvtier.native.engine_loop import (
    DuplicateRequestId,
    EngineFailure,
    EngineLoop,
    EngineUnavailable,
    Overloaded,
    SeqSpec,
    SeqUpdate,
    Submission,
)
from kvtier.native.openai_requests import ModelInfo, Prompt, RequestBuilder, Seq, ServerLimits
from kvtier.native.protocol import (
    APIError,
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    CompletionLogProbs,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    DeltaMessage,
    PromptTokenUsageInfo,
    UsageInfo,
    error_body,
)
from kvtier.native.protocol_requests import (
    ChatCompletionRequest,
    CompletionRequest,
)
from kvtier.native.sampling import TokenLogprobs
from kvtier.native.serve_metrics import ServeMetrics
from kvtier.native.tokenizer import Tokenizer

log = logging.getLogger("kvtier.server")
RETRY_AFTER_S = 1  # what a client refused for a full queue is told to wait


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, read as it arrives and refused (413) as soon as it passes `limit`
    bytes: a client cannot make the server buffer more than the limit."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit, int(declared))
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit, None)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int, declared: int | None) -> APIError:
    got = f"{declared} bytes" if declared is not None else "more"
    # the rest of the body is never read: the connection closes after the answer
    return APIError(
        413, f"the request body is {got}; this server takes at most {limit} bytes "
        "(kvtier serve --max-request-body-size)", None, {"Connection": "close"},
    )  # fmt: skip


@dataclass
class _Choice:
    """The client's view of one sequence, filled from its updates."""

    seq: Seq
    token_ids: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)  # joined once at the end: linear
    length: int = 0  # characters in pieces
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cached: int = 0
    offsets: list[int] = field(default_factory=list)
    retention: dict[str, object] | None = None  # what the prompt's retention hint was granted

    def add(self, u: SeqUpdate) -> None:
        # a token's text starts where the text stood before it (held-back text lands later)
        self.offsets.extend([self.length] * len(u.output.new_token_ids))
        self.token_ids.extend(u.output.new_token_ids)
        self.pieces.append(u.text)
        self.length += len(u.text)
        if u.output.logprobs is not None:
            self.logprobs.append(u.output.logprobs)
        self.cached = u.output.num_cached_tokens + u.output.num_external_tokens
        if u.finished:
            self.finish_reason, self.stop_reason = u.finish_reason, u.stop_reason
            self.retention = u.output.retention

    @property
    def text(self) -> str:
        """All text so far."""
        return "".join(self.pieces)

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
        limits: ServerLimits | None = None,
    ) -> None:
        self.loop = loop
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.model = model
        self.clock = clock
        self.limits = limits or ServerLimits()
        self.requests = RequestBuilder(tokenizer, model, self.limits)

    async def _body(self, request: Request) -> bytes:
        return await read_body(request, self.limits.max_body_bytes)

    # ---- running (event loop) ------------------------------------------------------------------

    def _submit(
        self, req: Any, rid: str, seqs: list[Seq], prompts: list[Prompt], arrival: float
    ) -> tuple[_Gather, Submission]:
        reason = self.loop.health()
        if reason is not None:
            raise APIError(503, f"the engine cannot serve: {reason}")
        gather = _Gather(asyncio.get_running_loop())
        specs = [
            SeqSpec(
                prompts[s.prompt].ids, s.params, gather.sink(s.index),
                TextStream(
                    self.tokenizer, req.stop_strings, include_stop=req.include_stop_str_in_output,
                    skip_special_tokens=req.skip_special_tokens,
                ),
                prompts[s.prompt].retention,
            )
            for s in seqs
        ]  # fmt: skip
        try:
            sub = self.loop.submit(rid, specs, arrival)
        except DuplicateRequestId:
            shown = repr(rid) if len(rid) <= 64 else f"{rid[:64]!r}... ({len(rid)} characters)"
            raise APIError(
                409, f"request_id {shown} is in use by a request in flight; send a request_id "
                "no request in flight has (or none: the server makes one)", "request_id",
            ) from None  # fmt: skip
        except Overloaded as exc:
            raise APIError(
                503, f"the server is at its limit of {exc.limit} queued sequences (kvtier serve "
                f"--max-queued-seqs; {exc.queued} queued, this request adds {exc.asked}); "
                f"retry after {RETRY_AFTER_S} s", None, {"Retry-After": str(RETRY_AFTER_S)},
            ) from None  # fmt: skip
        except EngineUnavailable as exc:
            raise APIError(503, f"the engine cannot serve: {exc}") from None
        self.metrics.observe_params(req.n)
        return gather, sub

    async def _collect(
        self, request: Request, gather: _Gather, seqs: list[Seq], sub: Submission
    ) -> list[_Choice] | None:
        """Every sequence to its end; None when the client went away. On a failure (one
        error for the request) or a disconnect the submission's other sequences are ended."""
        choices = {s.index: _Choice(s) for s in seqs}

        async def run() -> None:
            async with contextlib.aclosing(gather.updates(len(seqs))) as updates:
                async for index, update in updates:
                    choices[index].add(update)

        work = asyncio.ensure_future(run())
        gone = asyncio.ensure_future(_wait_disconnect(request))
        complete = False
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if work.done():
                work.result()  # raises APIError for a failed sequence or the engine's failure
                complete = True
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
            if not complete:
                self.loop.abort(sub)
        return [choices[s.index] for s in seqs] if complete else None

    def _best(self, req: Any, choices: list[_Choice], per_prompt: int) -> list[_Choice]:
        if per_prompt == req.n:
            return choices
        out = []
        for p in range(len(choices) // per_prompt):
            group = choices[p * per_prompt : (p + 1) * per_prompt]
            out.extend(sorted(group, key=lambda c: -c.cumulative_logprob)[: req.n])
        return out

    def _usage(self, prompts: list[Prompt], choices: list[_Choice], echo_only: bool) -> UsageInfo:
        n_prompt = sum(len(p.ids) for p in prompts)
        completion = 0 if echo_only else sum(len(c.token_ids) for c in choices)
        first = {}
        for c in choices:
            first.setdefault(c.seq.prompt, min(c.cached, len(prompts[c.seq.prompt].ids)))
        granted = [c.retention for c in choices if c.retention is not None]
        return UsageInfo(
            prompt_tokens=n_prompt,
            completion_tokens=completion,
            total_tokens=n_prompt + completion,
            prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=sum(first.values())),
            kvtier_retention=granted[0] if granted else None,
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
        body = await self._body(request)
        req, prompts, seqs = await run_in_threadpool(self.requests.completion, body)
        rid = self.requests.request_id(req, "cmpl")
        gather, sub = self._submit(req, rid, seqs, prompts, arrival)
        created = int(time.time())
        if req.stream:
            return StreamingResponse(
                self._completion_stream(req, prompts, seqs, gather, sub, created),
                media_type="text/event-stream",
            )
        choices = await self._collect(request, gather, seqs, sub)
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
        self, req: CompletionRequest, prompts: list[Prompt], seqs: list[Seq], gather: _Gather,
        sub: Submission, created: int,
    ) -> AsyncIterator[str]:  # fmt: skip
        choices = {s.index: _Choice(s) for s in seqs}
        done = False
        rid = sub.rid
        # echo with max_tokens 0 runs one token (the engine needs one): it is not the client's
        echo_only = bool(req.echo) and req.max_tokens == 0

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
                    if echo_only:
                        if u.finish_reason is not None:
                            yield chunk(CompletionResponseChoice(
                                index=index, text="", finish_reason=u.finish_reason,
                                stop_reason=u.stop_reason,
                            ))  # fmt: skip
                        continue
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
                usage = self._usage(prompts, list(choices.values()), echo_only)
                yield _sse(CompletionStreamResponse(
                    id=rid, created=created, model=self.model.name, choices=[], usage=usage
                ))  # fmt: skip
        except APIError as exc:
            yield _sse(error_body(exc.status, exc.message, exc.param))
        finally:
            if not done:  # a failure, or a disconnect cancelling this generator mid-stream
                self.loop.abort(sub)
        yield "data: [DONE]\n\n"

    # ---- chat ----------------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        """POST /v1/chat/completions."""
        arrival = self.clock()
        body = await self._body(request)
        req, prompts, seqs = await run_in_threadpool(self.requests.chat, body)
        rid = self.requests.request_id(req, "chatcmpl")
        gather, sub = self._submit(req, rid, seqs, prompts, arrival)
        created = int(time.time())
        echo = self._chat_echo(req)
        if req.stream:
            return StreamingResponse(
                self._chat_stream(req, prompts, seqs, gather, sub, created, echo),
                media_type="text/event-stream",
            )
        choices = await self._collect(request, gather, seqs, sub)
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
        self, req: ChatCompletionRequest, prompts: list[Prompt], seqs: list[Seq],
        gather: _Gather, sub: Submission, created: int, echo: str,
    ) -> AsyncIterator[str]:  # fmt: skip
        choices = {s.index: _Choice(s) for s in seqs}
        done = False
        rid = sub.rid

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
                self.loop.abort(sub)
        yield "data: [DONE]\n\n"

    # ---- tokenize ------------------------------------------------------------------------------

    async def tokenize(self, request: Request) -> Response:
        """POST /tokenize."""
        return _json(await run_in_threadpool(self.requests.tokenize, await self._body(request)))

    async def detokenize(self, request: Request) -> Response:
        """POST /detokenize."""
        return _json(await run_in_threadpool(self.requests.detokenize, await self._body(request)))


def json_error(exc: APIError) -> JSONResponse:
    """The JSON response of an APIError."""
    return JSONResponse(
        error_body(exc.status, exc.message, exc.param), status_code=exc.status, headers=exc.headers
    )
