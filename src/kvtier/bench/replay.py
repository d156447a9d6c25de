"""`kvtier bench run`: a seeded workload against any OpenAI-compatible endpoint, arm by arm.

A run generates one request stream (prefix pool, multi-turn conversations or a Mooncake trace),
then for every (repetition, arm) in alternating order starts the arm's server (or uses `--url`),
sends the stream closed-loop (`workload.concurrency`) or open-loop (`workload.rate`, or the
trace's timestamps), samples `/metrics` during the load and scrapes it before and after on the
drained server. Everything lands in one run directory:

    meta.json          what was run: workload, load, arms (commands), ceiling sizes, versions
    workload.jsonl     the request stream (one spec per line)
    aiperf-inputs.json the same stream as aiperf's inputs.json (aiperf sends it verbatim)
    records/ARM-repN.jsonl   one client record per request (times, usage, output ids)
    scrapes/ARM-repN.json    /metrics before and after, periodic samples, server start/exit
    logs/ARM-repN.log        each server's output
    aiperf/NAME.json         imported aiperf profile exports
    summary.json, report.html, *.png   written by `analyse` + `report.write_report`

`analyse(run_dir)` recomputes every number from those files (so `kvtier bench report` can
re-render with another start-cut or bucket width): per arm and repetition the throughput, TTFT
and inter-token percentiles over the full window and after the cut, the server's cache-read
rate next to the ceilings simulated on the exact prompts sent, the counter identities, and time
series; across repetitions the mean and spread of each.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rich.console import Console

from kvtier import __version__, scrape
from kvtier.bench import analysis
from kvtier.bench.aiperf import (
    INPUTS_ARGS,
    INPUTS_NAME,
    AiperfRun,
    export_path,
    load_profile_export,
    write_inputs,
)
from kvtier.bench.arms import (
    OFF_AGAIN,
    ArmSpec,
    Drive,
    Say,
    Workload,
    alternate,
    flag_value,
    pool_mismatches,
    post_reset,
    run_endpoint_arm,
)
from kvtier.bench.breakdown import Breakdown, breakdown, step_rows
from kvtier.bench.ceiling import Ceiling, ceilings
from kvtier.bench.client import OUTPUTS, LoadOptions, Record, read_jsonl
from kvtier.bench.table import Report, Row, Target, machine, write_json
from kvtier.bench.vllm_load import KVTIER_CLIENT, VLLM_BENCH, VLLMBenchLoad
from kvtier.bench.workload import (
    MULTI_TURN,
    PREFIX_POOL,
    TRACE,
    WARMUP,
    RequestSpec,
    multi_turn,
    no_reuse,
    poisson_arrivals,
    prefix_pool,
    read_specs,
    sent_prompts,
    trace_requests,
    with_arrivals,
    write_specs,
)
from kvtier.cachemodel.trace import read_trace_rows
from kvtier.errors import ConfigError
from kvtier.scrape import Counters, MetricSet

ADMISSION = "kvtier_admission_total"
ADMISSION_RETURNS = "kvtier_admission_returns_total"


WORKLOADS = {"prefix-pool": PREFIX_POOL, "multi-turn": MULTI_TURN, "trace": TRACE}
CACHE_BUST = ("first-turn-suffix", "none")
DEFAULT_REQUESTS = 200  # prefix pool without --requests or --duration
DURATION_POOL = 4096  # prefix pool with --duration and no --requests: the stream's length
FULL = "full"
CUT = "cut"

# (summary field, label, unit): the client-side numbers of every window
METRICS = (
    ("request_throughput", "requests/s", "req/s"),
    ("output_throughput", "output tok/s", "tok/s"),
    ("ttft_p50_ms", "TTFT p50", "ms"),
    ("ttft_p90_ms", "TTFT p90", "ms"),
    ("ttft_p99_ms", "TTFT p99", "ms"),
    ("itl_p50_ms", "ITL p50", "ms"),
    ("itl_p90_ms", "ITL p90", "ms"),
    ("itl_p99_ms", "ITL p99", "ms"),
)


@dataclass(frozen=True)
class WorkloadConfig:
    """The request stream: its kind, shape and seed (the same stream in every arm)."""

    kind: str = PREFIX_POOL
    seed: int = 0
    vocab: int = 2048
    requests: int | None = None
    osl: int = 16  # output tokens per request (trace: a cap on output_length)
    isl: int = 32  # prefix pool: unique tail; multi-turn: new user tokens per turn
    prefixes: int = 8
    prefix_len: int = 256
    conversations: int = 8
    turns: int = 4
    trace: str | None = None
    trace_block: int = 512
    trace_source_block: int | None = None
    time_scale: float = 1.0
    rate: float | None = None  # Poisson arrivals (requests/s); None: closed loop or timestamps
    ignore_timestamps: bool = False  # trace: closed loop instead of the timestamps
    bust: int | None = None  # run id of the first-turn-suffix cache bust; None: no bust
    duration_pool: bool = False  # stream sized for --duration

    def to_json(self) -> dict[str, Any]:
        """Plain fields."""
        return dict(self.__dict__)


# the share of the model's predicted cache-read rate a live ON arm must reach
MODEL_AGREEMENT = 0.9


@dataclass(frozen=True)
class CeilingConfig:
    """Cache sizes the ceilings are simulated with (None: that ceiling is not computed)."""

    block_size: int = 16
    hbm_blocks: int | None = None
    chunk_size: int | None = None
    tier_chunks: int | None = None
    min_load_tokens: int = 0
    # the tier's admission mode where it is known (kvtier serve's arms): adds the "kvtier"
    # prediction of the real tier next to the ceilings
    admission: str | None = None
    # the ON server's token budget per step (kvtier serve's arms): the model saves a long
    # prefill step by step, as the engine does
    step_tokens: int | None = None

    def to_json(self) -> dict[str, Any]:
        """Plain fields."""
        return dict(self.__dict__)


@dataclass(frozen=True)
class RunConfig:
    """Everything one `kvtier bench run` does."""

    out_dir: Path
    workload: WorkloadConfig
    load: LoadOptions
    arms: tuple[ArmSpec, ...]
    repeat: int = 1
    warmup: int = 0
    reset_path: str | None = None
    ceiling: CeilingConfig = field(default_factory=CeilingConfig)
    tp: int | None = None
    baseline: str | None = None
    cut_s: float = 0.0
    bucket_s: float = 10.0
    scrape_interval_s: float = 2.0
    host: str = "127.0.0.1"
    port: int = 8000
    health_path: str = "/health"
    startup_timeout_s: float = 600.0
    aiperf: tuple[tuple[str, Path], ...] = ()
    engine: str = KVTIER_CLIENT  # or VLLM_BENCH: vLLM's benchmark loop, from `vllm_python`
    vllm_python: Path | None = None


def parse_seconds(text: str | float | int, what: str = "--from") -> float:
    """`600`, `600s`, `10m`, `1.5h` or `250ms` as seconds (>= 0)."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s|m|h)?\s*", str(text))
        if m is None:
            raise ConfigError(f"{what} {text!r} is not a duration; use e.g. 600s, 10m or 1.5h")
        scale = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}[m.group(2)]
        value = float(m.group(1)) * scale
    if not (math.isfinite(value) and value >= 0):
        raise ConfigError(f"{what} {text!r} must be a finite duration >= 0")
    return value


def build_specs(wc: WorkloadConfig) -> list[RequestSpec]:
    """The run's request stream (deterministic in `wc`)."""
    if wc.requests is not None and wc.requests < 1:
        raise ConfigError(f"--requests {wc.requests} must be >= 1")
    if wc.kind == PREFIX_POOL:
        n = wc.requests or (DURATION_POOL if wc.duration_pool else DEFAULT_REQUESTS)
        specs = prefix_pool(
            wc.prefixes, wc.prefix_len, wc.isl, n, wc.seed, wc.vocab,
            max_tokens=wc.osl, bust=wc.bust,
        )  # fmt: skip
    elif wc.kind == MULTI_TURN:
        specs = multi_turn(
            wc.conversations, wc.turns, wc.isl, wc.seed, wc.vocab, max_tokens=wc.osl,
            n_prefixes=wc.prefixes if wc.prefix_len else 0, prefix_len=wc.prefix_len,
            bust=wc.bust,
        )  # fmt: skip
        if wc.requests is not None:
            if wc.requests > len(specs):
                raise ConfigError(
                    f"--requests {wc.requests} exceeds {wc.conversations} conversations x "
                    f"{wc.turns} turns = {len(specs)}; raise workload.conversations or "
                    "workload.turns"
                )
            specs = specs[: wc.requests]  # round-robin order: whole turn rounds come first
    elif wc.kind == TRACE:
        if wc.trace is None:
            raise ConfigError(
                "--workload trace needs --trace FILE (Mooncake JSONL), or mooncake-synthetic "
                "for the trace bundled with kvtier"
            )
        rows = read_trace_rows(wc.trace, limit=wc.requests)
        specs = trace_requests(
            rows, wc.seed, wc.vocab, block=wc.trace_block, source_block=wc.trace_source_block,
            time_scale=wc.time_scale, max_tokens=wc.osl, bust=wc.bust,
        )  # fmt: skip
        if wc.ignore_timestamps:
            specs = [replace(s, arrival=None) for s in specs]
    else:
        raise ConfigError(f"workload kind {wc.kind!r} is not one of {sorted(WORKLOADS)}")
    if wc.rate is not None:
        specs = with_arrivals(specs, poisson_arrivals(len(specs), wc.rate, wc.seed))
    return specs


def is_open_loop(wc: WorkloadConfig) -> bool:
    """Open loop with a rate, or a trace replayed on its timestamps."""
    return wc.rate is not None or (wc.kind == TRACE and not wc.ignore_timestamps)


def run(
    cfg: RunConfig,
    *,
    say: Say | None = None,
    progress: bool = True,
    console: Console | None = None,
) -> Path:
    """Run every (repetition, arm) and write the run directory; returns it."""
    log = say or (lambda _m: None)
    out = cfg.out_dir
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {str(out)!r} is not empty; pass a new run directory")
    names = [a.name for a in cfg.arms]
    order = alternate(names, cfg.repeat)
    if cfg.baseline is not None and cfg.baseline not in names:
        raise ConfigError(f"arms.baseline {cfg.baseline!r} is not an arm; arms: {names}")
    if any(not a.argv for a in cfg.arms) and cfg.repeat > 1 and cfg.reset_path is None:
        raise ConfigError(
            "load.repeat > 1 against a running endpoint would hit the previous repetition's "
            "prompts; set load.reset=true (POST /reset_prefix_cache before each) or "
            "load.repeat=1"
        )
    mismatched = pool_mismatches(cfg.arms)
    if mismatched:
        raise ConfigError(
            "the arms do not pin the same HBM pool: " + "; ".join(mismatched) + ". Pass the "
            "same pool flags (--num-gpu-blocks-override / --hbm-blocks, --block-size) to every arm"
        )
    specs = build_specs(cfg.workload)
    bad = [t for s in specs for t in s.prompt if not 0 <= t < cfg.workload.vocab][:1]
    if bad:
        raise ConfigError(f"token id {bad[0]} is outside --vocab {cfg.workload.vocab}")
    warm = (
        no_reuse(
            cfg.warmup, max(cfg.workload.isl, 8), cfg.workload.seed, cfg.workload.vocab,
            max_tokens=cfg.workload.osl, tag=WARMUP,
        )
        if cfg.warmup
        else []
    )  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    write_specs(out / "workload.jsonl", specs)
    inputs = write_inputs(out / INPUTS_NAME, specs, cfg.load.model)
    aiperf = _copy_aiperf(cfg.aiperf, out)
    meta = run_meta(cfg, order, specs, aiperf)
    write_json(out / "meta.json", meta)
    t0 = time.perf_counter()
    by_name = {a.name: a for a in cfg.arms}
    log(
        f"{len(specs)} requests ({cfg.workload.kind}, seed {cfg.workload.seed}), "
        f"{'open loop' if cfg.load.open_loop else f'concurrency {cfg.load.concurrency}'}; "
        f"arms {names} x {cfg.repeat}; for aiperf: --input-file {inputs} {INPUTS_ARGS}"
    )
    reset = None
    if cfg.reset_path:
        hint = "; vLLM serves it only in dev mode (VLLM_SERVER_DEV_MODE=1), or drop load.reset"
        reset = post_reset(cfg.reset_path, hint)
    engine = None
    if cfg.engine == VLLM_BENCH:
        assert cfg.vllm_python is not None
        engine = VLLMBenchLoad(cfg.vllm_python, out / "vllm-bench", cfg.load.timeout_s)
    drive = Drive(
        [Workload(cfg.workload.kind, specs)],
        out,
        cfg.load,
        warm,
        reset,
        log,
        progress,
        console,
        sample_every_s=cfg.scrape_interval_s,
        records="records/{arm}-rep{rep}.jsonl",
        engine=engine,
    )
    try:
        for rep, name in order:
            run_endpoint_arm(
                by_name[name],
                rep,
                drive,
                host=cfg.host,
                port=cfg.port,
                health_path=cfg.health_path,
                startup_timeout_s=cfg.startup_timeout_s,
            )
    finally:
        if engine is not None:
            engine.close()
    meta["complete"] = True
    meta["elapsed_s"] = round(time.perf_counter() - t0, 2)
    meta["env"]["loadavg_end"] = list(os.getloadavg())
    write_json(out / "meta.json", meta)
    return out


def run_meta(
    cfg: RunConfig,
    order: Sequence[tuple[int, str]],
    specs: Sequence[RequestSpec],
    aiperf: Mapping[str, str],
) -> dict[str, Any]:
    """meta.json of a run: its configuration, arm order, stream size and machine."""
    return {
        "bench": "run",
        "kvtier": __version__,
        "complete": False,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "workload": cfg.workload.to_json(),
        "requests": len(specs),
        "prompt_tokens": sum(len(s.prompt) for s in specs),
        "load": {**cfg.load.describe(), "engine": cfg.engine},
        "arms": [a.to_json() for a in cfg.arms],
        "order": [[rep, name] for rep, name in order],
        "repeat": cfg.repeat,
        "warmup": cfg.warmup,
        "reset_path": cfg.reset_path,
        "ceiling": cfg.ceiling.to_json(),
        "tp": cfg.tp,
        "baseline": cfg.baseline,
        "cut_s": cfg.cut_s,
        "bucket_s": cfg.bucket_s,
        "scrape_interval_s": cfg.scrape_interval_s,
        "aiperf": dict(aiperf),
        "env": {**machine(), "loadavg_start": list(os.getloadavg())},
    }


def _copy_aiperf(items: Sequence[tuple[str, Path]], out: Path) -> dict[str, str]:
    """Copy each aiperf export into the run (checked on the way), so a re-render needs only it."""
    copied: dict[str, str] = {}
    for name, path in items:
        load_profile_export(path, name)  # a broken file fails now, not at report time
        src = export_path(path)
        dest = out / "aiperf" / f"{name}.json"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest)
        copied[name] = str(dest.relative_to(out))
    return copied


@dataclass
class ArmRep:
    """One (arm, repetition) of a recorded run: its records and scrapes."""

    arm: str
    rep: int
    records: list[Record]
    scrapes: dict[str, Any]

    @property
    def started(self) -> float:
        """The load's start on the records' clock."""
        return float(self.scrapes["started"])

    @property
    def finished(self) -> float:
        """The load's end on the records' clock."""
        return float(self.scrapes["finished"])

    def metric_set(self, key: str) -> MetricSet | None:
        """The `before` or `after` scrape (None without `/metrics`)."""
        doc = self.scrapes.get(key)
        return None if doc is None else MetricSet.from_json(doc)


@dataclass
class RunData:
    """A run directory read back: meta, the stream and every (arm, repetition)."""

    path: Path
    meta: dict[str, Any]
    specs: list[RequestSpec]
    reps: list[ArmRep]
    aiperf: list[AiperfRun]


def load_run(run_dir: str | Path) -> RunData:
    """Read a run directory that `run` wrote (the (arm, repetition) pairs that completed)."""
    path = Path(run_dir)
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise ConfigError(f"{str(path)!r} has no meta.json; pass a directory `bench run` wrote")
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    specs = read_specs(path / "workload.jsonl")
    reps = []
    for rep, name in meta["order"]:
        rec_path = path / "records" / f"{name}-rep{rep}.jsonl"
        scr_path = path / "scrapes" / f"{name}-rep{rep}.json"
        if not (rec_path.is_file() and scr_path.is_file()):
            continue  # an interrupted run: report what completed
        scrapes = json.loads(scr_path.read_text(encoding="utf-8"))
        reps.append(ArmRep(name, int(rep), read_jsonl(rec_path), scrapes))
    if not reps:
        raise ConfigError(f"{str(path)!r} holds no completed arm (records/ and scrapes/ empty)")
    aiperf = [load_profile_export(path / rel, name) for name, rel in meta.get("aiperf", {}).items()]
    return RunData(path, meta, specs, reps, aiperf)


def add_aiperf(run_dir: str | Path, items: Sequence[tuple[str, Path]]) -> None:
    """Copy more aiperf exports into a recorded run and list them in its meta."""
    path = Path(run_dir)
    meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
    meta.setdefault("aiperf", {}).update(_copy_aiperf(items, path))
    write_json(path / "meta.json", meta)


def analyse(
    data: RunData, *, cut_s: float | None = None, bucket_s: float | None = None
) -> dict[str, Any]:
    """Every number of a recorded run as one JSON document (NaN as None), with the summary
    table's document under "table"."""
    meta = data.meta
    cut = float(meta.get("cut_s", 0.0) if cut_s is None else cut_s)
    bucket = float(meta.get("bucket_s", 10.0) if bucket_s is None else bucket_s)
    if not (math.isfinite(bucket) and bucket > 0):
        raise ConfigError(f"--bucket {bucket!r} must be a positive number of seconds")
    if not (math.isfinite(cut) and cut >= 0):
        raise ConfigError(f"--from {cut!r} must be a finite number of seconds >= 0")
    arms_meta = {a["name"]: a for a in meta["arms"]}
    results = [_analyse_rep(data, r, arms_meta[r.arm], cut, bucket) for r in data.reps]
    names = [a["name"] for a in meta["arms"] if any(x["arm"] == a["name"] for x in results)]
    arms = {name: _aggregate(name, arms_meta[name], results) for name in names}
    checks = _checks(results, arms_meta)
    baseline = meta.get("baseline") or ("off" if "off" in arms else None)
    if baseline not in arms:
        baseline = None
    doc: dict[str, Any] = {
        "bench": "run",
        "run_dir": str(data.path),
        "cut_s": cut,
        "bucket_s": bucket,
        "baseline": baseline,
        "meta": meta,
        "arms": arms,
        "runs": results,
        "checks": checks,
        "aiperf": [a.to_json() for a in data.aiperf],
    }
    doc["table"] = _table(doc).to_json()
    return _clean(doc)


def _analyse_rep(
    data: RunData, r: ArmRep, arm_meta: Mapping[str, Any], cut: float, bucket: float
) -> dict[str, Any]:
    meta = data.meta
    records = r.records
    windows: dict[str, analysis.Summary | None] = {
        FULL: analysis.summarize_window(records, r.started, r.finished, 0.0)
    }
    if cut > 0:
        windows[CUT] = analysis.summarize_window(records, r.started, r.finished, cut)
    before, after = r.metric_set("before"), r.metric_set("after")
    counters: dict[str, Counters | None] = {FULL: None, CUT: None}
    idents: list[scrape.Identity] = []
    client_server: list[scrape.Identity] = []
    tp = None
    offload = arm_meta.get("offload")
    if before is not None and after is not None:
        counters[FULL] = c = Counters.of(after.delta(before))
        tp = (
            meta.get("tp")
            or scrape.world_size(after)
            or int_or_none(flag_value(arm_meta.get("argv") or [], "--tp", "--tensor-parallel-size"))
            or 1
        )
        if offload is None:
            offload = c.ext_queries > 0
        idents = scrape.identities(
            c, int(tp), bool(offload), has_retrieved=after.has(scrape.RETRIEVED)
        )
        client_server = analysis.client_server_checks(records, c)
        if cut > 0:
            counters[CUT] = analysis.counters_since(
                r.scrapes.get("samples") or [], r.started + cut, after
            )
    hit: dict[str, dict[str, float | None]] = {}
    for w, summ in windows.items():
        cw = counters.get(w)
        hit[w] = {
            "server": None if cw is None or cw.prompt_tokens <= 0 else 100.0 * cw.hit_rate,
            "client": None if summ is None else summ.cache_read_pct,
            "policy_recompute": (
                None
                if cw is None or cw.prompt_tokens <= 0 or not offload
                else 100.0 * cw.policy_recomputed / cw.prompt_tokens
            ),
        }
    ceilings = _ceilings(data, records, r.started, cut)
    samples = r.scrapes.get("samples") or []
    steps = writes = None
    if before is not None and after is not None and offload and after.has(scrape.RETRIEVED):
        delta = after.delta(before)
        steps = breakdown(delta, int(tp or 1)).to_json()
        writes = _writes(delta, int(tp or 1), int(meta["ceiling"].get("chunk_size") or 0))
    return {
        "arm": r.arm,
        "rep": r.rep,
        "offload": offload,
        "tp": tp,
        "duration_s": r.finished - r.started,
        "unsent": r.scrapes.get("unsent", 0),
        "stopped_by": r.scrapes.get("stopped_by"),
        "startup_s": r.scrapes.get("startup_s"),
        "exit_code": r.scrapes.get("exit_code"),
        "model": r.scrapes.get("model"),
        "windows": {w: None if s is None else s.to_json() for w, s in windows.items()},
        "counters": {w: None if c is None else c.to_json() for w, c in counters.items()},
        "hit_rate_pct": hit,
        "ceilings": {w: {k: c.to_json() for k, c in cs.items()} for w, cs in ceilings.items()},
        "identities": [i.to_json() for i in idents],
        "client_server": [i.to_json() for i in client_server],
        "cache_config": {} if after is None else scrape.cache_config(after),
        "steps": steps,
        "writes": writes,
        "series": {
            "buckets": [b.to_json() for b in analysis.time_series(records, r.started, bucket)],
            "residency": analysis.residency_series(samples, r.started),
            "server_hit": analysis.server_hit_series(samples, r.started),
        },
    }


def _writes(delta: MetricSet, tp: int, chunk: int) -> dict[str, float] | None:
    """What the tier was written per rank, next to what write-through would have written: the
    stored tokens plus the chunks admission rejected (counted once, by the scheduler)."""
    stored = sum(
        v for r, v in delta.by_label(scrape.STORED, "rank").items() if r != scrape.SCHEDULER
    ) / max(tp, 1)
    decided = delta.by_label(ADMISSION, "decision")
    rejected_tokens = decided.get("rejected", 0.0) * chunk
    through = stored + rejected_tokens
    return {
        "stored_tokens": stored,
        "rejected_tokens": rejected_tokens,
        "write_through_tokens": through,
        "share": stored / through if through > 0 else 1.0,
        "admitted_chunks": decided.get("admitted", 0.0),
        "rejected_chunks": decided.get("rejected", 0.0),
        "forced_chunks": decided.get("forced", 0.0),
        "rejected_returns": delta.by_label(ADMISSION_RETURNS, "decision").get("rejected", 0.0),
    }


def _ceilings(
    data: RunData, records: Sequence[Record], started: float, cut: float
) -> dict[str, dict[str, Ceiling]]:
    """Ceilings on the prompts this arm really sent, in send order (full window and cut)."""
    cc = data.meta["ceiling"]
    history = data.meta["load"].get("history", OUTPUTS)
    sent = sorted((r for r in records if r.sent), key=lambda r: (r.start, r.index))
    if not sent:
        return {}
    have = {r.index for r in records}
    specs = [s for s in data.specs if s.index in have]
    outputs = {r.index: r.output_ids for r in records} if history == OUTPUTS else None
    prompts = sent_prompts(specs, outputs)
    stream = [prompts[r.index] for r in sent]
    outs = [r.output_ids for r in sent]
    windows = {FULL: [True] * len(sent)}
    if cut > 0:
        windows[CUT] = [r.start >= started + cut for r in sent]
    sizes = [cc.get(k) for k in ("block_size", "hbm_blocks", "chunk_size", "tier_chunks")]
    min_load = cc.get("min_load_tokens") or 0
    policy = cc.get("admission")
    return {
        w: ceilings(
            stream,
            *sizes,
            min_load,
            outputs=outs,
            counted=counted,
            policy=policy,
            step_tokens=cc.get("step_tokens"),
        )  # fmt: skip
        for w, counted in windows.items()
    }


def _aggregate(
    name: str, arm_meta: Mapping[str, Any], results: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    mine = [x for x in results if x["arm"] == name]
    spreads: dict[str, dict[str, Any]] = {}
    for w in (FULL, CUT):
        if not any(w in x["windows"] for x in mine):
            continue
        fields: dict[str, list[Any]] = {}
        for x in mine:
            s = x["windows"].get(w) or {}
            for key, _label, _unit in METRICS:
                fields.setdefault(key, []).append(s.get(key))
            fields.setdefault("completed", []).append(s.get("completed"))
            fields.setdefault("failed", []).append(s.get("failed"))
            h = x["hit_rate_pct"].get(w) or {}
            fields.setdefault("server_hit_pct", []).append(h.get("server"))
            fields.setdefault("client_hit_pct", []).append(h.get("client"))
            fields.setdefault("policy_recompute_pct", []).append(h.get("policy_recompute"))
            for cname, c in (x["ceilings"].get(w) or {}).items():
                fields.setdefault(f"ceiling_{cname}_pct", []).append(100.0 * c["hit_rate"])
        spreads[w] = {k: analysis.spread(v).to_json() for k, v in fields.items()}
        spreads[w]["per_rep"] = dict(fields)
    offload = arm_meta.get("offload")
    if offload is None:
        offload = any(x["offload"] for x in mine)
    return {
        "name": name,
        "command": arm_meta.get("command"),
        "url": arm_meta.get("url"),
        "offload": offload,
        "reps": len(mine),
        "spread": spreads,
    }


def _checks(results: Sequence[Mapping[str, Any]], arms_meta: Mapping[str, Any]) -> dict[str, Any]:
    failing = [
        {"arm": x["arm"], "rep": x["rep"], **i}
        for x in results
        for i in x["identities"] + x["client_server"]
        if not i["holds"]
    ]
    checked = sum(len(x["identities"]) + len(x["client_server"]) for x in results)
    arms = [
        ArmSpec(a["name"], tuple(a["argv"]), a.get("url"), offload=a.get("offload"))
        for a in arms_meta.values()
    ]
    pool = pool_mismatches(arms)
    configs = {(x["arm"], x["rep"]): x["cache_config"] for x in results if x["cache_config"]}
    for key in ("num_gpu_blocks", "block_size"):
        values = {f"{a}.rep{r}": c.get(key) for (a, r), c in configs.items() if key in c}
        if len(set(values.values())) > 1:
            pool.append(f"vllm:cache_config_info {key}: {values}")
    above = []
    for x in results:
        h = (x["hit_rate_pct"].get(FULL) or {}).get("server")
        inf = (x["ceilings"].get(FULL) or {}).get("infinite")
        if h is not None and inf is not None and h > 100.0 * inf["hit_rate"] + 1e-6:
            above.append(f"{x['arm']}.rep{x['rep']}: {h:.3f}% > {100 * inf['hit_rate']:.3f}%")
    return {
        "identities_checked": checked,
        "identities_failing": failing,
        "pool_mismatches": pool,
        "pool_checked_by": "commands" + (" + vllm:cache_config_info" if configs else ""),
        "above_infinite": above,
        "requests_failed": sum((x["windows"][FULL] or {}).get("failed", 0) for x in results),
        "requests_sent": sum((x["windows"][FULL] or {}).get("requests", 0) for x in results),
    }


def _table(doc: Mapping[str, Any]) -> Report:
    """The summary table of an analysed run: metrics, hit rates, checks and aiperf's rows."""
    meta = doc["meta"]
    arms: dict[str, Any] = doc["arms"]
    baseline = doc["baseline"]
    cut = doc["cut_s"]
    wl = meta["workload"]
    # with a duration, the stream is only as long as an upper bound: show what went out
    sent = max(((r["windows"][FULL] or {}).get("requests", 0) for r in doc["runs"]), default=0)
    shown_n = (
        f"x {meta['requests']} requests"
        if sent >= meta["requests"]
        else f"{sent} of {meta['requests']} requests sent (duration)"
    )
    title = f"kvtier bench run: {wl['kind']} {shown_n}, arms {', '.join(arms)} x {meta['repeat']}"
    report = Report("run", title)
    shown = [a for a in arms if a != baseline] or list(arms)
    report.note(
        "values are means over repetitions (spread in detail: sd, min, max); "
        + (f"raw = the {baseline} arm" if baseline else "no baseline arm")
        + f"; arm order alternates; load: {_load_text(meta)}"
    )
    windows = [FULL] + ([CUT] if cut > 0 else [])
    _metric_rows(report, doc, windows, shown)
    _aa_rows(report, doc)
    _hit_rows(report, doc, windows)
    _write_rows(report, doc)
    _step_rows(report, doc)
    _check_rows(report, doc["checks"])
    _aiperf_rows(report, doc["aiperf"])
    return report


def _metric_rows(
    report: Report, doc: Mapping[str, Any], windows: Sequence[str], shown: Sequence[str]
) -> None:
    """Each shown arm's client metrics per window, against the baseline arm."""
    meta, arms, baseline, cut = doc["meta"], doc["arms"], doc["baseline"], doc["cut_s"]
    for w in windows:
        suffix = "" if w == FULL else f" (from {cut:g}s)"
        if w == CUT:
            report.note(
                f"from {cut:g}s: only requests sent at least {cut:g}s after the start; the "
                "server's counters for it start at the last /metrics sample at or before the cut "
                f"(sampled every {meta.get('scrape_interval_s', 0):g}s), the client's exactly"
            )
        for name in shown:
            for key, label, unit in METRICS:
                _add(report, arms, name, baseline, w, key, f"{name}: {label}{suffix}", unit)


# the metrics judged against the A/A pair, and which way is better
_AA_METRICS = (
    ("output_throughput", "output tok/s", ">="),
    ("request_throughput", "requests/s", ">="),
    ("ttft_p50_ms", "TTFT p50", "<="),
)


# throughputs an open-loop schedule fixes while the server keeps up
_SCHEDULED = frozenset({"output_throughput", "request_throughput"})


def _rep_ratios(doc: Mapping[str, Any], name: str, baseline: str, key: str) -> list[float]:
    """`name` over `baseline` per repetition (full window), where both are known."""
    by: dict[str, dict[int, float | None]] = {}
    for x in doc["runs"]:
        by.setdefault(x["arm"], {})[x["rep"]] = (x["windows"].get(FULL) or {}).get(key)
    ratios = analysis.paired_ratios(by.get(name, {}), by.get(baseline, {}))
    return [ratios[rep] for rep in sorted(ratios)]


def _policy_turned(doc: Mapping[str, Any], name: str) -> tuple[float, float]:
    """`name`'s tier tokens loaded (external hits) and recomputed by its load policy (found in
    the tier, predicted slower to load than to prefill), over its full windows."""
    ext = turned = 0.0
    for x in doc["runs"]:
        c = ((x.get("counters") or {}).get(FULL) or {}) if x["arm"] == name else {}
        ext += float(c.get("ext_hits") or 0.0)
        turned += float(c.get("policy_recomputed") or 0.0)
    return ext, turned


def _aa_rows(report: Report, doc: Mapping[str, Any]) -> None:
    """With an A/A arm (the baseline once more, right after it): each other arm's ratio to the
    baseline against the band the A/A ratios span, every repetition; PASS when the mean ratio
    lies beyond the A/A pair's worst repetition in the better direction. Inside the band, an
    arm whose load policy recomputed at least as many tier hits as it loaded gave its speed-up
    away by design (`load_policy: cost` on a loaded host): UNDETERMINED, not FAIL; beyond the
    band on the worse side it fails whatever the policy did."""
    baseline = doc["baseline"]
    if baseline is None or OFF_AGAIN not in doc["arms"]:
        return
    # open loop, the schedule sets the throughput: every arm that keeps up sends and finishes
    # the same requests in the same time, so ON/OFF and A/A all read 1.00x and a verdict on
    # them decides noise in the fifth digit (a roomy trace run read ON 0.99999x against an
    # A/A 1.000004x: FAIL). Throughput is judged closed loop only.
    open_loop = bool(doc["meta"]["load"].get("open_loop"))
    note = report.note(
        f"A/A: {OFF_AGAIN} is the {baseline} arm started once more right after it; its "
        f"ratios to {baseline} are what the machine alone moves a ratio by. A ratio is outside "
        "the A/A band when it is beyond every repetition's A/A ratio in the better direction"
    )
    for name in doc["arms"]:
        if name in (baseline, OFF_AGAIN):
            continue
        loaded, turned = _policy_turned(doc, name)
        by_policy = turned > 0 and turned >= loaded
        for i, (key, label, better) in enumerate(_AA_METRICS):
            ratios = _rep_ratios(doc, name, baseline, key)
            aa = _rep_ratios(doc, OFF_AGAIN, baseline, key)
            if not ratios or not aa:
                continue
            bound = max(aa) if better == ">=" else min(aa)
            mean = sum(ratios) / len(ratios)
            judged = not (open_loop and key in _SCHEDULED)
            # inside the band: not beyond it on either side (beyond the worse side fails)
            met = mean >= bound if better == ">=" else mean <= bound
            inside = not met and min(aa) <= mean <= max(aa)
            undetermined = judged and by_policy and inside
            detail: dict[str, float | int | str] = {
                "aa_min": min(aa), "aa_max": max(aa),
                **{f"rep{j}": r for j, r in enumerate(ratios)},
                **{f"aa_rep{j}": r for j, r in enumerate(aa)},
            }  # fmt: skip
            if undetermined:
                detail.update(verdict="undetermined", loaded_tokens=loaded,
                              policy_recomputed_tokens=turned)  # fmt: skip
                judged = False
            why = ""
            if undetermined:
                why = (
                    " (undetermined: inside the A/A band, and the load policy recomputed "
                    f"{turned:.0f} tier hit tokens against {loaded:.0f} loaded)"
                )
            elif not judged:
                why = " (open loop: the schedule's rate, not judged)"
            report.add(
                Row(
                    f"aa.{name}.{key}",
                    f"{name}/{baseline} {label}, beyond the A/A band{why}"
                    + (f" {note}" if i == 0 else ""),
                    mean,
                    "x",
                    target=Target("value", better, bound) if judged else None,  # type: ignore[arg-type]
                    detail=detail,
                )
            )


def _write_rows(report: Report, doc: Mapping[str, Any]) -> None:
    """Per arm with a tier: what it wrote over what write-through would have written (its
    stored tokens plus the chunks admission rejected), and the rejected chunks that came back."""
    for name in doc["arms"]:
        ws = [x["writes"] for x in doc["runs"] if x["arm"] == name and x.get("writes")]
        if not ws:
            continue
        share = sum(w["share"] for w in ws) / len(ws)
        report.add(
            Row(
                f"writes.{name}.share",
                f"{name}: tier writes / write-through's (admission)",
                share,
                "x",
                detail={
                    "stored_tokens": sum(w["stored_tokens"] for w in ws) / len(ws),
                    "rejected_chunks": sum(w["rejected_chunks"] for w in ws) / len(ws),
                    "rejected_returns": sum(w["rejected_returns"] for w in ws) / len(ws),
                },
            )
        )


def _step_rows(report: Report, doc: Mapping[str, Any]) -> None:
    """Per arm with a tier: its engine step time and what kvtier took of it (`step_rows`)."""
    for name in doc["arms"]:
        reps = [
            (x["rep"], Breakdown.from_json(x["steps"]))
            for x in doc["runs"]
            if x["arm"] == name and x.get("steps")
        ]
        step_rows(report, name, name, reps)


def _hit_rows(report: Report, doc: Mapping[str, Any], windows: Sequence[str]) -> None:
    """Each arm's cache-read rate per window against its simulated ceiling."""
    arms, cut = doc["arms"], doc["cut_s"]
    hit_note = report.note(
        "cache-read rate = (HBM hits + external hits) / prompt tokens from the server's "
        "counters (client: sum cached_tokens / sum prompt_tokens); raw = the ceiling simulated on "
        "the exact prompts sent: HBM+tier for an arm with a tier, HBM alone otherwise"
    )
    for w in windows:
        suffix = "" if w == FULL else f" (from {cut:g}s)"
        for name, arm in arms.items():
            sp = arm["spread"].get(w) or {}
            server = sp.get("server_hit_pct", {})
            client = sp.get("client_hit_pct", {})
            predicted = "ceiling_hbm+tier_pct" if arm["offload"] else "ceiling_hbm_pct"
            ceil = (sp.get(predicted) or {}).get("mean")
            measured, source = (
                (server.get("mean"), "server")
                if server.get("mean") is not None
                else (client.get("mean"), "client")
            )
            if measured is None:
                continue
            detail = {
                k: v["mean"]
                for k, v in sp.items()
                if k.startswith("ceiling_") and isinstance(v, dict) and v.get("mean") is not None
            }
            if client.get("mean") is not None:
                detail["client_hit_pct"] = client["mean"]
            mark = f" {hit_note}" if w == FULL and name == next(iter(arms)) else ""
            report.add(
                Row(
                    f"{w}.{name}.hit_rate",
                    f"{name}: cache-read rate ({source}){suffix}{mark}",
                    measured,
                    "%",
                    raw=ceil if ceil is not None and ceil > 0 else None,
                    detail=detail,
                )
            )
            if not arm["offload"]:
                continue
            # hits the load policy turned away were found in the tier: what the model predicts
            turned = (sp.get("policy_recompute_pct") or {}).get("mean")
            policy_note = report.note(
                "tier hits the load policy chose to recompute (load_policy: cost, "
                "kvtier_load_decision_tokens_total{decision=recompute}) over prompt tokens: "
                "found in the tier, predicted slower to load than to prefill"
            )
            if turned is not None:
                report.add(
                    Row(
                        f"{w}.{name}.policy_recompute",
                        f"{name}: tier hits recomputed by the load policy{suffix} {policy_note}",
                        turned,
                        "%",
                    )
                )
            model = (sp.get("ceiling_kvtier_pct") or {}).get("mean")
            if model:
                found = measured + (turned or 0.0) if source == "server" else measured
                model_note = report.note(
                    "the model: the same HBM in front of kvtier's own tier of the run's size, "
                    "its real TierStack and admission policy driven request by request "
                    "(kvtier.cachemodel.predict); the live arm finds (reads, or recomputes by "
                    f"its load policy) at least {MODEL_AGREEMENT:g} of it (concurrency can only "
                    "lose hits a sequential run finds): less says the engine and the model "
                    "disagree"
                )
                report.add(
                    Row(
                        f"{w}.{name}.hit_rate_vs_model",
                        f"{name}: cache-found rate vs the model's{suffix} {model_note}",
                        found,
                        "%",
                        raw=model,
                        target=Target("ratio", ">=", MODEL_AGREEMENT),
                        detail={"read_pct": measured, "policy_recompute_pct": turned or 0.0},
                    )
                )


def _check_rows(report: Report, checks: Mapping[str, Any]) -> None:
    """Identities, the infinite-cache bound, the HBM pool and failed requests: none allowed."""
    ident_note = report.note(
        "identities on the drained server, every arm and repetition: prefix_cache_queries - "
        "hits == external queries and retrieved / TP == external hits (with a tier), no "
        "external hits without one, hits <= queries, client usage sums == server counters"
    )
    report.add(
        Row(
            "checks.identities_failing",
            f"counter identities failing {ident_note}",
            len(checks["identities_failing"]),
            "checks",
            target=Target("value", "<=", 0),
            detail={
                "checked": checks["identities_checked"],
                **{
                    f"{f['arm']}.rep{f['rep']}.{f['name']}": f"{f['lhs']} {f['op']} {f['rhs']}"
                    for f in checks["identities_failing"][:12]
                },
            },
        )
    )
    report.add(
        Row(
            "checks.above_infinite",
            "cache-read rate above the infinite-cache ceiling (a counting bug)",
            len(checks["above_infinite"]),
            "arms",
            target=Target("value", "<=", 0),
            detail={str(i): t for i, t in enumerate(checks["above_infinite"][:8])},
        )
    )
    report.add(
        Row(
            "checks.pool_mismatches",
            f"HBM pool differs between arms (checked by {checks['pool_checked_by']})",
            len(checks["pool_mismatches"]),
            "flags",
            target=Target("value", "<=", 0),
            detail={str(i): t for i, t in enumerate(checks["pool_mismatches"][:8])},
        )
    )
    report.add(
        Row(
            "checks.requests_failed",
            "requests failed or skipped, all arms",
            checks["requests_failed"],
            "requests",
            target=Target("value", "<=", 0),
            detail={"sent": checks["requests_sent"]},
        )
    )


def _aiperf_rows(report: Report, aiperf: Sequence[Mapping[str, Any]]) -> None:
    """aiperf's own summary of each run it exported, as measured."""
    for a in aiperf:
        note = report.note(f"aiperf {a['name']}: {a['source']} (aiperf {a.get('version')})")
        for i, (key, label, unit) in enumerate(AIPERF_ROWS):
            value = a["summary"].get(key)
            if value is None or not math.isfinite(value):
                continue
            report.add(
                Row(
                    f"aiperf.{a['name']}.{key}",
                    f"aiperf {a['name']}: {label}{' ' + note if i == 0 else ''}",
                    float(value),
                    unit,
                )
            )


AIPERF_ROWS = (*METRICS, ("cache_read_pct", "cache-read rate (client)", "%"))


def _add(
    report: Report,
    arms: Mapping[str, Any],
    name: str,
    baseline: str | None,
    window: str,
    key: str,
    label: str,
    unit: str,
) -> None:
    sp = (arms[name]["spread"].get(window) or {}).get(key) or {}
    value = sp.get("mean")
    if value is None:
        return  # e.g. ITL of one-token outputs: nothing to show
    raw = None
    if baseline is not None and name != baseline:
        raw = ((arms[baseline]["spread"].get(window) or {}).get(key) or {}).get("mean")
        if raw is not None and not raw > 0:
            raw = None
    per_rep = (arms[name]["spread"].get(window) or {}).get("per_rep", {}).get(key, [])
    detail: dict[str, float | int | str] = {
        k: v for k, v in sp.items() if k != "mean" and v is not None
    }
    for i, v in enumerate(per_rep):
        if v is not None:
            detail[f"rep{i}"] = v
    report.add(Row(f"{window}.{name}.{key}", label, float(value), unit, raw=raw, detail=detail))


def _load_text(meta: Mapping[str, Any]) -> str:
    load = meta["load"]
    wl = meta["workload"]
    if load.get("open_loop"):
        how = (
            f"Poisson {wl['rate']:g} req/s"
            if wl.get("rate")
            else f"trace timestamps x {wl['time_scale']:g}"
        )
        shape = f"open loop ({how})"
    else:
        shape = f"concurrency {load.get('concurrency')}"
    if load.get("duration_s"):
        shape += f", {load['duration_s']:g}s"
    return shape


def int_or_none(text: str | None) -> int | None:
    try:
        return None if text is None else int(text)
    except ValueError:
        return None


def _clean(x: Any) -> Any:
    """NaN/inf as None, recursively (JSON has neither)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    return x


def named_paths(items: Sequence[str], what: str) -> list[tuple[str, Path]]:
    """`NAME=PATH` items (a bare PATH is named after its file stem)."""
    out = []
    for item in items:
        name, sep, path = item.partition("=")
        if not sep:
            name, path = Path(item).stem, item
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
            raise ConfigError(f"{what} {item!r}: the name must be letters, digits, '_', '.', '-'")
        out.append((name, Path(path)))
    return out
