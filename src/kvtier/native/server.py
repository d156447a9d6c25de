"""The native engine's OpenAI-compatible HTTP server (FastAPI) and the thread that drives it.

`Engine` is not thread-safe, so one background thread (`EngineLoop`) owns it: it takes new
requests, aborts and calls from a queue, steps the engine while there is work, and hands each
`RequestOutput` to the request's asyncio queue with `loop.call_soon_threadsafe`.

Usage::

    with EngineServer(engine, model_name="tiny") as server:   # starts the loop thread
        app = server.app                                        # mount in uvicorn / httpx

`serve()` is what `kvtier serve` runs: bind, build the engine (with kvtier when asked), serve
until SIGINT/SIGTERM, then close everything.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import math
import shutil
import signal
import socket
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvtier.config import KVTierConfig
from kvtier.errors import StartupError
from kvtier.native.config import EngineConfig
from kvtier.native.engine import Engine
from kvtier.native.sampling import SamplingParams
from kvtier.native.sequence import RequestOutput
from kvtier.native.serve_metrics import CONTENT_TYPE, ServeMetrics
from kvtier.native.tokenizer import Tokenizer

__all__ = [
    "APIError",
    "CompletionRequest",
    "EngineFailure",
    "EngineLoop",
    "EngineServer",
    "EngineUnavailable",
    "parse_completion_request",
    "serve",
]

log = logging.getLogger("kvtier.server")
T = TypeVar("T")

# ------------------------------------------------------------------------------------- errors


class APIError(Exception):
    """An HTTP error answered as OpenAI's error object; `param` names the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


class EngineUnavailable(RuntimeError):
    """The engine loop is not accepting work (stopped, or the engine failed)."""


@dataclass(frozen=True)
class EngineFailure:
    """Delivered instead of an output when a request cannot go on (status and reason)."""

    status: int
    message: str


_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    kind = _ERROR_TYPES.get(status, "APIError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def _error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


# ------------------------------------------------------------------------------ request parsing


@dataclass(frozen=True)
class CompletionRequest:
    """A validated `/v1/completions` body (one prompt; `max_tokens=None`: fill the context)."""

    prompt: str | list[int]
    model: str | None = None
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    stream: bool = False
    include_usage: bool = False
    continuous_usage_stats: bool = False
    return_token_ids: bool = False


_KNOWN = frozenset(
    {
        "model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stream",
        "stream_options", "ignore_eos", "stop_token_ids", "return_token_ids", "user",
        "min_tokens",
    }
)  # fmt: skip
# fields whose other values would change the result: accepted only at their neutral value
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "logprobs": (None,),
    "prompt_logprobs": (None,),
    "suffix": (None, ""),
    "stop": (None, "", []),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1),
    "logit_bias": (None, {}),
    "top_k": (None, 0, -1),
    "min_p": (None, 0),
}


_warned: set[str] = set()


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_field(body: Mapping[str, Any], name: str, default: int | None) -> int | None:
    value = body.get(name, default)
    if value is None or _is_int(value):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise APIError(400, f"{name}={value!r} is not an integer; send a whole number", name)


def _float_field(body: Mapping[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise APIError(400, f"{name}={value!r} is not a finite number; send e.g. {default}", name)
    return float(value)


def _bool_field(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise APIError(400, f"{name}={value!r} is not a boolean; send true or false", name)
    return value


def _token_list(value: object, name: str) -> list[int] | None:
    if isinstance(value, list) and all(_is_int(t) for t in value):
        return list(value)
    return None


def _parse_prompt(value: object) -> str | list[int]:
    if isinstance(value, str):
        return value
    ids = _token_list(value, "prompt")
    if ids is not None:
        return ids
    if isinstance(value, list) and len(value) == 1:
        # a batch of one: the single string or token list inside
        inner = value[0]
        if isinstance(inner, str):
            return inner
        ids = _token_list(inner, "prompt")
        if ids is not None:
            return ids
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, str | list) for p in value):
        raise APIError(
            400,
            f"prompt is a batch of {len(value)} prompts; this server takes one prompt per "
            "request: send each prompt in its own request",
            "prompt",
        )
    shown = type(value).__name__ if value is not None else "missing"
    raise APIError(
        400,
        f"prompt is {shown}; send a string or a list of token ids (integers)",
        "prompt",
    )


def parse_completion_request(body: object) -> CompletionRequest:
    """Validate a `/v1/completions` JSON body; raises `APIError(400)` naming the field and fix."""
    if not isinstance(body, dict):
        raise APIError(400, f"the body is a JSON {type(body).__name__}; send a JSON object")
    for name, neutral in _NEUTRAL.items():
        if name in body and body[name] not in neutral:
            raise APIError(
                400,
                f"{name}={json.dumps(body[name])} is not supported by the native server; "
                f"omit {name} or send {json.dumps(neutral[-1])}",
                name,
            )
    unknown = sorted(k for k in body if k not in _KNOWN and k not in _NEUTRAL)
    if unknown and not _warned.issuperset(unknown):
        # vLLM ignores unknown fields too; say so (once per field) instead of failing a client
        _warned.update(unknown)
        log.warning("ignoring unknown completion fields %s", unknown)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError(400, f"model={model!r} is not a string; send the served model name", "model")
    if "prompt" not in body:
        raise APIError(400, "prompt is missing; send a string or a list of token ids", "prompt")
    prompt = _parse_prompt(body["prompt"])
    if not prompt:
        raise APIError(400, "prompt is empty; send at least one character or token", "prompt")
    max_tokens = _int_field(body, "max_tokens", 16)
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, f"max_tokens={max_tokens} must be >= 1", "max_tokens")
    temperature = _float_field(body, "temperature", 1.0)
    if temperature < 0:
        raise APIError(400, f"temperature={temperature} must be >= 0 (0 = greedy)", "temperature")
    top_p = _float_field(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise APIError(400, f"top_p={top_p} must be in (0, 1]", "top_p")
    seed = _int_field(body, "seed", None)
    stop_ids = body.get("stop_token_ids")
    if stop_ids is None:
        stop_ids = []
    if _token_list(stop_ids, "stop_token_ids") is None:
        raise APIError(
            400, f"stop_token_ids={stop_ids!r} is not a list of token ids", "stop_token_ids"
        )
    ignore_eos = _bool_field(body, "ignore_eos")
    min_tokens = _int_field(body, "min_tokens", 0) or 0
    if min_tokens < 0:
        raise APIError(400, f"min_tokens={min_tokens} must be >= 0", "min_tokens")
    fits = max_tokens is not None and min_tokens <= max_tokens
    if min_tokens and not (ignore_eos and not stop_ids and fits):
        # with ignore_eos, no stop ids and min_tokens <= max_tokens it holds by construction
        raise APIError(
            400,
            f"min_tokens={min_tokens} is only supported with ignore_eos=true, no stop_token_ids "
            "and min_tokens <= max_tokens",
            "min_tokens",
        )
    options = body.get("stream_options")
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise APIError(400, f"stream_options={options!r} is not an object", "stream_options")
    bad = sorted(set(options) - {"include_usage", "continuous_usage_stats"})
    if bad:
        raise APIError(
            400,
            f"stream_options has unknown keys {bad}; use include_usage/continuous_usage_stats",
            "stream_options",
        )
    return CompletionRequest(
        prompt=prompt,
        model=model,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        ignore_eos=ignore_eos,
        stop_token_ids=tuple(stop_ids),
        stream=_bool_field(body, "stream"),
        include_usage=_bool_field(options, "include_usage"),
        continuous_usage_stats=_bool_field(options, "continuous_usage_stats"),
        return_token_ids=_bool_field(body, "return_token_ids"),
    )


# ---------------------------------------------------------------------------------- engine loop


@dataclass(frozen=True)
class _Submit:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    sink: Callable[[object], bool]
    arrival: float


@dataclass(frozen=True)
class _Abort:
    rid: str


@dataclass(frozen=True)
class _Call:
    fn: Callable[[Engine], Any]
    future: concurrent.futures.Future[Any]


@dataclass
class _Track:
    """What the loop knows of one live request: where outputs go and its token times."""

    sink: Callable[[object], bool]
    arrival: float
    first_at: float | None = None
    last_at: float | None = None
    gaps: list[float] = field(default_factory=list)


class EngineLoop:
    """The one thread that drives an `Engine`; every other thread talks to it through a queue.

    `sink(item)` is called on the loop thread with each `RequestOutput` (or an `EngineFailure`)
    and returns False when nobody listens any more, which aborts the request.
    """

    def __init__(
        self,
        engine: Engine,
        metrics: ServeMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
        idle_wait_s: float = 1.0,
        transfer_wait_s: float = 0.001,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.clock = clock
        self._idle_wait_s = idle_wait_s
        self._transfer_wait_s = transfer_wait_s
        self._cv = threading.Condition()
        self._inbox: deque[_Submit | _Abort | _Call] = deque()
        self._stopping = False
        self._closed = False  # set by the loop thread on exit: no command is taken after it
        self._idle = threading.Event()
        self._tracks: dict[str, _Track] = {}  # loop thread only
        self._finished: Counter[str] = Counter()  # finished requests by reason, loop thread only
        self.fatal: str | None = None
        self._thread = threading.Thread(target=self._run, name="kvtier-engine-loop", daemon=True)

    # ---- any thread ----------------------------------------------------------------------------

    def start(self) -> None:
        """Publish the first metrics snapshot and start the loop thread."""
        self._publish()
        self._thread.start()

    def submit(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        sink: Callable[[object], bool],
        arrival: float,
    ) -> None:
        """Queue a new request; raises EngineUnavailable when the loop no longer takes work."""
        self._put(_Submit(rid, prompt_ids, params, sink, arrival))

    def abort(self, rid: str) -> None:
        """Ask the loop to abort a request (a no-op once it finished or the loop stopped)."""
        with contextlib.suppress(EngineUnavailable):
            self._put(_Abort(rid))

    def call(self, fn: Callable[[Engine], T]) -> concurrent.futures.Future[T]:
        """Run `fn(engine)` on the loop thread between steps; its result comes in the future."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._put(_Call(fn, fut))
        return fut

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is queued, running, loading or holding blocks (drained)."""
        return self._idle.wait(timeout_s)

    def health(self) -> str | None:
        """None when the engine can serve, else why not (a failed step, a dead TP rank)."""
        if self.fatal is not None:
            return self.fatal
        if self._closed or not self._thread.is_alive():
            return "the engine loop is not running"
        for rank, proc in enumerate(getattr(self.engine.executor, "procs", [])):
            code = proc.poll()
            if code is not None:
                return f"TP rank {rank} (pid {proc.pid}) exited with code {code}"
        return None

    def stop(self, timeout_s: float = 30.0) -> None:
        """Fail what is in flight with 503 and stop the thread (the engine stays open)."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.error("engine loop did not stop within %.0f s (a step is stuck)", timeout_s)

    def _put(self, cmd: _Submit | _Abort | _Call) -> None:
        with self._cv:
            if self._closed or self._stopping:
                raise EngineUnavailable(self.fatal or "the server is shutting down")
            self._inbox.append(cmd)
            self._idle.clear()
            self._cv.notify()

    # ---- loop thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                cmds = self._take()
                if cmds is None:
                    break
                for cmd in cmds:
                    self._apply(cmd)
                if self.engine.has_unfinished_requests():
                    self._step()
                self._publish()
        except Exception as exc:
            # the scheduler's state after a half-done step is unknown: stop serving
            self.fatal = f"engine failed: {type(exc).__name__}: {exc}"
            log.exception(
                "engine failed; failing %d requests, the server cannot serve any more",
                len(self._tracks),
            )
        finally:
            self._shutdown()

    def _take(self) -> list[_Submit | _Abort | _Call] | None:
        eng = self.engine
        with self._cv:
            while True:
                if self._stopping:
                    return None
                if self._inbox:
                    break
                if not eng.has_unfinished_requests():
                    self._idle.set()
                    self._cv.wait(self._idle_wait_s)
                    continue
                if eng.last_step_tokens == 0:
                    # only transfers in flight (loads, delayed frees): give them a moment, but
                    # wake at once for a new request
                    self._cv.wait(self._transfer_wait_s)
                break
            cmds = list(self._inbox)
            self._inbox.clear()
        return cmds

    def _apply(self, cmd: _Submit | _Abort | _Call) -> None:
        if isinstance(cmd, _Submit):
            try:
                self.engine.add_request(cmd.prompt_ids, cmd.params, request_id=cmd.rid)
            except ValueError as exc:  # ConfigError is a ValueError too
                cmd.sink(EngineFailure(400, str(exc)))
                return
            self._tracks[cmd.rid] = _Track(cmd.sink, cmd.arrival)
        elif isinstance(cmd, _Abort):
            track = self._tracks.pop(cmd.rid, None)
            if self.engine.abort(cmd.rid) and track is not None:
                log.info("%s: aborted (client went away)", cmd.rid)
        elif cmd.future.set_running_or_notify_cancel():
            try:
                cmd.future.set_result(cmd.fn(self.engine))
            except Exception as exc:  # noqa: BLE001 - the caller gets it through the future
                cmd.future.set_exception(exc)

    def _step(self) -> None:
        outs = self.engine.step()
        now = self.clock()
        for out in outs:
            if out.finished and out.finish_reason is not None:
                self._finished[out.finish_reason] += 1
            track = self._tracks.get(out.request_id)
            if track is None:
                continue
            if track.first_at is None:
                track.first_at = now
            elif track.last_at is not None:
                track.gaps.extend([now - track.last_at] * len(out.new_token_ids))
            track.last_at = now
            if out.finished:
                del self._tracks[out.request_id]
                self._record(out, track, now)
            if not track.sink(out) and not out.finished:
                self._tracks.pop(out.request_id, None)
                self.engine.abort(out.request_id)

    def _record(self, out: RequestOutput, track: _Track, now: float) -> None:
        ttft = None if track.first_at is None else track.first_at - track.arrival
        e2e = now - track.arrival
        self.metrics.observe_request(ttft, e2e, track.gaps)
        log.info(
            "%s: prompt=%d cached=%d (hbm=%d external=%d) completion=%d finish=%s "
            "ttft=%.3fs e2e=%.3fs",
            out.request_id,
            out.prompt_tokens,
            out.num_cached_tokens + out.num_external_tokens,
            out.num_cached_tokens,
            out.num_external_tokens,
            len(out.output_token_ids),
            out.finish_reason,
            ttft or 0.0,
            e2e,
        )

    def _publish(self) -> None:
        self.metrics.publish(self.engine.stats(), self._finished)

    def _shutdown(self) -> None:
        with self._cv:
            self._closed = True
            pending = list(self._inbox)
            self._inbox.clear()
            self._idle.set()
        status, reason = (500, self.fatal) if self.fatal else (503, "the server is shutting down")
        for track in self._tracks.values():
            track.sink(EngineFailure(status, reason))
        self._tracks.clear()
        for cmd in pending:
            if isinstance(cmd, _Submit):
                cmd.sink(EngineFailure(503, reason))
            elif isinstance(cmd, _Call) and cmd.future.set_running_or_notify_cancel():
                cmd.future.set_exception(EngineUnavailable(reason))


# ---------------------------------------------------------------------------------- the server


class _RequestStream:
    """The asyncio side of one request: the loop thread puts outputs, the handler awaits them."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.queue: asyncio.Queue[object] = asyncio.Queue()

    def put(self, item: object) -> bool:
        """Called on the engine loop thread; False once the event loop is gone."""
        try:
            self._loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop closed: nobody will read this request
            return False
        return True

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Outputs until the finished one; an EngineFailure raises APIError."""
        while True:
            item = await self.queue.get()
            if isinstance(item, EngineFailure):
                raise APIError(item.status, item.message)
            assert isinstance(item, RequestOutput)
            yield item
            if item.finished:
                return


class _Detokenizer:
    """Incremental text over a sliding window (vLLM's scheme): decode the tokens since the last
    emitted boundary with and without the new ones and emit the difference; a trailing
    replacement character (an incomplete UTF-8 sequence) waits for the next token."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens whose text was emitted

    def update(self, token_ids: list[int], final: bool) -> str:
        """The text that `token_ids` (all output so far) adds to what was emitted."""
        if self.tokenizer is None:
            return ""
        # decoding from a window start keeps the cost per token constant; starting a little
        # before the emitted boundary keeps word-joining decoders consistent
        prefix_text = self.tokenizer.decode(token_ids[self._prefix : self._read])
        new_text = self.tokenizer.decode(token_ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(token_ids)
        return new_text[len(prefix_text) :]


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client disconnects (or, after the response, when the server is done)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _sse_line(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class EngineServer:
    """An Engine behind an OpenAI-compatible FastAPI app; `close()` stops loop and engine."""

    def __init__(
        self,
        engine: Engine,
        *,
        model_name: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        close_engine: bool = True,
    ) -> None:
        self.engine = engine
        self.model_name = model_name or engine.model_dir
        self.clock = clock
        self.close_engine = close_engine
        has_tok = (Path(engine.model_dir) / "tokenizer.json").is_file()
        # loaded here, before the loop thread exists: afterwards it is only read
        self.tokenizer: Tokenizer | None = engine.tokenizer if has_tok else None
        collector = getattr(engine.connector, "collector", None) if engine.has_connector else None
        self.metrics = ServeMetrics(self.model_name, collector)
        self.loop = EngineLoop(engine, self.metrics, clock=clock)
        self.app = self._build_app()
        self._started = False
        self._closed = False

    def start(self) -> EngineServer:
        """Start the engine loop thread (idempotent)."""
        if not self._started:
            self._started = True
            self.loop.start()
        return self

    def close(self) -> None:
        """Stop the loop thread, then close the engine (TP workers, connector); idempotent."""
        if self._closed:
            return
        self._closed = True
        self.loop.stop()
        if self.close_engine:
            self.engine.close()

    def __enter__(self) -> EngineServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- request handling ----------------------------------------------------------------------

    def prompt_ids(self, req: CompletionRequest) -> list[int]:
        """Token ids of the prompt, checked against the vocabulary and the context length."""
        if isinstance(req.prompt, str):
            if self.tokenizer is None:
                raise APIError(
                    400,
                    "the model directory has no tokenizer.json, so prompt must be token ids",
                    "prompt",
                )
            ids = self.tokenizer.encode(req.prompt)
        else:
            ids = list(req.prompt)
            vocab = self.engine.model_config.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise APIError(
                    400, f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})",
                    "prompt",
                )  # fmt: skip
        limit = self.engine.max_model_len
        if len(ids) >= limit:
            raise APIError(
                400,
                f"prompt has {len(ids)} tokens but max_model_len is {limit} (prompt plus at least "
                f"one generated token must fit); shorten the prompt{self._room_hint()}",
                "prompt",
            )
        if req.max_tokens is not None and len(ids) + req.max_tokens > limit:
            raise APIError(
                400,
                f"prompt ({len(ids)} tokens) + max_tokens ({req.max_tokens}) = "
                f"{len(ids) + req.max_tokens} exceeds max_model_len={limit}; "
                f"set max_tokens <= {limit - len(ids)}",
                "max_tokens",
            )
        vocab = self.engine.model_config.vocab_size
        bad = [t for t in req.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise APIError(
                400, f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab})",
                "stop_token_ids",
            )  # fmt: skip
        return ids

    def _room_hint(self) -> str:
        cfg = self.engine.config
        if self.engine.max_model_len < self.engine.model_config.max_position:
            # the KV pool, not the model, sets the limit
            return f" or restart the server with more than --hbm-blocks {cfg.num_blocks}"
        return ""

    def _params(self, req: CompletionRequest, n_prompt: int) -> SamplingParams:
        max_tokens = req.max_tokens or self.engine.max_model_len - n_prompt
        return SamplingParams(
            temperature=req.temperature,
            top_p=req.top_p,
            max_tokens=max_tokens,
            seed=req.seed,
            ignore_eos=req.ignore_eos,
            stop_token_ids=req.stop_token_ids,
        )

    def _usage(self, out: RequestOutput) -> dict[str, Any]:
        completion = len(out.output_token_ids)
        return {
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": out.prompt_tokens + completion,
            # vLLM's meaning: HBM prefix hit plus tokens the connector loaded
            "prompt_tokens_details": {
                "cached_tokens": out.num_cached_tokens + out.num_external_tokens
            },
        }

    async def completions(self, request: Request) -> Response:
        """POST /v1/completions."""
        arrival = self.clock()
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(400, f"the body is not valid JSON ({exc}); send a JSON object") from None
        req = parse_completion_request(body)
        if req.model is not None and req.model != self.model_name:
            raise APIError(
                404,
                f"model {req.model!r} is not served here; use {self.model_name!r} (GET /v1/models)",
                "model",
            )
        ids = self.prompt_ids(req)
        params = self._params(req, len(ids))
        reason = self.loop.health()
        if reason is not None:
            raise APIError(503, f"the engine cannot serve: {reason}")
        rid = f"cmpl-{uuid.uuid4().hex}"
        stream = _RequestStream(asyncio.get_running_loop())
        try:
            self.loop.submit(rid, ids, params, stream.put, arrival)
        except EngineUnavailable as exc:
            raise APIError(503, f"the engine cannot serve: {exc}") from None
        created = int(time.time())
        if req.stream:
            return StreamingResponse(
                self._sse(req, rid, created, stream), media_type="text/event-stream"
            )
        return await self._complete(request, req, rid, created, stream)

    async def _complete(
        self,
        request: Request,
        req: CompletionRequest,
        rid: str,
        created: int,
        stream: _RequestStream,
    ) -> Response:
        async def last() -> RequestOutput:
            final = None
            async with contextlib.aclosing(stream.outputs()) as outs:
                async for out in outs:
                    final = out
            assert final is not None
            return final

        result = asyncio.ensure_future(last())
        gone = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not result.done():
                result.cancel()
                self.loop.abort(rid)
        if not result.done() or result.cancelled():
            return Response(status_code=499)  # the client is gone; nobody reads this
        out = result.result()  # raises APIError for an engine failure
        choice: dict[str, Any] = {
            "index": 0,
            "text": self._decode(out.output_token_ids),
            "logprobs": None,
            "finish_reason": out.finish_reason,
        }
        if req.return_token_ids:
            choice["token_ids"] = list(out.output_token_ids)
        return JSONResponse(
            {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": [choice],
                "usage": self._usage(out),
            }
        )

    def _decode(self, ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(ids)

    async def _sse(
        self, req: CompletionRequest, rid: str, created: int, stream: _RequestStream
    ) -> AsyncIterator[str]:
        head = {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": self.model_name,
        }
        detok = _Detokenizer(self.tokenizer)
        final: RequestOutput | None = None
        try:
            async with contextlib.aclosing(stream.outputs()) as outs:
                async for out in outs:
                    final = out if out.finished else None
                    chunk: dict[str, Any] = {**head, "choices": [self._delta(req, out, detok)]}
                    if req.include_usage:
                        chunk["usage"] = self._usage(out) if req.continuous_usage_stats else None
                    yield _sse_line(chunk)
            if req.include_usage and final is not None:
                yield _sse_line({**head, "choices": [], "usage": self._usage(final)})
        except APIError as exc:
            yield _sse_line(error_body(exc.status, exc.message, exc.param))
        finally:
            # a disconnect cancels this generator mid-stream: the engine must drop the request
            if final is None:
                self.loop.abort(rid)
        yield "data: [DONE]\n\n"

    def _delta(
        self, req: CompletionRequest, out: RequestOutput, detok: _Detokenizer
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": 0,
            "text": detok.update(out.output_token_ids, out.finished),
            "logprobs": None,
            "finish_reason": out.finish_reason if out.finished else None,
        }
        if req.return_token_ids:
            choice["token_ids"] = list(out.new_token_ids)
        return choice

    # ---- the app -------------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="kvtier native server", docs_url=None, redoc_url=None)
        app.state.server = self

        @app.exception_handler(APIError)
        async def _api_error(request: Request, exc: APIError) -> JSONResponse:
            return _error_response(exc.status, exc.message, exc.param)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self.completions(request)

        @app.get("/v1/models")
        async def models() -> JSONResponse:
            card = {
                "id": self.model_name,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "kvtier",
                "root": self.engine.model_dir,
                "max_model_len": self.engine.max_model_len,
            }
            return JSONResponse({"object": "list", "data": [card]})

        @app.get("/health")
        async def health() -> JSONResponse:
            reason = self.loop.health()
            if reason is not None:
                return _error_response(503, reason)
            return JSONResponse({"status": "ok"})

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache() -> JSONResponse:
            try:
                fut = self.loop.call(lambda eng: eng.reset_prefix_cache())
            except EngineUnavailable as exc:
                raise APIError(503, f"the engine cannot serve: {exc}") from None
            await asyncio.wrap_future(fut)
            return JSONResponse({"status": "ok"})

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(self.metrics.render(), media_type=CONTENT_TYPE)

        return app


# ------------------------------------------------------------------------------------ serve()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def bind_socket(host: str, port: int) -> socket.socket:
    """A bound (not yet listening) TCP socket; port 0 picks a free one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise StartupError(
            f"cannot bind {host}:{port} ({exc.strerror}); pick another --port or --host"
        ) from None
    return sock


def serve(
    model_dir: str | Path,
    engine_config: EngineConfig,
    *,
    offload: KVTierConfig | None,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    log_level: str = "info",
) -> None:
    """Serve `model_dir` over HTTP until SIGINT/SIGTERM, then close the engine and its ranks.

    `offload=None` runs without kvtier. Startup errors (bad config, port in use, a rank that
    fails to start) raise before anything is served.
    """
    import uvicorn

    from kvtier.lookup import make_run_dir
    from kvtier.native.offload import connector_spec

    main = threading.current_thread() is threading.main_thread()
    # SIGTERM during startup or serving unwinds like Ctrl-C, so every finally below runs
    previous = signal.signal(signal.SIGTERM, _interrupt) if main else None
    sock = bind_socket(host, port)
    run_dir: Path | None = None
    server: EngineServer | None = None
    try:
        spec = None
        if offload is not None:
            run_dir = make_run_dir(base=offload.lookup_dir)
            spec = connector_spec(offload, model_dir, run_dir)
        engine = Engine(model_dir, engine_config, spec)
        try:
            server = EngineServer(engine, model_name=served_model_name or str(model_dir)).start()
        except BaseException:
            engine.close()
            raise
        sock.listen(2048)  # from here connections queue until uvicorn accepts them
        bound_host, bound_port = sock.getsockname()[:2]
        log.info(
            "kvtier serve: listening on http://%s:%d (model %s, TP=%d, hbm blocks=%d x %d tokens, "
            "max_model_len=%d, offload %s)",
            bound_host, bound_port, server.model_name, engine_config.tensor_parallel_size,
            engine_config.num_blocks, engine_config.block_size, engine.max_model_len,
            "on" if offload is not None else "off",
        )  # fmt: skip
        config = uvicorn.Config(
            server.app,
            log_level=log_level,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=5,
        )
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:
        log.info("kvtier serve: interrupted")
    finally:
        try:
            if server is not None:
                server.close()
        finally:
            sock.close()
            if run_dir is not None:
                shutil.rmtree(run_dir, ignore_errors=True)
            if main:
                signal.signal(signal.SIGTERM, previous)
    log.info("kvtier serve: shut down cleanly")
