"""The native server in process (ASGI): completions equal `Engine.generate`, streaming, chat
through the model's template, two-pass restore with vLLM-named /metrics that close (cache hits
by source included), OpenAI's error shape for every bad input (malformed Unicode and 100k-deep
JSON too), sampling edge values, a request whose sampling raises failing alone, large bodies
off the event loop, the stall check of /health, and an engine failure ending serving."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.config import KVTierConfig
from kvtier.native import Engine, EngineConfig
from kvtier.native.detokenizer import Detokenizer, TextStream
from kvtier.native.offload import connector_spec
from kvtier.native.server import EngineServer
from kvtier.native.tokenizer import Tokenizer
from tests.native.conftest import make_prompts

GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True, "return_token_ids": True}
CHUNK = 64
TEXT = "Kasumi ronetavi pelo dazu. Fori make nosa teli wage buho yani doru sepa."

# vLLM counter (without _total) -> engine.stats() key
COUNTERS = {
    "vllm:prefix_cache_queries": "prefix_cache_queries",
    "vllm:prefix_cache_hits": "prefix_cache_hits",
    "vllm:external_prefix_cache_queries": "external_prefix_cache_queries",
    "vllm:external_prefix_cache_hits": "external_prefix_cache_hits",
    "vllm:prompt_tokens": "prompt_tokens",
    "vllm:generation_tokens": "generation_tokens",
    "vllm:num_preemptions": "num_preemptions",
}
GAUGES = {
    "vllm:num_requests_running": "num_requests_running",
    "vllm:num_requests_waiting": "num_requests_waiting",
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
}


# ---- helpers ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    """A TP=1 engine with kvtier (64-token chunks, no load gate) behind the HTTP app."""
    config = KVTierConfig(
        chunk_size=CHUNK, memory_bytes="64MiB", load_gate=False, lookup_timeout_ms=2000
    )
    run_dir = tmp_path_factory.mktemp("server-run")
    spec = connector_spec(config, tiny_model, run_dir=run_dir)
    engine = Engine(tiny_model, EngineConfig(num_threads=1, num_blocks=256), spec)
    try:
        srv = EngineServer(engine, model_name="tiny")
    except BaseException:
        engine.close()
        raise
    with srv:
        yield srv


@contextlib.asynccontextmanager
async def client(srv: EngineServer) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=srv.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://kvtier") as c:
        yield c


def post_all(srv: EngineServer, path: str, bodies: list[Any]) -> list[httpx.Response]:
    """POST each body (JSON, or raw bytes) in turn."""

    async def go() -> list[httpx.Response]:
        async with client(srv) as c:
            out = []
            for b in bodies:
                if isinstance(b, bytes):
                    out.append(await c.post(path, content=b))
                else:
                    out.append(await c.post(path, json=b))
            return out

    return asyncio.run(go())


def engine_stats(srv: EngineServer) -> dict[str, float]:
    """engine.stats() read on the loop thread, after the server drained."""
    assert srv.loop.wait_idle(30.0), "the server did not drain within 30 s"
    return srv.loop.call(lambda eng: eng.stats()).result(timeout=10.0)


def sse_events(body: str) -> list[Any]:
    """The `data:` payloads of an SSE body; `[DONE]` stays a string."""
    events = []
    for block in body.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def scrape(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text -> {(sample name, sorted labels): value}."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def vllm_value(samples: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted({"model_name": "tiny", "engine": "0", **labels}.items())))
    assert key in samples, f"{name} {labels} missing from /metrics"
    return samples[key]


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> str:
    """The body is OpenAI's error object with no traceback; returns the message."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    if param is not None:
        assert err["param"] == param, err
    assert "Traceback" not in r.text and 'File "' not in r.text and ".py" not in r.text
    return err["message"]


# ---- completions and chat ----------------------------------------------------------------------


def test_completion_returns_the_token_ids_of_engine_generate(server, prompts, baseline):
    (r,) = post_all(server, "/v1/completions", [{"model": "tiny", "prompt": prompts[0], **GREEDY}])
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-") and body["model"] == "tiny"
    (choice,) = body["choices"]
    assert choice["token_ids"] == baseline[0]
    assert choice["text"] == server.tokenizer.decode(baseline[0])
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    usage = body["usage"]
    assert usage["prompt_tokens"] == 304 and usage["completion_tokens"] == 8
    assert usage["total_tokens"] == 312
    assert "cached_tokens" in usage["prompt_tokens_details"]


def test_streaming_returns_the_same_text_and_token_ids_and_ends_with_done(
    server, prompts, baseline
):
    ids, text, plain = post_all(
        server, "/v1/completions",
        [{"prompt": prompts[1], "stream": True, **GREEDY,
          "stream_options": {"include_usage": True}},
         {"prompt": TEXT, "stream": True, **GREEDY},
         {"prompt": TEXT, **GREEDY}],
    )  # fmt: skip
    assert ids.headers["content-type"].startswith("text/event-stream")
    ids_events, text_events = sse_events(ids.text), sse_events(text.text)
    # token-id prompt: deltas add up to Engine.generate's output; a usage chunk, then [DONE]
    assert ids_events[-1] == "[DONE]"
    usage_chunk = ids_events[-2]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 8
    assert usage_chunk["usage"]["prompt_tokens"] == 304
    token_chunks = ids_events[:-2]
    assert all(e["usage"] is None for e in token_chunks)
    assert [t for e in token_chunks for t in e["choices"][0]["token_ids"]] == baseline[1]
    assert "".join(e["choices"][0]["text"] for e in token_chunks) == server.tokenizer.decode(
        baseline[1]
    )
    assert [e["choices"][0]["finish_reason"] for e in token_chunks] == [None] * 7 + ["length"]
    # text prompt: the stream equals the non-streaming answer
    assert text_events[-1] == "[DONE]"
    chunks = text_events[:-1]
    (choice,) = plain.json()["choices"]
    assert [t for e in chunks for t in e["choices"][0]["token_ids"]] == choice["token_ids"]
    assert "".join(e["choices"][0]["text"] for e in chunks) == choice["text"]
    assert plain.json()["usage"]["prompt_tokens"] == len(server.tokenizer.encode(TEXT))


def test_chat_renders_the_models_template_and_streams_the_same_tokens(server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}]
    rendered = server.tokenizer.apply_chat_template(messages)
    assert rendered.startswith("<s>System: Be brief.\nUser: ") and rendered.endswith("Assistant:")
    ids = server.tokenizer.encode(rendered, add_special_tokens=False)
    chat, stream, completion, tok = [
        *post_all(server, "/v1/chat/completions", [
            {"messages": messages, **GREEDY},
            {"messages": messages, **GREEDY, "stream": True,
             "stream_options": {"include_usage": True}},
        ]),
        *post_all(server, "/v1/completions", [{"prompt": ids, **GREEDY}]),
        *post_all(server, "/tokenize", [{"messages": messages}]),
    ]  # fmt: skip
    body = chat.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["token_ids"] == completion.json()["choices"][0]["token_ids"]
    assert choice["message"]["content"] == completion.json()["choices"][0]["text"]
    assert body["usage"]["prompt_tokens"] == len(ids) == tok.json()["count"]
    assert tok.json()["tokens"] == ids
    events = sse_events(stream.text)
    assert events[-1] == "[DONE]" and events[0]["choices"][0]["delta"]["role"] == "assistant"
    deltas = [e["choices"][0]["delta"]["content"] for e in events[1:-2]]
    assert "".join(deltas) == choice["message"]["content"]
    assert events[-2]["usage"]["completion_tokens"] == 8


def test_two_pass_restore_over_http_and_metrics_close(server, prompts, baseline):
    async def one_pass(c: httpx.AsyncClient) -> list[dict]:
        rs = await asyncio.gather(
            *(c.post("/v1/completions", json={"prompt": p, **GREEDY}) for p in prompts)
        )
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
        return [r.json() for r in rs]

    async def go() -> tuple[list[dict], list[dict], dict, dict, str]:
        async with client(server) as c:
            first = await one_pass(c)
            assert server.loop.wait_idle(30.0)
            r = await c.post("/reset_prefix_cache")
            assert r.status_code == 200, r.text
            before = engine_stats(server)
            second = await one_pass(c)
            after = engine_stats(server)
            metrics = await c.get("/metrics")
            assert metrics.status_code == 200
        return first, second, before, after, metrics.text

    first, second, before, after, text = asyncio.run(go())
    assert [b["choices"][0]["token_ids"] for b in first] == baseline
    assert [b["choices"][0]["token_ids"] for b in second] == baseline
    # 304-token prompts in 64-token chunks: 4 whole chunks per prompt come back from the tier,
    # and after the reset none from HBM, so cached_tokens is exactly the external tokens
    cached = [b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in second]
    assert cached == [4 * CHUNK] * len(prompts)
    ext = after["external_prefix_cache_hits"] - before["external_prefix_cache_hits"]
    assert ext == sum(cached)
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == 0

    # /metrics of the drained server: vLLM names and labels with engine.stats()'s exact values
    samples = scrape(text)
    for name, key in COUNTERS.items():
        assert vllm_value(samples, f"{name}_total") == after[key], name
    for name, key in GAUGES.items():
        assert vllm_value(samples, name) == after[key], name
    assert vllm_value(samples, "vllm:prefix_cache_queries_total") - vllm_value(
        samples, "vllm:prefix_cache_hits_total"
    ) == vllm_value(samples, "vllm:external_prefix_cache_queries_total")
    # the tier's contribution by source: every external hit came from kvtier's memory tier
    by_source = {
        s: vllm_value(samples, "vllm:prompt_tokens_cached_by_source_total", source=s)
        for s in ("device", "host", "disk", "p2p", "external_unspecified")
    }
    assert by_source["host"] == after["external_prefix_cache_hits"] > 0
    assert by_source["device"] == after["prefix_cache_hits"]
    assert by_source["disk"] == by_source["p2p"] == by_source["external_unspecified"] == 0
    done = sum(
        vllm_value(samples, "vllm:request_success_total", finished_reason=r)
        for r in ("stop", "length")
    )
    assert done == after["requests_finished"]
    aborted = vllm_value(samples, "vllm:request_success_total", finished_reason="abort")
    assert aborted == after["requests_aborted"]
    finished = after["requests_finished"] + after["requests_aborted"] + after["requests_failed"]
    for hist in ("e2e_request_latency_seconds", "request_prompt_tokens",
                 "request_generation_tokens", "request_queue_time_seconds",
                 "request_max_num_generation_tokens"):  # fmt: skip
        assert vllm_value(samples, f"vllm:{hist}_count") == finished, hist
    assert vllm_value(samples, "vllm:request_generation_tokens_sum") == after["generation_tokens"]
    assert vllm_value(samples, "vllm:iteration_tokens_total_count") > 0
    assert vllm_value(samples, "kvtier_engine_stalled") == 0
    # and kvtier's own families, per rank: every retrieved token is an external hit (TP=1)
    retrieved = samples[("kvtier_retrieved_tokens_total", (("rank", "0"),))]
    assert retrieved == after["external_prefix_cache_hits"] >= ext


# ---- bad input --------------------------------------------------------------------------------


LONG = make_prompts(1, 4096, seed=5)[0]
BAD = [
    ({"prompt": LONG}, 400, "prompt", "context length is 4096 tokens"),
    ({"prompt": LONG[:4000], "max_tokens": 200}, 400, "max_tokens", "max_tokens <= 96"),
    ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens", "at least 1"),
    ({"prompt": 123}, 400, "prompt", "prompt"),
    ({"prompt": [5, 99999]}, 400, "prompt", "outside the vocabulary [0, 2048)"),
    ({"prompt": ""}, 400, "prompt", "must be provided and non-empty"),
    ({}, 400, "prompt", "must be provided and non-empty"),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature", "valid number"),
    ({"prompt": "hi", "temperature": 3}, 400, "temperature", "must be in [0, 2]"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p", "(0, 1]"),
    ({"prompt": "hi", "top_k": -2}, 400, "top_k", "at least 1"),
    ({"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty", "[-2, 2]"),
    ({"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty", "greater than zero"),
    ({"prompt": "hi", "logprobs": 21}, 400, "logprobs", "[0, 20]"),
    ({"prompt": "hi", "n": 2, "temperature": 0}, 400, "n", "greedy"),
    ({"prompt": "hi", "best_of": 2, "n": 1, "stream": True}, 400, "best_of", "stream"),
    ({"prompt": "hi", "stop": [""]}, 400, "stop", "empty string"),
    ({"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias", "converted to int"),
    ({"prompt": "hi", "logit_bias": {"99999": 1}}, 400, "logit_bias", "outside the vocabulary"),
    ({"prompt": "hi", "stop_token_ids": [1, "x"]}, 400, "stop_token_ids", "valid integer"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options",
     "stream=True"),
    ({"prompt": "hi", "echo": True, "logprobs": 1}, 400, "echo", "prompt logprobs"),
    ({"prompt": "hi", "use_beam_search": True}, 400, "use_beam_search", "not supported"),
    ({"prompt": "hi", "response_format": {"type": "json_object"}}, 400, "response_format",
     "grammar"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model", "serves 'tiny'"),
    (b"{not json", 400, None, "Invalid JSON"),
    (b'{"prompt": "\\ud800"}', 400, None, "Invalid JSON"),  # a lone surrogate
    (b'{"prompt": "\xff\xfe"}', 400, None, "Invalid JSON"),  # not UTF-8
    (b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None, "recursion limit"),
    (b"[1, 2]", 400, None, "should be an object"),
    (b"", 400, None, "body is empty"),
]  # fmt: skip


def test_bad_input_answers_openai_errors_naming_the_field_and_never_reaches_the_engine(server):
    before = engine_stats(server)
    rs = post_all(server, "/v1/completions", [body for body, *_ in BAD])
    for r, (body, status, param, words) in zip(rs, BAD, strict=True):
        message = assert_openai_error(r, status, param)
        assert words in message, (body if isinstance(body, dict) else body[:40], message)
    assert engine_stats(server)["prompt_tokens"] == before["prompt_tokens"]


def test_unknown_routes_and_methods_answer_openai_errors_and_the_small_endpoints_answer(server):
    async def go() -> list[httpx.Response]:
        async with client(server) as c:
            return [
                await c.post("/v1/nothing", json={}),
                await c.post("/v1/responses", json={"input": "hi"}),
                await c.get("/v1/completions"),
                await c.get("/version"),
                await c.get("/ping"),
                await c.post("/ping"),
                await c.get("/docs"),
                await c.post("/detokenize", json={"tokens": [5, 6, 7]}),
                await c.post("/tokenize", json={"prompt": "ka ro", "return_token_strs": True}),
                await c.post("/tokenize", json={}),
            ]

    (nothing, responses, method, version, ping, ping_post, docs, detok, tok, empty) = asyncio.run(
        go()
    )
    assert "no route POST /v1/nothing" in assert_openai_error(nothing, 404)
    assert "/v1/chat/completions" in assert_openai_error(responses, 404)
    assert_openai_error(method, 405)
    assert version.json()["version"] and ping.status_code == ping_post.status_code == 200
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    assert detok.json() == {"prompt": server.tokenizer.decode([5, 6, 7])}
    body = tok.json()
    assert body["tokens"] == server.tokenizer.encode("ka ro") and body["count"] == 3
    assert body["max_model_len"] == 4096 and len(body["token_strs"]) == 3
    assert "exactly one of prompt or messages" in assert_openai_error(empty, 400)


# ---- sampling edge values and a request that fails alone ---------------------------------------

EDGE = [{"temperature": 1e-39}, {"temperature": 1e-45}, {"temperature": 1e-300},
        {"top_p": 1e-300}, {"top_p": 1e-300, "temperature": 1.0, "top_k": 1}]  # fmt: skip


def test_sampling_edge_values_are_greedy_and_the_engine_lives_on(server):
    # before: logits / 1e-39 overflowed to inf, the sampler raised inside the step, the engine
    # loop died and every later request (and /health) answered 503
    greedy, *edge = post_all(
        server, "/v1/completions",
        [{"prompt": "hi", "max_tokens": 4, "temperature": 0, "return_token_ids": True}]
        + [{"prompt": "hi", "max_tokens": 4, "return_token_ids": True, **e} for e in EDGE],
    )  # fmt: skip
    want = greedy.json()["choices"][0]["token_ids"]
    for r, e in zip(edge, EDGE, strict=True):
        assert r.status_code == 200, (e, r.text)
        assert r.json()["choices"][0]["token_ids"] == want, e
    assert server.loop.health() is None


def test_a_request_whose_sampling_raises_fails_alone_with_a_500(make_engine, monkeypatch, caplog):
    engine = make_engine(num_blocks=64)
    sampler = engine.executor.runner.sampler
    real = sampler._row

    def row(logits: Any, spec: Any) -> Any:
        if spec.seed == 4242:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(logits, spec)

    monkeypatch.setattr(sampler, "_row", row)
    caplog.set_level(logging.INFO, logger="kvtier.server")
    body = {"prompt": "ka ro mi", "max_tokens": 6, "ignore_eos": True}
    with EngineServer(engine, model_name="tiny") as srv:

        async def go() -> list[httpx.Response]:
            async with client(srv) as c:
                bad = c.post("/v1/completions", json={**body, "seed": 4242})
                bad_stream = c.post("/v1/completions", json={**body, "seed": 4242, "stream": True})
                good = c.post("/v1/completions", json={**body, "seed": 1})
                first = await asyncio.gather(bad, bad_stream, good)
                return [*first, await c.get("/health"), await c.post("/v1/completions", json=body)]

        bad, bad_stream, good, health, later = asyncio.run(go())
        stats = engine_stats(srv)
    # the client hears that it failed, never the exception's text; the log keeps the text
    message = assert_openai_error(bad, 500)
    assert "failed in the engine" in message and "probability" not in message
    error_event = sse_events(bad_stream.text)[-2]
    assert error_event["error"]["code"] == 500 and "probability" not in bad_stream.text
    logged = [r.getMessage() for r in caplog.records if "finish=error" in r.getMessage()]
    assert len(logged) == 2 and all("probability tensor contains" in m for m in logged)
    assert good.status_code == later.status_code == health.status_code == 200
    assert good.json()["usage"]["completion_tokens"] == 6
    assert stats["requests_failed"] == 2 and stats["kv_cache_usage"] == 0.0


# ---- the event loop, the stall check, an engine failure ---------------------------------------


def test_a_huge_prompt_is_tokenized_off_the_event_loop(server):
    # 2 MiB tokenize for seconds, a /health round trip takes milliseconds: on the loop, health
    # would wait the whole tokenization (10 MiB prove no more, for five times the suite's time)
    huge = ("ka ro mi ne su " * 140_000)[: 2 * 1024 * 1024]

    async def go() -> tuple[httpx.Response, bool, httpx.Response]:
        async with client(server) as c:
            big = asyncio.ensure_future(c.post("/v1/completions", json={"prompt": huge}))
            await asyncio.sleep(0)  # let the big request's handler start reading
            health = await c.get("/health")
            big_done_when_health_answered = big.done()
            return health, big_done_when_health_answered, await big

    health, big_was_done, big = asyncio.run(go())
    assert health.status_code == 200 and not big_was_done
    assert "context length is 4096 tokens" in assert_openai_error(big, 400, "prompt")


def test_health_turns_503_with_a_reason_when_queued_work_makes_no_progress(make_engine):
    engine = make_engine(num_blocks=64)
    real_step = engine.step
    wedged = threading.Event()
    wedged.set()

    def step() -> list:
        if wedged.is_set():  # a wedged scheduler: steps complete, nothing is scheduled
            engine.last_step_tokens = 0
            return []
        return real_step()

    engine.step = step  # type: ignore[method-assign]
    with EngineServer(engine, model_name="tiny", stall_timeout_s=0.2) as srv:

        async def go() -> tuple[httpx.Response, httpx.Response, httpx.Response, httpx.Response]:
            async with client(srv) as c:
                assert (await c.get("/health")).status_code == 200
                req = asyncio.ensure_future(
                    c.post("/v1/completions", json={"prompt": "ka", "max_tokens": 2})
                )
                while srv.loop.stall_seconds() <= 0.2:  # the loop's own clock, no sleep guess
                    await asyncio.sleep(0.01)
                stalled, metrics = await c.get("/health"), await c.get("/metrics")
                wedged.clear()
                done = await req
                return stalled, metrics, done, await c.get("/health")

        stalled, metrics, done, healthy = asyncio.run(go())
    reason = assert_openai_error(stalled, 503)
    assert "engine stalled: 1 requests queued" in reason and "--stall-timeout" in reason
    assert vllm_value(scrape(metrics.text), "kvtier_engine_stalled") == 1
    assert vllm_value(scrape(metrics.text), "kvtier_engine_stall_seconds") > 0.2
    assert done.status_code == 200 and healthy.status_code == 200


def test_engine_failure_fails_in_flight_requests_once_and_ends_serving(make_engine, caplog):
    engine = make_engine()

    def broken_step() -> list:
        raise RuntimeError("simulated rank failure\n  File \"/x/y.py\", line 1")

    engine.step = broken_step  # type: ignore[method-assign]
    fatal: list[str] = []
    ended = threading.Event()

    def on_fatal(reason: str) -> None:
        fatal.append(reason)
        ended.set()

    async def go() -> list[httpx.Response]:
        async with client(srv) as c:
            ok = await c.get("/health")
            failed = await c.post("/v1/completions", json={"prompt": "ka ro mi", "max_tokens": 2})
            assert ended.wait(10.0)
            return [
                ok, failed, await c.get("/health"),
                await c.post("/v1/completions", json={"prompt": "ka", "max_tokens": 2}),
            ]  # fmt: skip

    with EngineServer(engine, model_name="tiny", on_fatal=on_fatal) as srv:
        ok, failed, health, refused = asyncio.run(go())
    assert ok.status_code == 200
    # clients hear the kind; the exception's text (and its source path) stays in the log
    for r, status in ((failed, 500), (health, 503), (refused, 503)):
        message = assert_openai_error(r, status)
        assert "engine failed (RuntimeError)" in message and "simulated" not in r.text
    assert fatal == ["engine failed: RuntimeError: simulated rank failure"]
    logged = [r for r in caplog.records if "the server exits" in r.getMessage()]
    assert len(logged) == 1 and "simulated rank failure" in logged[0].getMessage()


# ---- text ---------------------------------------------------------------------------------------


def test_streamed_text_deltas_add_up_to_the_full_decode(tiny_model):
    # random ids include lone byte tokens: partial UTF-8 must wait, never garble the text
    tok = Tokenizer(tiny_model)
    for ids in make_prompts(60, 40, seed=11):
        ids = [t % 2048 for t in ids] + [0, 1, 2]  # special tokens too (skipped in text)
        detok = Detokenizer(tok)
        text = "".join(detok.update(ids[:i], i == len(ids)) for i in range(1, len(ids) + 1))
        assert text == tok.decode(ids)


def test_stop_strings_truncate_hold_back_and_can_be_kept(tiny_model):
    tok = Tokenizer(tiny_model)
    ids = tok.encode("ka ro mi ne su ta lo vi", add_special_tokens=False)
    for stop, keep, want in (("ne", False, "ka ro mi "), ("ne", True, "ka ro mi ne"),
                             ("zz", False, "ka ro mi ne su ta lo vi")):  # fmt: skip
        stream = TextStream(tok, [stop], include_stop=keep)
        emitted = ""
        for i in range(1, len(ids) + 1):
            emitted += stream.update(ids[:i], i == len(ids))
            if stream.stopped_by:
                break
            # never stream a prefix of the stop string before it is known not to match
            assert not emitted.endswith(stop[0]) or stop == "zz" or keep
        assert emitted == want == stream.text
        assert stream.stopped_by == (None if stop == "zz" else stop)
