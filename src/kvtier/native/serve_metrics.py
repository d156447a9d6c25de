"""vLLM-named Prometheus metrics of the native server (`vllm:` prefix, label `model_name`).

Counters and gauges mirror `Engine.stats()`: the engine loop publishes a snapshot after every
step and a custom collector serves it, so a scrape of a drained server equals `engine.stats()`
exactly. Latency histograms are observed by the loop as requests finish. When offload is on,
the connector's merged `kvtier_*` collector is served from the same registry.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["CONTENT_TYPE", "FINISH_REASONS", "ServeMetrics"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
FINISH_REASONS = ("stop", "length", "abort")

# vLLM's bucket boundaries, so dashboards built for vLLM bin the same way
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
_E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

# (vLLM counter name without `_total`, engine.stats() key, help)
_COUNTERS = (
    ("vllm:prefix_cache_queries", "prefix_cache_queries", "Prefix-cache (HBM) tokens queried."),
    ("vllm:prefix_cache_hits", "prefix_cache_hits", "Prefix-cache (HBM) tokens hit."),
    (
        "vllm:external_prefix_cache_queries",
        "external_prefix_cache_queries",
        "Tokens asked of the KV connector (the HBM misses).",
    ),
    (
        "vllm:external_prefix_cache_hits",
        "external_prefix_cache_hits",
        "Tokens loaded by the KV connector.",
    ),
    ("vllm:prompt_tokens", "prompt_tokens", "Prefill tokens processed."),
    ("vllm:generation_tokens", "generation_tokens", "Generation tokens processed."),
    ("vllm:num_preemptions", "num_preemptions", "Cumulative preemptions."),
)
_GAUGES = (
    ("vllm:num_requests_running", "num_requests_running", "Requests in model execution."),
    ("vllm:num_requests_waiting", "num_requests_waiting", "Requests waiting (or loading KV)."),
    ("vllm:kv_cache_usage_perc", "kv_cache_usage", "KV-cache usage; 1 means 100 percent."),
)


class _StatsCollector(Collector):
    """Serves the latest published engine snapshot as vLLM-named counters and gauges."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self._lock = threading.Lock()
        self._stats: dict[str, float] = {}
        self._finished: dict[str, int] = {}

    def publish(self, stats: Mapping[str, float], finished: Mapping[str, int]) -> None:
        with self._lock:
            self._stats = dict(stats)
            self._finished = dict(finished)

    def snapshot(self) -> tuple[dict[str, float], dict[str, int]]:
        with self._lock:
            return dict(self._stats), dict(self._finished)

    def describe(self) -> list[Metric]:
        # no names: the registry must not collect at registration time
        return []

    def collect(self) -> Iterator[Metric]:
        stats, finished = self.snapshot()
        labels = [self.model_name]
        for name, key, doc in _COUNTERS:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(labels, float(stats.get(key, 0.0)))
            yield c
        success = CounterMetricFamily(
            "vllm:request_success",
            "Finished requests by reason.",
            labels=["model_name", "finished_reason"],
        )
        for reason in FINISH_REASONS:
            if reason == "abort":
                count = stats.get("requests_aborted", 0.0)
            else:
                count = finished.get(reason, 0)
            success.add_metric([self.model_name, reason], float(count))
        yield success
        for name, key, doc in _GAUGES:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(labels, float(stats.get(key, 0.0)))
            yield g


class ServeMetrics:
    """The native server's /metrics: vLLM names from engine snapshots plus kvtier's families."""

    def __init__(self, model_name: str, kvtier_collector: Collector | None = None) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._stats = _StatsCollector(model_name)
        self.registry.register(self._stats)

        def hist(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, ["model_name"], registry=self.registry, buckets=buckets)

        self.ttft = hist(
            "vllm:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS
        ).labels(model_name)
        self.e2e = hist(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency.", _E2E_BUCKETS
        ).labels(model_name)
        self.itl = hist(
            "vllm:inter_token_latency_seconds", "Time between output tokens.", _ITL_BUCKETS
        ).labels(model_name)
        if kvtier_collector is not None:
            # its families carry a `rank` label and the kvtier_ prefix: no name can collide
            self.registry.register(kvtier_collector)

    def publish(self, stats: Mapping[str, float], finished: Mapping[str, int]) -> None:
        """Replace the engine snapshot (`engine.stats()`) and the finished-by-reason tallies."""
        self._stats.publish(stats, finished)

    def snapshot(self) -> tuple[dict[str, float], dict[str, int]]:
        """The latest published snapshot and tallies (copies)."""
        return self._stats.snapshot()

    def observe_request(self, ttft_s: float | None, e2e_s: float, itl_s: Sequence[float]) -> None:
        """Record one finished request's latencies (TTFT is None when it sampled nothing)."""
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        self.e2e.observe(e2e_s)
        for gap in itl_s:
            self.itl.observe(gap)

    def render(self) -> bytes:
        """Prometheus text exposition of every family."""
        return generate_latest(self.registry)
