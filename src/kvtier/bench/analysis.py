"""From client records and server counter deltas to the numbers a bench reports.

Throughput and TTFT come from the client; hit rates and identities from the server's `/metrics`
deltas over the same window (taken on a drained server); output identity from comparing the
greedy token ids of two arms request by request.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from kvtier.bench.client import Record

# vLLM's counter names, as the native server exports them (sample names, with `_total`).
PROMPT_TOKENS = "vllm:prompt_tokens_total"
HBM_QUERIES = "vllm:prefix_cache_queries_total"
HBM_HITS = "vllm:prefix_cache_hits_total"
EXT_QUERIES = "vllm:external_prefix_cache_queries_total"
EXT_HITS = "vllm:external_prefix_cache_hits_total"
RETRIEVED = "kvtier_retrieved_tokens_total"

LabelKey = tuple[tuple[str, str], ...]


# ----------------------------------------------------------------------------------------------
# /metrics
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MetricSet:
    """Prometheus samples by (sample name, sorted labels); `_created` timestamps left out."""

    samples: Mapping[tuple[str, LabelKey], float] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> MetricSet:
        """Samples of a Prometheus text exposition."""
        out: dict[tuple[str, LabelKey], float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.endswith("_created"):
                    continue
                out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
        return cls(out)

    def total(self, name: str, **labels: str) -> float:
        """Sum of sample `name` over every label value not fixed by `labels` (0.0 if absent)."""
        return sum(
            v
            for (n, key), v in self.samples.items()
            if n == name and all(dict(key).get(k) == want for k, want in labels.items())
        )

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """Sample `name` summed per value of `label`."""
        out: dict[str, float] = {}
        for (n, key), v in self.samples.items():
            if n == name:
                value = dict(key).get(label)
                if value is not None:
                    out[value] = out.get(value, 0.0) + v
        return out

    def has(self, name: str) -> bool:
        """Whether any sample is named `name`."""
        return any(n == name for n, _ in self.samples)

    def delta(self, before: MetricSet) -> MetricSet:
        """`self - before`, sample by sample (a sample new in `self` counts from 0)."""
        return MetricSet({k: v - before.samples.get(k, 0.0) for k, v in self.samples.items()})


@dataclass(frozen=True, slots=True)
class Counters:
    """The server counters of one window (deltas), in tokens."""

    prompt_tokens: float
    hbm_queries: float
    hbm_hits: float
    ext_queries: float
    ext_hits: float
    retrieved_by_rank: dict[str, float]
    has_external: bool

    @classmethod
    def of(cls, delta: MetricSet) -> Counters:
        """Pick the counters out of a window's delta; `rank="scheduler"` holds no retrievals."""
        ranks = {r: v for r, v in delta.by_label(RETRIEVED, "rank").items() if r != "scheduler"}
        return cls(
            prompt_tokens=delta.total(PROMPT_TOKENS),
            hbm_queries=delta.total(HBM_QUERIES),
            hbm_hits=delta.total(HBM_HITS),
            ext_queries=delta.total(EXT_QUERIES),
            ext_hits=delta.total(EXT_HITS),
            retrieved_by_rank=dict(sorted(ranks.items())),
            has_external=delta.has(EXT_QUERIES) or delta.has(EXT_HITS),
        )

    @property
    def retrieved(self) -> float:
        """Tokens retrieved, summed over ranks."""
        return sum(self.retrieved_by_rank.values())

    @property
    def hbm_hit_rate(self) -> float:
        """HBM prefix-cache hits over prompt tokens."""
        return _share(self.hbm_hits, self.prompt_tokens)

    @property
    def external_hit_rate(self) -> float:
        """Tier (external) hits over prompt tokens."""
        return _share(self.ext_hits, self.prompt_tokens)

    @property
    def hit_rate(self) -> float:
        """All hits over prompt tokens."""
        return _share(self.hbm_hits + self.ext_hits, self.prompt_tokens)

    def to_json(self) -> dict[str, object]:
        """Counts, rates and the retrieved tokens per rank."""
        out: dict[str, object] = asdict(self)
        out.update(
            retrieved=self.retrieved,
            hbm_hit_rate=self.hbm_hit_rate,
            external_hit_rate=self.external_hit_rate,
            hit_rate=self.hit_rate,
        )
        return out


# ----------------------------------------------------------------------------------------------
# identities
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Identity:
    """`lhs == rhs` (or `lhs <= rhs` for a bound) on one window, and whether it holds."""

    name: str
    expr: str
    lhs: float
    rhs: float
    op: str = "=="

    @property
    def holds(self) -> bool:
        """Exact for counts (they are integers carried as floats)."""
        if self.op == "<=":
            return self.lhs <= self.rhs + 1e-9
        return abs(self.lhs - self.rhs) <= 1e-9 * max(1.0, abs(self.rhs))

    def describe(self) -> str:
        """`expr: lhs == rhs holds|fails`."""
        verdict = "holds" if self.holds else "FAILS"
        return f"{self.expr}: {_num(self.lhs)} {self.op} {_num(self.rhs)} {verdict}"

    def to_json(self) -> dict[str, object]:
        """Fields plus `holds`."""
        return {
            "name": self.name,
            "expr": self.expr,
            "lhs": self.lhs,
            "op": self.op,
            "rhs": self.rhs,
            "holds": self.holds,
        }


def identities(c: Counters, tp: int, offload: bool) -> list[Identity]:
    """The counter identities of a drained window: with offload, HBM misses are exactly what the
    connector was asked and the ranks' retrieved tokens are the external hits TP times over;
    without, no external hit at all. Hits never exceed queries in either."""
    if tp < 1:
        raise ValueError(f"tp={tp} must be >= 1")
    out = [
        Identity(
            "hbm_hits_le_queries",
            "prefix_cache_hits <= prefix_cache_queries",
            c.hbm_hits,
            c.hbm_queries,
            "<=",
        ),
    ]
    if offload:
        out += [
            Identity(
                "hbm_misses_eq_external_queries",
                "prefix_cache_queries - prefix_cache_hits == external_prefix_cache_queries",
                c.hbm_queries - c.hbm_hits,
                c.ext_queries,
            ),
            Identity(
                "retrieved_eq_external_hits",
                f"sum_ranks kvtier_retrieved_tokens / TP({tp}) == external_prefix_cache_hits",
                c.retrieved / tp,
                c.ext_hits,
            ),
            Identity(
                "external_hits_le_queries",
                "external_prefix_cache_hits <= external_prefix_cache_queries",
                c.ext_hits,
                c.ext_queries,
                "<=",
            ),
        ]
    else:
        out.append(
            Identity(
                "no_external_hits_off",
                "external_prefix_cache_hits == 0 (offload off)",
                c.ext_hits,
                0.0,
            )
        )
    return out


def client_server_checks(records: Sequence[Record], c: Counters) -> list[Identity]:
    """The client's usage sums against the server's counters over the same window."""
    ok = [r for r in records if r.ok]
    return [
        Identity(
            "client_prompt_tokens_eq_server",
            "sum usage.prompt_tokens == vllm:prompt_tokens",
            float(sum(r.prompt_tokens or 0 for r in ok)),
            c.prompt_tokens,
        ),
        Identity(
            "client_cached_eq_server_hits",
            "sum usage.cached_tokens == prefix_cache_hits + external_prefix_cache_hits",
            float(sum(r.cached_tokens or 0 for r in ok)),
            c.hbm_hits + c.ext_hits,
        ),
    ]


# ----------------------------------------------------------------------------------------------
# client-side summary
# ----------------------------------------------------------------------------------------------


def percentile(values: Iterable[float], q: float) -> float:
    """The `q`-th percentile (linear interpolation between order statistics, numpy's default)."""
    arr = np.asarray(list(values), dtype=float)
    if arr.size == 0:
        raise ValueError(f"percentile {q} of no values; the window completed no request")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q={q} must lie in [0, 100]")
    return float(np.percentile(arr, q))


@dataclass(frozen=True, slots=True)
class Summary:
    """Client-side numbers of one window, under aiperf/vLLM-like names."""

    requests: int
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    total_cached_tokens: int
    request_throughput: float  # requests/s
    output_throughput: float  # output tokens/s
    ttft_p50_ms: float
    ttft_p99_ms: float
    ttft_mean_ms: float
    osl_mismatch: int  # completed requests whose completion_tokens != max_tokens
    errors: list[str]

    def to_json(self) -> dict[str, object]:
        """Plain fields."""
        return asdict(self)


def summarize(records: Sequence[Record], duration_s: float) -> Summary:
    """Throughput over the window's wall clock and TTFT percentiles of completed requests."""
    if not (math.isfinite(duration_s) and duration_s > 0):
        raise ValueError(f"duration_s={duration_s!r} must be a positive finite number")
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft * 1e3 for r in ok if r.ttft is not None]
    out_tokens = sum(r.completion_tokens or 0 for r in ok)
    has = bool(ttfts)
    return Summary(
        requests=len(records),
        completed=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration_s,
        total_input_tokens=sum(r.prompt_tokens or 0 for r in ok),
        total_output_tokens=out_tokens,
        total_cached_tokens=sum(r.cached_tokens or 0 for r in ok),
        request_throughput=len(ok) / duration_s,
        output_throughput=out_tokens / duration_s,
        ttft_p50_ms=percentile(ttfts, 50) if has else math.nan,
        ttft_p99_ms=percentile(ttfts, 99) if has else math.nan,
        ttft_mean_ms=float(np.mean(ttfts)) if has else math.nan,
        osl_mismatch=sum(1 for r in ok if r.completion_tokens != r.max_tokens),
        errors=sorted({r.error for r in records if r.error is not None})[:10],
    )


# ----------------------------------------------------------------------------------------------
# ON vs OFF
# ----------------------------------------------------------------------------------------------


def on_off_ratio(on: float, off: float) -> float | None:
    """`on / off`, or None when `off` is not a positive finite number."""
    if not (math.isfinite(on) and math.isfinite(off) and off > 0):
        return None
    return on / off


@dataclass(frozen=True, slots=True)
class OutputComparison:
    """Greedy outputs of two arms, request by request."""

    compared: int  # requests completed in both arms
    mismatches: int  # of which the token ids differ
    missing: int  # requests not completed in one arm or both
    first_mismatches: list[int]  # up to 10 request indices, for a look

    def to_json(self) -> dict[str, object]:
        """Plain fields."""
        return asdict(self)


def compare_outputs(a: Sequence[Record], b: Sequence[Record]) -> OutputComparison:
    """Compare the output token ids of the same requests (by index) in two arms."""
    ra = {r.index: r for r in a}
    rb = {r.index: r for r in b}
    if len(ra) != len(a) or len(rb) != len(b):
        raise ValueError("records of one arm repeat a request index; compare one window each")
    compared = mismatches = missing = 0
    first: list[int] = []
    for idx in sorted(ra.keys() | rb.keys()):
        x, y = ra.get(idx), rb.get(idx)
        if x is None or y is None or not x.ok or not y.ok:
            missing += 1
            continue
        compared += 1
        if x.output_ids != y.output_ids:
            mismatches += 1
            if len(first) < 10:
                first.append(idx)
    return OutputComparison(compared, mismatches, missing, first)


def _share(part: float, whole: float) -> float:
    return part / whole if whole > 0 else 0.0


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.6g}"
