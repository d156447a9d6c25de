"""kvtier's Prometheus families on vLLM's own `/metrics`, through vLLM's connector-stats path.

The scheduler-side connector holds every rank's latest metrics (workers ship snapshots with
their reports). `StatsDelta` turns that merged view into per-step deltas (counters) and new
values (gauges); vLLM carries them in `SchedulerStats.kv_connector_stats` to its frontend
process, where `KVTierPromMetrics` replays them onto `kvtier_*` families labelled with vLLM's
`model_name`/`engine` plus kvtier's own labels. A histogram's `_bucket`, `_count` and `_sum`
samples (cumulative per rank) are shown as gauges of those names, since vLLM's metric classes
cannot take pre-aggregated buckets.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
)

from kvtier.metrics import counter_labels, families, gauge_labels
from kvtier.topology import resolve

__all__ = ["KVTierPromMetrics", "KVTierStats", "StatsDelta"]

_COUNTER_SUFFIX = "_total"
# what the periodic "KV Transfer metrics: ..." log line sums (over ranks, per interval)
_LOGGED = ("retrieved_tokens", "stored_tokens", "load_failures", "save_failures", "skipped_loads")


def _key(name: str, labels: dict[str, str]) -> str:
    return json.dumps([name, sorted(labels.items())], separators=(",", ":"))


def _unkey(key: str) -> tuple[str, dict[str, str]]:
    name, items = json.loads(key)
    return name, dict(items)


class KVTierStats(KVConnectorStats):
    """Counter deltas (`c`) and gauge values (`g`) keyed by sample name and labels."""

    def reset(self) -> None:
        """Forget the interval's observations."""
        self.data = {"c": {}, "g": {}}

    def aggregate(self, other: KVConnectorStats) -> KVTierStats:
        """Sum counter deltas, keep the later gauge values."""
        counters = dict(self.data.get("c", {}))
        for key, value in other.data.get("c", {}).items():
            counters[key] = counters.get(key, 0.0) + value
        gauges = {**self.data.get("g", {}), **other.data.get("g", {})}
        return KVTierStats(data={"c": counters, "g": gauges})

    def reduce(self) -> dict[str, int | float]:
        """Interval totals over ranks of the counters people read in logs."""
        out: dict[str, int | float] = dict.fromkeys(_LOGGED, 0)
        for key, value in self.data.get("c", {}).items():
            name, labels = _unkey(key)
            short = name.removeprefix("kvtier_").removesuffix(_COUNTER_SUFFIX)
            # worker ranks only: the scheduler counts its own view of the same loads
            if short in out and labels.get("rank") != "scheduler":
                out[short] += int(value)
        return out

    def is_empty(self) -> bool:
        """Nothing changed in the interval."""
        return not self.data.get("c") and not self.data.get("g")


class StatsDelta:
    """Remembers the last exported value of every counter and gauge sample of a collector."""

    def __init__(self) -> None:
        # by (name, labels in the family's order): runs every engine step, so the wire key
        # (a JSON string) is built once per sample, and only for samples that changed
        self._last: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._keys: dict[tuple[str, tuple[tuple[str, str], ...]], str] = {}

    def take(self, metrics: Iterable[Metric]) -> KVTierStats | None:
        """What changed since the previous call (None if nothing did)."""
        counters: dict[str, float] = {}
        gauges: dict[str, float] = {}
        for metric in metrics:
            for s in metric.samples:
                if s.name.endswith("_created"):
                    continue  # creation timestamps
                ident = (s.name, tuple(s.labels.items()))
                last = self._last.get(ident)
                if last == s.value:
                    continue
                self._last[ident] = s.value
                key = self._keys.get(ident)
                if key is None:
                    key = self._keys[ident] = _key(s.name, dict(s.labels))
                if metric.type == "counter":
                    delta = s.value - (last or 0.0)
                    if delta > 0:
                        counters[key] = delta
                else:
                    # gauges, and a histogram's cumulative _bucket/_count/_sum per rank: the
                    # frontend shows them under the same sample names (as gauges)
                    gauges[key] = s.value
        if not counters and not gauges:
            return None
        return KVTierStats(data={"c": counters, "g": gauges})


# One family object per name and process: vLLM rebuilds its stat loggers (and so this class)
# per engine, but only unregisters `vllm:` collectors from prometheus' global registry.
_families: dict[str, tuple[PromMetric, tuple[str, ...]]] = {}
_families_lock = threading.Lock()
_DOCS: dict[str, str] = {}


def _doc(name: str) -> str:
    """kvtier's help text of a family, or of the histogram a `_bucket/_count/_sum` belongs to."""
    if not _DOCS:
        registry = CollectorRegistry()
        families(registry)
        _DOCS.update({m.name: m.documentation for m in registry.collect()})
    if name in _DOCS:
        return _DOCS[name]
    for part in ("_bucket", "_count", "_sum"):
        base = name.removesuffix(part)
        if base != name and base in _DOCS:
            return f"{_DOCS[base]} ({part[1:]}, cumulative per rank)"
    return f"kvtier metric {name}"


class KVTierPromMetrics(KVConnectorPromMetrics):
    """Replays `KVTierStats` onto `kvtier_*` families in vLLM's frontend process; every kvtier
    counter and gauge family is on /metrics from startup, per-rank counters at 0 (absent means
    not kvtier)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        ranks = ["scheduler", *map(str, range(resolve(vllm_config, rank=0).world))]
        for sample, names in counter_labels().items():
            metric, keys = self._family(sample, dict.fromkeys(names, ""), counter=True)
            if keys != ("rank",):
                continue  # by reason or tier: the family is declared, children come with use
            for engine in per_engine_labelvalues.values():
                for rank in ranks:
                    metric.labels(*engine, rank).inc(0)
        # gauges (breaker open, residency, ...) are declared too: an alert on one must find
        # the family even on an engine whose tiers never set it
        for name, names in gauge_labels().items():
            self._family(name, dict.fromkeys(names, ""), counter=False)

    def _family(
        self, sample: str, labels: dict[str, str], counter: bool
    ) -> tuple[PromMetric, tuple[str, ...]]:
        name = sample.removesuffix(_COUNTER_SUFFIX) if counter else sample
        with _families_lock:
            got = _families.get(name)
            if got is None:
                keys = tuple(sorted(labels))
                names = [*self._labelnames, *keys]
                if counter:
                    metric = self._counter_cls(
                        name=name, documentation=_doc(name), labelnames=names
                    )
                else:
                    metric = self._gauge_cls(
                        name=name,
                        documentation=_doc(name),
                        labelnames=names,
                        multiprocess_mode="mostrecent",
                    )
                got = _families[name] = (metric, keys)
            return got

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add the counter deltas and set the gauges of one engine's stats."""
        engine = self.per_engine_labelvalues[engine_idx]
        for kind, counter in (("c", True), ("g", False)):
            for key, value in transfer_stats_data.get(kind, {}).items():
                sample, labels = _unkey(key)
                metric, keys = self._family(sample, labels, counter)
                child = metric.labels(*engine, *(labels.get(k, "") for k in keys))
                if counter:
                    child.inc(value)
                else:
                    child.set(value)
