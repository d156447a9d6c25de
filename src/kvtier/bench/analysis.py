"""From client records and server counter deltas to the numbers a bench reports.

Throughput, TTFT and inter-token latency come from the client; hit rates and identities from
the server's `/metrics` deltas over the same window (taken on a drained server); output identity
from comparing the greedy token ids of two arms request by request. A start-cut window keeps the
requests sent at or after `t0 + cut`; time series bucket requests by send time and periodic
server samples (tier residency, counters) by scrape time.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvtier.bench.client import Record
from kvtier.scrape import RESIDENCY, Counters, Identity, MetricSet, sampled_totals


def client_server_checks(records: Sequence[Record], c: Counters) -> list[Identity]:
    """The client's usage sums against the server's counters over the same window; the cached
    sum only where every request reported one (vLLM's benchmark loop keeps no cached count)."""
    ok = [r for r in records if r.ok]
    checks = [
        Identity(
            "client_prompt_tokens_eq_server",
            "sum usage.prompt_tokens == vllm:prompt_tokens",
            float(sum(r.prompt_tokens or 0 for r in ok)),
            c.prompt_tokens,
        )
    ]
    if all(r.cached_tokens is not None for r in ok):
        checks.append(
            Identity(
                "client_cached_eq_server_hits",
                "sum usage.cached_tokens == prefix_cache_hits + external_prefix_cache_hits",
                float(sum(r.cached_tokens or 0 for r in ok)),
                c.hbm_hits + c.ext_hits,
            )
        )
    return checks


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
    ttft_p90_ms: float = math.nan
    itl_p50_ms: float = math.nan  # gaps between consecutive tokens, pooled over requests
    itl_p90_ms: float = math.nan
    itl_p99_ms: float = math.nan
    itl_mean_ms: float = math.nan
    cache_read_pct: float = math.nan  # 100 x sum cached_tokens / sum prompt_tokens (client)

    def to_json(self) -> dict[str, object]:
        """Plain fields, NaN (a percentile of no values) as None: JSON has no NaN."""
        return {k: _nan_none(v) for k, v in asdict(self).items()}


def summarize(records: Sequence[Record], duration_s: float) -> Summary:
    """Throughput over the window's wall clock, TTFT and inter-token latency percentiles of
    completed requests, and the client-side cache-read share."""
    if not (math.isfinite(duration_s) and duration_s > 0):
        raise ValueError(f"duration_s={duration_s!r} must be a positive finite number")
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft * 1e3 for r in ok if r.ttft is not None]
    itls = [g * 1e3 for r in ok for g in r.itl()]  # pooled over requests
    out_tokens = sum(r.completion_tokens or 0 for r in ok)
    in_tokens = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    has = bool(ttfts)
    return Summary(
        requests=len(records),
        completed=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration_s,
        total_input_tokens=in_tokens,
        total_output_tokens=out_tokens,
        total_cached_tokens=cached,
        request_throughput=len(ok) / duration_s,
        output_throughput=out_tokens / duration_s,
        ttft_p50_ms=percentile(ttfts, 50) if has else math.nan,
        ttft_p99_ms=percentile(ttfts, 99) if has else math.nan,
        ttft_mean_ms=float(np.mean(ttfts)) if has else math.nan,
        osl_mismatch=sum(1 for r in ok if r.completion_tokens != r.max_tokens),
        errors=sorted({r.error for r in records if r.error is not None})[:10],
        ttft_p90_ms=percentile(ttfts, 90) if has else math.nan,
        itl_p50_ms=percentile(itls, 50) if itls else math.nan,
        itl_p90_ms=percentile(itls, 90) if itls else math.nan,
        itl_p99_ms=percentile(itls, 99) if itls else math.nan,
        itl_mean_ms=float(np.mean(itls)) if itls else math.nan,
        cache_read_pct=100.0 * cached / in_tokens if in_tokens else math.nan,
    )


def after_cut(records: Iterable[Record], t0: float, cut_s: float) -> list[Record]:
    """Requests sent at or after `t0 + cut_s` (a start-cut window; skipped ones left out)."""
    if not (math.isfinite(cut_s) and cut_s >= 0):
        raise ValueError(f"cut_s={cut_s!r} must be a finite number of seconds >= 0")
    return [r for r in records if r.sent and r.start >= t0 + cut_s]


def summarize_window(
    records: Sequence[Record], started: float, finished: float, cut_s: float = 0.0
) -> Summary | None:
    """`summarize` of the requests sent at or after `started + cut_s`, over the wall clock from
    the cut to the load's end; None when the window holds no request."""
    window = after_cut(records, started, cut_s) if cut_s > 0 else list(records)
    begin = started + cut_s
    if not window or finished <= begin:
        return None
    return summarize(window, finished - begin)


@dataclass(frozen=True, slots=True)
class Bucket:
    """Requests sent within `[t_s, t_s + width)` seconds of the load's start."""

    t_s: float
    requests: int
    completed: int
    ttft_p50_ms: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int

    @property
    def hit_rate(self) -> float:
        """Client cached tokens over prompt tokens (NaN without prompt tokens)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else math.nan

    def to_json(self) -> dict[str, object]:
        """Fields plus `hit_rate`."""
        out: dict[str, object] = asdict(self)
        out["hit_rate"] = self.hit_rate
        return out


def time_series(records: Sequence[Record], t0: float, bucket_s: float) -> list[Bucket]:
    """Per `bucket_s` of send time: requests, TTFT p50 (ms) and the client hit rate."""
    if not (math.isfinite(bucket_s) and bucket_s > 0):
        raise ValueError(f"bucket_s={bucket_s!r} must be a positive number of seconds")
    sent = [r for r in records if r.sent]
    if not sent:
        return []
    n = int((max(r.start for r in sent) - t0) // bucket_s) + 1
    groups: list[list[Record]] = [[] for _ in range(max(n, 1))]
    for r in sent:
        groups[max(0, int((r.start - t0) // bucket_s))].append(r)
    out = []
    for k, group in enumerate(groups):
        ok = [r for r in group if r.ok]
        ttfts = [r.ttft * 1e3 for r in ok if r.ttft is not None]
        out.append(
            Bucket(
                t_s=k * bucket_s,
                requests=len(group),
                completed=len(ok),
                ttft_p50_ms=percentile(ttfts, 50) if ttfts else math.nan,
                prompt_tokens=sum(r.prompt_tokens or 0 for r in ok),
                cached_tokens=sum(r.cached_tokens or 0 for r in ok),
                output_tokens=sum(r.completion_tokens or 0 for r in ok),
            )
        )
    return out


def sample(ms: MetricSet, t: float) -> dict[str, Any]:
    """One periodic sample: time, tier residency bytes per tier (summed over ranks) and the
    `SAMPLED` counter totals the server exports."""
    return {
        "t": t,
        "residency": ms.by_label(RESIDENCY, "tier"),
        "counters": sampled_totals(ms),
    }


def residency_series(
    samples: Sequence[Mapping[str, Any]], t0: float
) -> dict[str, list[list[float]]]:
    """Per tier: [seconds since `t0`, bytes] pairs, in sample order. A tier's gauge appears
    with its first write, so a sample without it (taken before) counts 0 bytes."""
    tiers = sorted({str(t) for smp in samples for t in smp.get("residency") or {}})
    out: dict[str, list[list[float]]] = {t: [] for t in tiers}
    for smp in samples:
        have = smp.get("residency") or {}
        for tier in tiers:
            out[tier].append([float(smp["t"]) - t0, float(have.get(tier, 0.0))])
    return out


def server_hit_series(samples: Sequence[Mapping[str, Any]], t0: float) -> list[dict[str, float]]:
    """Between consecutive samples: the server's (HBM + external) hits over prompt tokens, at
    the later sample's time since `t0` (intervals with no prompt tokens left out)."""
    out = []
    for a, b in zip(samples, samples[1:], strict=False):
        ca, cb = a.get("counters") or {}, b.get("counters") or {}
        c = Counters.of_samples(ca, cb)
        if c.prompt_tokens > 0:
            out.append({"t_s": float(b["t"]) - t0, "hit_rate": c.hit_rate})
    return out


def counters_since(
    samples: Sequence[Mapping[str, Any]], t_from: float, after: MetricSet
) -> Counters | None:
    """Server counters from the last sample at or before `t_from` to the final `after` scrape
    (a start-cut window, aligned to the scrape interval: requests still being counted at that
    sample fall in the window too); None without such a sample."""
    first = None
    for smp in samples:
        if float(smp["t"]) <= t_from:
            first = smp
    if first is None:
        return None
    return Counters.of_samples(first.get("counters") or {}, sampled_totals(after))


@dataclass(frozen=True, slots=True)
class Spread:
    """Mean, sample sd, min and max of one metric over repetitions (NaNs left out)."""

    n: int
    mean: float
    sd: float
    min: float
    max: float

    def to_json(self) -> dict[str, float | int | None]:
        """Fields, with NaN as None (JSON has no NaN)."""
        return {k: _nan_none(v) for k, v in asdict(self).items()}


def spread(values: Iterable[float]) -> Spread:
    """The spread of the finite values (n = 0 gives NaNs; one value gives sd NaN)."""
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not xs:
        return Spread(0, math.nan, math.nan, math.nan, math.nan)
    sd = statistics.stdev(xs) if len(xs) >= 2 else math.nan
    return Spread(len(xs), statistics.fmean(xs), sd, min(xs), max(xs))


def on_off_ratio(on: float, off: float) -> float | None:
    """`on / off`, or None when `off` is not a positive finite number."""
    if not (math.isfinite(on) and math.isfinite(off) and off > 0):
        return None
    return on / off


def median_se(values: Sequence[float], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The median of `values` and its standard error, bootstrapped over the values (seeded:
    one run's numbers always give one verdict)."""
    arr = np.asarray(values, dtype=float)
    if arr.size == 0:
        raise ValueError("the median of no values: a bench arm measured nothing")
    rng = np.random.default_rng(seed)
    meds = np.median(arr[rng.integers(0, arr.size, size=(draws, arr.size))], axis=1)
    return float(np.median(arr)), float(np.std(meds, ddof=1)) if arr.size > 1 else 0.0


def paired_ratios(
    values: Mapping[int, float | None], base: Mapping[int, float | None]
) -> dict[int, float]:
    """`values` over `base`, repetition by repetition, where both are known and the ratio is
    defined (`on_off_ratio`)."""
    out = {}
    for rep, v in values.items():
        b = base.get(rep)
        if v is not None and b is not None and (r := on_off_ratio(v, b)) is not None:
            out[rep] = r
    return out


@dataclass(frozen=True, slots=True)
class OutputComparison:
    """Greedy outputs of two arms, request by request."""

    compared: int  # requests completed in both arms
    mismatches: int  # of which the outputs differ
    missing: int  # requests not completed in one arm or both
    first_mismatches: list[int]  # up to 10 request indices, for a look

    def to_json(self) -> dict[str, object]:
        """Plain fields."""
        return asdict(self)


def compare_outputs(a: Sequence[Record], b: Sequence[Record]) -> OutputComparison:
    """Compare the outputs of the same requests (by index) in two arms: token ids, or the text
    where a load engine returned text only; a request with neither is missing, never equal."""
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
        out_x, out_y = _output(x), _output(y)
        if out_x is None or out_y is None:
            missing += 1
            continue
        compared += 1
        if out_x != out_y:
            mismatches += 1
            if len(first) < 10:
                first.append(idx)
    return OutputComparison(compared, mismatches, missing, first)


def _output(r: Record) -> tuple[int, ...] | str | None:
    if r.output_ids:
        return tuple(r.output_ids)
    return r.output_text


def _nan_none(v: Any) -> Any:
    return None if isinstance(v, float) and math.isnan(v) else v
