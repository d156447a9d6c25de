"""vLLM-named Prometheus metrics of the native server (`vllm:` prefix, labels `model_name` and
`engine`, vLLM 0.32's families and buckets), so vLLM's dashboards render against it.

Counters and gauges mirror `Engine.stats()`: the engine loop publishes a snapshot after every
step and a custom collector serves it, so a scrape of a drained server equals `engine.stats()`
exactly. Per-request histograms are observed by the loop as requests finish, iteration sizes
after every step. `kvtier_engine_stalled` / `kvtier_engine_stall_seconds` are read at scrape
time (a hung step cannot freeze them). When offload is on, the connector's merged `kvtier_*`
collector is served from the same registry.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.native.connector import CACHE_HIT_SOURCES

__all__ = ["CONTENT_TYPE", "FINISH_REASONS", "STALL_METRIC", "RequestTimes", "ServeMetrics"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM's FinishReason
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
STALL_METRIC = "kvtier_engine_stalled"
ENGINE = "0"  # one engine core per server, as vLLM labels a single-engine deployment

# vLLM's bucket boundaries (vllm/v1/metrics/buckets.py), so dashboards built for vLLM bin alike
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)


def token_buckets(max_model_len: int) -> list[float]:
    """vLLM's 1-2-5 series up to `max_model_len` (its `request_tokens` family)."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return out
            out.append(float(m * scale))
        scale *= 10


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
    # admissions after a preemption, kept apart from the four above as vLLM's PrefixCacheStats
    # keeps them (vLLM does not export them; kvtier's names carry its field names)
    (
        "kvtier_engine_preempted_prefix_cache_queries",
        "preempted_queries",
        "Prefix-cache (HBM) tokens queried by requests admitted again after a preemption.",
    ),
    (
        "kvtier_engine_preempted_prefix_cache_hits",
        "preempted_hits",
        "Prefix-cache (HBM) tokens hit by requests admitted again after a preemption.",
    ),
    (
        "kvtier_engine_preempted_external_prefix_cache_queries",
        "preempted_external_queries",
        "Tokens asked of the KV connector by requests admitted again after a preemption.",
    ),
    (
        "kvtier_engine_preempted_external_prefix_cache_hits",
        "preempted_external_hits",
        "Tokens loaded by the KV connector for requests admitted again after a preemption.",
    ),
)
_GAUGES = (
    ("vllm:num_requests_running", "num_requests_running", "Requests in model execution."),
    ("vllm:num_requests_waiting", "num_requests_waiting", "Requests waiting (or loading KV)."),
    ("vllm:kv_cache_usage_perc", "kv_cache_usage", "KV-cache usage; 1 means 100 percent."),
)


@dataclass
class RequestTimes:
    """One request's timeline (monotonic seconds) and token counts, for the histograms."""

    arrival: float
    prompt_tokens: int
    max_tokens: int
    scheduled_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    generated: int = 0
    cached: int = 0  # HBM prefix hit
    external: int = 0  # loaded by the connector


class _StatsCollector(Collector):
    """Serves the latest published engine snapshot as vLLM-named counters and gauges."""

    def __init__(self, model_name: str) -> None:
        self.labels = [model_name, ENGINE]
        self._lock = threading.Lock()
        self._stats: dict[str, float] = {}
        self._finished: dict[str, int] = {}
        self.stall: Callable[[], float] = lambda: 0.0
        self.stall_limit_s = float("inf")

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

    def _num(self, stats: Mapping[str, float], key: str) -> float:
        return float(stats.get(key, 0.0))

    def collect(self) -> Iterator[Metric]:
        stats, finished = self.snapshot()
        base = ["model_name", "engine"]
        for name, key, doc in _COUNTERS:
            c = CounterMetricFamily(name, doc, labels=base)
            c.add_metric(self.labels, self._num(stats, key))
            yield c
        success = CounterMetricFamily(
            "vllm:request_success", "Finished requests by reason.",
            labels=[*base, "finished_reason"],
        )  # fmt: skip
        for reason in FINISH_REASONS:
            success.add_metric([*self.labels, reason], float(finished.get(reason, 0)))
        yield success
        cached = CounterMetricFamily(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the tier that supplied them: device (HBM), host "
            "(kvtier's memory tier), disk, external_unspecified (a shared store).",
            labels=[*base, "source"],
        )
        for source in CACHE_HIT_SOURCES:
            key = "prefix_cache_hits" if source == "device" else f"external_hits_{source}"
            cached.add_metric([*self.labels, source], self._num(stats, key))
        yield cached
        for name, key, doc in _GAUGES:
            g = GaugeMetricFamily(name, doc, labels=base)
            g.add_metric(self.labels, self._num(stats, key))
            yield g
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason",
            "Waiting requests: capacity (for blocks or a batch slot), deferred (loading KV).",
            labels=[*base, "reason"],
        )
        waiting.add_metric([*self.labels, "capacity"], self._num(stats, "num_requests_queued"))
        waiting.add_metric([*self.labels, "deferred"], self._num(stats, "num_requests_loading"))
        yield waiting
        stalled_s = self.stall()
        g = GaugeMetricFamily(
            "kvtier_engine_stall_seconds",
            "Seconds since an engine step last made progress while requests are queued.",
            labels=base,
        )
        g.add_metric(self.labels, stalled_s)
        yield g
        g = GaugeMetricFamily(
            STALL_METRIC,
            "1 while requests are queued and no engine step made progress for longer than "
            "the stall timeout (/health answers 503 then).",
            labels=base,
        )
        g.add_metric(self.labels, 1.0 if stalled_s > self.stall_limit_s else 0.0)
        yield g


class ServeMetrics:
    """The native server's /metrics: vLLM names from engine snapshots plus kvtier's families."""

    def __init__(
        self,
        model_name: str,
        kvtier_collector: Collector | None = None,
        max_model_len: int = 4096,
    ) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._stats = _StatsCollector(model_name)
        self.registry.register(self._stats)
        labels = (model_name, ENGINE)
        tokens = token_buckets(max_model_len)

        def hist(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            family = Histogram(
                name, doc, ["model_name", "engine"], registry=self.registry, buckets=buckets
            )
            return family.labels(*labels)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between tokens.", _ITL_BUCKETS)
        self.tpot = hist(
            "vllm:request_time_per_output_token_seconds",
            "Decode time per output token after the first.", _ITL_BUCKETS,
        )  # fmt: skip
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Request latency.", _LATENCY_BUCKETS)
        self.queue = hist(
            "vllm:request_queue_time_seconds", "Arrival to first scheduled.", _LATENCY_BUCKETS
        )
        self.inference = hist(
            "vllm:request_inference_time_seconds", "First scheduled to last token.",
            _LATENCY_BUCKETS,
        )  # fmt: skip
        self.prefill = hist(
            "vllm:request_prefill_time_seconds", "First scheduled to first token.",
            _LATENCY_BUCKETS,
        )  # fmt: skip
        self.decode = hist(
            "vllm:request_decode_time_seconds", "First token to last token.", _LATENCY_BUCKETS
        )
        self.prompt_len = hist("vllm:request_prompt_tokens", "Prompt tokens per request.", tokens)
        self.gen_len = hist(
            "vllm:request_generation_tokens", "Generated tokens per request.", tokens
        )
        self.max_gen = hist(
            "vllm:request_max_num_generation_tokens", "Requested max generation tokens.", tokens
        )
        self.params_max = hist("vllm:request_params_max_tokens", "max_tokens per request.", tokens)
        self.params_n = hist("vllm:request_params_n", "n per request.", _N_BUCKETS)
        self.computed = hist(
            "vllm:request_prefill_kv_computed_tokens",
            "Prompt tokens computed (not served from a cache) per request.", tokens,
        )  # fmt: skip
        self.iteration = hist(
            "vllm:iteration_tokens_total", "Tokens per engine step.", _ITERATION_BUCKETS
        )
        by_source = Counter(
            "vllm:prompt_tokens_by_source", "Prompt tokens by source.",
            ["model_name", "engine", "source"], registry=self.registry,
        )  # fmt: skip
        self.prompt_source = {s: by_source.labels(*labels, s) for s in PROMPT_SOURCES}
        self.prompt_cached = Counter(
            "vllm:prompt_tokens_cached", "Cached prompt tokens (local + external).",
            ["model_name", "engine"], registry=self.registry,
        ).labels(*labels)  # fmt: skip
        if kvtier_collector is not None:
            # its families carry a `rank` label and the kvtier_ prefix: no name can collide
            self.registry.register(kvtier_collector)

    def set_stall_source(self, seconds: Callable[[], float], limit_s: float) -> None:
        """Where the stall gauges read from (called at scrape time) and the stall limit."""
        self._stats.stall = seconds
        self._stats.stall_limit_s = limit_s

    def publish(self, stats: Mapping[str, float], finished: Mapping[str, int]) -> None:
        """Replace the engine snapshot (`engine.stats()`) and the finished-by-reason tallies."""
        self._stats.publish(stats, finished)

    def snapshot(self) -> tuple[dict[str, float], dict[str, int]]:
        """The latest published snapshot and tallies (copies)."""
        return self._stats.snapshot()

    def observe_iteration(self, tokens: int) -> None:
        """One engine step that computed `tokens` tokens."""
        self.iteration.observe(tokens)

    def observe_params(self, n: int) -> None:
        """One HTTP request asking for `n` sequences per prompt."""
        self.params_n.observe(n)

    def observe_request(self, t: RequestTimes, itl_s: Sequence[float], reason: str) -> None:
        """Record one finished request's timeline and token counts."""
        end = t.finished_at if t.finished_at is not None else t.arrival
        self.e2e.observe(max(0.0, end - t.arrival))
        self.prompt_len.observe(t.prompt_tokens)
        self.gen_len.observe(t.generated)
        self.max_gen.observe(t.max_tokens)
        self.params_max.observe(t.max_tokens)
        cached = min(t.cached + t.external, t.prompt_tokens)
        self.computed.observe(t.prompt_tokens - cached)
        if t.first_token_at is not None:
            self.ttft.observe(max(0.0, t.first_token_at - t.arrival))
            self.prompt_source["local_cache_hit"].inc(min(t.cached, t.prompt_tokens))
            self.prompt_source["external_kv_transfer"].inc(cached - min(t.cached, cached))
            self.prompt_source["local_compute"].inc(t.prompt_tokens - cached)
            self.prompt_cached.inc(cached)
        for gap in itl_s:
            self.itl.observe(gap)
        if t.scheduled_at is not None:
            self.queue.observe(max(0.0, t.scheduled_at - t.arrival))
            self.inference.observe(max(0.0, end - t.scheduled_at))
            if t.first_token_at is not None:
                self.prefill.observe(max(0.0, t.first_token_at - t.scheduled_at))
                decode = max(0.0, end - t.first_token_at)
                self.decode.observe(decode)
                if t.generated > 1:
                    self.tpot.observe(decode / (t.generated - 1))

    def render(self) -> bytes:
        """Prometheus text exposition of every family."""
        return generate_latest(self.registry)
