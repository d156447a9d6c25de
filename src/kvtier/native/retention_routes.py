"""The native server's retention admin API: `POST /kvtier/{retain,release,prefetch,forget}` and
`GET /kvtier/retention`.

A body names one target: `prompt` (text or token ids) or `messages` (rendered as a chat request
would be), or `prompt_cache_key` (a conversation), or `"all": true` with `user` (every
conversation of that user); `user` scopes a key to its tenant, `ttl_s` sets retain's TTL. The
routes answer 403 unless the server was given an admin key (`KVTIER_ADMIN_KEY`) and the
request carries it as `Authorization: Bearer <key>`: forget deletes other clients' chunks.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kvtier.native.engine_loop import EngineLoop, EngineUnavailable
from kvtier.native.openai_requests import RequestBuilder
from kvtier.native.protocol import APIError
from kvtier.offload.retention import MAX_SESSION_CHARS, positive_seconds

ADMIN_KEY_ENV = "KVTIER_ADMIN_KEY"
_OPS = ("retain", "release", "prefetch", "forget")
_MAX_BODY = 16 << 20


def add_retention_routes(
    app: FastAPI, loop: EngineLoop, requests: RequestBuilder, admin_key: str | None
) -> None:
    """Mount the retention admin routes on `app` (the engine's connector must take them)."""

    def check(request: Request) -> None:
        if not admin_key:
            raise APIError(
                403, f"the retention admin API is off: start the server with {ADMIN_KEY_ENV} "
                "set to a secret and send it as 'Authorization: Bearer <secret>'",
            )  # fmt: skip
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {admin_key}".encode()):
            raise APIError(401, "the retention admin API needs 'Authorization: Bearer <key>'")

    async def call(fn: Callable[[Any], Any]) -> Any:
        try:
            fut = loop.call(fn)
        except EngineUnavailable as exc:
            raise APIError(503, f"the engine cannot serve: {exc}") from None
        return await asyncio.wrap_future(fut)

    def admin_of(engine: Any) -> Callable[..., dict[str, Any]]:
        admin = getattr(engine.connector, "retention_admin", None)
        if admin is None:
            raise APIError(
                400, "this server runs without kvtier's connector (--no-offload): nothing "
                "is retained",
            )  # fmt: skip
        return admin

    async def run(request: Request, op: str) -> JSONResponse:
        check(request)
        body = await request.body()
        if len(body) > _MAX_BODY:
            raise APIError(413, f"the body is over {_MAX_BODY} bytes")
        target = _target(body, requests)

        def job(engine: Any) -> dict[str, Any]:
            try:
                return admin_of(engine)(op, **target)
            except ValueError as exc:
                raise APIError(400, str(exc)) from None

        return JSONResponse(await call(job))

    for op in _OPS:

        async def route(request: Request, op: str = op) -> JSONResponse:
            return await run(request, op)

        app.add_api_route(f"/kvtier/{op}", route, methods=["POST"], name=f"kvtier_{op}")

    @app.get("/kvtier/retention")
    async def retention_stats(request: Request) -> JSONResponse:
        check(request)
        return JSONResponse(await call(lambda engine: admin_of(engine)("stats")))


def _target(body: bytes, requests: RequestBuilder) -> dict[str, Any]:
    """The admin body's target as `run_admin` keywords (a prompt tokenized as the server does)."""
    try:
        doc = json.loads(body or b"{}")
    except ValueError as exc:
        raise APIError(400, f"the body is not JSON: {exc}") from None
    except RecursionError:
        raise APIError(400, "the body nests too deep; send a flat JSON object") from None
    if not isinstance(doc, dict):
        raise APIError(400, "the body must be a JSON object")
    user = doc.get("user") or ""
    key = doc.get("prompt_cache_key")
    ttl = doc.get("ttl_s")
    if not isinstance(user, str) or (key is not None and not isinstance(key, str)):
        raise APIError(400, "user and prompt_cache_key must be strings")
    if len(user) > MAX_SESSION_CHARS or (key is not None and len(key) > MAX_SESSION_CHARS):
        raise APIError(400, f"user and prompt_cache_key are at most {MAX_SESSION_CHARS} characters")
    whole = doc.get("all", False)
    if not isinstance(whole, bool):
        raise APIError(400, f"all is {whole!r}; send true or false", "all")
    if whole and not user:
        raise APIError(400, "all: true acts on one tenant's conversations: name it in user", "user")
    if ttl is not None and not positive_seconds(ttl):
        raise APIError(400, f"ttl_s is {ttl!r}; send a finite number of seconds > 0", "ttl_s")
    prompt = None
    if doc.get("prompt") is not None or doc.get("messages") is not None:
        prompt = _prompt_ids(doc, requests)
    return {
        "prompt": prompt,
        "session": key,
        "tenant": user,
        "ttl_s": None if ttl is None else float(ttl),
        "whole_tenant": whole,
    }


def _prompt_ids(doc: dict[str, Any], requests: RequestBuilder) -> list[int]:
    p = doc.get("prompt")
    if isinstance(p, list):
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            raise APIError(400, "prompt must be text or a list of token ids", "prompt")
        requests._check_ids(p, "prompt")
        return list(p)
    sub = {k: doc[k] for k in ("prompt", "messages", "add_special_tokens") if k in doc}
    return requests.tokenize(json.dumps(sub).encode()).tokens
