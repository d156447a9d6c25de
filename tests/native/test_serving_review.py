"""Review of the serving path against what comes from outside the process: hostile JSON values
(each a 400 naming its field, none reaching the engine), a sampling value that must never stop
the engine, echo with max_tokens=0 streamed, clients that go away mid-generation (every
sequence aborted, the block pool whole again), a concurrent mix of good, bad and abandoned
requests (later requests get exactly a clean run's tokens), and the admin API's bodies and
headers (4xx, never 500)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvtier.native import Engine, EngineConfig
from kvtier.native.server import EngineServer
from tests.native.test_request_lifecycle import RawClient
from tests.native.test_server import assert_openai_error, client, sse_events

GREEDY = {"temperature": 0, "ignore_eos": True, "return_token_ids": True}
# one request, three prompts: its sequences enter the engine in one submission, so the batch
# shape of a clean run and of a run after the chaos is the same
BATCH = {"prompt": ["ka ro mi ne su", "Fori make nosa teli", "wage buho yani"],
         "max_tokens": 8, **GREEDY}  # fmt: skip
USER = [{"role": "user", "content": "ka ro mi ne su ta lo vi"}]


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[EngineServer]:
    """A plain TP=1 engine (128 blocks of 16: a 2048-token context) behind the app."""
    engine = Engine(tiny_model, EngineConfig(num_threads=1, num_blocks=128))
    with EngineServer(engine, model_name="tiny") as srv:
        yield srv


@pytest.fixture(scope="module")
def clean_batch(server: EngineServer) -> list[list[int]]:
    """BATCH's greedy tokens on the fresh server, before any hostile client."""
    (r,) = post(server, "/v1/completions", [BATCH])
    assert r.status_code == 200, r.text
    return [c["token_ids"] for c in r.json()["choices"]]


def post(srv: EngineServer, path: str, bodies: list[Any], **kw: Any) -> list[httpx.Response]:
    """POST each body (JSON, or raw bytes) in turn; a 500 is answered, never raised."""

    async def go() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=srv.app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvtier") as c:
            return [
                await (c.post(path, content=b, **kw) if isinstance(b, bytes)
                       else c.post(path, json=b, **kw))
                for b in bodies
            ]  # fmt: skip

    return asyncio.run(go())


def on_loop(srv: EngineServer, fn: Callable[[Engine], Any]) -> Any:
    return srv.loop.call(fn).result(timeout=30.0)


def pool_whole(eng: Engine) -> bool:
    bm = eng.block_manager
    return bm.num_free_blocks() == bm.num_blocks and all(c == 0 for c in bm.ref_counts)


async def until(cond: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 20.0) -> None:
    """Wait for `cond` with a deadline; each check is a round trip through the engine loop (it
    answers between steps), so the wait needs no sleep."""
    deadline = time.monotonic() + timeout_s
    while not await cond():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s} s"


# ---- hostile values ----------------------------------------------------------------------------

HI = {"prompt": "hi", "max_tokens": 2}
COMPLETION_BAD = [
    (b'{"prompt": "hi", "temperature": NaN}', "temperature", "finite"),
    (b'{"prompt": "hi", "top_p": Infinity}', "top_p", "finite"),
    ({**HI, "top_p": 1.5}, "top_p", "(0, 1]"),
    (b'{"prompt": "hi", "min_p": NaN}', "min_p", "[0, 1]"),
    (b'{"prompt": "hi", "repetition_penalty": Infinity}', "repetition_penalty", "finite"),
    ({**HI, "seed": 2**64}, "seed", "less than or equal"),
    ({**HI, "seed": -(2**64)}, "seed", "greater than or equal"),
    ({**HI, "n": 0}, "n", "[1, 128]"),
    ({**HI, "n": 2**70}, "n", "[1, 128]"),
    ({**HI, "n": 3, "best_of": 2}, "best_of", "[n=3, 128]"),
    ({**HI, "min_tokens": 5}, "min_tokens", "[0, max_tokens]"),
    ({**HI, "min_tokens": -1}, "min_tokens", "[0, max_tokens]"),
    ({**HI, "max_tokens": 2**63}, "max_tokens", "set max_tokens <="),
    ({**HI, "stop_token_ids": [-1]}, "stop_token_ids", "outside the vocabulary"),
    ({**HI, "stop_token_ids": [2**70]}, "stop_token_ids", "outside the vocabulary"),
    ({**HI, "logit_bias": {"-1": 1}}, "logit_bias", "outside the vocabulary"),
    ({**HI, "truncate_prompt_tokens": -2}, "truncate_prompt_tokens", "greater than or equal"),
    ({"prompt": [-1], "max_tokens": 2}, "prompt", "greater than or equal"),
    ({"prompt": [[5], []], "max_tokens": 2}, "prompt", "every prompt needs a token"),
    ({"prompt": ["a"] * 1025, "max_tokens": 2}, "prompt", "maximum allowed count of 1024"),
    ({**HI, "prompt_cache_key": 7}, "prompt_cache_key", "valid string"),
    ({**HI, "prompt_cache_retention": "24h", "user": "\u202e" * 300}, "user", "at most 256"),
]
CHAT_BAD = [
    ({"messages": []}, "messages", "at least one message"),
    ({"messages": "hi"}, "messages", "valid array"),
    ({"messages": [{"content": "hi"}]}, "messages", "has no role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages", "string or a list of text"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages",
     "text parts only"),
    ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    ({"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens", "at least 1"),
    ({"messages": USER, "top_k": -5}, "top_k", "at least 1"),
    ({"messages": USER, "max_tokens": 5000}, "max_tokens", "maximum context length is 2048"),
    ({"messages": USER, "continue_final_message": True}, "continue_final_message", "both"),
]  # fmt: skip


def test_hostile_values_are_400s_naming_the_field_and_never_reach_the_engine(server):
    before = on_loop(server, lambda e: e.stats())
    got = post(server, "/v1/completions", [b for b, *_ in COMPLETION_BAD])
    got += post(server, "/v1/chat/completions", [b for b, *_ in CHAT_BAD])
    for r, (body, param, words) in zip(got, COMPLETION_BAD + CHAT_BAD, strict=True):
        shown = body[:60] if isinstance(body, bytes) else json.dumps(body)[:80]
        message = assert_openai_error(r, 400, param)
        assert words in message, (shown, message)
    after = on_loop(server, lambda e: e.stats())
    assert after["prompt_tokens"] == before["prompt_tokens"]
    assert server.loop.health() is None


def test_a_top_k_past_64_bits_is_refused_and_the_engine_keeps_serving(make_engine):
    # found: top_k is an unbounded int; SamplingParams only checks >= -1, and the step's
    # msgspec encoding (runner.encode) raises OverflowError for an int >= 2**64 inside
    # engine.step(): the loop takes it for an engine failure and every client gets 500/503
    with EngineServer(make_engine(num_blocks=64), model_name="tiny") as srv:
        (clean,) = post(srv, "/v1/completions", [{"prompt": "ka ro", "max_tokens": 4, **GREEDY}])
        huge = post(srv, "/v1/completions", [{"prompt": "ka ro", "max_tokens": 2, "top_k": 2**64}])
        huge += post(srv, "/v1/chat/completions", [{"messages": USER, "top_k": 2**70}])
        (after,) = post(srv, "/v1/completions", [{"prompt": "ka ro", "max_tokens": 4, **GREEDY}])
        health = srv.loop.health()
    for r in huge:
        assert_openai_error(r, 400, "top_k")
    assert health is None, health
    assert after.status_code == 200, after.text
    assert after.json()["choices"][0]["token_ids"] == clean.json()["choices"][0]["token_ids"]


# ---- output shape ------------------------------------------------------------------------------


def test_echo_with_max_tokens_0_streams_the_prompt_and_no_generated_token(server):
    # found: the request is run with max_tokens=1 (openai_requests.completion, echo_only) and
    # only the non-streaming answer drops that token; the stream sends it
    body = {"prompt": "ka ro mi", "echo": True, "max_tokens": 0, "return_token_ids": True}
    plain, stream = post(server, "/v1/completions", [body, {
        **body, "stream": True, "stream_options": {"include_usage": True}}])  # fmt: skip
    assert plain.status_code == stream.status_code == 200, (plain.text, stream.text)
    (choice,) = plain.json()["choices"]
    assert choice["text"] == "ka ro mi" and choice["token_ids"] == []
    assert plain.json()["usage"]["completion_tokens"] == 0
    events = sse_events(stream.text)
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]["usage"]
    assert "".join(e["choices"][0]["text"] for e in chunks) == "ka ro mi"
    assert [t for e in chunks for t in e["choices"][0]["token_ids"] or []] == []
    assert usage["completion_tokens"] == 0 and usage["total_tokens"] == usage["prompt_tokens"]


# ---- clients that go away, clients at once -----------------------------------------------------


def test_clients_gone_mid_generation_abort_every_sequence_and_free_the_pool(server, clean_batch):
    before = on_loop(server, lambda e: e.stats())
    long = {"max_tokens": 300, "ignore_eos": True, "temperature": 1.0, "seed": 3}
    chat = RawClient(server.app, "/v1/chat/completions", {"messages": USER, "n": 3, **long})
    stream = RawClient(server.app, "/v1/completions",
                       {"prompt": "ka ro mi", "n": 2, "stream": True, **long})  # fmt: skip

    async def generated() -> bool:
        st = await asyncio.wrap_future(server.loop.call(lambda e: e.stats()))
        return st["generation_tokens"] - before["generation_tokens"] >= 10

    async def go() -> None:
        tasks = [asyncio.ensure_future(c.run()) for c in (chat, stream)]
        await until(generated, "generation of the five sequences")
        for c in (chat, stream):
            c.disconnect.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 20.0)

    asyncio.run(go())
    assert server.loop.wait_idle(30.0)
    after = on_loop(server, lambda e: e.stats())
    assert after["requests_aborted"] - before["requests_aborted"] == 5
    assert after["generation_tokens"] - before["generation_tokens"] < 5 * 300
    assert on_loop(server, pool_whole) and server.loop.queued == 0
    (r,) = post(server, "/v1/completions", [BATCH])
    assert [c["token_ids"] for c in r.json()["choices"]] == clean_batch


def test_a_concurrent_mix_of_good_bad_and_abandoned_requests_leaves_exact_tokens(
    server, clean_batch
):
    good = {"prompt": "Fori make nosa", "max_tokens": 6, **GREEDY}
    bad = [{**good, "temperature": 7}, {**good, "prompt": [99999]}, {**good, "n": 0}]
    gone = [RawClient(server.app, "/v1/completions",
                      {**good, "max_tokens": 200, "stream": s}) for s in (True, False)]  # fmt: skip

    async def go() -> list[httpx.Response]:
        async with client(server) as c:
            abandoned = [asyncio.ensure_future(g.run()) for g in gone]
            answers = asyncio.gather(
                *(c.post("/v1/completions", json=b) for b in [good, *bad, good, BATCH]),
                c.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4}),
            )
            for g in gone:
                g.disconnect.set()
            await asyncio.wait_for(asyncio.gather(*abandoned), 20.0)
            return await asyncio.wait_for(answers, 60.0)

    ok1, *errs, ok2, batch, chat = asyncio.run(go())
    for r, param in zip(errs, ("temperature", "prompt", "n"), strict=True):
        assert_openai_error(r, 400, param)
    for r, n in ((ok1, 6), (ok2, 6), (chat, 4)):
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == n, r.text
    assert batch.status_code == 200, batch.text
    assert server.loop.wait_idle(30.0)
    assert on_loop(server, pool_whole) and server.loop.queued == 0
    (r,) = post(server, "/v1/completions", [BATCH])  # alone again: the clean run's batch shape
    assert [c["token_ids"] for c in r.json()["choices"]] == clean_batch
    assert server.loop.health() is None


# ---- the admin API -----------------------------------------------------------------------------


def test_admin_bodies_and_headers_get_4xx_never_500(make_engine):
    # found: retention_routes._target parses with json.loads, whose RecursionError (a body
    # nested a few thousand deep) is not a ValueError: it escapes as a 500
    auth = {"Authorization": "Bearer k3y"}
    with EngineServer(make_engine(num_blocks=64), model_name="tiny", admin_key="k3y") as srv:
        deep = post(srv, "/kvtier/retain", [b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"],
                    headers=auth)  # fmt: skip
        keys = [b"Bearer " + b"k" * 100_000, b"Bearer k3y\xc3\xa9", b"bearer k3y", b"Bearer  k3y"]
        denied = [post(srv, "/kvtier/retain", [b"{}"], headers={"Authorization": k})[0]
                  for k in keys]  # fmt: skip
        traversal = post(srv, "/kvtier/forget", [{"prompt_cache_key": "../" * 90 + "\u202e"}],
                         headers=auth)  # fmt: skip
    for r in denied:
        assert "Authorization: Bearer" in assert_openai_error(r, 401)
    # over the 256-character cap: refused before anything is looked up
    assert "are at most 256 characters" in assert_openai_error(traversal[0], 400)
    assert "JSON" in assert_openai_error(deep[0], 400)
