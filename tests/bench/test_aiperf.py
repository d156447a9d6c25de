"""aiperf profile exports are read into the report's keys (times in ms, cache-read share)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvtier.bench.aiperf import EXPORT_NAME, load_profile_export, summarize
from kvtier.errors import ConfigError


def _stats(unit: str, avg: float, p50: float, p90: float, p99: float, count: int) -> dict[str, Any]:
    return {
        "unit": unit, "avg": avg, "p1": p50 * 0.6, "p5": p50 * 0.7, "p10": p50 * 0.8,
        "p25": p50 * 0.9, "p50": p50, "p75": (p50 + p90) / 2, "p90": p90, "p95": (p90 + p99) / 2,
        "p99": p99, "min": p50 * 0.5, "max": p99 * 1.1, "std": (p90 - p50) / 1.3,
        "count": count, "sum": avg * count,
    }  # fmt: skip


def sample_export() -> dict[str, Any]:
    """A small profile_export_aiperf.json as aiperf 0.13.0 writes it (prefix-pool run, 300
    requests at concurrency 4, OFF arm of the mock in the reference)."""
    return {
        "schema_version": "1.0",
        "aiperf_version": "0.13.0",
        "benchmark_id": "5f0c2a9e-3b1d-4c55-9a4e-1f7e8d2b6c10",
        "input_config": {
            "endpoint": {"model_names": ["tok"], "type": "chat", "streaming": True},
            "input": {"prompt": {"prefix_prompt": {"pool_size": 8, "length": 512}}},
            "loadgen": {"concurrency": 4, "request_count": 300},
        },
        "run_info": {"hostname": "bench-1"},
        "was_cancelled": False,
        "is_complete": True,
        "error_summary": [],
        "start_time": "2026-01-10T12:00:00.000000",
        "end_time": "2026-01-10T12:00:03.520000",
        "warmup_metrics": {"request_count": {"unit": "requests", "avg": 32}},
        "time_to_first_token": _stats("ms", 16.9, 16.2, 22.1, 26.7, 300),
        "inter_token_latency": _stats("ms", 2.1, 2.0, 2.6, 3.9, 300),
        "request_latency": _stats("ms", 48.0, 46.5, 58.0, 71.2, 300),
        "input_sequence_length": _stats("tokens", 575.4, 575, 576, 577, 300),
        "usage_prompt_cache_read_tokens": _stats("tokens", 51.1, 0, 512, 512, 300),
        "request_throughput": {"unit": "requests/sec", "avg": 85.2},
        "output_token_throughput": {"unit": "tokens/sec", "avg": 1363.2},
        "request_count": {"unit": "requests", "avg": 300},
        "request_error_rate": {"unit": "%", "avg": 0.0},
        "benchmark_duration": {"unit": "sec", "avg": 3.52},
        "total_usage_prompt_tokens": {"unit": "tokens", "avg": 172617},
        "total_usage_prompt_cache_read_tokens": {"unit": "tokens", "avg": 15344},
        "overall_usage_prompt_cache_read_pct": {"unit": "%", "avg": 8.889},
    }


def write_sample(path: Path, doc: dict[str, Any] | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc if doc is not None else sample_export(), indent=2))
    return path


def test_sample_export_is_read_into_report_keys(tmp_path: Path) -> None:
    run = load_profile_export(write_sample(tmp_path / EXPORT_NAME), "aiperf-off")
    assert (run.name, run.version) == ("aiperf-off", "0.13.0")
    assert run.benchmark_id == "5f0c2a9e-3b1d-4c55-9a4e-1f7e8d2b6c10"
    s = run.summary
    assert (s["ttft_p50_ms"], s["ttft_p90_ms"], s["ttft_p99_ms"]) == (16.2, 22.1, 26.7)
    assert (s["itl_p50_ms"], s["itl_p99_ms"], s["ttft_mean_ms"]) == (2.0, 3.9, 16.9)
    assert s["request_throughput"] == 85.2 and s["output_throughput"] == 1363.2
    assert s["cache_read_pct"] == 8.889
    assert (s["request_count"], s["duration_s"], s["error_rate"]) == (300, 3.52, 0.0)
    assert (s["total_prompt_tokens"], s["total_cached_tokens"]) == (172617, 15344)
    # every metric object is kept as exported; the config blocks are not metrics
    assert run.metrics["time_to_first_token"]["count"] == 300
    assert "input_config" not in run.metrics and "warmup_metrics" not in run.metrics
    assert json.loads(json.dumps(run.to_json()))["summary"]["ttft_p99_ms"] == 26.7


def test_artifact_dir_and_default_name(tmp_path: Path) -> None:
    write_sample(tmp_path / "artifacts" / EXPORT_NAME)
    run = load_profile_export(tmp_path / "artifacts")
    assert run.name == "profile_export_aiperf"
    assert run.source.endswith(EXPORT_NAME)


def test_units_are_converted_to_ms_and_missing_share_is_computed() -> None:
    doc = sample_export()
    doc["time_to_first_token"] = _stats("ns", 16.9e6, 16.2e6, 22.1e6, 26.7e6, 300)
    doc["inter_token_latency"] = _stats("s", 0.0021, 0.002, 0.0026, 0.0039, 300)
    del doc["overall_usage_prompt_cache_read_pct"]
    s = summarize({k: v for k, v in doc.items() if isinstance(v, dict) and "unit" in v})
    assert s["ttft_p50_ms"] == pytest.approx(16.2)
    assert s["itl_p99_ms"] == pytest.approx(3.9)
    assert s["cache_read_pct"] == pytest.approx(100 * 15344 / 172617)


def test_missing_metrics_read_as_none() -> None:
    s = summarize({"request_throughput": {"unit": "requests/sec", "avg": 10.0}})
    assert s["request_throughput"] == 10.0
    assert s["ttft_p50_ms"] is None and s["cache_read_pct"] is None


def test_bad_files_are_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_profile_export(tmp_path / "nope.json")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=f"holds no {EXPORT_NAME}"):
        load_profile_export(tmp_path / "empty")
    garbage = tmp_path / "g.json"
    garbage.write_text("{not json")
    with pytest.raises(ConfigError, match="is not JSON"):
        load_profile_export(garbage)
    records = write_sample(tmp_path / "r.json", {"aiperf_version": "0.13.0", "metadata": {}})
    with pytest.raises(ConfigError, match="has none of the metrics"):
        load_profile_export(records)
    weird = sample_export()
    weird["time_to_first_token"]["unit"] = "fortnights"
    with pytest.raises(ConfigError, match="unit 'fortnights'"):
        load_profile_export(write_sample(tmp_path / "w.json", weird))
