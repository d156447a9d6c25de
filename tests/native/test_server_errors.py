"""What errors tell a client and what they leave in the log: a 500 carries no exception text or
path (the log has it, under an error id the body quotes), `/v1/models` shows the served name
and never the model's directory, and client text in log lines is escaped."""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path

import httpx
import pytest

from kvtier.native import protocol
from kvtier.native.server import EngineServer
from tests.native.test_server import assert_openai_error, client

SECRET = "secret detail at /srv/models/private/weights.py line 7"


def test_a_500_names_no_exception_text_and_the_log_keeps_it_under_an_error_id(
    make_engine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    # before: the body said "internal error: RuntimeError: secret detail at /srv/..."
    with EngineServer(make_engine(num_blocks=64), model_name="tiny") as srv:

        def broken(body: bytes) -> object:
            raise RuntimeError(SECRET)

        monkeypatch.setattr(srv.serving.requests, "completion", broken)

        async def go() -> list[httpx.Response]:
            # Starlette re-raises a 500's exception after answering (for the server's own
            # log); this client takes the answer, as a socket client would
            transport = httpx.ASGITransport(app=srv.app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://kvtier") as c:
                return [
                    await c.post("/v1/completions", json={"prompt": "ka"}),
                    await c.post("/tokenize", json={"prompt": "ka"}),
                ]

        failed, still = asyncio.run(go())
    message = assert_openai_error(failed, 500)
    assert "secret" not in failed.text and "/srv" not in failed.text
    assert "RuntimeError" not in failed.text
    error_id = re.search(r"error id ([0-9a-f]{16})", message).group(1)  # type: ignore[union-attr]
    logged = [r for r in caplog.records if error_id in r.getMessage()]
    assert len(logged) == 1 and "'/v1/completions'" in logged[0].getMessage()
    assert logged[0].exc_info is not None and SECRET in str(logged[0].exc_info[1])
    assert still.status_code == 200


def test_models_lists_the_served_name_and_never_the_models_directory(
    make_engine, tiny_model: Path
):
    # before: root was the model's directory, e.g. /tmp/pytest-.../tiny/model
    with EngineServer(make_engine(num_blocks=64), model_name="tiny") as srv:

        async def go() -> httpx.Response:
            async with client(srv) as c:
                return await c.get("/v1/models")

        r = asyncio.run(go())
    assert r.status_code == 200
    (card,) = r.json()["data"]
    assert card["id"] == card["root"] == "tiny"
    assert str(tiny_model) not in r.text and str(tiny_model.parent) not in r.text


def test_unknown_routes_echo_at_most_a_capped_path(make_engine):
    with EngineServer(make_engine(num_blocks=64), model_name="tiny") as srv:

        async def go() -> httpx.Response:
            async with client(srv) as c:
                return await c.get("/v1/" + "p" * 5000)

        r = asyncio.run(go())
    message = assert_openai_error(r, 404)
    assert len(message) < 400 and "ppp..." in message


def test_a_request_id_with_control_characters_is_logged_escaped(make_engine, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="kvtier.server")
    # a fresh set of warned names: other tests in this process may have filled it
    monkeypatch.setattr(protocol, "_warned", protocol._WarnedNames(protocol.MAX_WARNED))
    rid = "evil\n2026-01-01 00:00:00 INFO kvtier.server: forged line\x1b[2J\r" + "z" * 500
    with EngineServer(make_engine(num_blocks=64), model_name="tiny") as srv:

        async def go() -> list[httpx.Response]:
            async with client(srv) as c:
                body = {"prompt": "ka", "max_tokens": 2, "request_id": rid}
                return [
                    await c.post("/v1/completions", json=body),
                    await c.post("/v1/completions", json={**body, "stream": True}),
                    await c.post("/tokenize", json={"prompt": "ka", rid: 1}),  # unknown field
                ]

        rs = asyncio.run(go())
    assert all(r.status_code == 200 for r in rs), [r.text[:200] for r in rs]
    assert rs[0].json()["id"] == rid  # the client gets its id back as it sent it
    messages = [r.getMessage() for r in caplog.records]
    finished = [m for m in messages if "completion=2" in m]
    assert len(finished) == 2
    for m in messages:
        assert "\n" not in m and "\r" not in m and "\x1b" not in m, m
    assert all(m.startswith(r"'evil\n2026-01-01 00:00:00 INFO") for m in finished), finished
    assert all(f"({len(rid)} chars)" in m and "z" * 100 not in m for m in finished), finished
    assert any(r"'evil\n2026" in m and "ignoring unknown" in m for m in messages)
