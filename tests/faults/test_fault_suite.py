"""The fault suite at its quick size (TP=1; the killed rank at TP=2): every fault of
`suite.FAULTS` under load, every request completed with the right output, hits lost during the
fault and back after it, and the counters that say why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from kvtier.errors import ConfigError, StartupError
from tests.faults import runner, suite

FIRST_ROWS = ["remote_restart", "load_fail"]


@pytest.fixture(scope="module")
def doc(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "faults.json"
    got = suite.run(out, quick=True, faults=FIRST_ROWS)
    # what run() returns is what it wrote
    assert json.loads(out.read_text()) == got
    return got


def test_every_fault_row_reads_nothing_lost(doc: dict) -> None:
    rows = {r["id"]: r for r in doc["rows"]}
    assert list(rows) == FIRST_ROWS
    per_phase = suite.QUICK.prompts_per_phase * 2  # a seed pass and a replay
    for row in rows.values():
        d = row["detail"]
        assert d["sent"] == 3 * per_phase
        assert d["completed"] == d["sent"] and d["verified"] == d["completed"], d["errors"]
        assert row["pass"] is True and row["ratio"] == 1.0
        assert d["nothing_lost"] == "yes"
    assert doc["summary"] == {"targets": 2, "passed": 2}


def test_remote_hits_drop_while_down_and_resume_after_the_restart(doc: dict) -> None:
    d = next(r for r in doc["rows"] if r["id"] == "remote_restart")["detail"]
    full = d["hit_tokens_possible"]
    assert full == suite.QUICK.prompts_per_phase * runner.CHUNKS_PER_PROMPT * runner.CHUNK
    # a memory tier of 4 chunks: replays of 4 prompts x 4 chunks come from the remote
    assert d["hits_before"] >= full // 2
    assert d["hits_during"] < d["hits_before"]
    assert d["hits_after"] >= full // 2  # hits resumed after the restart
    # the metrics say why: writes dropped by the open breaker, calls that failed
    assert d["counter:ranks:dropped_writes{reason=breaker_open,tier=remote}"] > 0
    assert "store_failures" in d["why"]


def test_a_failing_load_lane_costs_hits_and_says_why(doc: dict) -> None:
    d = next(r for r in doc["rows"] if r["id"] == "load_fail")["detail"]
    assert d["hits_during"] == 0 < d["hits_before"]
    assert d["hits_after"] > 0
    assert d["counter:scheduler:load_failures{reason=error:RuntimeError}"] > 0
    assert "load_failures(error:RuntimeError)=" in d["why"]


def test_render_prints_the_fault_table(doc: dict) -> None:
    console = Console(record=True, width=220)
    console.print(suite.render(doc))
    text = console.export_text()
    assert "remote killed + restarted" in text and "a load failing on one rank" in text
    assert text.count("nothing lost") == 2  # one per row
    assert "as intended: 2 of 2 faults" in text


def test_bad_arguments_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown faults"):
        suite.run(tmp_path / "x.json", quick=True, faults=["gremlins"])
    with pytest.raises(ValueError, match="is a directory"):
        suite.run(tmp_path, quick=True)


def test_missing_redis_server_fails_clearly(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on PATH, redis-server included
    with pytest.raises(StartupError, match="redis-server"):
        suite.shared_store(tmp_path / "redis")
    # a remote fault asked for stops the run before any engine is built, naming redis-server
    with pytest.raises(StartupError, match="redis-server") as e:
        suite.run(tmp_path / "f.json", quick=True, faults=["remote_slow"])
    assert "disk_full" in str(e.value)  # and the faults that run without it


# ---- the rows of issue 10 ------------------------------------------------------------------

ISSUE_10_ROWS = [
    "hbm_pressure",
    "tp_rank_killed",
    "disk_tmpfs",
    "namespace_collision",
    "sampling_edges",
]


@pytest.fixture(scope="module")
def issue10(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("bench") / "faults-10.json"
    got = suite.run(out, quick=True, faults=ISSUE_10_ROWS)
    return {r["id"]: r for r in got["rows"]}


def test_pressure_full_filesystem_and_collision_rows_read_nothing_lost(issue10) -> None:
    for name in ("hbm_pressure", "disk_tmpfs", "namespace_collision", "sampling_edges"):
        row = issue10[name]
        d = row["detail"]
        assert row["pass"] is True and d["nothing_lost"] == "yes", (name, d["errors"])
        assert d["verified"] == d["sent"] > 0
    # two loads fill the pool and every replay runs at once: it completes, from the tier
    pressure = issue10["hbm_pressure"]["detail"]
    assert pressure["hits_during"] > 0
    # the filler filled the filesystem for real: the tier shrank and evicted instead of
    # freezing; once the filler was gone, hits came back
    tmpfs = issue10["disk_tmpfs"]["detail"]
    assert tmpfs["counter:ranks:evictions{tier=disk}"] > 0, sorted(tmpfs)
    assert tmpfs["hits_after"] > 0
    # the other weights found none of the first weights' chunks, and their own afterwards
    collision = issue10["namespace_collision"]["detail"]
    assert collision["hits_before"] > 0 and collision["hits_during"] == 0
    assert collision["hits_after"] > 0


def test_a_killed_tp_rank_ends_cleanly_naming_it(issue10) -> None:
    row = issue10["tp_rank_killed"]
    d = row["detail"]
    assert row["pass"] is True and d["outcome"] == "clean failure", d
    assert "TP rank 1" in d["engine_error"] and "exited with code -9" in d["engine_error"]
    assert d["ranks_left"] == 0  # the survivor was stopped with it
    assert d["completed"] == d["verified"]  # nothing served wrong
    assert d["hits_before"] > 0


def test_a_dead_rank_stops_the_harness_waiting_before_the_engine_loop_notices(
    tmp_path: Path,
) -> None:
    """The killed-rank row raced: the server's health check refused requests for the dead rank
    while the idle engine loop had not failed yet, and the harness asked the dead rank's agent
    to flush, waiting its whole deadline (60 s) for an answer that could not come."""
    from types import SimpleNamespace

    from tests.faults.inject import Control

    loop = SimpleNamespace(fatal=None, dead_rank=lambda: "TP rank 1 (pid 7) exited with code -9")
    run = object.__new__(runner.FaultRun)
    run.server = SimpleNamespace(loop=loop)  # type: ignore[assignment]
    run.stuck = None
    assert run.fatal == "TP rank 1 (pid 7) exited with code -9"
    # no agent answers here: without `give_up` this waits out the deadline and raises
    ctl = Control(tmp_path / "ctl", world=2)
    assert ctl.request("flush", timeout_s=30.0, give_up=lambda: run.fatal) == []
    assert not list((tmp_path / "ctl").glob("*.req")), "the request was withdrawn"
    with pytest.raises(RuntimeError, match=r"ranks \[0, 1\] did not answer 'flush' within 0.2s"):
        ctl.request("flush", timeout_s=0.2)


# ---- the other rows ------------------------------------------------------------------------

OTHER_ROWS = ["remote_slow", "remote_corrupt", "disk_full", "lookup_down"]


def test_the_module_runs_every_fault_of_the_suite() -> None:
    assert sorted(FIRST_ROWS + ISSUE_10_ROWS + OTHER_ROWS) == sorted(suite.FAULTS)


@pytest.fixture(scope="module")
def others(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("bench") / "faults-others.json"
    got = suite.run(out, quick=True, faults=OTHER_ROWS)
    return {r["id"]: r for r in got["rows"]}


def _moved(d: dict, prefix: str, *labels: str) -> float:
    """The sum of the counters of `d` named `prefix{...}` that carry every label."""
    return sum(
        v for k, v in d.items()
        if k.startswith(f"counter:{prefix}{{") and all(lb in k for lb in labels)
    )  # fmt: skip


def test_slow_corrupt_full_and_unreachable_rows_read_nothing_lost_and_say_why(others) -> None:
    assert list(others) == OTHER_ROWS
    per_phase = suite.QUICK.prompts_per_phase * 2  # a seed pass and a replay
    for name, row in others.items():
        d = row["detail"]
        assert row["pass"] is True and d["nothing_lost"] == "yes", (name, d["errors"])
        assert d["verified"] == d["sent"] == 3 * per_phase
        # the fault cost hits, and they came back once it was cleared
        assert d["hits_during"] < d["hits_before"], name
        assert d["hits_after"] > 0, name
    slow = others["remote_slow"]["detail"]
    assert _moved(slow, "ranks:store_failures", "tier=remote") > 0, sorted(slow)
    corrupt = others["remote_corrupt"]["detail"]
    assert _moved(corrupt, "ranks:verify_failures", "tier=remote") > 0, sorted(corrupt)
    assert _moved(corrupt, "scheduler:load_failures") > 0
    full = others["disk_full"]["detail"]
    # a full disk refuses the disk tier's saves; chunks the memory tier still holds may hit
    # (128 tokens in one run of several), so only "fewer than before" holds, checked above
    assert full["counter:ranks:store_failures{reason=enospc,tier=disk}"] > 0
    down = others["lookup_down"]["detail"]
    assert down["counter:scheduler:skipped_loads{reason=lookup_timeout}"] > 0
    assert "lookup_timeouts" in down["why"] and down["hits_during"] == 0
