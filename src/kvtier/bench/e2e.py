"""`kvtier bench e2e`: the native engine served with the tier ON against OFF, back to back.

Two workloads per arm, the same seed in both arms:

* prefix pool: N shared prefixes + a unique tail per request, N chosen so the reuse distance
  lies in `[HBM pool, tier)` (the only place where a tier can add hits);
* no reuse: unique prompts, which measure what saving every chunk costs when nothing comes back.

Reported: throughput and TTFT per arm and their ON/OFF ratios, hit rates from the server's
counters next to ceilings simulated on the exact requests sent, the counter identities, and
whether greedy outputs agree token for token between the arms.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console

from kvtier import __version__
from kvtier.bench import analysis
from kvtier.bench.arms import OFF, ON, ArmRun, ServerConfig, Window, Workload, arm_order, run_arm
from kvtier.bench.ceiling import Ceiling, hbm_ceiling, infinite_ceiling, tier_ceiling
from kvtier.bench.table import Report, Row, Target, write_json
from kvtier.bench.workload import (
    NO_REUSE,
    PREFIX_POOL,
    WARMUP,
    Placement,
    no_reuse,
    place_in_window,
    prefix_pool,
)
from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.layout import bytes_per_token_from_hf

DEFAULT_JSON = Path("runs/bench-e2e.json")
# The tiny model (hidden 256, 4 layers) prefills so fast on a CPU that recompute costs about as
# much as a lookup round trip; the small one (hidden 512, 8 layers) is where a tier can pay.
MODEL_PRESETS: dict[str, dict[str, int]] = {
    "tiny": {},
    "small": {"hidden": 512, "layers": 8, "heads": 8, "kv_heads": 4, "intermediate": 1536},
}
DEFAULT_MEMORY_BYTES = "256MiB"
# The native engine computes and caches KV in its default dtype unless told otherwise.
KV_DTYPE = "float32"
BLOCK_SIZE = 16
NO_REUSE_TARGET = 0.97

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class Plan:
    """Workload shape and sizes of one run (`FULL` or `QUICK`)."""

    prefix_requests: int
    no_reuse_requests: int
    prefix_len: int
    tail_len: int
    no_reuse_len: int
    max_tokens: int
    concurrency: int
    hbm_blocks: int
    low_margin: float  # reuse distance >= low_margin x HBM pool
    warmup_requests: int
    max_batched_tokens: int


# About 2-3 minutes at TP 2 on 2 shared cores: 22 prefixes of 256 tokens against a 2,048-token
# HBM pool; the pool also holds 4 requests in flight (4 x 304 tokens).
FULL = Plan(
    prefix_requests=240,
    no_reuse_requests=96,
    prefix_len=256,
    tail_len=32,
    no_reuse_len=288,
    max_tokens=16,
    concurrency=4,
    hbm_blocks=128,
    low_margin=3.0,
    warmup_requests=4,
    max_batched_tokens=1024,
)
# Under a minute: 7 prefixes of 128 tokens against a 512-token pool.
QUICK = Plan(
    prefix_requests=48,
    no_reuse_requests=16,
    prefix_len=128,
    tail_len=32,
    no_reuse_len=160,
    max_tokens=8,
    concurrency=2,
    hbm_blocks=32,
    low_margin=2.0,
    warmup_requests=2,
    max_batched_tokens=512,
)


def ensure_model(model_dir: str | Path | None, preset: str = "small") -> Path:
    """`model_dir`, or a float32 preset model under runs/ (generated once, then reused)."""
    if model_dir is not None:
        path = Path(model_dir)
        if not (path / "config.json").is_file():
            raise ConfigError(f"--model-dir {str(path)!r} has no config.json; pass a model dir")
        return path
    if preset not in MODEL_PRESETS:
        raise ConfigError(f"model preset {preset!r} is unknown; use one of {sorted(MODEL_PRESETS)}")
    path = Path("runs") / f"{preset}-model"
    if not (path / "model.safetensors").is_file():
        from kvtier.native.modelgen import init_model

        init_model(path, dtype="float32", **MODEL_PRESETS[preset])
    return path


def tier_chunks_per_rank(
    model_config: dict[str, Any], tp: int, chunk_size: int, memory: int
) -> int:
    """Chunks the memory tier of one rank holds: its budget over one chunk's KV bytes."""
    geometry = bytes_per_token_from_hf(model_config, tp_size=tp, kv_dtype=KV_DTYPE)
    return memory // geometry.bytes_for_tokens(chunk_size)


def run(
    *,
    model_dir: str | Path | None = None,
    tp: int = 2,
    hbm_blocks: int | None = None,
    chunk_size: int = 64,
    requests: int | None = None,
    concurrency: int | None = None,
    repeat: int = 1,
    quick: bool = False,
    json_path: str | Path | None = None,
    seed: int = 0,
    progress: Progress | None = None,
    bars: bool = True,
    console: Console | None = None,
) -> dict[str, Any]:
    """Run both arms (`repeat` times, order alternating), write the JSON report and return it.

    Tier settings come from `KVTIER_*` variables (`KVTIER_MEMORY_BYTES` defaults to 256MiB);
    `chunk_size` sets `KVTIER_CHUNK_SIZE`. Missed targets are reported in rows, never raised;
    a server that fails to start or a window with no completed request raises.
    """
    say = progress or (lambda _m: None)
    out = Path(DEFAULT_JSON if json_path is None else json_path)
    if out.is_dir():
        raise ConfigError(f"--json {str(out)!r} is a directory; pass a file such as {out}/e.json")
    plan = _plan(quick, hbm_blocks, requests, concurrency)
    if tp < 1:
        raise ConfigError(f"--tp {tp} must be >= 1")
    t0 = time.perf_counter()

    model = ensure_model(model_dir, "tiny" if quick else "small")
    model_config = json.loads((model / "config.json").read_text())
    vocab = int(model_config["vocab_size"])
    env = {"KVTIER_MEMORY_BYTES": DEFAULT_MEMORY_BYTES, **_kvtier_env()}
    env["KVTIER_CHUNK_SIZE"] = str(chunk_size)
    kv_config = KVTierConfig.from_env(env)
    if not kv_config.enabled:
        raise ConfigError(
            "the kvtier config has enabled=false, which would make the ON arm an OFF arm; "
            "unset KVTIER_ENABLED (or enabled: in $KVTIER_CONFIG) for the bench"
        )
    if kv_config.chunk_size % BLOCK_SIZE:
        raise ConfigError(f"--chunk-size {chunk_size} is not a multiple of {BLOCK_SIZE}")
    tier_chunks = tier_chunks_per_rank(model_config, tp, chunk_size, kv_config.memory_bytes)
    hbm_tokens = plan.hbm_blocks * BLOCK_SIZE
    placement = place_in_window(
        hbm_tokens,
        tier_chunks * chunk_size,
        plan.prefix_len,
        plan.tail_len,
        low_margin=plan.low_margin,
    )
    pool = prefix_pool(
        placement.n_prefixes,
        plan.prefix_len,
        plan.tail_len,
        plan.prefix_requests,
        seed,
        vocab,
        max_tokens=plan.max_tokens,
    )
    fresh = no_reuse(
        plan.no_reuse_requests, plan.no_reuse_len, seed, vocab, max_tokens=plan.max_tokens
    )
    warm = no_reuse(
        plan.warmup_requests,
        plan.no_reuse_len,
        seed,
        vocab,
        max_tokens=plan.max_tokens,
        tag=WARMUP,
    )
    workloads = [Workload(PREFIX_POOL, pool), Workload(NO_REUSE, fresh)]
    ceilings = _ceilings(workloads, plan, chunk_size, tier_chunks, kv_config)
    cp = ceilings[PREFIX_POOL]
    say(
        f"prefix pool: {placement.n_prefixes} prefixes x {plan.prefix_len} + {plan.tail_len} "
        f"tail, reuse distance {placement.reuse_distance} tokens in [{placement.low}, "
        f"{placement.high}] (HBM {hbm_tokens}, tier {tier_chunks * chunk_size} tokens/rank); "
        f"ceilings: HBM {cp['hbm'].hit_rate:.1%}, HBM+tier {cp['hbm+tier'].hit_rate:.1%}, "
        f"infinite {cp['infinite'].hit_rate:.1%}"
    )

    server = ServerConfig(
        model_dir=model,
        tp=tp,
        hbm_blocks=plan.hbm_blocks,
        block_size=BLOCK_SIZE,
        max_num_seqs=plan.concurrency,
        max_batched_tokens=plan.max_batched_tokens,
        threads=1,
        env=env,
    )
    records_dir = out.parent / f"{out.stem}-records"
    runs: list[ArmRun] = []
    for rep, arm in arm_order(repeat):
        runs.append(
            run_arm(
                arm,
                rep,
                server,
                workloads,
                concurrency=plan.concurrency,
                out_dir=records_dir,
                warmup=warm,
                say=say,
                progress=bars,
                console=console,
            )
        )

    report = _report(runs, workloads, ceilings, placement, plan, tp, quick)
    report.meta.update(
        kvtier=__version__,
        quick=quick,
        seed=seed,
        repeat=repeat,
        tp=tp,
        chunk_size=chunk_size,
        block_size=BLOCK_SIZE,
        model_dir=str(model),
        tier_chunks_per_rank=tier_chunks,
        kvtier_config=kv_config.to_dict(),  # secrets masked
        plan=asdict(plan),
        placement=placement.to_json(),
        ceilings={w: {k: c.to_json() for k, c in cs.items()} for w, cs in ceilings.items()},
        records_dir=str(records_dir),
        env={
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cores": len(os.sched_getaffinity(0)),
            "loadavg_end": list(os.getloadavg()),
        },
        elapsed_s=round(time.perf_counter() - t0, 2),
    )
    doc = report.to_json()
    write_json(out, doc)
    say(f"wrote {out}")
    return doc


# ----------------------------------------------------------------------------------------------
# plan and ceilings
# ----------------------------------------------------------------------------------------------


def _plan(
    quick: bool, hbm_blocks: int | None, requests: int | None, concurrency: int | None
) -> Plan:
    plan = QUICK if quick else FULL
    if hbm_blocks is not None:
        if hbm_blocks < 1:
            raise ConfigError(f"--hbm-blocks {hbm_blocks} must be >= 1")
        plan = replace(plan, hbm_blocks=hbm_blocks)
    if requests is not None:
        if requests < 1:
            raise ConfigError(f"--requests {requests} must be >= 1")
        share = plan.no_reuse_requests / plan.prefix_requests
        plan = replace(
            plan, prefix_requests=requests, no_reuse_requests=max(1, round(requests * share))
        )
    if concurrency is not None:
        if concurrency < 1:
            raise ConfigError(f"--concurrency {concurrency} must be >= 1")
        plan = replace(plan, concurrency=concurrency)
    in_flight = plan.concurrency * (
        max(plan.prefix_len + plan.tail_len, plan.no_reuse_len) + plan.max_tokens
    )
    if in_flight > plan.hbm_blocks * BLOCK_SIZE:
        raise ConfigError(
            f"--hbm-blocks {plan.hbm_blocks} ({plan.hbm_blocks * BLOCK_SIZE} tokens) cannot hold "
            f"{plan.concurrency} requests in flight ({in_flight} tokens); raise --hbm-blocks or "
            "lower --concurrency"
        )
    return plan


def _ceilings(
    workloads: Sequence[Workload],
    plan: Plan,
    chunk_size: int,
    tier_chunks: int,
    kv: KVTierConfig,
) -> dict[str, dict[str, Ceiling]]:
    out = {}
    for wl in workloads:
        prompts = [s.prompt for s in wl.specs]
        out[wl.name] = {
            "hbm": hbm_ceiling(prompts, BLOCK_SIZE, plan.hbm_blocks),
            "hbm+tier": tier_ceiling(
                prompts,
                BLOCK_SIZE,
                plan.hbm_blocks,
                chunk_size,
                tier_chunks,
                kv.effective_min_load_tokens,
            ),
            "infinite": infinite_ceiling(prompts, BLOCK_SIZE),
        }
    return out


def _kvtier_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith("KVTIER_")}


# ----------------------------------------------------------------------------------------------
# analysis of the runs
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _WindowResult:
    arm: str
    rep: int
    workload: str
    summary: analysis.Summary
    counters: analysis.Counters
    identities: list[analysis.Identity]
    checks: list[analysis.Identity]

    def to_json(self) -> dict[str, Any]:
        return {
            "arm": self.arm,
            "rep": self.rep,
            "workload": self.workload,
            "summary": self.summary.to_json(),
            "counters": self.counters.to_json(),
            "identities": [i.to_json() for i in self.identities],
            "client_server": [i.to_json() for i in self.checks],
        }


def _analyse(run: ArmRun, window: Window, tp: int) -> _WindowResult:
    records = window.load.records
    summary = analysis.summarize(records, window.load.duration_s)
    if summary.completed == 0:
        raise RuntimeError(
            f"{run.arm.upper()} rep {run.rep} {window.workload}: no request completed "
            f"(errors: {summary.errors}); server log: {run.log_path}"
        )
    counters = analysis.Counters.of(window.delta)
    return _WindowResult(
        run.arm,
        run.rep,
        window.workload,
        summary,
        counters,
        analysis.identities(counters, tp, run.offload),
        analysis.client_server_checks(records, counters),
    )


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _report(
    runs: Sequence[ArmRun],
    workloads: Sequence[Workload],
    ceilings: dict[str, dict[str, Ceiling]],
    placement: Placement,
    plan: Plan,
    tp: int,
    quick: bool,
) -> Report:
    results = [_analyse(r, w, tp) for r in runs for w in r.windows.values()]

    def pick(arm: str, workload: str) -> list[_WindowResult]:
        return sorted(
            (x for x in results if x.arm == arm and x.workload == workload), key=lambda x: x.rep
        )

    def metric(arm: str, workload: str, name: str) -> float:
        return _mean([float(getattr(x.summary, name)) for x in pick(arm, workload)])

    reps = sorted({r.rep for r in runs})
    comparisons = {
        wl.name: [
            analysis.compare_outputs(
                _window(runs, ON, rep, wl.name).load.records,
                _window(runs, OFF, rep, wl.name).load.records,
            )
            for rep in reps
        ]
        for wl in workloads
    }

    title = f"kvtier bench e2e (native, TP {tp}{', quick' if quick else ''})"
    report = Report("e2e", title)
    n = len(reps)
    arms_note = report.note(
        f"ON = --offload, OFF = --no-offload; same seed, HBM pool ({plan.hbm_blocks} blocks), "
        f"concurrency {plan.concurrency}, {plan.max_tokens} output tokens; a fresh server per "
        f"arm; values are means over {n} repetition{'s' if n > 1 else ''} (order alternating); "
        "latency on a shared 2-core machine is noise-prone, counts are exact"
    )

    # ---- prefix pool: speed
    p = PREFIX_POOL
    rows = [
        ("output_throughput", "output tok/s", "tok/s"),
        ("request_throughput", "requests/s", "req/s"),
        ("ttft_p50_ms", "TTFT p50", "ms"),
        ("ttft_p99_ms", "TTFT p99", "ms"),
    ]
    pool_note = report.note(
        f"{len(workloads[0].specs)} requests over {placement.n_prefixes} prefixes of "
        f"{placement.prefix_len} tokens + {placement.tail_len}-token unique tails; reuse "
        f"distance {placement.reuse_distance} tokens within [{placement.low}, {placement.high}] "
        f"(>= {plan.low_margin:g} x HBM pool of {placement.hbm_pool_tokens}, <= tier / 2 of "
        f"{placement.tier_tokens})"
    )
    for i, (name, label, unit) in enumerate(rows):
        marks = f" {arms_note}{pool_note}" if i == 0 else ""
        report.add(
            Row(
                f"{p}.{name}",
                f"prefix pool: {label}, ON (raw = OFF){marks}",
                metric(ON, p, name),
                unit,
                raw=metric(OFF, p, name),
                detail=_per_rep(pick(ON, p), pick(OFF, p), name),
            )
        )

    # ---- prefix pool: hits vs ceilings
    cp = ceilings[p]
    on_hit = _mean([x.counters.hit_rate for x in pick(ON, p)]) * 100
    off_hit = _mean([x.counters.hit_rate for x in pick(OFF, p)]) * 100
    on_ext = _mean([x.counters.external_hit_rate for x in pick(ON, p)]) * 100
    ceil_note = report.note(
        "ceilings simulated on the exact prompts in send order: HBM = LRU of the HBM pool's "
        "blocks (OFF's prediction); HBM+tier = that pool in front of an LRU tier of "
        "whole chunks written by every request (ON's prediction); infinite = every block kept "
        "(a hard bound); hit rate = server (HBM + external hits) / prompt tokens"
    )
    report.add(
        Row(
            f"{p}.hit_rate_on",
            f"prefix pool: hit rate ON (raw = HBM+tier ceiling) {ceil_note}",
            on_hit,
            "%",
            raw=_positive(cp["hbm+tier"].hit_rate * 100),
            detail={"external_pct": on_ext, "hbm_pct": on_hit - on_ext},
        )
    )
    report.add(
        Row(
            f"{p}.external_hit_rate_on",
            "prefix pool: tier hit rate ON (raw = its ceiling share)",
            on_ext,
            "%",
            raw=_positive(cp["hbm+tier"].external_rate * 100),
        )
    )
    report.add(
        Row(
            f"{p}.hit_rate_off",
            "prefix pool: hit rate OFF (raw = HBM ceiling)",
            off_hit,
            "%",
            raw=_positive(cp["hbm"].hit_rate * 100),
        )
    )
    bound = _positive(cp["infinite"].hit_rate * 100)
    report.add(
        Row(
            f"{p}.hit_rate_bound",
            "prefix pool: hit rate ON (raw = infinite-cache bound)",
            on_hit,
            "%",
            raw=bound,
            target=None if bound is None else Target("ratio", "<=", 1.0),
        )
    )
    ext_tokens = sum(x.counters.ext_hits for x in pick(ON, p))
    report.add(
        Row(
            f"{p}.external_hits_on",
            "prefix pool: external hit tokens ON (tier is live)",
            ext_tokens,
            "tokens",
            target=Target("value", ">=", 1),
            detail={"retrieved_all_ranks": sum(x.counters.retrieved for x in pick(ON, p))},
        )
    )

    # ---- identities (every ON window, every repetition)
    on_windows = [x for x in results if x.arm == ON]
    ident_note = report.note(
        "identity rows: |lhs - rhs| in the worst ON window (every workload, every repetition), "
        f"with lhs == rhs of the {p} window of repetition 0 in the label; counter deltas on a "
        "drained server (scraped until two scrapes agree)"
    )
    for ident, short in (
        ("hbm_misses_eq_external_queries", "HBM queries - hits == ext queries"),
        ("retrieved_eq_external_hits", "sum retrieved / TP == ext hits"),
    ):
        found = [(x, i) for x in on_windows for i in x.identities if i.name == ident]
        first = found[0][1] if found else None
        shown = "" if first is None else f" ({_n(first.lhs)} == {_n(first.rhs)})"
        report.add(
            Row(
                f"identity.{ident}",
                f"identity: {short}{shown}{' ' + ident_note if ident.startswith('hbm') else ''}",
                max((abs(i.lhs - i.rhs) for _, i in found), default=0.0),
                "tokens",
                target=Target("value", "<=", 0),
                detail={f"{x.workload}.rep{x.rep}": i.describe() for x, i in found},
            )
        )
    other = [
        (x, i)
        for x in results
        for i in x.identities + x.checks
        if i.name not in ("hbm_misses_eq_external_queries", "retrieved_eq_external_hits")
    ]
    failing = [(x, i) for x, i in other if not i.holds]
    other_note = report.note(
        "other checks, in every window: hits <= queries (HBM and tier); OFF has no external "
        "hits; client usage sums (prompt_tokens, cached_tokens) == server counters"
    )
    report.add(
        Row(
            "identity.other_failing",
            f"other checks failing {other_note}",
            len(failing),
            "checks",
            target=Target("value", "<=", 0),
            detail={
                f"{x.arm}.{x.workload}.rep{x.rep}.{i.name}": i.describe()
                for x, i in (failing or other)[:24]
            },
        )
    )

    # ---- outputs and completeness
    all_cmp = [c for cs in comparisons.values() for c in cs]
    report.add(
        Row(
            "outputs.mismatches",
            "greedy outputs differing ON vs OFF (token ids)",
            sum(c.mismatches for c in all_cmp),
            "requests",
            target=Target("value", "<=", 0),
            detail={
                "compared": sum(c.compared for c in all_cmp),
                "missing": sum(c.missing for c in all_cmp),
                "first_mismatches": json.dumps(
                    {w: [c.first_mismatches for c in cs] for w, cs in comparisons.items()}
                ),
            },
        )
    )
    report.add(
        Row(
            "requests.failed",
            "requests failed, all arms",
            sum(x.summary.failed for x in results),
            "requests",
            target=Target("value", "<=", 0),
            detail={
                "sent": sum(x.summary.requests for x in results),
                "osl_mismatch": sum(x.summary.osl_mismatch for x in results),
                "errors": json.dumps(sorted({e for x in results for e in x.summary.errors})[:5]),
            },
        )
    )

    # ---- no reuse
    q = NO_REUSE
    nr_note = report.note(
        f"{len(workloads[1].specs)} unique prompts of {plan.no_reuse_len} tokens after the "
        "prefix pool on the same server (HBM prefix cache reset first): ON saves every full "
        "chunk and loads nothing, so this is the tier's pure overhead"
    )
    report.add(
        Row(
            f"{q}.output_throughput",
            f"no reuse: output tok/s, ON (raw = OFF) {nr_note}",
            metric(ON, q, "output_throughput"),
            "tok/s",
            raw=metric(OFF, q, "output_throughput"),
            target=Target("ratio", ">=", NO_REUSE_TARGET),
            detail=_per_rep(pick(ON, q), pick(OFF, q), "output_throughput"),
        )
    )
    report.add(
        Row(
            f"{q}.ttft_p50_ms",
            "no reuse: TTFT p50, ON (raw = OFF)",
            metric(ON, q, "ttft_p50_ms"),
            "ms",
            raw=metric(OFF, q, "ttft_p50_ms"),
        )
    )

    report.meta["windows"] = [x.to_json() for x in results]
    report.meta["outputs"] = {w: [c.to_json() for c in cs] for w, cs in comparisons.items()}
    report.meta["servers"] = [
        {
            "arm": r.arm,
            "rep": r.rep,
            "startup_s": round(r.startup_s, 2),
            "exit_code": r.exit_code,
            "log": str(r.log_path),
            "records": {w.workload: str(w.records_path) for w in r.windows.values()},
        }
        for r in runs
    ]
    return report


def _window(runs: Sequence[ArmRun], arm: str, rep: int, workload: str) -> Window:
    for r in runs:
        if r.arm == arm and r.rep == rep:
            return r.windows[workload]
    raise KeyError(f"no {arm} run for repetition {rep}")


def _per_rep(
    on: Sequence[_WindowResult], off: Sequence[_WindowResult], name: str
) -> dict[str, float]:
    """Each repetition's ON and OFF value and their paired ratio; with two or more repetitions
    also the sample sd per arm and the mean of the paired ratios (runs are the unit)."""
    out: dict[str, float] = {}
    ratios = []
    for a, b in zip(on, off, strict=True):
        va, vb = float(getattr(a.summary, name)), float(getattr(b.summary, name))
        out[f"rep{a.rep}.on"] = va
        out[f"rep{a.rep}.off"] = vb
        r = analysis.on_off_ratio(va, vb)
        if r is not None:
            out[f"rep{a.rep}.ratio"] = r
            ratios.append(r)
    if len(on) >= 2:
        out["on.sd"] = statistics.stdev(float(getattr(x.summary, name)) for x in on)
        out["off.sd"] = statistics.stdev(float(getattr(x.summary, name)) for x in off)
    if len(ratios) >= 2:
        out["ratio.mean"] = statistics.fmean(ratios)
        out["ratio.sd"] = statistics.stdev(ratios)
    return out


def _positive(x: float) -> float | None:
    """A raw baseline must be positive: a zero ceiling shows as no baseline."""
    return x if math.isfinite(x) and x > 0 else None


def _n(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.6g}"
