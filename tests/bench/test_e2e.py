"""bench e2e: analysis on synthetic records, the client against a mock server, arm
plumbing, and one real ON/OFF run against `kvtier serve` subprocesses."""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import sys
from pathlib import Path

import httpx
import pytest

from kvtier.bench import analysis, e2e
from kvtier.bench.arms import ServerProcess, arm_order
from kvtier.bench.client import Record, completion_body, read_jsonl, run_load, write_jsonl
from kvtier.bench.workload import no_reuse
from kvtier.errors import StartupError
from kvtier.native.modelgen import init_model
from kvtier.scrape import Counters

# ---- synthetic records -----------------------------------------------------------------------


def rec(i: int, ttft_ms: float, *, ids: list[int] | None = None, ok: bool = True) -> Record:
    r = Record(
        index=i,
        tag="t",
        prefix_id=None,
        start=float(i),
        first_token=i + ttft_ms / 1e3,
        end=i + 1.0,
        prompt_tokens=100,
        cached_tokens=40,
        completion_tokens=4,
        max_tokens=4,
        sent_prompt_tokens=100,
        output_ids=ids if ids is not None else [1, 2, 3, 4],
    )
    if not ok:
        r.error = "HTTPError: boom"
    return r


def test_percentiles_interpolate_linearly() -> None:
    values = [float(v) for v in range(1, 101)]
    assert analysis.percentile(values, 50) == pytest.approx(50.5)
    assert analysis.percentile(values, 99) == pytest.approx(99.01)
    assert analysis.percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError, match="no values"):
        analysis.percentile([], 50)


def test_summary_counts_throughput_and_ttft() -> None:
    records = [rec(i, ttft_ms=10.0 * (i + 1)) for i in range(10)] + [rec(10, 5.0, ok=False)]
    s = analysis.summarize(records, duration_s=4.0)
    assert (s.requests, s.completed, s.failed) == (11, 10, 1)
    assert s.total_output_tokens == 40
    assert s.output_throughput == pytest.approx(10.0)
    assert s.request_throughput == pytest.approx(2.5)
    assert s.ttft_p50_ms == pytest.approx(55.0)
    assert s.ttft_p99_ms == pytest.approx(99.1)
    assert s.total_cached_tokens == 400
    assert s.osl_mismatch == 0
    assert s.errors == ["HTTPError: boom"]


def test_on_off_ratio() -> None:
    assert analysis.on_off_ratio(97.0, 100.0) == pytest.approx(0.97)
    assert analysis.on_off_ratio(1.0, 0.0) is None
    assert analysis.on_off_ratio(float("nan"), 1.0) is None


def test_client_server_checks_compare_usage_sums() -> None:
    c = Counters(1000.0, 1000.0, 300.0, 700.0, 100.0, {}, True)
    records = [rec(i, 1.0) for i in range(10)]  # 10 x 100 prompt, 10 x 40 cached
    got = {i.name: i for i in analysis.client_server_checks(records, c)}
    assert got["client_prompt_tokens_eq_server"].holds
    assert got["client_cached_eq_server_hits"].holds
    c2 = Counters(1000.0, 1000.0, 300.0, 700.0, 99.0, {}, True)
    assert not {i.name: i for i in analysis.client_server_checks(records, c2)}[
        "client_cached_eq_server_hits"
    ].holds
    # vllm-bench records carry no cached count: that sum is not checked, never read as 0
    for r in records:
        r.cached_tokens = None
    assert [i.name for i in analysis.client_server_checks(records, c2)] == [
        "client_prompt_tokens_eq_server"
    ]


def test_compare_outputs_counts_mismatches_and_missing() -> None:
    a = [rec(0, 1.0), rec(1, 1.0), rec(2, 1.0), rec(3, 1.0)]
    b = [rec(0, 1.0), rec(1, 1.0, ids=[1, 2, 3, 5]), rec(2, 1.0, ok=False), rec(3, 1.0)]
    cmp = analysis.compare_outputs(a, b)
    assert (cmp.compared, cmp.mismatches, cmp.missing, cmp.first_mismatches) == (3, 1, 1, [1])
    assert analysis.compare_outputs(a, a).mismatches == 0


def test_compare_outputs_compares_text_where_an_engine_returns_no_ids_and_never_nothing() -> None:
    """vllm-bench records carry text only: texts are compared; a record with neither ids nor
    text is missing, never an empty output equal to another empty one."""
    a = [rec(i, 1.0, ids=[]) for i in range(3)]
    b = [rec(i, 1.0, ids=[]) for i in range(3)]
    for r, t in zip(a, ["x y", "z", "w"], strict=True):
        r.output_text = t
    for r, t in zip(b, ["x y", "q", None], strict=True):
        r.output_text = t
    cmp = analysis.compare_outputs(a, b)
    assert (cmp.compared, cmp.mismatches, cmp.missing, cmp.first_mismatches) == (2, 1, 1, [1])
    bare = [rec(0, 1.0, ids=[])]
    assert analysis.compare_outputs(bare, bare).missing == 1


# ---- the client against a mock server --------------------------------------------------------


def _sse_handler(request: httpx.Request) -> httpx.Response:
    body = json.loads(request.content)
    assert body["stream"] is True and body["return_token_ids"] is True
    assert body["temperature"] == 0 and body["ignore_eos"] is True
    prompt = body["prompt"]
    ids = [prompt[0] + k for k in range(body["max_tokens"])]
    lines = [{"choices": [{"index": 0, "text": "x", "token_ids": [t]}], "usage": None} for t in ids]
    usage = {
        "prompt_tokens": len(prompt),
        "completion_tokens": len(ids),
        "total_tokens": len(prompt) + len(ids),
        "prompt_tokens_details": {"cached_tokens": 16},
    }
    lines.append({"choices": [], "usage": usage})
    text = "".join(f"data: {json.dumps(x)}\n\n" for x in lines) + "data: [DONE]\n\n"
    return httpx.Response(200, content=text.encode(), headers={"content-type": "text/event-stream"})


def test_client_records_tokens_usage_and_times(tmp_path: Path) -> None:
    specs = no_reuse(5, 20, seed=1, vocab=2048, max_tokens=3)
    ticks = itertools.count()
    result = asyncio.run(
        run_load(
            "http://mock",
            specs,
            concurrency=1,
            progress=False,
            clock=lambda: float(next(ticks)),
            transport=httpx.MockTransport(_sse_handler),
        )
    )
    assert [r.index for r in result.records] == list(range(5))
    for spec, r in zip(specs, result.records, strict=True):
        assert r.ok, r.error
        assert r.output_ids == [spec.prompt[0] + k for k in range(3)]
        assert (r.prompt_tokens, r.cached_tokens, r.completion_tokens) == (20, 16, 3)
        # one clock tick at the send, one at the first token chunk (the first of three)
        assert r.ttft == 1.0
    path = write_jsonl(tmp_path / "r.jsonl", result.records)
    assert read_jsonl(path) == result.records
    assert completion_body(specs[0], "m")["model"] == "m"


def test_client_keeps_http_errors_in_records() -> None:
    def fail(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"error": {"message": "engine down"}})

    specs = no_reuse(3, 8, seed=0, vocab=2048)
    result = asyncio.run(
        run_load(
            "http://mock",
            specs,
            concurrency=2,
            progress=False,
            transport=httpx.MockTransport(fail),
        )
    )
    assert [r.ok for r in result.records] == [False] * 3
    assert all(r.error is not None and "HTTP 503" in r.error for r in result.records)


# ---- arms ------------------------------------------------------------------------------------


def test_arm_order_alternates() -> None:
    assert arm_order(1) == [(0, "on"), (0, "off")]
    assert arm_order(3) == [(0, "on"), (0, "off"), (1, "off"), (1, "on"), (2, "on"), (2, "off")]
    with pytest.raises(ValueError, match="repeat=0"):
        arm_order(0)


def test_server_that_dies_at_startup_raises_with_its_log(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]
    proc = ServerProcess(argv, {}, "http://127.0.0.1:9", tmp_path / "s.log", startup_timeout_s=30)
    with pytest.raises(StartupError, match=r"(?s)exited with code 3.*no model here"):
        proc.start()
    assert proc.stop() == 3


def test_server_that_never_gets_healthy_is_killed_after_the_deadlines(tmp_path: Path) -> None:
    # ignores SIGTERM and never listens: the start deadline passes, then the stop deadline
    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('up', flush=True); time.sleep(120)"
    )
    proc = ServerProcess(
        [sys.executable, "-c", code], {}, "http://127.0.0.1:9", tmp_path / "s.log",
        startup_timeout_s=2.0, stop_timeout_s=1.0,
    )  # fmt: skip
    with pytest.raises(StartupError, match=r"(?s)did not answer /health within 2s.*up"):
        proc.start()
    assert proc.proc is not None and proc.proc.returncode == -signal.SIGKILL


# ---- one real run ----------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_quick_run_against_real_servers(tmp_path: Path) -> None:
    model = init_model(tmp_path / "model", dtype="float32")
    out = tmp_path / "e2e.json"
    doc = e2e.run(quick=True, tp=1, model_dir=model, requests=32, json_path=out, bars=False)
    assert json.loads(out.read_text()) == doc
    meta = doc["meta"]
    windows = meta["windows"]
    # the A/A pair (OFF once more, right after OFF) runs by default
    assert {(w["arm"], w["workload"]) for w in windows} == {
        (a, w) for a in ("on", "off", "off_again") for w in ("prefix_pool", "no_reuse")
    }
    assert [s["arm"] for s in meta["servers"]] == ["on", "off", "off_again"]
    assert meta["load"] == "kvtier"  # natively kvtier's client is the default engine
    sent = {"prefix_pool": 32, "no_reuse": meta["plan"]["no_reuse_requests"]}
    for w in windows:
        s = w["summary"]
        assert s["completed"] == s["requests"] == sent[w["workload"]], s["errors"]
        assert s["osl_mismatch"] == 0
        bad = [i for i in w["identities"] + w["client_server"] if not i["holds"]]
        assert bad == [], bad
    on_pool = next(w for w in windows if w["arm"] == "on" and w["workload"] == "prefix_pool")
    assert on_pool["counters"]["ext_hits"] > 0
    assert on_pool["counters"]["retrieved"] == on_pool["counters"]["ext_hits"]
    off_pool = next(w for w in windows if w["arm"] == "off" and w["workload"] == "prefix_pool")
    assert off_pool["counters"]["ext_hits"] == 0
    assert all(w["counters"]["ext_hits"] == 0 for w in windows if w["arm"] == "off_again")
    # the tier adds hits the HBM alone cannot give, within the infinite-cache bound
    infinite = meta["ceilings"]["prefix_pool"]["infinite"]["hit_rate"]
    assert off_pool["counters"]["hit_rate"] < on_pool["counters"]["hit_rate"] <= infinite
    assert all(c["mismatches"] == 0 for cs in meta["outputs"].values() for c in cs)
    assert sum(c["compared"] for cs in meta["outputs"].values() for c in cs) == sum(sent.values())
    rows = {r["id"]: r for r in doc["rows"]}
    assert rows["outputs.mismatches"]["value"] == 0
    assert rows["identity.retrieved_eq_external_hits"]["pass"] is True
    assert rows["requests.failed"]["value"] == 0
    assert all(s["exit_code"] == 0 for s in meta["servers"])
    # where the ON arm's step time went, per window, from the server's kvtier histograms
    assert all(w["step_breakdown"] is None for w in windows if w["arm"] == "off")
    for w in (w for w in windows if w["arm"] == "on"):
        b = w["step_breakdown"]
        assert b["steps"] > 0 and 0 < b["step_p50_ms"] <= b["step_p99_ms"], b
        hooks = {(h["side"], h["hook"]): h for h in b["hooks"]}
        for side, hook in (("scheduler", "lookup"), ("scheduler", "meta"), ("ranks", "load")):
            assert hooks[side, hook]["steps"] > 0 and hooks[side, hook]["per_step_ms"] > 0
        # kvtier's own CPU next to each hook's wall time: work never exceeds the time taken
        for h in b["hooks"]:
            if h["steps"]:
                assert h["cpu_per_step_ms"] is not None, h
                assert 0 < h["cpu_per_step_ms"] <= h["per_step_ms"] + 0.01, h
        assert 0 < b["path_cpu_per_step_ms"] < b["step_mean_ms"], b
        if w["workload"] == "no_reuse":
            # no prompt starts with a chunk this engine saved: every miss known without asking
            assert b["lookup_calls"] == 0
            # every prompt's chunks were copied out by a save lane
            assert b["lanes_cpu_per_step_ms"] > 0, b
        else:
            assert b["lookup_calls"] > 0 and b["lookup_call_p50_ms"] > 0
    pool_steps = on_pool["step_breakdown"]
    # every load of the window ended (parked steps observed), in the forward or parked
    assert pool_steps["loads"] > 0 and 0 <= pool_steps["sync_loads"] <= pool_steps["loads"]
    assert pool_steps["parked_mean_steps"] is not None
    for row in ("step_ms", "path_cpu_ms", "lanes_cpu_ms", "scheduler.lookup", "ranks.load",
                "lookup_call_ms", "parked_steps"):  # fmt: skip
        assert f"steps.prefix_pool.{row}" in rows
    for key, target in (("output_throughput", ">= 0.97 x"), ("ttft_p50_ms", "<= 1.03 x")):
        worst, aa_row = rows[f"no_reuse.{key}.worst_rep"], rows[f"no_reuse.{key}.aa_worst_rep"]
        assert aa_row["target"] == target
        if aa_row["pass"] is False:
            # the OFF / OFF again pair itself moved past the target: the tier's row has no verdict
            assert worst["target"] is None and worst["detail"]["verdict"] == "undetermined"
        else:
            assert worst["target"] == target
    # the machine's own noise, under the same targets, from the OFF / OFF again pair
    aa = rows["no_reuse.output_throughput.aa_worst_rep"]
    assert aa["target"] == ">= 0.97 x" and 0 < aa["value"] <= 1.0
    assert aa["detail"]["rep0.ratio"] > 0
    assert all(w["step_breakdown"] is None for w in windows if w["arm"] == "off_again")
