"""The native server over HTTP: OpenAI completions equal `Engine.generate`, streaming, two-pass
restore through kvtier, vLLM-named /metrics that close, 400s for bad input, disconnects abort,
engine failures answer 500/503, and the `kvtier serve` / `kvtier model init` commands."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from kvtier.cli import app as cli_app
from kvtier.config import KVTierConfig
from kvtier.native import Engine, EngineConfig, SamplingParams
from kvtier.native.offload import connector_spec
from kvtier.native.server import APIError, EngineServer, _Detokenizer, parse_completion_request
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
    key = (name, tuple(sorted({"model_name": "tiny", **labels}.items())))
    assert key in samples, f"{name} {labels} missing from /metrics"
    return samples[key]


# ---- completions ------------------------------------------------------------------------------


def test_completion_returns_the_token_ids_of_engine_generate(server, prompts, baseline):
    async def go() -> dict:
        async with client(server) as c:
            r = await c.post(
                "/v1/completions", json={"model": "tiny", "prompt": prompts[0], **GREEDY}
            )
            assert r.status_code == 200, r.text
            return r.json()

    body = asyncio.run(go())
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
    async def go() -> tuple[list[Any], list[Any], dict]:
        async with client(server) as c:
            ids = await c.post(
                "/v1/completions",
                json={"prompt": prompts[1], "stream": True, **GREEDY,
                      "stream_options": {"include_usage": True}},
            )  # fmt: skip
            text = await c.post("/v1/completions", json={"prompt": TEXT, "stream": True, **GREEDY})
            plain = await c.post("/v1/completions", json={"prompt": TEXT, **GREEDY})
        assert ids.headers["content-type"].startswith("text/event-stream")
        return sse_events(ids.text), sse_events(text.text), plain.json()

    ids_events, text_events, plain = asyncio.run(go())
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
    # text prompt: the stream equals the non-streaming answer, and no usage chunk was asked for
    assert text_events[-1] == "[DONE]"
    chunks = text_events[:-1]
    assert all("usage" not in e for e in chunks)
    (choice,) = plain["choices"]
    assert [t for e in chunks for t in e["choices"][0]["token_ids"]] == choice["token_ids"]
    assert "".join(e["choices"][0]["text"] for e in chunks) == choice["text"]
    assert plain["usage"]["prompt_tokens"] == len(server.tokenizer.encode(TEXT))


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

    # /metrics of the drained server: vLLM names with engine.stats()'s exact values
    samples = scrape(text)
    for name, key in COUNTERS.items():
        assert vllm_value(samples, f"{name}_total") == after[key], name
    for name, key in GAUGES.items():
        assert vllm_value(samples, name) == after[key], name
    assert vllm_value(samples, "vllm:prefix_cache_queries_total") - vllm_value(
        samples, "vllm:prefix_cache_hits_total"
    ) == vllm_value(samples, "vllm:external_prefix_cache_queries_total")
    done = sum(
        vllm_value(samples, "vllm:request_success_total", finished_reason=r)
        for r in ("stop", "length")
    )
    assert done == after["requests_finished"]
    aborted = vllm_value(samples, "vllm:request_success_total", finished_reason="abort")
    assert aborted == after["requests_aborted"]
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert vllm_value(samples, f"vllm:{hist}_count") == after["requests_finished"]
    # ignore_eos + max_tokens=8 everywhere in this module: 7 gaps per finished request
    assert vllm_value(samples, "vllm:inter_token_latency_seconds_count") == (
        after["generation_tokens"] - after["requests_finished"]
    )
    # and kvtier's own families, per rank: every retrieved token is an external hit (TP=1)
    retrieved = samples[("kvtier_retrieved_tokens_total", (("rank", "0"),))]
    assert retrieved == after["external_prefix_cache_hits"] >= ext
    assert samples[("kvtier_lookups_total", (("rank", "0"),))] > 0
    assert ("kvtier_stored_tokens_total", (("rank", "0"),)) in samples


# ---- bad input --------------------------------------------------------------------------------


LONG = make_prompts(1, 4096, seed=5)[0]
BAD = [
    ({"prompt": LONG}, 400, "prompt", "4096 tokens but max_model_len is 4096"),
    ({"prompt": LONG[:4000], "max_tokens": 200}, 400, "max_tokens", "max_tokens <= 96"),
    ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens", "max_tokens=-1 must be >= 1"),
    ({"prompt": "hi", "max_tokens": "8"}, 400, "max_tokens", "not an integer"),
    ({"prompt": 123}, 400, "prompt", "send a string or a list of token ids"),
    ({"prompt": ["a", "b"]}, 400, "prompt", "one prompt per request"),
    ({"prompt": [5, 99999]}, 400, "prompt", "outside the vocabulary [0, 2048)"),
    ({"prompt": ""}, 400, "prompt", "prompt is empty"),
    ({}, 400, "prompt", "prompt is missing"),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature", "not a finite number"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p", "(0, 1]"),
    ({"prompt": "hi", "stream": "yes"}, 400, "stream", "send true or false"),
    ({"prompt": "hi", "n": 2}, 400, "n", "not supported"),
    ({"prompt": "hi", "stop": ["."]}, 400, "stop", "not supported"),
    ({"prompt": "hi", "stop_token_ids": [1, "x"]}, 400, "stop_token_ids", "list of token ids"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model", "use 'tiny'"),
]


def test_bad_input_answers_400_naming_the_field_and_never_reaches_the_engine(server):
    async def go() -> list[httpx.Response]:
        async with client(server) as c:
            rs = [await c.post("/v1/completions", json=body) for body, *_ in BAD]
            rs.append(await c.post("/v1/completions", content=b"{not json"))
            rs.append(await c.post("/v1/completions", json=[1, 2]))
            rs.append(await c.get("/health"))
        return rs

    before = engine_stats(server)
    rs = asyncio.run(go())
    for r, (body, status, param, words) in zip(rs, BAD, strict=False):
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], (body, err)
        assert err["code"] == status
    assert rs[-3].status_code == 400 and "not valid JSON" in rs[-3].json()["error"]["message"]
    assert rs[-2].status_code == 400 and "send a JSON object" in rs[-2].json()["error"]["message"]
    assert rs[-1].status_code == 200 and rs[-1].json() == {"status": "ok"}
    assert engine_stats(server)["prompt_tokens"] == before["prompt_tokens"]


def test_neutral_values_of_unsupported_fields_and_a_batch_of_one_are_accepted():
    req = parse_completion_request(
        {"prompt": [[5, 6, 7]], "n": 1, "logprobs": None, "stop": [], "echo": False,
         "max_tokens": None, "stream_options": {"include_usage": True}, "user": "u",
         "some_extension": 1}
    )  # fmt: skip
    assert req.prompt == [5, 6, 7] and req.max_tokens is None and req.include_usage
    # min_tokens holds by construction with ignore_eos, no stop ids and max_tokens >= it
    ok = {"prompt": "x", "min_tokens": 4, "max_tokens": 8, "ignore_eos": True}
    assert parse_completion_request(ok).max_tokens == 8
    assert parse_completion_request({"prompt": ["hello"]}).prompt == "hello"
    with pytest.raises(APIError) as info:
        parse_completion_request({"prompt": "x", "min_tokens": 4})
    assert info.value.param == "min_tokens" and info.value.status == 400


def test_streamed_text_deltas_add_up_to_the_full_decode(tiny_model):
    # random ids include lone byte tokens: partial UTF-8 must wait, never garble the text
    tok = Tokenizer(tiny_model)
    for ids in make_prompts(100, 40, seed=11):
        ids = [t % 2048 for t in ids] + [0, 1, 2]  # special tokens too (skipped in text)
        detok = _Detokenizer(tok)
        text = "".join(detok.update(ids[:i], i == len(ids)) for i in range(1, len(ids) + 1))
        assert text == tok.decode(ids)


# ---- disconnects ------------------------------------------------------------------------------


async def call_then_disconnect(srv: EngineServer, body: dict) -> list[dict]:
    """Drive the ASGI app directly: send `body`, then report the client gone at once."""
    sent: list[dict] = []
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
        "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
        "server": ("kvtier", 80), "client": ("test", 1),
    }  # fmt: skip
    await srv.app(scope, receive, send)
    return sent


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_aborts_the_request(server, stream):
    # 3000 tokens would take minutes on this box: draining at once proves the abort
    prompt = make_prompts(1, 300, seed=7)[0]
    body = {"prompt": prompt, "max_tokens": 3000, "ignore_eos": True, "stream": stream}
    before = engine_stats(server)
    asyncio.run(call_then_disconnect(server, body))
    after = engine_stats(server)
    assert after["requests_aborted"] == before["requests_aborted"] + 1
    assert after["generation_tokens"] - before["generation_tokens"] < 3000
    assert after["num_requests_running"] == 0 and after["kv_cache_usage"] == 0.0


# ---- engine failure ---------------------------------------------------------------------------


def test_engine_failure_answers_500_then_503_and_health_fails(make_engine):
    engine = make_engine()

    def broken_step() -> list:
        raise RuntimeError("simulated rank failure")

    engine.step = broken_step  # type: ignore[method-assign]

    async def go() -> list[httpx.Response]:
        async with client(srv) as c:
            return [
                await c.get("/health"),
                await c.post("/v1/completions", json={"prompt": "ka ro mi", "max_tokens": 2}),
                await c.get("/health"),
                await c.post("/v1/completions", json={"prompt": "ka ro mi", "max_tokens": 2}),
                await c.post("/reset_prefix_cache"),
            ]

    with EngineServer(engine, model_name="tiny") as srv:
        ok, failed, health, refused, reset = asyncio.run(go())
    assert ok.status_code == 200
    assert failed.status_code == 500
    assert "simulated rank failure" in failed.json()["error"]["message"]
    assert health.status_code == 503 and "simulated rank failure" in health.text
    assert refused.status_code == 503 and reset.status_code == 503


# ---- the CLI ------------------------------------------------------------------------------------


class Output:
    """Collects a subprocess's merged output on a thread; waits for a line with a deadline."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self._new: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.append(line)
            self._new.put(line)
        self._new.put(None)

    def wait_for(self, needle: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{needle!r} not seen in {timeout_s} s:\n{self.text}")
            try:
                line = self._new.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"process ended before {needle!r}:\n{self.text}")
            if needle in line:
                return line

    @property
    def text(self) -> str:
        return "".join(self.lines)


def wait_until(predicate: Any, timeout_s: float, what: str) -> None:
    """Re-check `predicate` (each check is a real HTTP round trip) until it holds."""
    deadline = time.monotonic() + timeout_s
    pause = threading.Event()
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s} s")
        pause.wait(0.02)


def test_cli_serve_tp2_answers_fails_health_on_a_dead_rank_and_exits_on_sigterm(
    tiny_model, tmp_path, prompts, baseline
):
    cfg = tmp_path / "kvtier.yaml"
    cfg.write_text(f"chunk_size: {CHUNK}\nmemory_bytes: 64MiB\nload_gate: false\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    cmd = [
        sys.executable, "-m", "kvtier.cli", "serve", str(tiny_model), "--port", "0", "--tp", "2",
        "--hbm-blocks", "256", "--config", str(cfg), "--served-model-name", "tiny",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path
    )
    out = Output(proc)
    try:
        line = out.wait_for("kvtier serve: listening on http://127.0.0.1:", 60.0)
        base = line.split("listening on ")[1].split()[0]
        assert "TP=2" in line and "offload on" in line
        assert "kvtier: lookup client on ranks [0, 1] (world=2)" in out.text
        with httpx.Client(base_url=base, timeout=30.0) as c:
            assert c.get("/health").status_code == 200
            assert c.get("/v1/models").json()["data"][0]["id"] == "tiny"
            r = c.post("/v1/completions", json={"prompt": prompts[0], **GREEDY})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == baseline[0]
            out.wait_for("prompt=304 cached=0 (hbm=0 external=0) completion=8", 10.0)
            workers = psutil.Process(proc.pid).children()
            assert len(workers) == 2, workers
            workers[1].kill()
            wait_until(lambda: c.get("/health").status_code == 503, 10.0, "/health turning 503")
            health = c.get("/health").json()["error"]["message"]
            assert f"pid {workers[1].pid}) exited" in health
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, out.text
        gone, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, alive
        out.wait_for("kvtier serve: shut down cleanly", 5.0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_cli_serve_config_error_exits_nonzero_without_traceback(tiny_model):
    result = CliRunner().invoke(
        cli_app, ["serve", str(tiny_model)], env={"KVTIER_CHUNK_SIZE": "33"}
    )
    assert result.exit_code == 2
    assert "chunk_size=33 is not a positive multiple of 16" in result.output
    assert "KVTIER_CHUNK_SIZE" in result.output and "Traceback" not in result.output


def test_cli_model_init_writes_a_loadable_model(tmp_path):
    target = tmp_path / "m"
    args = ["model", "init", str(target), "--dtype", "float32", "--layers", "2", "--hidden", "128",
            "--heads", "2", "--kv-heads", "1", "--intermediate", "256", "--seed", "3"]  # fmt: skip
    result = CliRunner().invoke(cli_app, args)
    assert result.exit_code == 0, result.output
    assert f"to {target}" in result.output and "model.safetensors" in result.output
    config = json.loads((target / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["hidden_size"] == 128
    with Engine(target, EngineConfig(num_threads=1, num_blocks=32)) as eng:
        (out,) = eng.generate(["ka ro mi"], SamplingParams(temperature=0, max_tokens=4))
    assert len(out.output_token_ids) == 4
    bad = CliRunner().invoke(cli_app, ["model", "init", str(tmp_path / "x"), "--dtype", "int8"])
    assert bad.exit_code == 2 and "dtype='int8'" in bad.output
