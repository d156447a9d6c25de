"""`kvtier plan`: size the HBM pool and the tier for a model and a workload, before any run.

From an HF config (or a preset) it derives bytes per token per rank, turns the pool and the tier
into tokens, measures the workload's reuse distance and says where it falls against the window a
tier can serve: a reuse that fits in the HBM pool already hits there, one longer than the tier
never hits anywhere, only those in between are the tier's to win. A reuse distance is the cache
(in tokens) that reuse needs in order to hit under LRU, the reused block itself included, so a
reuse of distance `d` hits a cache of `c` tokens exactly when `d <= c`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import typer

from kvtier.cachemodel.curve import CurvePoint, hit_curve, plot_curve
from kvtier.cachemodel.optimum import infinite_leading, optimal_leading
from kvtier.cachemodel.predict import TierHits, predict, tally
from kvtier.cachemodel.reuse import ReuseProfile, pool_reuse_distance, reuse_profile
from kvtier.cachemodel.stream import Request, from_trace, hbm_floors, working_set
from kvtier.cachemodel.trace import TraceRow, parse_trace_rows, read_trace_rows
from kvtier.config import parse_size
from kvtier.errors import ConfigError, KVTierError, LayoutError
from kvtier.layout import KVGeometry, bytes_per_token_from_hf, normalize_dtype
from kvtier.plan_presets import is_preset, preset, preset_names

GB = 10**9
GiB = 1 << 30

# Above this many trace blocks the pure-Python ceiling replay takes minutes; say so instead.
MAX_SIM_BLOCKS = 2_000_000

BELOW_POOL = "below_pool"
INSIDE = "inside"
ABOVE_TIER = "above_tier"
NO_REUSE = "no_reuse"

_VERDICT_LABEL = {
    BELOW_POOL: "HBM already hits",
    INSIDE: "tier can hit",
    ABOVE_TIER: "tier too small",
    NO_REUSE: "no reuse",
}


# ----------------------------------------------------------------------------------- workloads


@dataclass(frozen=True, slots=True)
class SyntheticWorkload:
    """A prefix pool: `n_prefixes` shared prefixes of `prefix_len` tokens, each request adding a
    unique `tail_len`-token tail, `concurrency` requests in flight."""

    n_prefixes: int
    prefix_len: int
    tail_len: int = 0
    concurrency: int = 1

    def __post_init__(self) -> None:
        for flag, value, low in (
            ("--prefixes", self.n_prefixes, 1),
            ("--prefix-len", self.prefix_len, 1),
            ("--tail-len", self.tail_len, 0),
            ("--concurrency", self.concurrency, 0),
        ):
            _check_int(flag, value, low)

    @property
    def request_tokens(self) -> int:
        """Prompt tokens of one request (prefix plus tail)."""
        return self.prefix_len + self.tail_len

    @property
    def in_flight_tokens(self) -> int:
        """Tokens held by requests in flight: pinned in HBM, so a reuse must also get past them."""
        return self.concurrency * self.request_tokens

    @property
    def reuse_distance_tokens(self) -> int:
        """Round-robin reuse distance of a prefix (the whole pool, itself included) plus what the
        requests in flight hold."""
        pool = pool_reuse_distance(self.n_prefixes, self.prefix_len, self.tail_len)
        return pool + self.in_flight_tokens

    @property
    def reusable_tokens(self) -> int:
        """Distinct shared-prefix tokens: what a tier must hold to serve every prefix."""
        return self.n_prefixes * self.prefix_len

    def describe(self) -> str:
        """One line for the report."""
        return (
            f"{self.n_prefixes:,} prefixes x ({self.prefix_len:,} + {self.tail_len:,}) tokens, "
            f"concurrency {self.concurrency}"
        )

    def to_json(self) -> dict[str, Any]:
        """Plain JSON fields."""
        return {
            "kind": "synthetic",
            "n_prefixes": self.n_prefixes,
            "prefix_len": self.prefix_len,
            "tail_len": self.tail_len,
            "concurrency": self.concurrency,
        }


@dataclass(frozen=True, slots=True)
class Trace:
    """A Mooncake-format request trace whose hash ids name `block_tokens`-token blocks."""

    requests: tuple[TraceRow, ...]
    block_tokens: int = 512
    source: str = ""

    def __post_init__(self) -> None:
        _check_int("--trace-block", self.block_tokens, 1)
        if not self.requests:
            raise ConfigError(
                f"--trace {self.source or '(inline)'} has no requests; give a Mooncake JSONL "
                "file with one {hash_ids, input_length, output_length, timestamp} row per line"
            )

    @property
    def chunk_requests(self) -> list[Request]:
        """The requests as the tier sees them, one chunk per trace block."""
        return from_trace(self.requests, self.block_tokens)

    @property
    def num_blocks(self) -> int:
        """Block uses over every request."""
        return sum(len(r.hash_ids) for r in self.requests)

    @property
    def prompt_tokens(self) -> int:
        """Sum of `input_length`."""
        return sum(r.input_length for r in self.requests)

    def describe(self) -> str:
        """One line for the report."""
        name = Path(self.source).name if self.source else "trace"
        return (
            f"{name}: {len(self.requests):,} requests, {self.num_blocks:,} blocks of "
            f"{self.block_tokens:,} tokens"
        )

    def to_json(self) -> dict[str, Any]:
        """Plain JSON fields."""
        return {
            "kind": "trace",
            "source": self.source,
            "requests": len(self.requests),
            "blocks": self.num_blocks,
            "block_tokens": self.block_tokens,
            "prompt_tokens": self.prompt_tokens,
        }


Workload = SyntheticWorkload | Trace


def parse_trace(lines: Iterable[str], block_tokens: int = 512, source: str = "") -> Trace:
    """A Trace from Mooncake JSONL lines, read by the one trace reader
    (`kvtier.cachemodel.trace`: timestamp order, output length 1 by default, no empty rows)."""
    _check_int("--trace-block", block_tokens, 1)
    rows = parse_trace_rows(lines, source=source or "--trace", block_tokens=block_tokens)
    return Trace(tuple(rows), block_tokens, source)


def read_trace(path: str | Path, block_tokens: int = 512) -> Trace:
    """Read a Mooncake JSONL trace file; ConfigError names the line and the fix."""
    _check_int("--trace-block", block_tokens, 1)
    if not Path(path).is_file():
        raise ConfigError(f"--trace {str(path)!r} is not a file; pass a Mooncake JSONL trace path")
    rows = read_trace_rows(path, block_tokens=block_tokens)
    return Trace(tuple(rows), block_tokens, str(path))


def trace_reuse_profile(trace: Trace, hbm_pool_tokens: int, tier_tokens: int) -> ReuseProfile:
    """Reuse distances of the trace's blocks against the pool and the tier."""
    requests = [r.hash_ids for r in trace.requests]
    return reuse_profile(requests, trace.block_tokens, hbm_pool_tokens, tier_tokens)


# ------------------------------------------------------------------------------------- verdict


@dataclass(frozen=True, slots=True)
class Verdict:
    """Where a reuse distance falls against the window (HBM pool, tier]."""

    kind: str
    message: str
    needed_tier_bytes: int | None = None

    @property
    def bad(self) -> bool:
        """True when the tier cannot win hits on this workload."""
        return self.kind != INSIDE

    def to_json(self) -> dict[str, Any]:
        """Plain JSON fields."""
        return {
            "kind": self.kind,
            "message": self.message,
            "needed_tier_bytes": self.needed_tier_bytes,
        }


def window_verdict(
    reuse_distance_tokens: int | None,
    hbm_pool_tokens: int,
    tier_tokens: int,
    bytes_per_token: int,
) -> Verdict:
    """The verdict for one reuse distance: HBM already hits it, the tier can, or the tier is too
    small (with the per-rank bytes a tier would need to hold it)."""
    d, h, t = reuse_distance_tokens, hbm_pool_tokens, tier_tokens
    if d is None:
        return Verdict(NO_REUSE, "no reuse: no block is used twice, so no cache can hit")
    if d <= h:
        return Verdict(
            BELOW_POOL,
            f"HBM already hits; the tier cannot add hits (reuse distance {d:,} <= HBM pool "
            f"{h:,} tokens)",
        )
    if d <= t:
        return Verdict(
            INSIDE, f"tier can hit (HBM pool {h:,} < reuse distance {d:,} <= tier {t:,} tokens)"
        )
    need = d * bytes_per_token
    return Verdict(
        ABOVE_TIER,
        f"tier too small: reuse distance exceeds it; need {need:,} bytes ({need / GiB:.2f} GiB) "
        f"per rank (reuse distance {d:,} > tier {t:,} tokens)",
        needed_tier_bytes=need,
    )


# ------------------------------------------------------------------------------------- ceilings


@dataclass(frozen=True, slots=True)
class TraceCeilings:
    """What each cache serves of a trace, one chunk per trace block (`kvtier.cachemodel`): the
    HBM pool alone (an LRU, tail first), and behind it the real tier driven as the engine does,
    the offline optimum at the tier's capacity (Belady) and an infinite tier (cold misses only).
    Tier rates are of the blocks the HBM missed."""

    usable_blocks: int  # blocks a hit could cover, summed over requests
    hbm_hit_blocks: int
    kvtier: TierHits
    optimum: TierHits
    infinite: TierHits
    hbm_blocks: int
    tier_blocks: int

    @property
    def hbm_rate(self) -> float:
        """HBM hits over usable blocks."""
        return self.hbm_hit_blocks / self.usable_blocks if self.usable_blocks else 0.0

    def to_json(self) -> dict[str, Any]:
        """The ceilings as plain JSON."""
        return {
            "unit": "trace blocks",
            "hbm_blocks": self.hbm_blocks,
            "tier_blocks": self.tier_blocks,
            "usable_blocks": self.usable_blocks,
            "hbm_hit_blocks": self.hbm_hit_blocks,
            "hbm_rate": self.hbm_rate,
            "kvtier": self.kvtier.to_json(),
            "optimum": self.optimum.to_json(),
            "infinite": self.infinite.to_json(),
        }


def trace_ceilings(
    trace: Trace, hbm_pool_tokens: int, tier_tokens: int
) -> tuple[TraceCeilings | None, str]:
    """HBM-alone hits, and the kvtier, optimal and infinite tier behind it (or None and why
    not), with a note. Mooncake hash ids chain their prefixes, so one chunk per block replays
    the same sharing as the full token stream at 1/block_tokens of the cost."""
    if trace.num_blocks > MAX_SIM_BLOCKS:
        return None, (
            f"not simulated: {trace.num_blocks:,} trace blocks exceed {MAX_SIM_BLOCKS:,} (the "
            "pure-Python replay would take minutes); cut the trace, e.g. with head -n"
        )
    requests = trace.chunk_requests
    hbm_blocks = hbm_pool_tokens // trace.block_tokens
    tier_blocks = tier_tokens // trace.block_tokens
    floors = hbm_floors(requests, hbm_blocks)
    result = TraceCeilings(
        usable_blocks=sum(r.usable for r in requests),
        hbm_hit_blocks=sum(floors),
        kvtier=predict(requests, tier_blocks, floors),
        optimum=tally(requests, floors, optimal_leading(requests, tier_blocks)),
        infinite=tally(requests, floors, infinite_leading(requests)),
        hbm_blocks=hbm_blocks,
        tier_blocks=tier_blocks,
    )
    note = (
        f"whole {trace.block_tokens}-token trace blocks: HBM {hbm_blocks:,} blocks (LRU), tier "
        f"{tier_blocks:,} blocks; tier rates are of the blocks the HBM missed, a request's last "
        "token never hits"
    )
    return result, note


def trace_curve(
    trace: Trace, hbm_pool_tokens: int, tier_tokens: int, png: str | Path | None
) -> tuple[list[CurvePoint], Path | None]:
    """Tier hits against tier capacity behind the HBM pool (kvtier, optimum, infinite), drawn
    as a PNG at `png` when given, the tier of `tier_tokens` marked."""
    if trace.num_blocks > MAX_SIM_BLOCKS:
        raise ConfigError(
            f"--trace has {trace.num_blocks:,} blocks, more than the {MAX_SIM_BLOCKS:,} a hit "
            "curve replays; cut the trace, e.g. with head -n"
        )
    requests = trace.chunk_requests
    points = hit_curve(requests, hbm_pool_tokens // trace.block_tokens)
    if png is None:
        return points, None
    name = Path(trace.source).name if trace.source else "trace"
    title = f"{name}: tier hits behind an HBM pool of {hbm_pool_tokens:,} tokens"
    mark = min(1.0, tier_tokens // trace.block_tokens / max(1, working_set(requests)))
    return points, plot_curve(points, png, title, mark)


# ----------------------------------------------------------------------------------------- plan


@dataclass(frozen=True, slots=True)
class PlanResult:
    """Everything `kvtier plan` reports; sizes are per rank unless a name says otherwise."""

    model: str
    geometry: KVGeometry
    block_size: int
    hbm_pool_tokens: int
    hbm_from: str  # "--hbm-tokens" or "--hbm-bytes"
    tier_bytes: int
    tier_tokens: int
    workload: Workload
    reuse_distance_tokens: int | None  # synthetic: the pool's; trace: the median
    reuse_p90_tokens: int | None
    reusable_tokens: int
    verdict: Verdict
    store_gbps: float
    prefill_tokens_per_s: float | None
    profile: ReuseProfile | None = None
    ceilings: TraceCeilings | None = None
    ceiling_note: str = ""
    warnings: tuple[str, ...] = field(default_factory=tuple)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes per token on one rank."""
        return self.geometry.bytes_per_token

    @property
    def total_bytes_per_token(self) -> int:
        """KV bytes per token over every TP rank (replicated copies included)."""
        return self.geometry.total_bytes_per_token

    @property
    def hbm_pool_bytes(self) -> int:
        """Bytes of the HBM pool on one rank."""
        return self.hbm_pool_tokens * self.bytes_per_token

    @property
    def tier_bytes_all_ranks(self) -> int:
        """Host memory the tier pins over all TP ranks (check it against each NUMA node)."""
        return self.tier_bytes * self.geometry.tp_size

    @property
    def reusable_bytes(self) -> int:
        """Per-rank bytes of the reusable working set: what the tier should hold."""
        return self.reusable_tokens * self.bytes_per_token

    @property
    def tier_over_reusable(self) -> float | None:
        """Tier size over the reusable working set (None when nothing is reusable)."""
        return self.tier_bytes / self.reusable_bytes if self.reusable_bytes else None

    @property
    def tier_fill_s(self) -> float:
        """Seconds to fill the whole tier at the store bandwidth."""
        return self.tier_bytes / (self.store_gbps * GB)

    @property
    def working_set_fill_s(self) -> float:
        """Seconds before steady-state reuse: the reusable set (at most the tier) stored once."""
        return min(self.reusable_bytes, self.tier_bytes) / (self.store_gbps * GB)

    @property
    def break_even_gbps(self) -> float | None:
        """Per-rank read GB/s at which loading a token costs as much as recomputing it."""
        if self.prefill_tokens_per_s is None:
            return None
        return self.bytes_per_token * self.prefill_tokens_per_s / GB

    def to_json(self) -> dict[str, Any]:
        """Every quantity as plain JSON (bytes in B, bandwidths in GB/s, times in s)."""
        g = self.geometry
        return {
            "model": self.model,
            "kind": g.kind,
            "num_layers": g.num_layers,
            "kv_dtype": g.kv_dtype,
            "tp": g.tp_size,
            "block_size": self.block_size,
            "bytes_per_token_per_rank": self.bytes_per_token,
            "bytes_per_token_all_ranks": self.total_bytes_per_token,
            "replicated_across_tp": g.replicated_across_tp,
            "hbm_pool_tokens": self.hbm_pool_tokens,
            "hbm_pool_bytes": self.hbm_pool_bytes,
            "hbm_from": self.hbm_from,
            "tier_bytes": self.tier_bytes,
            "tier_tokens": self.tier_tokens,
            "tier_bytes_all_ranks": self.tier_bytes_all_ranks,
            "workload": self.workload.to_json(),
            "reuse_distance_tokens": self.reuse_distance_tokens,
            "reuse_p90_tokens": self.reuse_p90_tokens,
            "reuse_profile": self.profile.to_json() if self.profile else None,
            "window": {"hbm_pool_tokens": self.hbm_pool_tokens, "tier_tokens": self.tier_tokens},
            "verdict": self.verdict.to_json(),
            "reusable_tokens": self.reusable_tokens,
            "reusable_bytes": self.reusable_bytes,
            "tier_over_reusable": self.tier_over_reusable,
            "store_gbps": self.store_gbps,
            "tier_fill_s": self.tier_fill_s,
            "working_set_fill_s": self.working_set_fill_s,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "break_even_gbps": self.break_even_gbps,
            "ceilings": self.ceilings.to_json() if self.ceilings else None,
            "ceiling_note": self.ceiling_note,
            "warnings": list(self.warnings),
        }


def plan(
    config: Mapping[str, object],
    *,
    tier_bytes: int,
    workload: Workload,
    model: str = "",
    kv_dtype: str = "auto",
    tp: int = 1,
    block_size: int = 16,
    hbm_tokens: int | None = None,
    hbm_bytes: int | None = None,
    store_gbps: float = 5.0,
    prefill_tokens_per_s: float | None = None,
    index_dtype: str = "fp8",
    include_mtp: bool = False,
) -> PlanResult:
    """Size the pool and tier of `config` (an HF config dict) for `workload`; pure, no I/O.

    The HBM pool is per rank, as `hbm_tokens` or as `hbm_bytes` (rounded down to whole
    `block_size` blocks); `tier_bytes` is per rank. Raises ConfigError/LayoutError naming the flag.
    """
    _check_int("--tp", tp, 1)
    _check_int("--block-size", block_size, 1)
    _check_int("--tier-bytes", tier_bytes, 1)
    if not (isinstance(store_gbps, int | float) and math.isfinite(store_gbps) and store_gbps > 0):
        raise ConfigError(f"--store-gbps {store_gbps!r} must be a number of GB/s > 0, e.g. 5")
    if prefill_tokens_per_s is not None and not (
        isinstance(prefill_tokens_per_s, int | float)
        and math.isfinite(prefill_tokens_per_s)
        and prefill_tokens_per_s > 0
    ):
        raise ConfigError(
            f"--prefill-tokens-per-s {prefill_tokens_per_s!r} must be a rate > 0, e.g. 14000"
        )
    for flag, name in (("--kv-dtype", kv_dtype), ("--index-dtype", index_dtype)):
        if name != "auto" or flag != "--kv-dtype":
            try:
                normalize_dtype(name)
            except LayoutError as exc:
                raise ConfigError(f"{flag}: {exc}") from exc
    try:
        geometry = bytes_per_token_from_hf(
            config, tp_size=tp, kv_dtype=kv_dtype, index_dtype=index_dtype, include_mtp=include_mtp
        )
    except LayoutError as exc:
        raise LayoutError(
            f"--model {model or '(config)'}: {exc} (check --kv-dtype, --tp and the config)"
        ) from exc
    bpt = geometry.bytes_per_token

    hbm_pool, hbm_from = _hbm_pool_tokens(hbm_tokens, hbm_bytes, bpt, block_size)
    tier_tokens = tier_bytes // bpt
    if tier_tokens == 0:
        raise ConfigError(
            f"--tier-bytes {tier_bytes} holds no token of {bpt:,} bytes per rank; give at least "
            f"{bpt} bytes, e.g. 64GiB"
        )

    profile: ReuseProfile | None = None
    ceilings: TraceCeilings | None = None
    if isinstance(workload, SyntheticWorkload):
        distance: int | None = workload.reuse_distance_tokens
        p90 = None
        reusable = workload.reusable_tokens
        note = (
            "not simulated: a synthetic pool has no request stream; pass --trace, or measure "
            "with kvtier bench e2e"
        )
    elif isinstance(workload, Trace):
        profile = trace_reuse_profile(workload, hbm_pool, tier_tokens)
        distance, p90 = profile.median, profile.p90
        reusable = profile.reusable_tokens
        ceilings, note = trace_ceilings(workload, hbm_pool, tier_tokens)
    else:
        raise ConfigError(
            f"workload {workload!r} is neither a SyntheticWorkload nor a Trace; "
            "pass --prefixes/--prefix-len or --trace"
        )

    verdict = window_verdict(distance, hbm_pool, tier_tokens, bpt)
    warnings: list[str] = []
    if tier_tokens <= hbm_pool:
        warnings.append(
            f"the tier ({tier_tokens:,} tokens) is no larger than the HBM pool ({hbm_pool:,} "
            "tokens): the window (HBM pool, tier] is empty, so the tier can never hit; "
            "raise --tier-bytes or lower the HBM pool"
        )
    if verdict.bad:
        warnings.append(verdict.message)
    if verdict.kind != ABOVE_TIER and reusable * bpt > tier_bytes:
        warnings.append(
            f"the tier ({tier_bytes:,} B) is smaller than the reusable working set "
            f"({reusable * bpt:,} B per rank): expect evictions of reusable prefixes"
        )

    return PlanResult(
        model=model,
        geometry=geometry,
        block_size=block_size,
        hbm_pool_tokens=hbm_pool,
        hbm_from=hbm_from,
        tier_bytes=tier_bytes,
        tier_tokens=tier_tokens,
        workload=workload,
        reuse_distance_tokens=distance,
        reuse_p90_tokens=p90,
        reusable_tokens=reusable,
        verdict=verdict,
        store_gbps=float(store_gbps),
        prefill_tokens_per_s=(
            None if prefill_tokens_per_s is None else float(prefill_tokens_per_s)
        ),
        profile=profile,
        ceilings=ceilings,
        ceiling_note=note,
        warnings=tuple(warnings),
    )


def _hbm_pool_tokens(
    hbm_tokens: int | None, hbm_bytes: int | None, bpt: int, block_size: int
) -> tuple[int, str]:
    if hbm_tokens is not None and hbm_bytes is not None:
        raise ConfigError(
            f"the HBM pool is given twice (--hbm-tokens {hbm_tokens} and --hbm-bytes "
            f"{hbm_bytes}); pass only one of them"
        )
    if hbm_tokens is not None:
        _check_int("--hbm-tokens", hbm_tokens, 1)
        return hbm_tokens, "--hbm-tokens"
    if hbm_bytes is not None:
        _check_int("--hbm-bytes", hbm_bytes, 1)
        block_bytes = bpt * block_size
        blocks = hbm_bytes // block_bytes
        if blocks == 0:
            raise ConfigError(
                f"--hbm-bytes {hbm_bytes} holds no block of {block_size} tokens x {bpt:,} bytes "
                f"per rank ({block_bytes:,} B); give the KV pool per rank, e.g. 80GiB"
            )
        return blocks * block_size, "--hbm-bytes"
    raise ConfigError(
        "the HBM pool is missing; pass --hbm-tokens N (KV-cache tokens per rank, e.g. "
        "num_gpu_blocks x block_size) or --hbm-bytes SIZE (KV pool bytes per rank, e.g. 80GiB)"
    )


def _check_int(flag: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{flag} {value!r} must be an integer >= {low}")


# ----------------------------------------------------------------------------------- model input


def load_model_config(model: str) -> dict[str, Any]:
    """The HF config of a preset name or a `config.json` path (a model directory works too)."""
    if is_preset(model):
        return preset(model)
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"--model {model!r} is neither a preset nor a config.json file; use one of "
            f"{', '.join(preset_names())} or the path of a model's config.json"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--model {model!r}: cannot read {path} as JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ConfigError(
            f"--model {model!r}: {path} holds a JSON {type(data).__name__}, not an HF config object"
        )
    return data


# -------------------------------------------------------------------------------------- report


def _bytes(n: int) -> str:
    return f"{n:,} ({n / GiB:.2f} GiB)"


def _secs(s: float) -> str:
    return f"{s:,.1f}" if s >= 10 else f"{s:.3g}"


def _pct(rate: float) -> str:
    return f"{100 * rate:.2f}%"


def report_rows(r: PlanResult) -> list[tuple[str, str, str]]:
    """(quantity, value, unit) rows of the report, in print order."""
    g = r.geometry
    rows: list[tuple[str, str, str]] = [
        ("model", f"{r.model} ({g.kind}, {g.num_layers} layers)", ""),
        ("KV dtype / TP / block size", f"{g.kv_dtype} / {g.tp_size} / {r.block_size}", ""),
        ("bytes per token per rank", f"{r.bytes_per_token:,}", "B"),
        (
            "bytes per token, all ranks",
            f"{r.total_bytes_per_token:,}" + (" (replicated)" if g.replicated_across_tp else ""),
            "B",
        ),
        (f"HBM pool per rank ({r.hbm_from})", f"{r.hbm_pool_tokens:,}", "tokens"),
        ("HBM pool per rank", _bytes(r.hbm_pool_bytes), "B"),
        ("tier per rank", _bytes(r.tier_bytes), "B"),
        ("tier per rank", f"{r.tier_tokens:,}", "tokens"),
        ("tier, all ranks (host memory pinned)", _bytes(r.tier_bytes_all_ranks), "B"),
        ("workload", r.workload.describe(), ""),
    ]
    if isinstance(r.workload, SyntheticWorkload):
        rows.append(("reuse distance", f"{r.reuse_distance_tokens:,}", "tokens"))
        rows.append(("  of which in flight", f"{r.workload.in_flight_tokens:,}", "tokens"))
    else:
        na = "n/a (no reuse)"
        rows.append(
            (
                "reuse distance median",
                na if r.reuse_distance_tokens is None else f"{r.reuse_distance_tokens:,}",
                "tokens",
            )
        )
        rows.append(
            (
                "reuse distance p90",
                na if r.reuse_p90_tokens is None else f"{r.reuse_p90_tokens:,}",
                "tokens",
            )
        )
        if r.profile is not None:
            p = r.profile
            rows.append(
                (
                    "reuses in HBM / window / above tier",
                    f"{p.below_pool:,} / {p.inside:,} / {p.above_tier:,}",
                    "reuses",
                )
            )
    rows += [
        ("window (HBM pool, tier]", f"({r.hbm_pool_tokens:,}, {r.tier_tokens:,}]", "tokens"),
        ("verdict", _VERDICT_LABEL[r.verdict.kind], ""),
        ("reusable working set", f"{r.reusable_tokens:,}", "tokens"),
        ("reusable working set per rank", _bytes(r.reusable_bytes), "B"),
        (
            "tier / reusable working set",
            "n/a" if r.tier_over_reusable is None else f"{r.tier_over_reusable:.2f}x",
            "",
        ),
        ("store bandwidth per rank", f"{r.store_gbps:g}", "GB/s"),
        ("tier fill time", _secs(r.tier_fill_s), "s"),
        ("working-set fill time", _secs(r.working_set_fill_s), "s"),
    ]
    if r.break_even_gbps is None:
        rows.append(("break-even read bandwidth per rank", "n/a: pass --prefill-tokens-per-s", ""))
    else:
        rows.append(("prefill rate", f"{r.prefill_tokens_per_s:,.0f}", "tokens/s"))
        rows.append(("break-even read bandwidth per rank", f"{r.break_even_gbps:.4g}", "GB/s"))
    if r.ceilings is None:
        rows.append(("hit ceiling", "n/a (see the note below)", ""))
    else:
        c = r.ceilings
        rows += [
            ("HBM hits (LRU pool alone)", _pct(c.hbm_rate), "of usable blocks"),
            ("tier hits, kvtier (real tier, predicted)", _pct(c.kvtier.rate), "of HBM misses"),
            ("tier hits, offline optimum (Belady)", _pct(c.optimum.rate), "of HBM misses"),
            ("tier hits, infinite tier", _pct(c.infinite.rate), "of HBM misses"),
        ]
    return rows


def print_report(r: PlanResult) -> None:
    """The report as a rich table, then the verdict and one WARNING line per problem."""
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    table = Table(title=f"kvtier plan: {r.model}")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_column("unit")
    for row in report_rows(r):
        table.add_row(*row)
    console.print(table)
    if not r.verdict.bad:
        console.print(f"verdict: {r.verdict.message}", soft_wrap=True, markup=False)
    console.print(f"ceilings: {r.ceiling_note}", soft_wrap=True, markup=False)
    for w in r.warnings:
        console.print(f"WARNING: {w}", soft_wrap=True, markup=False)


# ----------------------------------------------------------------------------------------- CLI


def plan_command(
    model: str = typer.Option(
        ...,
        "--model",
        "-m",
        help=f"A preset ({', '.join(preset_names())}) or the path of an HF config.json.",
    ),
    kv_dtype: str = typer.Option(
        "auto", "--kv-dtype", help="KV-cache dtype: bf16, fp16, fp8, ... (auto: the config's)."
    ),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel ranks."),
    block_size: int = typer.Option(16, "--block-size", help="HBM block size in tokens."),
    hbm_tokens: int | None = typer.Option(
        None, "--hbm-tokens", help="HBM KV pool per rank in tokens."
    ),
    hbm_bytes: str | None = typer.Option(
        None, "--hbm-bytes", help="HBM KV pool per rank in bytes, e.g. 80GiB."
    ),
    tier_bytes: str = typer.Option(..., "--tier-bytes", help="Tier size per rank, e.g. 64GiB."),
    prefixes: int | None = typer.Option(None, "--prefixes", help="Shared prefixes in the pool."),
    prefix_len: int | None = typer.Option(None, "--prefix-len", help="Tokens per prefix."),
    tail_len: int | None = typer.Option(
        None, "--tail-len", help="Unique tokens after the prefix [default: 0]."
    ),
    concurrency: int | None = typer.Option(
        None, "--concurrency", help="Requests in flight [default: 1]."
    ),
    trace: Path | None = typer.Option(
        None, "--trace", help="Mooncake JSONL trace instead of a synthetic pool."
    ),
    trace_block: int = typer.Option(512, "--trace-block", help="Tokens per trace hash id."),
    store_gbps: float = typer.Option(5.0, "--store-gbps", help="Tier store GB/s per rank."),
    prefill_tokens_per_s: float | None = typer.Option(
        None, "--prefill-tokens-per-s", help="Measured prefill rate, for break-even bandwidth."
    ),
    index_dtype: str = typer.Option("fp8", "--index-dtype", help="DSA indexer cache dtype."),
    include_mtp: bool = typer.Option(
        False, "--include-mtp", help="Count MTP/nextn layers (speculative decoding on)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    png: Path = typer.Option(
        Path("runs/plan-trace.png"),
        "--png",
        help="With --trace: where to draw tier hits vs tier capacity (kvtier, optimum, infinite).",
    ),
) -> None:
    """Bytes per token, pool and tier in tokens, the reuse window verdict, fill time, break-even
    bandwidth and (for a trace) hit ceilings and a PNG of tier hits against tier capacity."""
    try:
        config = load_model_config(model)
        workload = _workload(prefixes, prefix_len, tail_len, concurrency, trace, trace_block)
        result = plan(
            config,
            model=model,
            kv_dtype=kv_dtype,
            tp=tp,
            block_size=block_size,
            hbm_tokens=hbm_tokens,
            hbm_bytes=None if hbm_bytes is None else parse_size(hbm_bytes, "--hbm-bytes"),
            tier_bytes=parse_size(tier_bytes, "--tier-bytes"),
            workload=workload,
            store_gbps=store_gbps,
            prefill_tokens_per_s=prefill_tokens_per_s,
            index_dtype=index_dtype,
            include_mtp=include_mtp,
        )
        curve: list[CurvePoint] = []
        drawn = None
        if isinstance(workload, Trace):
            curve, drawn = trace_curve(workload, result.hbm_pool_tokens, result.tier_tokens, png)
    except KVTierError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    if as_json:
        doc = result.to_json()
        if curve:
            doc["hit_curve"] = [p.to_json() for p in curve]
            doc["hit_curve_png"] = str(drawn)
        typer.echo(json.dumps(doc, indent=2))
        for w in result.warnings:
            typer.echo(f"WARNING: {w}", err=True)
    else:
        print_report(result)
        if drawn is not None:
            typer.echo(f"hit curve: {drawn}")


def _workload(
    prefixes: int | None,
    prefix_len: int | None,
    tail_len: int | None,
    concurrency: int | None,
    trace: Path | None,
    trace_block: int,
) -> Workload:
    synthetic = {
        "--prefixes": prefixes,
        "--prefix-len": prefix_len,
        "--tail-len": tail_len,
        "--concurrency": concurrency,
    }
    given = [flag for flag, v in synthetic.items() if v is not None]
    if trace is not None:
        if given:
            raise ConfigError(
                f"--trace and {', '.join(given)} both describe the workload; pass either a "
                "trace or a synthetic pool (--prefixes/--prefix-len/--tail-len/--concurrency)"
            )
        return read_trace(trace, trace_block)
    if prefixes is None or prefix_len is None:
        missing = [f for f in ("--prefixes", "--prefix-len") if synthetic[f] is None]
        raise ConfigError(
            f"no workload: {' and '.join(missing)} missing; pass --prefixes N --prefix-len L "
            "[--tail-len T --concurrency C] or --trace FILE"
        )
    return SyntheticWorkload(
        prefixes,
        prefix_len,
        0 if tail_len is None else tail_len,
        1 if concurrency is None else concurrency,
    )
