"""Read an aiperf `profile_export_aiperf.json` so its numbers sit in a kvtier bench report, and
write a bench stream as aiperf's own `inputs.json` so aiperf can send it.

aiperf (ai-dynamo/aiperf) writes one object per metric tag, e.g. `time_to_first_token`:
`{unit, avg, p1, ..., p50, p90, p99, min, max, std, count, sum}` (aggregates carry only `unit`
and `avg`), next to `aiperf_version`, `benchmark_id`, `input_config` and the like. The file is
parsed as JSON; aiperf itself is never imported (it is not a dependency).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.bench.client import completion_body
from kvtier.bench.workload import RequestSpec
from kvtier.errors import ConfigError

EXPORT_NAME = "profile_export_aiperf.json"
INPUTS_NAME = "aiperf-inputs.json"
# what sends the file, exactly as written and in its order
INPUTS_ARGS = (
    "--custom-dataset-type inputs_json --dataset-sampling-strategy sequential "
    "--endpoint-type completions --streaming"
)

# aiperf tag -> (our key prefix, percentiles taken); times are converted to ms
_LATENCY = {
    "time_to_first_token": "ttft",
    "inter_token_latency": "itl",
    "request_latency": "latency",
}
_TIME_UNITS = {"ns": 1e-6, "us": 1e-3, "µs": 1e-3, "ms": 1.0, "s": 1e3, "sec": 1e3}
_KNOWN = (*_LATENCY, "request_throughput", "output_token_throughput", "request_count")


@dataclass(frozen=True)
class AiperfRun:
    """One aiperf profile export: every metric as exported, and the few a report shows."""

    name: str
    source: str
    version: str | None
    benchmark_id: str | None
    metrics: dict[str, dict[str, Any]]
    summary: dict[str, float | None] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """Name, source, version and the summary (the raw metrics under `metrics`)."""
        return {
            "name": self.name,
            "source": self.source,
            "version": self.version,
            "benchmark_id": self.benchmark_id,
            "summary": dict(self.summary),
            "metrics": self.metrics,
        }


def export_path(path: str | Path) -> Path:
    """The export file itself: `path`, or `profile_export_aiperf.json` inside a directory."""
    p = Path(path)
    if p.is_dir():
        found = p / EXPORT_NAME
        if not found.is_file():
            matches = sorted(p.glob(f"*{EXPORT_NAME}"))
            if not matches:
                raise ConfigError(
                    f"aiperf artifact dir {str(p)!r} holds no {EXPORT_NAME}; pass the file "
                    "aiperf wrote (--artifact-dir)"
                )
            found = matches[0]
        return found
    if not p.is_file():
        raise ConfigError(f"aiperf export {str(p)!r} does not exist; pass {EXPORT_NAME}")
    return p


def load_profile_export(path: str | Path, name: str | None = None) -> AiperfRun:
    """Parse an aiperf profile export (a file or its artifact directory)."""
    src = export_path(path)
    try:
        doc = json.loads(src.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"aiperf export {str(src)!r} is not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"aiperf export {str(src)!r} is not a JSON object")
    metrics = _metrics(doc)
    if not any(tag in metrics for tag in _KNOWN):
        raise ConfigError(
            f"aiperf export {str(src)!r} has none of the metrics {list(_KNOWN)}; pass aiperf's "
            f"{EXPORT_NAME} (profile_export.jsonl holds per-request records instead)"
        )
    return AiperfRun(
        name=name or src.stem,
        source=str(src),
        version=_str(doc.get("aiperf_version")),
        benchmark_id=_str(doc.get("benchmark_id")),
        metrics=metrics,
        summary=summarize(metrics),
    )


def summarize(metrics: Mapping[str, Mapping[str, Any]]) -> dict[str, float | None]:
    """The report's keys from aiperf's metric objects: latency percentiles in ms, throughputs,
    the token-weighted cache-read share (%) and counts."""
    out: dict[str, float | None] = {}
    for tag, key in _LATENCY.items():
        m = metrics.get(tag)
        scale = _time_scale(tag, m)
        for stat in ("avg", "p50", "p90", "p99"):
            v = _num(m, stat)
            out[f"{key}_{'mean' if stat == 'avg' else stat}_ms"] = None if v is None else v * scale
    out["request_throughput"] = _num(metrics.get("request_throughput"), "avg")
    out["output_throughput"] = _num(metrics.get("output_token_throughput"), "avg")
    out["request_count"] = _num(metrics.get("request_count"), "avg")
    out["error_rate"] = _num(metrics.get("request_error_rate"), "avg")
    out["duration_s"] = _seconds(metrics.get("benchmark_duration"))
    prompt = _num(metrics.get("total_usage_prompt_tokens"), "avg")
    cached = _num(metrics.get("total_usage_prompt_cache_read_tokens"), "avg")
    out["total_prompt_tokens"] = prompt
    out["total_cached_tokens"] = cached
    pct = _num(metrics.get("overall_usage_prompt_cache_read_pct"), "avg")
    if pct is None and prompt and cached is not None:
        pct = 100.0 * cached / prompt
    out["cache_read_pct"] = pct
    return out


def _metrics(doc: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Metric objects: top-level values with a `unit` (aiperf 0.13), or under "records"."""
    pools: list[Mapping[str, Any]] = [doc]
    for key in ("records", "metrics"):
        sub = doc.get(key)
        if isinstance(sub, Mapping):
            pools.append(sub)
    out: dict[str, dict[str, Any]] = {}
    for pool in pools:
        for tag, value in pool.items():
            if isinstance(value, Mapping) and "unit" in value and "avg" in value:
                out[str(tag)] = dict(value)
    return out


def _time_scale(tag: str, m: Mapping[str, Any] | None) -> float:
    if m is None:
        return 1.0
    unit = str(m.get("unit", "ms")).strip().lower()
    if unit not in _TIME_UNITS:
        raise ConfigError(f"aiperf metric {tag} has unit {unit!r}; expected one of {_TIME_UNITS}")
    return _TIME_UNITS[unit]


def _seconds(m: Mapping[str, Any] | None) -> float | None:
    v = _num(m, "avg")
    if v is None or m is None:
        return None
    unit = str(m.get("unit", "sec")).strip().lower()
    return v * _TIME_UNITS.get(unit, 1e3) / 1e3


def _num(m: Mapping[str, Any] | None, stat: str) -> float | None:
    if m is None:
        return None
    v = m.get(stat)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    return float(v)


def _str(v: object) -> str | None:
    return None if v is None else str(v)


def write_inputs(path: Path, specs: Sequence[RequestSpec], model: str | None) -> Path:
    """`specs` as aiperf's inputs.json: one session per conversation (or request), each turn
    the completion body kvtier's client sends (token-id prompt, greedy, `ignore_eos`, usage),
    which aiperf sends verbatim. A later turn carries the stream's seeded stand-in for the
    previous output: a payload cannot carry a reply not yet made."""
    sessions: dict[str, list[dict[str, Any]]] = {}
    for spec in sorted(specs, key=lambda s: s.index):
        sid = f"r{spec.index}" if spec.conversation is None else f"c{spec.conversation}"
        sessions.setdefault(sid, []).append(completion_body(spec, model))
    data = [{"session_id": sid, "payloads": payloads} for sid, payloads in sessions.items()]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"data": data}), encoding="utf-8")
    return path
