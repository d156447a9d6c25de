"""The native engine's OpenAI-compatible HTTP app (FastAPI).

Usage::

    with EngineServer(engine, model_name="tiny") as server:   # starts the engine loop thread
        app = server.app                                        # mount in uvicorn / httpx

Routes: `/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/tokenize`, `/detokenize`,
`/health`, `/ping`, `/version`, `/metrics`, `/reset_prefix_cache`, `/docs`. Every error,
unknown routes included, is OpenAI's error object; no traceback or source path reaches a
client. `kvtier.native.launcher.serve` runs it as `kvtier serve`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvtier.errors import StartupError
from kvtier.native.engine import Engine
from kvtier.native.engine_loop import DEFAULT_STALL_TIMEOUT_S, EngineLoop, EngineUnavailable
from kvtier.native.openai_requests import ModelInfo, ServerLimits
from kvtier.native.openai_serving import OpenAIServing, json_error
from kvtier.native.protocol import APIError, ModelCard, ModelList, error_body
from kvtier.native.protocol_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from kvtier.native.retention_routes import ADMIN_KEY_ENV, add_retention_routes
from kvtier.native.sequence import loggable
from kvtier.native.serve_metrics import CONTENT_TYPE, ServeMetrics
from kvtier.native.tokenizer import Tokenizer

__all__ = ["APIError", "EngineServer", "ServerLimits", "bind_socket"]

log = logging.getLogger("kvtier.server")

# the request bodies the OpenAPI document (/openapi.json, /docs) describes: the routes read
# their bodies themselves (on a worker thread, under the size limit), so FastAPI cannot see them
REQUEST_BODIES = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}

# served on 404 and in docs/native-server.md: what this server answers and what it refuses
UNSUPPORTED_ROUTES = {
    "/v1/responses": "the Responses API is not implemented; use /v1/chat/completions",
    "/v1/embeddings": "the native engine serves generation only",
    "/v1/audio/transcriptions": "the native engine serves text only",
}


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


def _room_hint(engine: Engine) -> str:
    if engine.max_model_len < engine.model_config.max_position:
        # the KV pool, not the model, sets the limit
        return f" or restart the server with more than --hbm-blocks {engine.config.num_blocks}"
    return ""


class EngineServer:
    """An Engine behind an OpenAI-compatible FastAPI app; `close()` stops loop and engine."""

    def __init__(
        self,
        engine: Engine,
        *,
        model_name: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        close_engine: bool = True,
        stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
        on_fatal: Callable[[str], None] | None = None,
        limits: ServerLimits | None = None,
        admin_key: str | None = None,
    ) -> None:
        self.engine = engine
        self.limits = limits or ServerLimits()
        self.model_name = model_name or engine.model_dir
        self.close_engine = close_engine
        has_tok = (Path(engine.model_dir) / "tokenizer.json").is_file()
        # loaded here, before the loop thread exists: afterwards it is only read
        self.tokenizer: Tokenizer | None = engine.tokenizer if has_tok else None
        collector = getattr(engine.connector, "collector", None) if engine.has_connector else None
        self.metrics = ServeMetrics(self.model_name, collector, engine.max_model_len)
        self.loop = EngineLoop(
            engine, self.metrics, clock=clock, stall_timeout_s=stall_timeout_s, on_fatal=on_fatal,
            max_queued_seqs=self.limits.max_queued_seqs,
        )  # fmt: skip
        self.metrics.set_stall_source(self.loop.stall_seconds, stall_timeout_s)
        info = ModelInfo(
            self.model_name, engine.max_model_len, engine.model_config.vocab_size,
            _room_hint(engine),
        )  # fmt: skip
        self.serving = OpenAIServing(
            self.loop, self.metrics, self.tokenizer, info, clock, self.limits
        )
        # the retention admin API's secret (`native/retention_routes.py`); None: the API is off
        self.admin_key = admin_key if admin_key is not None else os.environ.get(ADMIN_KEY_ENV)
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

    # ---- the app -------------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        from kvtier import __version__

        app = FastAPI(title="kvtier native server", version=__version__, redoc_url=None)
        app.state.server = self
        serving = self.serving

        _add_error_handlers(app)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await serving.completions(request)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Response:
            return await serving.chat(request)

        @app.post("/tokenize")
        async def tokenize(request: Request) -> Response:
            return await serving.tokenize(request)

        @app.post("/detokenize")
        async def detokenize(request: Request) -> Response:
            return await serving.detokenize(request)

        @app.get("/v1/models")
        async def models() -> Response:
            # root is the served name: the model's directory stays the operator's business
            card = ModelCard(
                id=self.model_name, root=self.model_name, max_model_len=self.engine.max_model_len
            )
            return Response(ModelList(data=[card]).model_dump_json(), media_type="application/json")

        @app.get("/health")
        async def health() -> Response:
            reason = self.loop.health()
            if reason is not None:
                return JSONResponse(error_body(503, reason), status_code=503)
            return JSONResponse({"status": "ok"})

        @app.get("/ping")
        async def ping() -> Response:
            return await health()

        @app.post("/ping")
        async def ping_post() -> Response:
            return await health()

        @app.get("/version")
        async def version() -> JSONResponse:
            return JSONResponse({"version": __version__})

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

        add_retention_routes(app, self.loop, serving.requests, self.admin_key)

        app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
        return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error the API answers as an OpenAI error body: kvtier's own, Starlette's (an
    unknown route names the fix), and anything else as a 500 whose detail stays in the log."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return json_error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        path = request.url.path
        shown = path if len(path) <= 200 else path[:200] + "..."
        if exc.status_code == 404:
            why = UNSUPPORTED_ROUTES.get(path)
            message = (
                f"{path} is not supported by the native server: {why}"
                if why
                else f"no route {request.method} {shown}; see /docs"
            )
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {shown}"
        return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        # the detail (exception text, traceback, paths) goes to the log only, under an id
        # the client gets to quote
        error_id = uuid.uuid4().hex[:16]
        log.error(
            "%s %s failed (error id %s)", request.method, loggable(request.url.path),
            error_id, exc_info=exc,
        )  # fmt: skip
        body = error_body(
            500, f"internal server error (error id {error_id}); the server log has the cause"
        )
        return JSONResponse(body, status_code=500)


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document with the request bodies the routes parse themselves (cached)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    ref = "#/components/schemas/{model}"
    for path, model in REQUEST_BODIES.items():
        schema = model.model_json_schema(ref_template=ref)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        doc["paths"][path]["post"]["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": ref.format(model=model.__name__)}}},
        }
    app.openapi_schema = doc
    return doc
