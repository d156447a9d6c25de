"""bench run: durations, the stream, start-cut analysis on synthetic records, the load generator
(closed loop with conversations, open loop on a fake clock, durations), arms and pool checks,
runs against a stdlib mock server (`--arm` commands and `--url`), and one real ON/OFF run
against `kvtier serve` subprocesses."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer
import yaml
from typer.testing import CliRunner

from kvtier.bench import analysis, replay
from kvtier.bench.aiperf import INPUTS_NAME
from kvtier.bench.arms import ArmSpec, ServerProcess, alternate, parse_arm
from kvtier.bench.client import STANDIN, LoadOptions, Record, completion_body, run_load
from kvtier.bench.ports import free_port
from kvtier.bench.replay import (
    RunConfig,
    WorkloadConfig,
    analyse,
    build_specs,
    load_run,
    parse_seconds,
)
from kvtier.bench.report import PNGS, bench_report_command
from kvtier.bench.run_cli import bench_run_command
from kvtier.bench.workload import (
    MULTI_TURN,
    TRACE,
    multi_turn,
    no_reuse,
    read_specs,
    with_arrivals,
)
from kvtier.errors import ConfigError
from kvtier.native.modelgen import init_model
from kvtier.scrape import EXT_HITS, LOAD_DECISION_TOKENS, MetricSet

VOCAB = 2048
MOCK = str(Path(__file__).with_name("mock_openai.py"))
PY = sys.executable

app = typer.Typer()
app.command("run")(bench_run_command)
app.command("report")(bench_report_command)


def cli(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.output


# ---- small pieces ----------------------------------------------------------------------------


def test_parse_seconds() -> None:
    assert parse_seconds("600s") == 600.0
    assert parse_seconds("10m") == 600.0
    assert parse_seconds("1.5h") == 5400.0
    assert parse_seconds("250ms") == 0.25
    assert parse_seconds("42") == 42.0
    with pytest.raises(ConfigError, match="--from 'soon' is not a duration"):
        parse_seconds("soon")


def test_build_specs_takes_whole_turn_rounds_and_sets_arrivals(tmp_path: Path) -> None:
    wc = WorkloadConfig(kind=MULTI_TURN, conversations=3, turns=3, isl=8, osl=2, prefix_len=0)
    specs = build_specs(replace_wc(wc, requests=5))
    assert [(s.turn, s.conversation) for s in specs] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    with pytest.raises(ConfigError, match="--requests 10 exceeds 3 conversations x 3 turns"):
        build_specs(replace_wc(wc, requests=10))
    poisson = build_specs(replace_wc(wc, rate=20.0))
    assert poisson[0].arrival == 0.0 and all(s.arrival is not None for s in poisson)
    assert replay.is_open_loop(replace_wc(wc, rate=20.0)) and not replay.is_open_loop(wc)
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"timestamp": 5, "input_length": 20, "output_length": 2, "hash_ids": [1, 2]}\n'
    )
    twc = WorkloadConfig(kind=TRACE, trace=str(trace), trace_block=16, osl=8)
    assert replay.is_open_loop(twc)
    (t,) = build_specs(twc)
    assert (len(t.prompt), t.max_tokens, t.arrival) == (20, 2, 0.0)
    (closed,) = build_specs(replace_wc(twc, ignore_timestamps=True))
    assert closed.arrival is None and not replay.is_open_loop(
        replace_wc(twc, ignore_timestamps=True)
    )


def replace_wc(wc: WorkloadConfig, **kw: Any) -> WorkloadConfig:
    return WorkloadConfig(**{**wc.to_json(), **kw})


def test_arms_parse_alternate_and_check_the_pool(tmp_path: Path) -> None:
    a = parse_arm("on=kvtier serve m --port {port} --hbm-blocks 64 --offload")
    assert a.name == "on" and a.argv[-1] == "--offload"
    assert a.command("h", 9)[3:5] == ["--port", "9"]
    assert a.flag("--hbm-blocks") == "64"
    assert parse_arm("x=serve --kv-cache-memory-bytes=1G").flag("--kv-cache-memory-bytes") == "1G"
    with pytest.raises(ConfigError, match="must look like NAME="):
        parse_arm("just-a-command")
    with pytest.raises(ConfigError, match="arm name 'a b'"):
        ArmSpec("a b", ("x",))
    assert alternate(["a", "b", "c"], 2) == [
        (0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a"),
    ]  # fmt: skip
    b = parse_arm("off=kvtier serve m --port {port} --hbm-blocks 128 --no-offload")
    cfg = RunConfig(
        out_dir=tmp_path / "r", workload=WorkloadConfig(requests=4, prefix_len=16, prefixes=2),
        load=LoadOptions(), arms=(a, b),
    )  # fmt: skip
    # refused before any server starts or any file is written
    with pytest.raises(ConfigError, match=r"--hbm-blocks: on=64, off=128"):
        replay.run(cfg)
    assert not (tmp_path / "r").exists()
    c = parse_arm("off=kvtier serve m --port {port} --no-offload")
    with pytest.raises(ConfigError, match=r"--hbm-blocks: on=64, off=\(default\)"):
        replay.run(RunConfig(**{**cfg.__dict__, "arms": (a, c)}))


def test_command_line_errors_name_the_fix(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["run", "--url", "http://127.0.0.1:9", "--out", str(tmp_path / "x")]
    )
    assert result.exit_code == 2 and "arms.vocab (--vocab) is needed" in result.output
    result = CliRunner().invoke(app, ["run", "--url", "http://h:1", "--arm", "a=x", "--vocab", "9"])
    assert result.exit_code == 2
    assert "arms.servers (--arm) and arms.url (--url) exclude each other" in result.output
    result = CliRunner().invoke(
        app,
        [
            "run",
            "--url",
            "http://h:1",
            "--vocab",
            "99",
            "--set",
            "load.repeat=2",
            "--out",
            str(tmp_path / "y"),
        ],
    )
    assert result.exit_code == 2 and "set load.reset=true" in result.output
    result = CliRunner().invoke(app, ["run", "--workload", "chat", "--vocab", "9", "--url", "u"])
    assert result.exit_code == 2 and "workload.kind (--workload) 'chat'" in result.output
    result = CliRunner().invoke(
        app, ["run", "--load", "vllm-bench", "--workload", "multi-turn", "--duration", "5s",
              "--vocab", "9", "--url", "u"],
    )  # fmt: skip
    assert result.exit_code == 2
    said = " ".join(result.output.split())
    assert "vllm-bench does not take workload.kind (--workload) multi-turn" in said
    assert "workload.duration (--duration); use kvtier's client" in said
    result = CliRunner().invoke(app, ["run", "--load", "aiperf", "--vocab", "9", "--url", "u"])
    assert result.exit_code == 2 and "load.engine (--load) 'aiperf' is not one of" in result.output
    result = CliRunner().invoke(
        app, ["run", "--load", "vllm-bench", "--set", f"load.vllm_python={tmp_path / 'no-python'}",
              "--vocab", "9", "--url", "u"],
    )  # fmt: skip
    assert result.exit_code == 2 and "no-python does not exist; build it with" in result.output


# ---- start-cut analysis on synthetic records -------------------------------------------------


def rec(i: int, start: float, ttft_ms: float, *, prompt: int = 100, cached: int = 0) -> Record:
    first = start + ttft_ms / 1e3
    return Record(
        index=i, tag="t", prefix_id=None, start=start, first_token=first, end=first + 0.03,
        prompt_tokens=prompt, cached_tokens=cached, completion_tokens=4, max_tokens=4,
        sent_prompt_tokens=prompt, output_ids=[1, 2, 3, 4],
        token_times=[first, first + 0.01, first + 0.02, first + 0.03],
    )  # fmt: skip


def test_start_cut_keeps_requests_sent_after_the_cut() -> None:
    # a cold start: 10 requests in the first 10 s are slow and miss; 10 after hit and are fast
    t0 = 500.0
    early = [rec(i, t0 + i, 200.0) for i in range(10)]
    late = [rec(10 + i, t0 + 10 + i, 20.0 + i, cached=80) for i in range(10)]
    records = early + late
    finished = t0 + 20.0
    full = analysis.summarize_window(records, t0, finished, 0.0)
    cut = analysis.summarize_window(records, t0, finished, 10.0)
    assert full is not None and cut is not None
    assert (full.completed, cut.completed) == (20, 10)
    assert cut.ttft_p50_ms == pytest.approx(24.5)  # 20..29 ms
    assert cut.ttft_p90_ms == pytest.approx(28.1)
    assert full.ttft_p90_ms == pytest.approx(200.0)
    assert cut.request_throughput == pytest.approx(10 / 10.0)  # from the cut to the end
    assert cut.cache_read_pct == pytest.approx(80.0)
    assert full.cache_read_pct == pytest.approx(40.0)
    assert cut.itl_p50_ms == pytest.approx(10.0)
    assert analysis.after_cut(records, t0, 10.0) == late
    # a cut past the last send leaves no window
    assert analysis.summarize_window(records, t0, finished, 25.0) is None
    buckets = analysis.time_series(records, t0, 5.0)
    assert [b.requests for b in buckets] == [5, 5, 5, 5]
    assert [b.hit_rate for b in buckets] == [0.0, 0.0, 0.8, 0.8]
    assert buckets[2].ttft_p50_ms == pytest.approx(22.0)


def test_server_counters_of_a_cut_window_start_at_the_last_sample_before_it() -> None:
    samples = [
        {"t": 0.0, "counters": {"prompt_tokens": 0, "hbm_hits": 0, "hbm_queries": 0}},
        {"t": 2.0, "counters": {"prompt_tokens": 1000, "hbm_hits": 100, "hbm_queries": 1000}},
        {"t": 4.0, "counters": {"prompt_tokens": 2000, "hbm_hits": 900, "hbm_queries": 2000}},
    ]
    after = MetricSet.parse(
        "# TYPE vllm:prompt_tokens counter\nvllm:prompt_tokens_total 3000\n"
        "# TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total 1700\n"
    )
    c = analysis.counters_since(samples, 3.0, after)
    assert c is not None and (c.prompt_tokens, c.hbm_hits) == (2000.0, 1600.0)
    assert analysis.counters_since(samples, -1.0, after) is None
    hits = analysis.server_hit_series(samples, 0.0)
    assert hits == [{"t_s": 2.0, "hit_rate": 0.1}, {"t_s": 4.0, "hit_rate": 0.8}]


def test_spread_over_repetitions() -> None:
    s = analysis.spread([1.0, 2.0, 3.0, float("nan")])
    assert (s.n, s.mean, s.sd, s.min, s.max) == (3, 2.0, 1.0, 1.0, 3.0)
    assert analysis.spread([5.0]).to_json()["sd"] is None
    assert analysis.spread([]).n == 0


# ---- the load generator ----------------------------------------------------------------------


class Mock:
    """An async completions handler: outputs are a function of the prompt; records bodies,
    send order and the most requests it saw at once."""

    def __init__(self, fail_prompt_len: int | None = None, tick: Callable[[], None] | None = None):
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = 0
        self.peak = 0
        self.fail_prompt_len = fail_prompt_len
        self.tick = tick

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            await asyncio.sleep(0)  # let other requests in, as a server would
            if self.tick is not None:
                self.tick()
            if len(body["prompt"]) == self.fail_prompt_len:
                return httpx.Response(500, json={"error": "boom"})
            ids = [(sum(body["prompt"]) + k) % 1000 + 3 for k in range(body["max_tokens"])]
            chunks = [{"choices": [{"index": 0, "token_ids": [t], "text": "x"}]} for t in ids]
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(ids)}
            chunks.append({"choices": [], "usage": usage})
            text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
            return httpx.Response(200, content=text.encode())
        finally:
            self.in_flight -= 1


def _aa_doc(open_loop: bool, full: dict[str, dict[str, float]]) -> dict[str, Any]:
    runs = [{"arm": a, "rep": 0, "windows": {"full": w}} for a, w in full.items()]
    return {
        "baseline": "off", "arms": dict.fromkeys(full), "runs": runs,
        "meta": {"load": {"open_loop": open_loop}},
    }  # fmt: skip


def test_open_loop_throughput_is_the_schedules_and_is_not_judged_against_the_aa_band() -> None:
    """A roomy trace run, open loop: every arm finished the schedule, so throughputs read
    0.99999x ON and 1.000004x A/A; judging them said FAIL on the fifth digit."""
    same = {"output_throughput": 50.805, "request_throughput": 3.6443}
    full = {
        "on": {**same, "output_throughput": 50.80504, "ttft_p50_ms": 27.3},
        "off": {**same, "output_throughput": 50.80571, "ttft_p50_ms": 36.0},
        "off_again": {**same, "output_throughput": 50.80590, "ttft_p50_ms": 33.9},
    }
    for open_loop in (True, False):
        report = replay.Report("run", "t")
        replay._aa_rows(report, _aa_doc(open_loop, full))
        rows = {r.id: r for r in report.rows}
        ttft = rows["aa.on.ttft_p50_ms"]
        assert ttft.target is not None and ttft.passed is True
        tput = rows["aa.on.output_throughput"]
        if open_loop:
            assert tput.target is None and tput.passed is None
            assert "not judged" in tput.label
        else:  # closed loop, throughput is the server's: judged, and 0.99999x is no gain
            assert tput.passed is False


def test_closed_loop_runs_turns_in_order_with_real_outputs() -> None:
    specs = multi_turn(3, 3, 6, seed=0, vocab=VOCAB, max_tokens=2)
    mock = Mock()
    res = asyncio.run(
        run_load(
            "http://m", specs, concurrency=2, progress=False,
            transport=httpx.MockTransport(mock),
        )
    )  # fmt: skip
    assert [r.index for r in res.records] == list(range(9)) and all(r.ok for r in res.records)
    assert mock.peak <= 2
    by_index = {r.index: r for r in res.records}
    sent = {tuple(b["prompt"]) for b in mock.bodies}
    for s in specs:
        r = by_index[s.index]
        assert (r.conversation, r.turn) == (s.conversation, s.turn)
        if s.parent is None:
            assert s.prompt in sent
            continue
        parent = by_index[s.parent]
        assert r.start >= parent.end  # a turn waits for the previous one
        # the prompt sent is the previous prompt + its real output + the new user tokens
        prev = next(b["prompt"] for b in mock.bodies if len(b["prompt"]) == parent.prompt_tokens
                    and tuple(b["prompt"][:2]) == s.prompt[:2])  # fmt: skip
        assert r.prompt_tokens == len(prev) + 2 + 6
        assert tuple(prev + parent.output_ids + list(s.prompt[-6:])) in sent
    # with stand-ins the stream goes out exactly as generated
    mock2 = Mock()
    asyncio.run(
        run_load(
            "http://m", specs, concurrency=2, progress=False, history=STANDIN,
            transport=httpx.MockTransport(mock2),
        )
    )  # fmt: skip
    assert {tuple(b["prompt"]) for b in mock2.bodies} == {s.prompt for s in specs}


def test_a_failed_turn_skips_the_rest_of_its_conversation() -> None:
    specs = multi_turn(2, 3, 6, seed=0, vocab=VOCAB, max_tokens=2, n_prefixes=1, prefix_len=4)
    # conversation lengths are equal per turn: fail turn 1 (4 + 6 + 2 + 6 = 18 tokens) of both
    res = asyncio.run(
        run_load(
            "http://m", specs, concurrency=2, progress=False,
            transport=httpx.MockTransport(Mock(fail_prompt_len=18)),
        )
    )  # fmt: skip
    by_turn = {(r.conversation, r.turn): r for r in res.records}
    assert by_turn[(0, 0)].ok and "HTTP 500" in (by_turn[(0, 1)].error or "")
    skipped = by_turn[(0, 2)]
    assert not skipped.sent and "skipped: previous turn" in (skipped.error or "")
    assert len(res.records) == 6


class FakeTime:
    """A clock that only `sleep` moves: a sleeper yields once, then time jumps to its deadline
    (sleepers resume first-in first-out, so sorted arrivals wake in deadline order)."""

    def __init__(self) -> None:
        self.now = 100.0

    def clock(self) -> float:
        return self.now

    async def sleep(self, s: float) -> None:
        target = self.now + s
        await asyncio.sleep(0)
        self.now = max(self.now, target)


def test_open_loop_sends_at_the_arrivals_and_stops_at_the_duration() -> None:
    ft = FakeTime()
    specs = with_arrivals(no_reuse(5, 8, seed=0, vocab=VOCAB), [0.0, 0.5, 1.0, 2.5, 4.0])
    res = asyncio.run(
        run_load(
            "http://m", specs, open_loop=True, duration_s=3.0, progress=False,
            clock=ft.clock, sleep=ft.sleep, transport=httpx.MockTransport(Mock()),
        )
    )  # fmt: skip
    assert [r.index for r in res.records] == [0, 1, 2, 3]
    assert [r.start - res.started for r in res.records] == [0.0, 0.5, 1.0, 2.5]
    assert [r.scheduled for r in res.records] == [r.start for r in res.records]
    assert (res.unsent, res.stopped_by) == (1, "duration")
    with pytest.raises(ValueError, match="needs an arrival"):
        asyncio.run(run_load("http://m", no_reuse(2, 8, 0, VOCAB), open_loop=True))


def test_closed_loop_duration_stops_new_sends() -> None:
    ft = FakeTime()

    def tick() -> None:
        ft.now += 1.0  # each request takes one second of fake time

    specs = no_reuse(10, 8, seed=0, vocab=VOCAB)
    res = asyncio.run(
        run_load(
            "http://m", specs, concurrency=1, duration_s=3.5, progress=False, clock=ft.clock,
            transport=httpx.MockTransport(Mock(tick=tick)),
        )
    )  # fmt: skip
    assert len(res.records) == 4 and res.unsent == 6 and res.stopped_by == "duration"


# ---- runs against a stdlib mock server -------------------------------------------------------


def mock_arm(name: str, *extra: str) -> str:
    return f"{name}={PY} {MOCK} {{port}} --hbm-blocks 40 {' '.join(extra)}"


def test_run_with_arm_commands_against_the_mock(tmp_path: Path) -> None:
    out = tmp_path / "run"
    # the run spec as a file, as docs/benchmarks.md shows it; the flags lay the rest over it
    spec = tmp_path / "run.yaml"
    servers = {name: mock_arm(name).partition("=")[2] for name in ("a", "b")}
    spec.write_text(yaml.safe_dump({
        "workload": {"kind": "multi-turn", "conversations": 4, "turns": 3, "isl": 16, "osl": 4,
                     "prefixes": 2, "prefix_len": 32, "concurrency": 2, "bust_id": 5},
        "arms": {"servers": servers, "baseline": "b"},
        "load": {"repeat": 2},
        "report": {"scrape_interval": "50ms", "bucket": "100ms"},
    }, sort_keys=False))  # fmt: skip
    text = cli("run", str(spec), "--vocab", str(VOCAB), "--out", str(out))
    assert "run directory:" in text
    meta = json.loads((out / "meta.json").read_text())
    assert meta["complete"] and meta["order"] == [[0, "a"], [0, "b"], [1, "b"], [1, "a"]]
    assert meta["workload"]["bust"] == 5
    # the stream for aiperf: a session per conversation, its turns' exact token-id prompts
    specs = read_specs(out / "workload.jsonl")
    sessions = json.loads((out / INPUTS_NAME).read_text())["data"]
    assert [x["session_id"] for x in sessions] == ["c0", "c1", "c2", "c3"]
    sent = [p for x in sessions for p in x["payloads"]]
    by_conv = sorted(specs, key=lambda sp: (sp.conversation, sp.index))
    assert sent == [completion_body(sp) for sp in by_conv] and len(sent) == 12
    # the ceiling's HBM pool and block size come from the arms' own flags
    assert meta["ceiling"]["hbm_blocks"] == 40 and meta["ceiling"]["block_size"] == 16
    for rep, name in meta["order"]:
        lines = (out / "records" / f"{name}-rep{rep}.jsonl").read_text().splitlines()
        assert len(lines) == 12
        scrapes = json.loads((out / "scrapes" / f"{name}-rep{rep}.json").read_text())
        assert (
            scrapes["before"] and scrapes["after"] and scrapes["log"] == f"logs/{name}-rep{rep}.log"
        )
    doc = json.loads((out / "summary.json").read_text())
    assert doc["checks"]["identities_failing"] == []
    assert doc["checks"]["pool_checked_by"] == "commands + vllm:cache_config_info"
    for run in doc["runs"]:
        c = run["counters"]["full"]
        assert c["prompt_tokens"] == run["windows"]["full"]["total_input_tokens"]
        # the mock is an LRU of 40 blocks with decode blocks, as the HBM ceiling assumes;
        # requests run two at a time, so the measured rate can only be at or below it
        hit = run["hit_rate_pct"]["full"]["server"]
        assert 0 < hit <= 100 * run["ceilings"]["full"]["hbm"]["hit_rate"] + 1e-9
        assert run["series"]["residency"]["memory"][-1][1] > 0
    assert {r["id"] for r in doc["table"]["rows"]} >= {"full.a.ttft_p50_ms", "full.b.hit_rate"}
    assert all((out / p).stat().st_size > 5 * 1024 for p in PNGS)


def test_run_against_a_url_with_reset_and_no_metrics(tmp_path: Path) -> None:
    port = free_port()
    argv = [PY, MOCK, str(port), "--no-metrics"]
    with ServerProcess(argv, {}, f"http://127.0.0.1:{port}", tmp_path / "mock.log"):
        out = tmp_path / "run"
        cli(
            "run", "--url", f"http://127.0.0.1:{port}", "--vocab", str(VOCAB), "--requests", "12",
            "--set", "workload.prefixes=2", "--set", "workload.prefix_len=32",
            "--set", "workload.isl=8", "--set", "workload.osl=2", "--set", "load.repeat=2",
            "--set", "load.reset=true", "--set", "arms.hbm_blocks=64", "--out", str(out),
            "--no-html",
        )  # fmt: skip
    doc = json.loads((out / "summary.json").read_text())
    assert list(doc["arms"]) == ["endpoint"] and doc["arms"]["endpoint"]["reps"] == 2
    assert not (out / "report.html").exists()
    runs = doc["runs"]
    # no /metrics: client-side numbers only, and the reset made both repetitions alike
    assert all(r["counters"]["full"] is None and r["identities"] == [] for r in runs)
    assert runs[0]["hit_rate_pct"]["full"]["client"] == runs[1]["hit_rate_pct"]["full"]["client"]
    assert runs[0]["hit_rate_pct"]["full"]["client"] > 0
    rows = {r["id"]: r for r in doc["table"]["rows"]}
    assert "(client)" in rows["full.endpoint.hit_rate"]["label"]
    # and the report renders later, from the directory alone
    cli("report", str(out))
    assert (out / "report.html").is_file()


def test_trace_replay_on_timestamps_against_the_mock(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 1000 * i, "input_length": 40, "output_length": 3, "hash_ids": [1, 2, 10 + i]}
        for i in range(6)
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    cli(
        "run", "--arm", mock_arm("m"), "--vocab", str(VOCAB), "--workload", "trace",
        "--trace", str(trace), "--set", "workload.trace_block=16",
        "--set", "workload.time_scale=0.02", "--set", "workload.cache_bust=none",
        "--out", str(out), "--no-html",
    )  # fmt: skip
    records = [json.loads(x) for x in (out / "records" / "m-rep0.jsonl").read_text().splitlines()]
    assert [r["scheduled"] - records[0]["scheduled"] for r in records] == pytest.approx(
        [0.02 * i for i in range(6)]
    )
    doc = json.loads((out / "summary.json").read_text())
    run = doc["runs"][0]
    # hash ids 1, 2 are shared: every request after the first hits its first 32 tokens
    assert run["windows"]["full"]["total_cached_tokens"] == 5 * 32
    assert run["ceilings"]["full"]["infinite"]["hit_tokens"] == 5 * 32


# ---- one real ON/OFF run ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def multi_turn_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One ON/OFF multi-turn run against `kvtier serve`, every hit loaded (`load_policy:
    always`: on a loaded host the cost policy may recompute them, see the test below)."""
    tmp_path = tmp_path_factory.mktemp("multi-turn")
    model = init_model(tmp_path / "model", dtype="float32")
    out = tmp_path / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVTIER_LOAD_POLICY", "always")
        # the model row holds the live arm to its hits: a lookup a loaded host answers after
        # the 200 ms default is a hit lost to the host, not to the tier
        mp.setenv("KVTIER_LOOKUP_TIMEOUT_MS", "2000")
        _multi_turn_cli(model, out)
    return out


def _multi_turn_cli(model: Path, out: Path) -> None:
    cli(
        "run", "--set", f"arms.model_dir={model}", "--set", "arms.tp=1",
        "--workload", "multi-turn", "--set", "workload.conversations=6",
        "--set", "workload.turns=3", "--set", "workload.prefixes=2",
        "--set", "workload.prefix_len=64", "--set", "workload.isl=32", "--set", "workload.osl=4",
        "--requests", "18", "--concurrency", "2", "--set", "arms.hbm_blocks=32",
        "--set", "arms.chunk_size=16", "--set", "report.scrape_interval=200ms",
        "--set", "report.bucket=1s", "--out", str(out),
    )  # fmt: skip


@pytest.mark.timeout(120)
def test_multi_turn_on_off_against_kvtier_serve(multi_turn_run: Path) -> None:
    out = multi_turn_run
    doc = json.loads((out / "summary.json").read_text())
    assert set(doc["arms"]) == {"on", "off"} and doc["baseline"] == "off"
    for run in doc["runs"]:
        w = run["windows"]["full"]
        assert w["completed"] == w["requests"] == 18, w["errors"]
        assert w["osl_mismatch"] == 0
        assert run["exit_code"] == 0
    failing = doc["checks"]["identities_failing"]
    assert failing == [], failing
    on = next(r for r in doc["runs"] if r["arm"] == "on")
    off = next(r for r in doc["runs"] if r["arm"] == "off")
    assert on["offload"] is True and off["offload"] is False
    assert on["counters"]["full"]["ext_hits"] > 0 and off["counters"]["full"]["ext_hits"] == 0
    # greedy outputs agree, so both arms sent the same multi-turn prompts
    recs = {
        arm: [json.loads(x) for x in (out / "records" / f"{arm}-rep0.jsonl").read_text().split()]
        for arm in ("on", "off")
    }
    assert [r["output_ids"] for r in recs["on"]] == [r["output_ids"] for r in recs["off"]]
    assert [r["prompt_tokens"] for r in recs["on"]] == [r["prompt_tokens"] for r in recs["off"]]
    turn1 = next(r for r in recs["on"] if r["turn"] == 1)
    turn0 = next(
        r for r in recs["on"] if r["turn"] == 0 and r["conversation"] == turn1["conversation"]
    )
    assert turn1["prompt_tokens"] == turn0["prompt_tokens"] + 4 + 32
    # the tier adds hits HBM alone cannot give, within the infinite-cache bound
    infinite = on["ceilings"]["full"]["infinite"]["hit_rate"] * 100
    on_hit = on["hit_rate_pct"]["full"]["server"]
    assert off["hit_rate_pct"]["full"]["server"] < on_hit <= infinite + 1e-9
    assert on["series"]["residency"]["memory"][-1][1] > 0
    assert all((out / p).stat().st_size > 5 * 1024 for p in PNGS)
    assert "on: TTFT p50" in (out / "report.html").read_text()
    # the tier arm's step breakdown: the step, kvtier's CPU on it, its hooks, the parked loads
    rows = {r["id"]: r for r in doc["table"]["rows"]}
    assert not any(i.startswith("steps.off.") for i in rows)
    step = rows["steps.on.step_ms"]
    assert step["value"] > 0 and step["raw"] > 0 and step["detail"]["rep0.steps"] > 0
    assert 0 < rows["steps.on.path_cpu_ms"]["value"] < step["raw"]
    assert rows["steps.on.scheduler.lookup"]["detail"]["rep0.steps_run"] > 0
    assert rows["steps.on.parked_steps"]["detail"]["rep0.loads"] > 0
    # the model of kvtier's own tier (real classes, the run's size and admission) next to the
    # live ON arm: within the infinite bound, and the live arm reads what it predicts
    model = on["ceilings"]["full"]["kvtier"]["hit_rate"] * 100
    assert on["ceilings"]["full"]["hbm"]["hit_rate"] * 100 <= model <= infinite + 1e-9
    vs = rows["full.on.hit_rate_vs_model"]
    assert vs["raw"] == pytest.approx(model) and vs["target"] == ">= 0.9x raw"
    assert vs["pass"] is True, vs
    assert "full.off.hit_rate_vs_model" not in rows
    assert rows["full.on.policy_recompute"]["value"] == 0.0


def test_hits_the_load_policy_recomputes_are_found_not_lost_against_the_model(
    multi_turn_run: Path, tmp_path: Path
) -> None:
    """CI once failed the model row at 48.4% against 65.4%: on a loaded host the cost policy
    judged memory loads slower than this tiny model's prefill and recomputed 416 of 432 hit
    tokens (load_margin 10 reproduces it, not every time). The real run's ON scrape is
    rewritten to what that run counted: the hits are found and shown, not a FAIL, while the
    same tokens simply missing still fail the row."""

    def rewritten(recomputed: bool) -> dict[str, Any]:
        run = tmp_path / f"run-{recomputed}"
        shutil.copytree(multi_turn_run, run)
        path = run / "scrapes" / "on-rep0.json"
        doc = json.loads(path.read_text())
        before = MetricSet.from_json(doc["before"]).samples
        after = dict(MetricSet.from_json(doc["after"]).samples)
        ext = next(k for k in after if k[0] == EXT_HITS)
        moved = after[ext] - before.get(ext, 0.0) - 16  # that run read one 16-token chunk
        after[ext] -= moved
        decided = (("decision", "recompute"), ("rank", "scheduler"), ("tier", "memory"))
        after[(LOAD_DECISION_TOKENS, decided)] = moved if recomputed else 0.0
        doc["after"] = MetricSet(after).to_json()
        path.write_text(json.dumps(doc))
        return analyse(load_run(run))

    for recomputed in (True, False):
        doc = rewritten(recomputed)
        rows = {r["id"]: r for r in doc["table"]["rows"]}
        on = next(r for r in doc["runs"] if r["arm"] == "on")
        turned = on["counters"]["full"]["policy_recomputed"]
        shown = rows["full.on.policy_recompute"]["value"]
        assert shown == pytest.approx(100 * turned / on["counters"]["full"]["prompt_tokens"])
        vs = rows["full.on.hit_rate_vs_model"]
        assert vs["detail"]["read_pct"] + shown == pytest.approx(vs["value"])
        assert vs["pass"] is recomputed, vs
        assert (turned > 100) is recomputed



def test_a_server_that_fails_to_start_names_its_exit_and_the_partial_run(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = CliRunner().invoke(
        app,
        [
            "run", "--arm", f"bad={PY} -c \"print('no model'); raise SystemExit(3)\"",
            "--vocab", str(VOCAB), "--requests", "4", "--set", "workload.prefix_len=16",
            "--out", str(out),
        ],
    )  # fmt: skip
    assert result.exit_code == 1
    assert "exited with code 3" in result.output and "no model" in result.output
    assert f"kvtier bench report {out}" in result.output
    assert json.loads((out / "meta.json").read_text())["complete"] is False


def test_tier_tokens_sizes_the_on_arms_tier_and_the_ceilings_alike(tmp_path: Path) -> None:
    """`arms.tier_tokens` for kvtier serve's ON/OFF arms sizes the ON server's memory tier, not
    only the ceilings: a 1M-token ceiling over the default 64k-token tier read as hits lost."""
    from kvtier.bench.run_spec import ArmsSpec, _arms_and_ceiling
    from kvtier.layout import bytes_per_token_from_hf

    model = init_model(tmp_path / "model", dtype="float32")
    spec = ArmsSpec(model_dir=str(model), hbm_blocks=64, chunk_size=64, tier_tokens=100_000)
    arms, _, cc = _arms_and_ceiling(spec, 4)
    per_token = bytes_per_token_from_hf(
        json.loads((model / "config.json").read_text()), tp_size=1, kv_dtype="float32"
    ).bytes_per_token
    on = next(a for a in arms if a.name == "on")
    # whole chunks: 100,000 tokens is 1562 chunks of 64
    assert int(on.env["KVTIER_MEMORY_BYTES"]) == 1562 * 64 * per_token
    assert cc.tier_chunks == 1562 and cc.chunk_size == 64
    assert cc.admission == "adaptive"  # the model of the tier runs the server's policy
    default_arms, _, default_cc = _arms_and_ceiling(
        ArmsSpec(model_dir=str(model), hbm_blocks=64, chunk_size=64), 4
    )
    on = next(a for a in default_arms if a.name == "on")
    assert "KVTIER_MEMORY_BYTES" not in on.env or on.env["KVTIER_MEMORY_BYTES"] == "256MiB"
    assert default_cc.tier_chunks == (256 << 20) // (64 * per_token)
