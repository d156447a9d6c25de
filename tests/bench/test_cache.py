"""`kvtier bench cache`: one run writes a table of ratios to the optimum with the previous policy as
a column, and its two targets (sessions ratio, no row below the previous policy by 2 points)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtier.bench import cache
from kvtier.cachemodel import workloads
from kvtier.cli import app
from kvtier.errors import ConfigError


def _small() -> list[cache.Workload]:
    return [
        cache.Workload(
            "zipf pool", "small", lambda: workloads.prefix_pool(20, n_requests=300, zipf=1.0)
        ),
        cache.Workload(
            cache.SESSIONS, "small", lambda: workloads.sessions(n_sessions=200, span_s=300.0)
        ),
    ]


def test_one_run_writes_the_table_and_its_targets(tmp_path: Path, capsys) -> None:
    out = tmp_path / "cache.json"
    doc = cache.run(quick=True, trace=None, json_path=out, workload_list=_small())
    assert json.loads(out.read_text()) == doc
    table = doc["meta"]["table"]
    # 2 workloads x (tier alone, HBM 5%) x the quick sizes
    assert len(table) == 2 * 2 * len(cache.QUICK_CAPACITIES)
    for r in table:
        assert r["optimum"] <= r["infinite"] + 1e-9
        if r["hbm_fraction"] == 0:  # the tier alone: the optimum is a bound
            assert r["kvtier"] <= r["optimum"] + 1e-9 and r["previous"] <= r["optimum"] + 1e-9
    target = next(r for r in doc["rows"] if r["id"] == "target.sessions_ratio_to_optimum")
    assert target["target"] == ">= 0.55 x"
    assert target["pass"] is (target["value"] >= 0.55)
    cache.print_table(doc)
    printed = capsys.readouterr().out
    for needle in ("optimum", "previous", "target: sessions, HBM 5%, tier 30%: kvtier / optimum"):
        assert needle in printed


def test_a_missing_trace_is_an_error_naming_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--no-trace"):
        cache.run(trace=tmp_path / "nope.jsonl", json_path=tmp_path / "x.json")
    result = CliRunner().invoke(app, ["bench", "cache", "--trace", str(tmp_path / "nope.jsonl")])
    assert result.exit_code == 2
    assert "is not a file" in result.output


def test_workload_keeps_only_the_named_streams_and_refuses_an_unknown_one(tmp_path: Path) -> None:
    from kvtier.bench.cache import _only, default_workloads, retention_workloads

    table, retention = _only(
        ["Mooncake Trace", "round_robin_turns"],
        default_workloads(cache.DEFAULT_TRACE),
        retention_workloads(cache.DEFAULT_TRACE),
    )
    assert [w.name for w in table] == ["round-robin turns", "mooncake trace"]
    assert [w.name for w in retention] == ["mooncake trace"]
    with pytest.raises(ConfigError, match=r"--workload nope is unknown; use one of agent-loops"):
        cache.run(only=["nope"], json_path=tmp_path / "x.json")
    with pytest.raises(ConfigError, match="mooncake-trace needs a --trace"):
        cache.run(trace=None, only=["mooncake-trace"], json_path=tmp_path / "x.json")
