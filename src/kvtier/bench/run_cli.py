"""`kvtier bench run`'s command line: its options, and the RunConfig they make (arms, workload,
load and the ceiling's cache sizes) for `bench/replay.py` to run and analyse."""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from kvtier.bench.arms import OFF, OFF_AGAIN, ArmSpec, ServerConfig, parse_arm
from kvtier.bench.client import HISTORY_MODES, OUTPUTS, LoadOptions
from kvtier.bench.replay import (
    CACHE_BUST,
    WORKLOADS,
    CeilingConfig,
    RunConfig,
    WorkloadConfig,
    analyse,
    int_or_none,
    is_open_loop,
    load_run,
    named_paths,
    parse_seconds,
    run,
)
from kvtier.bench.table import write_json
from kvtier.errors import ConfigError, StartupError

_Out = Annotated[
    Path | None,
    typer.Option("--out", help="Run directory to create [default: runs/bench-run-<time>]."),
]
_Workload = Annotated[str, typer.Option("--workload", help="prefix-pool, multi-turn or trace.")]
_Seed = Annotated[int, typer.Option("--seed", help="Workload seed (the same stream in every arm).")]
_Requests = Annotated[
    int | None,
    typer.Option("--requests", help="Requests to send (prefix pool default 200; others: all)."),
]
_Duration = Annotated[
    str | None, typer.Option("--duration", help="Stop sending after this long (e.g. 600s, 10m).")
]
_Concurrency = Annotated[
    int, typer.Option("--concurrency", help="Requests in flight (closed loop).")
]
_Rate = Annotated[
    float | None,
    typer.Option("--rate", help="Open loop: Poisson arrivals at this many requests/s (seeded)."),
]
_Osl = Annotated[int, typer.Option("--osl", help="Output tokens per request (trace: a cap).")]
_Isl = Annotated[
    int,
    typer.Option("--isl", help="Unique tail per request (prefix pool) / new user tokens per turn."),
]
_Prefixes = Annotated[int, typer.Option("--prefixes", help="Shared prefixes in the pool.")]
_PrefixLen = Annotated[
    int, typer.Option("--prefix-len", help="Tokens per shared prefix (multi-turn: 0 for none).")
]
_Conversations = Annotated[int, typer.Option("--conversations", help="Multi-turn conversations.")]
_Turns = Annotated[int, typer.Option("--turns", help="Turns per conversation.")]
_History = Annotated[
    str, typer.Option("--history", help="Later turns carry the real outputs or a seeded standin.")
]
_Trace = Annotated[Path | None, typer.Option("--trace", help="Mooncake JSONL trace to replay.")]
_TraceBlock = Annotated[int, typer.Option("--trace-block", help="Tokens per trace hash id.")]
_TraceSourceBlock = Annotated[
    int | None,
    typer.Option(
        "--trace-source-block",
        help="The trace's own block size (512 for Mooncake): lengths scale by block/this.",
    ),
]
_TimeScale = Annotated[
    float, typer.Option("--time-scale", help="Trace arrival = timestamp x this (0.1 = 10x faster).")
]
_IgnoreTimestamps = Annotated[
    bool, typer.Option("--ignore-timestamps", help="Replay a trace closed-loop at --concurrency.")
]
_CacheBust = Annotated[
    str, typer.Option("--cache-bust", help="first-turn-suffix (a run id) or none.")
]
_BustId = Annotated[
    int | None,
    typer.Option("--bust-id", help="The cache-bust run id [default: random, kept in meta.json]."),
]
_Url = Annotated[str | None, typer.Option("--url", help="An endpoint already running (one arm).")]
_Model = Annotated[
    str | None,
    typer.Option("--model", help="Model name to send [default: the first of /v1/models]."),
]
_Vocab = Annotated[
    int | None,
    typer.Option("--vocab", help="Token ids are drawn below this [default: the model's]."),
]
_ModelDir = Annotated[
    Path | None,
    typer.Option("--model-dir", help="ON/OFF arms: the model for kvtier serve [default: tiny]."),
]
_Tp = Annotated[int, typer.Option("--tp", help="ON/OFF arms: tensor-parallel size.")]
_HbmBlocks = Annotated[
    int | None,
    typer.Option("--hbm-blocks", help="HBM pool in blocks (ON/OFF arms: 128); also the ceiling's."),
]
_BlockSize = Annotated[
    int | None,
    typer.Option("--block-size", help="Tokens per KV block [default: from the arms, else 16]."),
]
_ChunkSize = Annotated[
    int | None,
    typer.Option("--chunk-size", help="kvtier chunk size (ON/OFF arms: 64); the tier ceiling's."),
]
_TierTokens = Annotated[
    int | None,
    typer.Option("--tier-tokens", help="Tier capacity in tokens per rank, for the ceiling."),
]
_MaxBatchedTokens = Annotated[
    int, typer.Option("--max-batched-tokens", help="ON/OFF arms: tokens computed per step.")
]
_Repeat = Annotated[int, typer.Option("--repeat", help="Repetitions; arm order alternates.")]
_AA = Annotated[
    bool,
    typer.Option(
        "--aa/--no-aa",
        help="ON/OFF arms: OFF once more right after OFF (off_again), the A/A pair that "
        "measures the machine's noise; ratios are then judged against it.",
    ),
]
_Baseline = Annotated[
    str | None, typer.Option("--baseline", help="The arm others are compared with [default: off].")
]
_Warmup = Annotated[int, typer.Option("--warmup", help="Warmup requests per arm, before scraping.")]
_Reset = Annotated[
    bool,
    typer.Option("--reset", help="POST /reset_prefix_cache?reset_external=true before each arm."),
]
_StartCut = Annotated[
    str, typer.Option("--from", help="Start-cut window: requests sent after this (e.g. 600s).")
]
_Bucket = Annotated[str, typer.Option("--bucket", help="Time-series bucket width.")]
_ScrapeInterval = Annotated[
    str, typer.Option("--scrape-interval", help="How often /metrics is sampled during the load.")
]
_ApiKey = Annotated[
    str | None,
    typer.Option("--api-key", envvar="KVTIER_BENCH_API_KEY", help="Bearer token for the endpoint."),
]
_Port = Annotated[int, typer.Option("--port", help="Port of an --arm command without {port}.")]
_HealthPath = Annotated[str, typer.Option("--health-path", help="Readiness probe path.")]
_StartupTimeout = Annotated[
    float, typer.Option("--startup-timeout", help="Seconds a server may take to become healthy.")
]
_Html = Annotated[bool, typer.Option("--html/--no-html", help="Write report.html and the PNGs.")]


def bench_run_command(
    out: _Out = None,
    workload: _Workload = "prefix-pool",
    seed: _Seed = 0,
    requests: _Requests = None,
    duration: _Duration = None,
    concurrency: _Concurrency = 4,
    rate: _Rate = None,
    osl: _Osl = 16,
    isl: _Isl = 32,
    prefixes: _Prefixes = 8,
    prefix_len: _PrefixLen = 256,
    conversations: _Conversations = 8,
    turns: _Turns = 4,
    history: _History = OUTPUTS,
    trace: _Trace = None,
    trace_block: _TraceBlock = 512,
    trace_source_block: _TraceSourceBlock = None,
    time_scale: _TimeScale = 1.0,
    ignore_timestamps: _IgnoreTimestamps = False,
    cache_bust: _CacheBust = "first-turn-suffix",
    bust_id: _BustId = None,
    arm: list[str] = typer.Option(
        [], "--arm", help="NAME='server command' (repeatable); {port} is filled in."
    ),
    url: _Url = None,
    model: _Model = None,
    vocab: _Vocab = None,
    model_dir: _ModelDir = None,
    tp: _Tp = 1,
    hbm_blocks: _HbmBlocks = None,
    block_size: _BlockSize = None,
    chunk_size: _ChunkSize = None,
    tier_tokens: _TierTokens = None,
    max_batched_tokens: _MaxBatchedTokens = 1024,
    repeat: _Repeat = 1,
    aa: _AA = False,
    baseline: _Baseline = None,
    warmup: _Warmup = 0,
    reset: _Reset = False,
    start_cut: _StartCut = "0",
    bucket: _Bucket = "10s",
    scrape_interval: _ScrapeInterval = "2s",
    aiperf: list[str] = typer.Option(
        [], "--aiperf", help="NAME=profile_export_aiperf.json to add to the report (repeatable)."
    ),
    api_key: _ApiKey = None,
    port: _Port = 8000,
    health_path: _HealthPath = "/health",
    startup_timeout: _StartupTimeout = 600.0,
    html: _Html = True,
) -> None:
    """A seeded workload against OpenAI-compatible endpoints, arm by arm: latency, hit rates
    next to simulated ceilings, counter identities, time series, HTML report."""
    # every option but --html is config_from_options' keyword of the same name
    options = dict(locals())
    write_html = options.pop("html")
    err = Console(stderr=True)
    try:
        cfg = config_from_options(**options)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from None
    _run_and_report(cfg, write_html, err)


def _run_and_report(cfg: RunConfig, write_html: bool, err: Console) -> None:
    """Run `cfg`, analyse the run directory, write summary.json (and the HTML report) and print
    the table; a bad setting exits 2, a failed server or request exits 1."""
    from kvtier.bench import report as report_mod
    from kvtier.bench import table

    try:
        run_dir = run(cfg, say=lambda m: err.print(f"[dim]{escape(m)}[/dim]"), console=err)
        doc = analyse(load_run(run_dir))
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from None
    except (StartupError, RuntimeError) as exc:
        typer.echo(
            f"error: {exc}\n(what completed is in {cfg.out_dir}; `kvtier bench report "
            f"{cfg.out_dir}` renders it)",
            err=True,
        )
        raise typer.Exit(code=1) from None
    write_json(run_dir / "summary.json", doc)
    if write_html:
        files = report_mod.write_report(doc, run_dir)
        err.print(f"[dim]wrote {files['html']}[/dim]")
    table.print_report(doc["table"])
    typer.echo(f"run directory: {run_dir}")


def config_from_options(
    *,
    out: Path | None,
    workload: str,
    seed: int,
    requests: int | None,
    duration: str | None,
    concurrency: int,
    rate: float | None,
    osl: int,
    isl: int,
    prefixes: int,
    prefix_len: int,
    conversations: int,
    turns: int,
    history: str,
    trace: Path | None,
    trace_block: int,
    trace_source_block: int | None,
    time_scale: float,
    ignore_timestamps: bool,
    cache_bust: str,
    bust_id: int | None,
    arm: Sequence[str],
    url: str | None,
    model: str | None,
    vocab: int | None,
    model_dir: Path | None,
    tp: int,
    hbm_blocks: int | None,
    block_size: int | None,
    chunk_size: int | None,
    tier_tokens: int | None,
    max_batched_tokens: int,
    repeat: int,
    aa: bool,
    baseline: str | None,
    warmup: int,
    reset: bool,
    start_cut: str,
    bucket: str,
    scrape_interval: str,
    aiperf: Sequence[str],
    api_key: str | None,
    port: int,
    health_path: str,
    startup_timeout: float,
) -> RunConfig:
    """The command line as a RunConfig: arms (ON/OFF `kvtier serve` by default, `--arm`s, or
    `--url`), the workload with its vocabulary, and the ceiling's cache sizes."""
    _check_choices(workload, history, cache_bust, bool(arm and url), concurrency, warmup)
    duration_s = None if duration is None else parse_seconds(duration, "--duration")
    if duration_s is not None and duration_s <= 0:
        raise ConfigError(f"--duration {duration!r} must be > 0")
    if aa and (arm or url):
        raise ConfigError(
            "--aa adds an OFF arm to the default ON/OFF arms; with --arm, pass the A/A arm "
            "yourself (the baseline's command under another name)"
        )
    arms, vocab, ceiling = _arms_and_ceiling(
        arm, url, vocab, model_dir, tp, hbm_blocks, block_size, chunk_size, tier_tokens,
        concurrency, max_batched_tokens,
    )  # fmt: skip
    if aa:
        off = next(a for a in arms if a.name == OFF)
        arms = (*arms, dataclasses.replace(off, name=OFF_AGAIN))
    wc = WorkloadConfig(
        kind=WORKLOADS[workload], seed=seed, vocab=vocab, requests=requests, osl=osl, isl=isl,
        prefixes=prefixes, prefix_len=prefix_len, conversations=conversations, turns=turns,
        trace=None if trace is None else str(trace), trace_block=trace_block,
        trace_source_block=trace_source_block, time_scale=time_scale, rate=rate,
        ignore_timestamps=ignore_timestamps,
        bust=None if cache_bust == "none" else (bust_id if bust_id is not None else _run_id()),
        duration_pool=duration_s is not None and requests is None,
    )  # fmt: skip
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    load = LoadOptions(
        concurrency=None if is_open_loop(wc) else concurrency,
        open_loop=is_open_loop(wc),
        duration_s=duration_s,
        history=history,
        require_token_ids=False,
        model=model,
        headers=headers,
    )
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return RunConfig(
        out_dir=out or Path("runs") / f"bench-run-{stamp}",
        workload=wc,
        load=load,
        arms=arms,
        repeat=repeat,
        warmup=warmup,
        reset_path="/reset_prefix_cache?reset_external=true" if reset else None,
        ceiling=ceiling,
        baseline=baseline,
        cut_s=parse_seconds(start_cut, "--from"),
        bucket_s=_positive_seconds(bucket, "--bucket"),
        scrape_interval_s=_positive_seconds(scrape_interval, "--scrape-interval"),
        port=port,
        health_path=health_path,
        startup_timeout_s=startup_timeout,
        aiperf=tuple(named_paths(aiperf, "--aiperf")),
    )


def _check_choices(
    workload: str, history: str, cache_bust: str, both: bool, concurrency: int, warmup: int
) -> None:
    """Options that must be one of their choices or in range; `both`: --arm and --url."""
    if workload not in WORKLOADS:
        raise ConfigError(f"--workload {workload!r} is not one of {sorted(WORKLOADS)}")
    if history not in HISTORY_MODES:
        raise ConfigError(f"--history {history!r} is not one of {list(HISTORY_MODES)}")
    if cache_bust not in CACHE_BUST:
        raise ConfigError(f"--cache-bust {cache_bust!r} is not one of {list(CACHE_BUST)}")
    if both:
        raise ConfigError("--arm and --url exclude each other: give server commands or one URL")
    if concurrency < 1:
        raise ConfigError(f"--concurrency {concurrency} must be >= 1")
    if warmup < 0:
        raise ConfigError(f"--warmup {warmup} must be >= 0")


def _arms_and_ceiling(
    arm: Sequence[str],
    url: str | None,
    vocab: int | None,
    model_dir: Path | None,
    tp: int,
    hbm_blocks: int | None,
    block_size: int | None,
    chunk_size: int | None,
    tier_tokens: int | None,
    concurrency: int,
    max_batched_tokens: int,
) -> tuple[tuple[ArmSpec, ...], int, CeilingConfig]:
    """The arms (`--arm`s, `--url`, or kvtier serve ON/OFF), the vocabulary token ids are
    drawn below, and the ceiling's cache sizes (from the options, else the arms' flags)."""
    bs = block_size
    ceiling_hbm = hbm_blocks
    tier_chunks = None
    min_load = 0
    chunk = chunk_size
    if arm or url:
        arms = tuple(parse_arm(a) for a in arm) if arm else (ArmSpec("endpoint", url=url),)
        if vocab is None:
            if model_dir is None:
                raise ConfigError(
                    "--vocab is needed with --arm or --url (token ids are drawn below it); "
                    "pass the model's vocabulary size, or --model-dir to read it"
                )
            vocab = int(_model_config(model_dir)["vocab_size"])
        for a in arms:
            bs = bs or int_or_none(a.flag("--block-size"))
            ceiling_hbm = ceiling_hbm or int_or_none(
                a.flag("--hbm-blocks", "--num-gpu-blocks-override")
            )
        if tier_tokens is not None:
            if not chunk:
                raise ConfigError(
                    "--tier-tokens needs --chunk-size (the tier stores whole chunks) for the "
                    "HBM + tier ceiling"
                )
            tier_chunks = tier_tokens // chunk
    else:
        arms, vocab, extra = _on_off_arms(
            model_dir, tp, hbm_blocks or 128, bs or 16, chunk or 64, concurrency,
            max_batched_tokens, vocab,
        )  # fmt: skip
        ceiling_hbm = hbm_blocks or 128
        chunk = extra["chunk_size"]
        tier_chunks = extra["tier_chunks"] if tier_tokens is None else tier_tokens // chunk
        min_load = extra["min_load_tokens"]
    bs = bs or 16
    return arms, vocab, CeilingConfig(bs, ceiling_hbm, chunk, tier_chunks, min_load)


def _positive_seconds(text: str, what: str) -> float:
    value = parse_seconds(text, what)
    if value <= 0:
        raise ConfigError(f"{what} {text!r} must be > 0")
    return value


def _run_id() -> int:
    return secrets.randbits(48)


def _model_config(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"--model-dir {str(model_dir)!r} has no config.json; pass a model dir")
    return dict(json.loads(path.read_text(encoding="utf-8")))


def _on_off_arms(
    model_dir: Path | None,
    tp: int,
    hbm_blocks: int,
    block_size: int,
    chunk_size: int,
    concurrency: int,
    max_batched_tokens: int,
    vocab: int | None,
) -> tuple[tuple[ArmSpec, ...], int, dict[str, int]]:
    """kvtier serve with --offload and --no-offload: same flags, same HBM pool, same env."""
    from kvtier.bench.e2e import NATIVE, ensure_model, tier_chunks_per_rank, tier_config

    if tp < 1:
        raise ConfigError(f"--tp {tp} must be >= 1")
    model = ensure_model(model_dir, "tiny")
    model_config = _model_config(model)
    env, _, kv = tier_config(NATIVE, chunk_size, block_size)
    server = ServerConfig(
        model_dir=model,
        tp=tp,
        hbm_blocks=hbm_blocks,
        block_size=block_size,
        max_num_seqs=concurrency,
        max_batched_tokens=max_batched_tokens,
        threads=1,
        env=env,
    )
    arms = (
        ArmSpec("on", tuple(server.argv("{port}", True)), env=env, offload=True),
        ArmSpec("off", tuple(server.argv("{port}", False)), env=env, offload=False),
    )
    extra = {
        "chunk_size": kv.chunk_size,
        "tier_chunks": tier_chunks_per_rank(model_config, tp, kv.chunk_size, kv.memory_bytes),
        "min_load_tokens": kv.min_load(block_size),
    }
    return arms, vocab or int(model_config["vocab_size"]), extra
