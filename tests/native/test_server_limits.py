"""Sizes a client chooses, bounded: the request body (413, read no further than the limit,
the server's memory stays flat), logit_bias / stop / stop_token_ids entries (400 naming the
flag), sequences queued across requests (503 with Retry-After past the cap, 400 for a request
that could never fit), the unknown field names the server remembers, and the detokenizer's
work (linear in the output)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import psutil
from typer.testing import CliRunner

from kvtier.cli import app as cli_app
from kvtier.native import protocol
from kvtier.native.detokenizer import MAX_PENDING_TOKENS, Detokenizer, TextStream
from kvtier.native.openai_requests import ServerLimits
from kvtier.native.server import EngineServer
from kvtier.native.tokenizer import Tokenizer
from tests.native.cli_server import kvtier_serve
from tests.native.test_server import assert_openai_error, client, engine_stats

MiB = 2**20
CHUNK = 64 * 1024
CONFIG = "chunk_size: 64\nmemory_bytes: 64MiB\nload_gate: false\n"


def token_body(size: int) -> bytes:
    """A valid completion body of about `size` bytes: one long token-id prompt."""
    ids = ",".join(["1"] * (size // 2))
    return b'{"prompt": [' + ids.encode() + b'], "max_tokens": 1}'


def test_a_body_over_the_limit_gets_413_and_is_read_no_further(make_engine):
    # before: the whole body was buffered first (then parsed: one 64 MiB completion body
    # drove the server past 12 GB), and no 413 existed
    limits = ServerLimits(max_body_bytes=MiB)
    with EngineServer(make_engine(num_blocks=64), model_name="tiny", limits=limits) as srv:
        pulled = [0]

        async def stream(total: int) -> AsyncIterator[bytes]:
            body = token_body(total)
            for i in range(0, len(body), CHUNK):
                pulled[0] += 1
                yield body[i : i + CHUNK]

        async def go() -> list[httpx.Response]:
            async with client(srv) as c:
                declared = await c.post("/v1/completions", content=token_body(2 * MiB))
                chunked = await c.post("/v1/completions", content=stream(64 * MiB))
                chat = await c.post("/v1/chat/completions", content=stream(4 * MiB))
                tok = await c.post("/tokenize", content=b" " * (MiB + 1))
                fits = await c.post("/v1/completions", content=token_body(MiB // 2))
                return [declared, chunked, chat, tok, fits]

        declared, chunked, chat, tok, fits = asyncio.run(go())
    for r in (declared, chunked, chat, tok):
        message = assert_openai_error(r, 413)
        assert "at most 1048576 bytes" in message and "--max-request-body-size" in message
        assert r.json()["error"]["type"] == "RequestEntityTooLargeError"
    assert f"is {len(token_body(2 * MiB))} bytes" in declared.json()["error"]["message"]
    # the 64 MiB stream was read up to the limit and no further: 17 chunks of 64 KiB, plus
    # the 4 MiB chat stream's 17
    assert pulled[0] <= 2 * (MiB // CHUNK + 1), pulled[0]
    assert "maximum context length is 1024 tokens" in assert_openai_error(fits, 400, "prompt")


def test_a_64mib_body_leaves_the_served_process_memory_flat(tiny_model, tmp_path):
    # the measured case: one 64 MiB completion body drove the server past 12 GB; the flags
    # reach the server from the command line
    extra = ("--no-offload", "--max-request-body-size", "8MiB", "--trust-request-chat-template")
    with kvtier_serve(tiny_model, tmp_path, tp=1, config=CONFIG, extra=extra) as srv, \
            httpx.Client(base_url=srv.base, timeout=120.0) as c:  # fmt: skip
        proc = psutil.Process(srv.proc.pid)
        assert c.post("/v1/completions", json={"prompt": "ka", "max_tokens": 1}).status_code == 200
        before = proc.memory_info().rss
        r = c.post("/v1/completions", content=token_body(64 * MiB))
        after = proc.memory_info().rss
        ok = c.post("/v1/completions", json={"prompt": "ka", "max_tokens": 1})
        templated = c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "ka"}], "max_tokens": 1,
            "chat_template": "{{ messages[0]['content'] }}",
        })  # fmt: skip
    assert "at most 8388608 bytes" in assert_openai_error(r, 413)
    assert ok.status_code == 200 and templated.status_code == 200, templated.text
    # what the server held of the body is the limit's worth, never the 64 MiB
    assert after - before < 48 * MiB, (before, after)


def test_cli_refuses_limits_out_of_range(tiny_model):
    for args, words in (
        (["--max-queued-seqs", "0"], "--max-queued-seqs 0 must be >= 1"),
        (["--max-request-body-size", "lots"], "--max-request-body-size='lots' is not a size"),
        (["--chat-template-timeout", "0"], "chat template timeout 0.0 must be > 0 seconds"),
        (["--max-stop-strings", "-1"], "--max-stop-strings -1 must be >= 0"),
    ):
        result = CliRunner().invoke(cli_app, ["serve", str(tiny_model), "--no-offload", *args])
        assert result.exit_code == 2, result.output
        assert words in result.output and "Traceback" not in result.output, result.output


def test_lists_a_client_sizes_are_bounded_with_a_400_naming_the_flag(make_engine):
    with EngineServer(make_engine(num_blocks=64), model_name="tiny") as srv:
        base = {"prompt": "ka ro", "max_tokens": 2}
        bodies = [
            {**base, "logit_bias": {str(i): 1.0 for i in range(1025)}},
            {**base, "stop": ["a", "b", "c", "d", "e"]},
            {**base, "stop_token_ids": list(range(1025))},
            {"messages": [{"role": "user", "content": "hi"}], "stop": list("abcdefgh")},
            {**base, "logit_bias": {str(i): 1.0 for i in range(1024)},
             "stop": ["a", "b", "c", "d"], "stop_token_ids": list(range(1024))},
        ]  # fmt: skip

        async def go() -> list[httpx.Response]:
            async with client(srv) as c:
                out = [await c.post("/v1/completions", json=b) for b in bodies[:3]]
                out.append(await c.post("/v1/chat/completions", json=bodies[3]))
                out.append(await c.post("/v1/completions", json=bodies[4]))
                return out

        bias, stop, stop_ids, chat_stop, at_limit = asyncio.run(go())
    assert "logit_bias has 1025 entries; this server takes at most 1024 (kvtier serve " \
        "--max-logit-bias)" in assert_openai_error(bias, 400, "logit_bias")
    assert "--max-stop-strings" in assert_openai_error(stop, 400, "stop")
    assert "at most 4" in stop.json()["error"]["message"]
    assert "--max-stop-token-ids" in assert_openai_error(stop_ids, 400, "stop_token_ids")
    assert "stop has 8 entries" in assert_openai_error(chat_stop, 400, "stop")
    assert at_limit.status_code == 200, at_limit.text


def test_queued_sequences_past_the_cap_get_503_with_retry_after(make_engine):
    engine = make_engine(num_blocks=256)
    real_step = engine.step
    wedged = threading.Event()
    wedged.set()

    def step() -> list:
        if wedged.is_set():  # nothing is scheduled: every submitted sequence stays queued
            engine.last_step_tokens = 0
            return []
        return real_step()

    engine.step = step  # type: ignore[method-assign]
    sampled = {"prompt": "ka ro", "max_tokens": 2, "temperature": 1.0, "seed": 5}
    limits = ServerLimits(max_queued_seqs=64)
    with EngineServer(engine, model_name="tiny", limits=limits) as srv:

        async def go() -> tuple[list[httpx.Response], ...]:
            async with client(srv) as c:
                held = [
                    asyncio.ensure_future(c.post("/v1/completions", json={**sampled, "n": 8}))
                    for _ in range(8)
                ]
                deadline = time.monotonic() + 30
                while srv.loop.queued < 64:  # the loop's own count, no sleep guess
                    assert time.monotonic() < deadline, srv.loop.queued
                    await asyncio.sleep(0.01)
                over = [
                    await c.post("/v1/completions", json=sampled),
                    await c.post("/v1/chat/completions",
                                 json={"messages": [{"role": "user", "content": "hi"}]}),
                ]  # fmt: skip
                never = await c.post("/v1/completions", json={**sampled, "n": 65})
                batch = await c.post(
                    "/v1/completions", json={**sampled, "n": 9, "prompt": ["ka"] * 8}
                )
                wedged.clear()
                done = await asyncio.wait_for(asyncio.gather(*held), 60)
                after = await c.post("/v1/completions", json=sampled)
                return over, [never, batch], list(done), [after]

        over, never, done, after = asyncio.run(go())
        stats = engine_stats(srv)
    for r in over:
        message = assert_openai_error(r, 503)
        assert "limit of 64 queued sequences" in message and "--max-queued-seqs" in message
        assert r.headers["retry-after"] == "1"
    for r, asked in zip(never, (65, 72), strict=True):
        message = assert_openai_error(r, 400, "n")
        assert f"asks for {asked} sequences" in message and "--max-queued-seqs" in message
    assert all(r.status_code == 200 and len(r.json()["choices"]) == 8 for r in done)
    assert after[0].status_code == 200 and srv.loop.queued == 0
    assert stats["requests_finished"] == 65  # nothing refused reached the engine


def test_the_unknown_field_names_remembered_are_bounded(make_engine, caplog, monkeypatch):
    # before: every distinct unknown field name ever sent was kept (and logged) forever
    monkeypatch.setattr(protocol, "_warned", protocol._WarnedNames(protocol.MAX_WARNED))
    with EngineServer(make_engine(num_blocks=64), model_name="tiny") as srv:

        async def go() -> list[httpx.Response]:
            async with client(srv) as c:
                return [
                    await c.post("/tokenize", json={
                        "prompt": "ka", **{f"junk_{i}_{j}\n": 1 for j in range(200)},
                    })  # fmt: skip
                    for i in range(10)
                ]

        rs = asyncio.run(go())
    assert all(r.status_code == 200 for r in rs)
    assert len(protocol._warned) == protocol.MAX_WARNED  # 2000 names sent
    warned = [r.getMessage() for r in caplog.records if "ignoring unknown" in r.getMessage()]
    assert 2 <= len(warned) <= 3 and "later ones are not" in warned[-1]
    assert all("\n" not in m and len(m) < 2000 for m in warned)


class CountingTokenizer:
    """A tokenizer that counts the tokens it was asked to decode."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.decoded = 0

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        self.decoded += len(ids)
        return self.tok.decode(ids, skip_special_tokens)


def test_the_detokenizer_does_work_linear_in_the_output(tiny_model):
    tok = Tokenizer(tiny_model)
    byte_token = next(i for i in range(tok.vocab_size) if tok.decode([i]) == "\ufffd")
    n = 3000
    for ids in ([byte_token] * n, ([byte_token] * 7 + [300, 301]) * (n // 9)):
        counting = CountingTokenizer(tok)
        detok: Callable[..., str] = Detokenizer(counting).update  # type: ignore[arg-type]
        text = "".join(detok(ids[:i], i == len(ids)) for i in range(1, len(ids) + 1))
        assert text == tok.decode(ids)
        # every step decodes a window of at most 2 x MAX_PENDING_TOKENS tokens, twice
        assert counting.decoded <= 4 * MAX_PENDING_TOKENS * len(ids), counting.decoded
    # and the stop-string search only looks at the held-back tail
    stream = TextStream(tok, ["zzz-never"])
    words = tok.encode("ka ro mi ne su " * 400, add_special_tokens=False)
    out = "".join(stream.update(words[:i], i == len(words)) for i in range(1, len(words) + 1))
    assert out == tok.decode(words) == stream.text and stream.stopped_by is None


def test_stop_strings_after_the_rewrite_match_across_tokens_and_keep_their_semantics(tiny_model):
    tok = Tokenizer(tiny_model)
    ids = tok.encode("ka ro mi ne su ta lo vi", add_special_tokens=False)
    for stop, keep, want in (
        (["ne su"], False, "ka ro mi "), (["ne su"], True, "ka ro mi ne su"),
        (["mi", "ro"], False, "ka "), (["i ne", "ne"], True, "ka ro mi ne"),
        (["vi"], False, "ka ro mi ne su ta lo "),
    ):  # fmt: skip
        stream = TextStream(tok, stop, include_stop=keep)
        emitted = ""
        for i in range(1, len(ids) + 1):
            emitted += stream.update(ids[:i], i == len(ids))
            if stream.stopped_by:
                break
        assert emitted == want == stream.text, (stop, keep, emitted)
