"""Request ids on the native server: a reused id is refused without touching the live request
that holds it, an abort reaches its own submission only, one failing sibling of `n > 1` ends
the others with one error, any client id (long, odd, control characters) is served, and ids
are logged escaped."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from kvtier.config import KVTierConfig
from kvtier.native import Engine, EngineConfig
from kvtier.native.offload import connector_spec
from kvtier.native.server import EngineServer
from tests.native.test_server import assert_openai_error, client, engine_stats, sse_events

BODY = {"prompt": "ka ro mi", "temperature": 0, "ignore_eos": True, "return_token_ids": True}


async def in_flight(srv: EngineServer, deadline_s: float = 30.0) -> None:
    """Wait until the engine holds a request (waiting or running)."""
    deadline = time.monotonic() + deadline_s
    while True:
        stats = await asyncio.wrap_future(srv.loop.call(lambda eng: eng.stats()))
        if stats["num_requests_running"] + stats["num_requests_waiting"] > 0:
            return
        assert time.monotonic() < deadline, "no request reached the engine"
        await asyncio.sleep(0.01)


@pytest.fixture
def plain_server(make_engine: Callable[..., Engine]) -> Any:
    """A TP=1 server without connector (every test gets its own)."""
    with EngineServer(make_engine(num_blocks=256), model_name="tiny") as srv:
        yield srv


def test_a_reused_request_id_is_refused_and_the_live_request_completes(plain_server):
    # before: the duplicate got its error, then its stream's cleanup aborted the *first*
    # request's track by id, and the first client waited forever
    srv = plain_server
    first_body = {**BODY, "max_tokens": 64, "request_id": "same"}

    async def go() -> tuple[httpx.Response, ...]:
        async with client(srv) as c:
            first = asyncio.ensure_future(c.post("/v1/completions", json=first_body))
            await in_flight(srv)
            dup_stream = await c.post(
                "/v1/completions", json={**first_body, "max_tokens": 4, "stream": True}
            )
            dup_chat = await c.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "request_id": "same"},
            )
            done = await asyncio.wait_for(first, 60.0)
            again = await c.post("/v1/completions", json={**first_body, "max_tokens": 4})
            reference = await c.post("/v1/completions", json={**BODY, "max_tokens": 64})
            return done, dup_stream, dup_chat, again, reference

    done, dup_stream, dup_chat, again, reference = asyncio.run(go())
    for dup in (dup_stream, dup_chat):
        message = assert_openai_error(dup, 409, "request_id")
        assert "'same'" in message and "in flight" in message
    assert done.status_code == 200, done.text
    choice = done.json()["choices"][0]
    assert done.json()["id"] == "same" and choice["finish_reason"] == "length"
    assert choice["token_ids"] == reference.json()["choices"][0]["token_ids"]
    assert len(choice["token_ids"]) == 64
    assert again.status_code == 200 and again.json()["id"] == "same"  # free once finished
    stats = engine_stats(srv)
    assert stats["requests_aborted"] == 0 and stats["kv_cache_usage"] == 0.0


def test_sibling_ids_of_n_do_not_collide_with_other_clients_ids(plain_server):
    # "x" with n=2 used to run as engine requests "x-0" and "x-1": a client's own "x-1" was
    # refused (or, streamed, aborted the other client's sibling)
    srv = plain_server
    sampled = {"prompt": "ka ro", "max_tokens": 32, "ignore_eos": True, "seed": 1}

    async def go() -> tuple[httpx.Response, httpx.Response]:
        async with client(srv) as c:
            pair = asyncio.ensure_future(
                c.post("/v1/completions", json={**sampled, "n": 2, "request_id": "x"})
            )
            await in_flight(srv)
            other = await c.post(
                "/v1/completions", json={**sampled, "stream": True, "request_id": "x-1"}
            )
            return await asyncio.wait_for(pair, 60.0), other

    pair, other = asyncio.run(go())
    assert pair.status_code == 200, pair.text
    assert pair.json()["id"] == "x" and len(pair.json()["choices"]) == 2
    assert all(c["finish_reason"] == "length" for c in pair.json()["choices"])
    events = sse_events(other.text)
    assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1]), other.text
    assert events[-2]["id"] == "x-1" and events[-2]["choices"][0]["finish_reason"] == "length"


def test_a_failing_sibling_ends_the_others_and_the_client_gets_one_error(
    make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
):
    # before: the other sibling ran to max_tokens after its twin failed (non-streaming), and
    # the failure's text (the sampler's exception) reached the client
    engine = make_engine(num_blocks=256)
    sampler = engine.executor.runner.sampler
    real = sampler._row

    def row(logits: Any, spec: Any) -> Any:
        if spec.seed == 4243:  # sibling 1 of seed 4242
            raise RuntimeError("probability tensor contains inf in /secret/path.py")
        return real(logits, spec)

    monkeypatch.setattr(sampler, "_row", row)
    body = {"prompt": "ka ro mi", "max_tokens": 2000, "ignore_eos": True, "seed": 4242, "n": 2}
    with EngineServer(engine, model_name="tiny") as srv:

        async def go() -> list[httpx.Response]:
            async with client(srv) as c:
                plain = await asyncio.wait_for(c.post("/v1/completions", json=body), 60.0)
                stream = await asyncio.wait_for(
                    c.post("/v1/completions", json={**body, "stream": True}), 60.0
                )
                return [plain, stream, await c.get("/health")]

        plain, stream, health = asyncio.run(go())
        stats = engine_stats(srv)
    message = assert_openai_error(plain, 500)
    assert "probability" not in message and "secret" not in message
    events = sse_events(stream.text)
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and errors[0]["error"]["code"] == 500, stream.text
    assert "probability" not in stream.text and events[-1] == "[DONE]"
    assert health.status_code == 200
    # each request: one sibling failed, the other was aborted long before 2000 tokens
    assert stats["requests_failed"] == 2 and stats["requests_aborted"] == 2
    assert stats["generation_tokens"] < 2 * 2000
    assert stats["kv_cache_usage"] == 0.0


ODD_IDS = ["x" * 100_000, "a\nb\r\x00c\u2028d\x1b[31m", "-", "--", "ü-😀-", " "]


def test_client_request_ids_of_any_length_and_content_are_served(plain_server, caplog):
    srv = plain_server
    caplog.set_level(logging.INFO, logger="kvtier.server")

    async def go() -> list[httpx.Response]:
        async with client(srv) as c:
            out = []
            for rid in ODD_IDS:
                for extra in ({}, {"n": 2, "temperature": 1.0, "seed": 3}, {"stream": True}):
                    out.append(
                        await c.post(
                            "/v1/completions",
                            json={"prompt": "ka", "max_tokens": 3, "request_id": rid, **extra},
                        )
                    )
            return out

    responses = asyncio.run(go())
    for i, r in enumerate(responses):
        rid = ODD_IDS[i // 3]
        assert r.status_code == 200, (rid[:20], r.text[:300])
        if i % 3 == 2:
            events = sse_events(r.text)
            assert events[-1] == "[DONE]" and all(e["id"] == rid for e in events[:-1])
        else:
            assert r.json()["id"] == rid
            assert len(r.json()["choices"]) == (2 if i % 3 == 1 else 1)
    # the log names them escaped and capped: no raw newline or escape character from a client
    lines = [r.getMessage() for r in caplog.records if r.name == "kvtier.server"]
    finished = [m for m in lines if "completion=" in m]
    assert len(finished) == len(ODD_IDS) * 4
    for m in lines:
        assert "\n" not in m and "\r" not in m and "\x1b" not in m and "\x00" not in m, m
        assert len(m) < 1000, m[:200]
    assert any(r"'a\nb\r\x00c\u2028d\x1b[31m'" in m for m in finished), finished
    assert any("'xxxxxxxx" in m and "100000 chars" in m for m in finished)


def test_odd_client_ids_never_reach_the_offload_core(tiny_model, tmp_path, prompts, baseline):
    # with kvtier's tier on, a long or odd client id used to travel into the engine, the
    # connector and the tier's lookups; now each sequence runs under the server's own id
    config = KVTierConfig(chunk_size=64, memory_bytes="64MiB", load_gate=False)
    spec = connector_spec(config, tiny_model, run_dir=tmp_path)
    engine = Engine(tiny_model, EngineConfig(num_threads=1, num_blocks=256), spec)
    try:
        srv = EngineServer(engine, model_name="tiny")
    except BaseException:
        engine.close()
        raise
    seen: list[str] = []
    real_add = engine.add_request

    def add(*args: Any, **kwargs: Any) -> str:
        seen.append(kwargs["request_id"])
        return real_add(*args, **kwargs)

    engine.add_request = add  # type: ignore[method-assign]
    with srv:

        async def go() -> list[httpx.Response]:
            async with client(srv) as c:
                return [
                    await c.post("/v1/completions", json={
                        "prompt": prompts[0], "max_tokens": 8, "temperature": 0,
                        "ignore_eos": True, "return_token_ids": True, "request_id": rid,
                    })  # fmt: skip
                    for rid in ODD_IDS
                ]

        responses = asyncio.run(go())
    for rid, r in zip(ODD_IDS, responses, strict=True):
        assert r.status_code == 200, r.text[:300]
        assert r.json()["id"] == rid and r.json()["choices"][0]["token_ids"] == baseline[0]
    # the second pass onwards restored the prompt from the tier: the ids changed, the keys not
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert len(seen) == len(ODD_IDS) and all(e.startswith("srv-") and len(e) < 16 for e in seen)
