"""Real clients against a real `kvtier serve` (TP=1 and TP=2, one server each for the module):
`vllm bench serve` (openai and openai-chat backends, random and prefix_repetition datasets),
aiperf 0.13 (chat and completions, streaming and not) and the official `openai` SDK for every
sampling and output field. Each asserts every request succeeded and the client's token counts
equal the server's counters.

A client sees one HTTP server whatever the TP size behind it, so the tests of a client's own
encoding (aiperf's runs and inputs file, `--load vllm-bench`'s exact prompts, `vllm bench
serve`'s backends and datasets) run on TP=1 only (`TP1_ONLY`); the server's counts under TP=2
are held by the bench's identities (`--load vllm-bench`: vLLM's own loop) and the SDK's fields.
Running the first four on both cost the suite a minute and a half."""

from __future__ import annotations

import asyncio
import json
import math
import random
import socketserver
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import openai
import pytest
import typer
from tokenizers import Tokenizer
from typer.testing import CliRunner

from kvtier.bench.aiperf import INPUTS_ARGS, INPUTS_NAME, load_profile_export, write_inputs
from kvtier.bench.client import run_load
from kvtier.bench.run_cli import bench_run_command
from kvtier.bench.vllm_load import VLLMBenchLoad
from kvtier.bench.workload import RequestSpec, prefix_pool
from tests.local_http import serving
from tests.native.cli_server import Served, clean_env, kvtier_serve
from tests.vllm.conftest import DRIVERS, REPO, _run
from tests.vllm.drivers.common import RESULT_PREFIX

# a server start per TP size plus client start-up: room beyond the default per-test timeout
pytestmark = pytest.mark.timeout(600)

AIPERF_SETUP = REPO / "scripts" / "setup-aiperf-env.sh"
AIPERF = REPO / ".venv-aiperf" / "bin" / "aiperf"
CONFIG = "chunk_size: 64\nmemory_bytes: 64MiB\nload_gate: false\nlookup_timeout_ms: 5000\n"
PROMPT = "Kasumi ronetavi pelo dazu. Fori make nosa teli wage buho yani doru sepa."


# the client-encoding tests: the module's TP=1 server only (see the module docstring)
TP1_ONLY = pytest.mark.parametrize("served", [1], indirect=True, ids=["tp1"])


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def served(
    request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    """One `kvtier serve` per TP size for the whole module (offload on, 64-token chunks)."""
    with kvtier_serve(tiny_model, tmp_path_factory.mktemp("clients"), tp=request.param,
                      config=CONFIG) as srv:  # fmt: skip
        yield srv


def delta(srv: Served, before: dict[str, float]) -> dict[str, float]:
    after = srv.counters()
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


# ---- vllm bench serve -------------------------------------------------------------------------

BENCH = {
    "openai-random": ["--backend", "openai", "--dataset-name", "random",
                      "--random-input-len", "96", "--random-output-len", "6"],
    "openai-chat-random": ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
                           "--dataset-name", "random", "--random-input-len", "96",
                           "--random-output-len", "6"],
    "openai-prefix-repetition": ["--backend", "openai", "--dataset-name", "prefix_repetition",
                                 "--prefix-repetition-prefix-len", "128",
                                 "--prefix-repetition-suffix-len", "16",
                                 "--prefix-repetition-num-prefixes", "2",
                                 "--prefix-repetition-output-len", "6"],
    "openai-chat-prefix-repetition": ["--backend", "openai-chat",
                                      "--endpoint", "/v1/chat/completions",
                                      "--dataset-name", "prefix_repetition",
                                      "--prefix-repetition-prefix-len", "128",
                                      "--prefix-repetition-suffix-len", "16",
                                      "--prefix-repetition-num-prefixes", "2",
                                      "--prefix-repetition-output-len", "6"],
}  # fmt: skip


@TP1_ONLY
def test_vllm_bench_serve_both_backends_and_datasets_succeed_with_the_servers_counts(
    served: Served, vllm_python: Path, vllm_env: dict[str, str]
):
    common = ["--base-url", served.base, "--model", "tiny", "--tokenizer", str(served.model_dir),
              "--num-prompts", "8", "--ignore-eos", "--temperature", "0",
              "--max-concurrency", "4", "--disable-tqdm", "--seed", "3"]  # fmt: skip
    jobs = [{"name": name, "argv": [*common, *argv]} for name, argv in BENCH.items()]
    args = json.dumps({"base_url": served.base, "jobs": jobs})
    code, out, err = _run([str(vllm_python), str(DRIVERS / "bench_serve.py"), args], vllm_env, 280)
    lines = [x for x in out.splitlines() if x.startswith(RESULT_PREFIX)]
    assert code == 0 and len(lines) == 1, err[-4000:]
    runs = json.loads(lines[0][len(RESULT_PREFIX) :])["runs"]
    assert [r["name"] for r in runs] == list(BENCH)
    for r in runs:
        assert r["completed"] == 8 and r["failed"] == 0, (r["name"], r["errors"], r["stdout_tail"])
        assert r["total_output_tokens"] == 8 * 6, r["name"]
        # the client's counts are the server's usage, and the usage is what /metrics counted
        assert r["server"]["vllm:prompt_tokens_total"] == r["total_input_tokens"], r["name"]
        assert r["server"]["vllm:generation_tokens_total"] == r["total_output_tokens"], r["name"]
        assert r["server"]["vllm:request_success_total"] == 8, r["name"]


@TP1_ONLY
def test_vllm_bench_load_sends_kvtiers_exact_prompts_and_gets_its_clients_outputs(
    served: Served, vllm_python: Path, tmp_path: Path
):
    """`--load vllm-bench`: vLLM's benchmark loop sends the bench's token-id prompts unchanged
    (the server counts exactly their tokens) and its greedy texts are the texts of the ids
    kvtier's own client gets for the same requests in the same order."""
    vocab = json.loads((served.model_dir / "config.json").read_text())["vocab_size"]
    rng = random.Random(7)
    specs = [
        RequestSpec(i, "vb", tuple(rng.randrange(3, vocab) for _ in range(40 + 8 * i)), 6)
        for i in range(5)
    ]
    ours = asyncio.run(run_load(served.base, specs, concurrency=1, model="tiny", progress=False))
    before = served.counters()
    load = VLLMBenchLoad(vllm_python, tmp_path)
    try:
        theirs = asyncio.run(load(served.base, specs, concurrency=1, model="tiny"))
        timed = [replace(s, arrival=0.4 * i) for i, s in enumerate(specs[:2])]
        again = asyncio.run(load(served.base, timed, open_loop=True, model="tiny"))
    finally:
        load.close()
    d = delta(served, before)
    assert [r.index for r in theirs.records] == [s.index for s in specs]
    assert all(r.ok for r in theirs.records + again.records), [r.error for r in theirs.records]
    assert [r.prompt_tokens for r in theirs.records] == [len(s.prompt) for s in specs]
    assert [r.completion_tokens for r in theirs.records] == [6] * 5
    sent = sum(len(s.prompt) for s in specs) + sum(len(s.prompt) for s in specs[:2])
    assert d["vllm:prompt_tokens_total"] == sent  # no ready-check or warmup request of its own
    assert d["vllm:request_success_total"] == 7
    tok = Tokenizer.from_file(str(served.model_dir / "tokenizer.json"))
    want = [tok.decode(r.output_ids, skip_special_tokens=True) for r in ours.records]
    assert [r.output_text for r in theirs.records] == want
    assert all(r.ttft is not None and r.ttft > 0 and r.token_times for r in theirs.records)
    # open loop: vLLM's self-timed replay sends each request at its arrival
    assert again.records[1].start - again.records[0].start >= 0.4 - 0.05


def test_bench_run_with_the_vllm_bench_load_closes_every_identity(
    served: Served, vllm_python: Path, tmp_path: Path
):
    """`kvtier bench run --load vllm-bench --url`: vLLM's loop sends the placed prefix pool,
    and kvtier's checks hold on what the server counted."""
    vocab = json.loads((served.model_dir / "config.json").read_text())["vocab_size"]
    out = tmp_path / "run"
    app = typer.Typer()  # one command: invoked without its name
    app.command("run")(bench_run_command)
    result = CliRunner().invoke(
        app,
        ["--url", served.base, "--vocab", str(vocab), "--load", "vllm-bench",
         "--set", f"load.vllm_python={vllm_python}", "--requests", "12",
         "--set", "workload.prefixes=2", "--set", "workload.prefix_len=128",
         "--set", "workload.isl=16", "--set", "workload.osl=4", "--concurrency", "2",
         "--set", "report.scrape_interval=200ms", "--no-html", "--out", str(out)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "summary.json").read_text())
    assert json.loads((out / "meta.json").read_text())["load"]["engine"] == "vllm-bench"
    (run,) = doc["runs"]
    w = run["windows"]["full"]
    assert w["completed"] == w["requests"] == 12 and w["osl_mismatch"] == 0, w["errors"]
    assert doc["checks"]["identities_failing"] == []
    recs = [json.loads(x) for x in (out / "records" / f"{run['arm']}-rep0.jsonl").open()]
    assert all(r["output_text"] is not None and r["prompt_tokens"] for r in recs)


@pytest.fixture
def stalled_url() -> Iterator[str]:
    """An HTTP endpoint that answers GETs (vLLM's loop reads /metrics first) with an empty 200
    and never answers a completion."""
    release = threading.Event()

    class Stall(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            if self.request.recv(65536).startswith(b"GET "):
                self.request.sendall(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 0\r\n"
                    b"Connection: close\r\n\r\n"
                )
                return
            release.wait()

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Stall)
    server.daemon_threads = True
    with serving(server) as url:
        try:
            yield url
        finally:
            release.set()  # the handlers end before the server shuts down


def test_vllm_bench_load_fails_a_request_with_no_answer_after_its_timeout(
    vllm_python: Path, stalled_url: str, tmp_path: Path
):
    """vLLM's loop would wait six hours for a silent server; the driver fails each request after
    `timeout_s` as a record with the reason, and the next load still runs."""
    specs = [RequestSpec(i, "st", (5, 6, 7, 8), 2) for i in range(3)]
    load = VLLMBenchLoad(vllm_python, tmp_path, timeout_s=1.0)
    try:
        first = asyncio.run(load(stalled_url, specs, concurrency=2, model="tiny"))
        again = asyncio.run(load(stalled_url, specs[:1], concurrency=1, model="tiny"))
    finally:
        load.close()
    records = first.records + again.records
    assert [r.index for r in first.records] == [0, 1, 2]
    assert [r.error for r in records] == ["no complete response within 1s"] * 4
    assert not any(r.ok for r in records)
    assert all(r.start > 0 for r in records)


def test_vllm_bench_load_refuses_a_multi_turn_stream_naming_the_fix(tmp_path: Path):
    turn2 = RequestSpec(1, "mt", (5, 6, 7), 2, conversation=0, turn=1, parent=0)
    with pytest.raises(ValueError, match=r"needs kvtier's client \(--load kvtier\)"):
        asyncio.run(VLLMBenchLoad(Path("/nonexistent/python"), tmp_path)("http://x", [turn2]))


# ---- aiperf -----------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def aiperf() -> Path:
    """`.venv-aiperf`'s aiperf CLI, built by scripts/setup-aiperf-env.sh when missing or stale."""
    proc = subprocess.run(["bash", str(AIPERF_SETUP)], cwd=REPO, capture_output=True, text=True,
                          timeout=1800, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return AIPERF


@TP1_ONLY
def test_aiperf_sends_a_bench_stream_written_as_its_inputs_file_token_for_token(
    served: Served, aiperf: Path, tmp_path: Path
):
    """`bench run` writes its stream as aiperf's inputs.json: aiperf sends those exact
    token-id prompts, in order (the server counts exactly their tokens and hits every prefix
    seen before), and its export reads back into a report."""
    vocab = json.loads((served.model_dir / "config.json").read_text())["vocab_size"]
    specs = prefix_pool(2, 128, 16, 8, seed=31, vocab=vocab, max_tokens=4)
    inputs = write_inputs(tmp_path / INPUTS_NAME, specs, model=None)
    before = served.counters()
    env = {**clean_env(), "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_DISABLE_TELEMETRY": "1"}
    cmd = [str(aiperf), "profile", "--model", "tiny", "--url", served.base,
           "--tokenizer", str(served.model_dir), "--input-file", str(inputs), *INPUTS_ARGS.split(),
           "--request-count", str(len(specs)), "--concurrency", "1",
           "--use-server-token-count", "--artifact-dir", str(tmp_path / "out"),
           "--no-server-metrics", "--ui-type", "none"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    d = delta(served, before)
    assert d["vllm:prompt_tokens_total"] == sum(len(s.prompt) for s in specs)
    assert d["vllm:request_success_total"] == len(specs)
    seen: set[int | None] = set()
    reused = 0
    for s in specs:  # one at a time, in order: a prefix seen before is a hit, whole
        reused += 128 if s.prefix_id in seen else 0
        seen.add(s.prefix_id)
    hits = d["vllm:prefix_cache_hits_total"] + d["vllm:external_prefix_cache_hits_total"]
    assert reused > 0 and hits == reused
    run = load_profile_export(tmp_path / "out")
    assert run.summary["request_count"] == len(specs)


AIPERF_RUNS = [("chat", True), ("chat", False), ("completions", True), ("completions", False)]


@TP1_ONLY
def test_aiperf_chat_and_completions_streaming_and_not_succeed_with_the_servers_counts(
    served: Served, aiperf: Path, tmp_path: Path
):
    # the four runs go at once (each is mostly aiperf's own start-up), so the server's counters
    # are held against their sum; each run's own requests must all have succeeded
    before = served.counters()
    # a local tokenizer directory: any hub call (there should be none) fails at once on loopback
    env = {**clean_env(), "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_DISABLE_TELEMETRY": "1"}
    procs = []
    for endpoint, streaming in AIPERF_RUNS:
        out = tmp_path / f"{endpoint}-{'stream' if streaming else 'plain'}"
        cmd = [str(aiperf), "profile", "--model", "tiny", "--url", served.base,
               "--endpoint-type", endpoint, "--tokenizer", str(served.model_dir),
               "--request-count", "6", "--concurrency", "2", "--isl", "48", "--osl", "5",
               "--extra-inputs", "ignore_eos:true", "--use-server-token-count",
               "--random-seed", "1", "--artifact-dir", str(out), "--no-server-metrics",
               "--ui-type", "none", *(["--streaming"] if streaming else [])]  # fmt: skip
        procs.append((out, subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT, text=True, env=env)))
    prompt = completion = 0.0
    for out, proc in procs:
        log, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, (out.name, log[-4000:])
        doc = json.loads((out / "profile_export_aiperf.json").read_text())
        assert doc["request_count"]["avg"] == 6, (out.name, doc.get("error_summary"))
        assert not doc.get("error_summary"), (out.name, doc["error_summary"])
        assert doc["total_usage_completion_tokens"]["avg"] == 6 * 5, out.name
        prompt += doc["total_usage_prompt_tokens"]["avg"]
        completion += doc["total_usage_completion_tokens"]["avg"]
    d = delta(served, before)
    assert d["vllm:request_success_total"] == 6 * len(AIPERF_RUNS)
    assert d["vllm:prompt_tokens_total"] == prompt
    assert d["vllm:generation_tokens_total"] == completion


# ---- the openai SDK, every field --------------------------------------------------------------


def test_openai_sdk_every_field(served: Served):
    client = openai.OpenAI(base_url=f"{served.base}/v1", api_key="none", max_retries=0)
    before = served.counters()
    usage = {"prompt": 0, "completion": 0, "requests": 0}

    def count(resp: Any, per_prompt: int = 1) -> Any:
        # the server prefills a prompt once per sequence it generates for it
        usage["prompt"] += resp.usage.prompt_tokens * per_prompt
        usage["completion"] += resp.usage.completion_tokens
        usage["requests"] += per_prompt * max(1, len(resp.choices) // per_prompt)
        return resp

    def complete(per_prompt: int = 1, **kw: Any) -> Any:
        kw.setdefault("max_tokens", 6)
        extra = {k: kw.pop(k) for k in ("top_k", "min_p", "repetition_penalty", "ignore_eos",
                                       "min_tokens", "return_token_ids",
                                       "include_stop_str_in_output") if k in kw}  # fmt: skip
        resp = client.completions.create(model="tiny", extra_body=extra, **kw)
        return count(resp, per_prompt)

    greedy = complete(prompt=PROMPT, temperature=0, return_token_ids=True, ignore_eos=True)
    ids = greedy.choices[0].token_ids
    text = greedy.choices[0].text
    # stop: the text ends before the stop string, finish_reason says stop, stop_reason names it
    stop = text.strip()[2:4]
    stopped = complete(prompt=PROMPT, temperature=0, stop=[stop], ignore_eos=True)
    assert stopped.choices[0].text == text[: text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    kept = complete(prompt=PROMPT, temperature=0, stop=stop, include_stop_str_in_output=True,
                    ignore_eos=True)  # fmt: skip
    assert kept.choices[0].text == text[: text.index(stop) + len(stop)]
    # n and best_of: n choices, indices 0..n-1, seeded children differ
    many = complete(3, prompt=PROMPT, n=3, seed=5, temperature=1.0, logprobs=0, ignore_eos=True)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert len({c.text for c in many.choices}) > 1
    best = complete(3, prompt=PROMPT, n=1, best_of=3, seed=5, temperature=1.0, logprobs=0,
                    ignore_eos=True)  # fmt: skip
    cumulative = [sum(c.logprobs.token_logprobs) for c in many.choices]
    assert math.isclose(sum(best.choices[0].logprobs.token_logprobs), max(cumulative),
                        rel_tol=1e-5)  # fmt: skip
    # logprobs: the greedy token is the likeliest, 2 alternatives each
    lp = complete(prompt=PROMPT, temperature=0, logprobs=2, ignore_eos=True).choices[0].logprobs
    assert len(lp.tokens) == 6 and all(len(t) >= 2 for t in lp.top_logprobs)
    pairs = zip(lp.token_logprobs, lp.top_logprobs, strict=True)
    assert all(math.isclose(v, max(t.values())) for v, t in pairs)
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == text
    # echo: the prompt comes first
    echo = complete(prompt=PROMPT, temperature=0, echo=True, ignore_eos=True)
    assert echo.choices[0].text == PROMPT + text
    # logit_bias forces a token; penalties, top_k, min_p change nothing structural
    forced = complete(prompt=PROMPT, temperature=0, logit_bias={"42": 100}, ignore_eos=True,
                      return_token_ids=True)  # fmt: skip
    assert forced.choices[0].token_ids == [42] * 6
    varied = complete(prompt=PROMPT, temperature=0.8, top_p=0.9, top_k=5, min_p=0.05, seed=1,
                      presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
                      ignore_eos=True, min_tokens=2)  # fmt: skip
    assert varied.usage.completion_tokens == 6
    rep = complete(prompt=PROMPT, temperature=0, frequency_penalty=2.0, ignore_eos=True,
                   return_token_ids=True, max_tokens=12)  # fmt: skip
    assert len(rep.choices[0].token_ids) == 12 and rep.choices[0].token_ids[0] == ids[0]
    # batched prompts: one choice per prompt, in order, as separate requests would give
    batch = complete(prompt=[PROMPT, "ka ro mi"], temperature=0, ignore_eos=True)
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[0].text == text
    # streaming with usage: deltas add up, a usage chunk closes it
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    usage["prompt"] += chunks[-1].usage.prompt_tokens
    usage["completion"] += chunks[-1].usage.completion_tokens
    usage["requests"] += 1
    assert ids == greedy.choices[0].token_ids

    # chat: the template, logprobs, stop, n, streaming
    messages = [{"role": "user", "content": PROMPT}]
    chat = count(client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=2, extra_body={"ignore_eos": True},
    ))  # fmt: skip
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    assert len(chat.choices[0].logprobs.content) == 6
    assert all(len(e.top_logprobs) == 2 for e in chat.choices[0].logprobs.content)
    chat_n = count(client.chat.completions.create(
        model="tiny", messages=messages, max_completion_tokens=4, n=2, seed=3,
        stop=["\n"], extra_body={"ignore_eos": True},
    ), per_prompt=2)  # fmt: skip
    assert [c.index for c in chat_n.choices] == [0, 1]
    stream = list(client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ))  # fmt: skip
    content = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert content == chat.choices[0].message.content
    usage["prompt"] += stream[-1].usage.prompt_tokens
    usage["completion"] += stream[-1].usage.completion_tokens
    usage["requests"] += 1

    # errors come back as the SDK's typed errors with OpenAI's body
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt="hi", temperature=3)
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi")
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="hi")

    # every token the SDK was told about is one the server counted (n>1 prompts count per
    # sequence on the server, once per prompt in usage: vLLM's accounting)
    d = delta(served, before)
    assert d["vllm:generation_tokens_total"] == usage["completion"]
    assert d["vllm:prompt_tokens_total"] == usage["prompt"]
    assert d["vllm:request_success_total"] == usage["requests"]


def test_openai_sdk_retention_hints_in_both_dialects(served: Served):
    """The SDK's own prompt_cache_key / prompt_cache_retention, and Anthropic-style
    cache_control on a content part, reach kvtier; usage carries what was granted."""
    client = openai.OpenAI(base_url=f"{served.base}/v1", api_key="none", max_retries=0)
    system = " ".join([PROMPT] * 12)
    resp = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": system}, {"role": "user", "content": "Hi."}],
        max_tokens=2,
        temperature=0,
        prompt_cache_key="sdk-conversation",
        prompt_cache_retention="in_memory",
    )
    granted = resp.usage.model_extra["kvtier_retention"]
    assert granted["status"] == "retained" and granted["ttl_s"] == 300.0
    assert granted["retained_tokens"] >= 64 and granted["retained_tokens"] % 64 == 0
    marked = client.chat.completions.create(
        model="tiny",
        messages=[
            {"role": "system", "content": [
                {"type": "text", "text": system, "cache_control": {"type": "ephemeral",
                                                                   "ttl": "1h"}},
            ]},
            {"role": "user", "content": "Hi."},
        ],  # type: ignore[list-item]
        max_tokens=2,
        temperature=0,
    )  # fmt: skip
    assert marked.usage.model_extra["kvtier_retention"]["ttl_s"] == 3600.0
    # a request without a hint gets OpenAI's usage object exactly
    plain = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi."}], max_tokens=2
    )
    assert "kvtier_retention" not in (plain.usage.model_extra or {})
