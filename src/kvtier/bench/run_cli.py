"""`kvtier bench run`'s command line: its options, and the RunConfig they make (arms, workload,
load and the ceiling's cache sizes) for `bench/replay.py` to run and analyse."""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Sequence
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from kvtier.bench.arms import OFF, OFF_AGAIN, ArmSpec, ServerConfig, parse_arm
from kvtier.bench.client import HISTORY_MODES, OUTPUTS, LoadOptions
from kvtier.bench.e2e import (
    KV_DTYPE,
    NATIVE,
    ensure_model,
    model_config,
    tier_chunks_per_rank,
    tier_config,
)
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
from kvtier.bench.vllm_host import default_venv
from kvtier.bench.vllm_load import KVTIER_CLIENT, LOADS
from kvtier.errors import ConfigError, StartupError
from kvtier.layout import bytes_per_token_from_hf


def bench_run_command(
    out: Path | None = typer.Option(
        None, "--out", help="Run directory to create [default: runs/bench-run-<time>]."
    ),
    workload: str = typer.Option(
        "prefix-pool", "--workload", help="prefix-pool, multi-turn or trace."
    ),
    seed: int = typer.Option(0, "--seed", help="Workload seed (the same stream in every arm)."),
    requests: int | None = typer.Option(
        None, "--requests", help="Requests to send (prefix pool default 200; others: all)."
    ),
    duration: str | None = typer.Option(
        None, "--duration", help="Stop sending after this long (e.g. 600s, 10m)."
    ),
    concurrency: int = typer.Option(4, "--concurrency", help="Requests in flight (closed loop)."),
    rate: float | None = typer.Option(
        None, "--rate", help="Open loop: Poisson arrivals at this many requests/s (seeded)."
    ),
    osl: int = typer.Option(16, "--osl", help="Output tokens per request (trace: a cap)."),
    isl: int = typer.Option(
        32, "--isl", help="Unique tail per request (prefix pool) / new user tokens per turn."
    ),
    prefixes: int = typer.Option(8, "--prefixes", help="Shared prefixes in the pool."),
    prefix_len: int = typer.Option(
        256, "--prefix-len", help="Tokens per shared prefix (multi-turn: 0 for none)."
    ),
    conversations: int = typer.Option(8, "--conversations", help="Multi-turn conversations."),
    turns: int = typer.Option(4, "--turns", help="Turns per conversation."),
    history: str = typer.Option(
        OUTPUTS, "--history", help="Later turns carry the real outputs or a seeded standin."
    ),
    trace: Path | None = typer.Option(None, "--trace", help="Mooncake JSONL trace to replay."),
    trace_block: int = typer.Option(512, "--trace-block", help="Tokens per trace hash id."),
    trace_source_block: int | None = typer.Option(
        None,
        "--trace-source-block",
        help="The trace's own block size (512 for Mooncake): lengths scale by block/this.",
    ),
    time_scale: float = typer.Option(
        1.0, "--time-scale", help="Trace arrival = timestamp x this (0.1 = 10x faster)."
    ),
    ignore_timestamps: bool = typer.Option(
        False, "--ignore-timestamps", help="Replay a trace closed-loop at --concurrency."
    ),
    cache_bust: str = typer.Option(
        "first-turn-suffix", "--cache-bust", help="first-turn-suffix (a run id) or none."
    ),
    bust_id: int | None = typer.Option(
        None, "--bust-id", help="The cache-bust run id [default: random, kept in meta.json]."
    ),
    arm: list[str] = typer.Option(
        [], "--arm", help="NAME='server command' (repeatable); {port} is filled in."
    ),
    url: str | None = typer.Option(None, "--url", help="An endpoint already running (one arm)."),
    model: str | None = typer.Option(
        None, "--model", help="Model name to send [default: the first of /v1/models]."
    ),
    vocab: int | None = typer.Option(
        None, "--vocab", help="Token ids are drawn below this [default: the model's]."
    ),
    model_dir: Path | None = typer.Option(
        None, "--model-dir", help="ON/OFF arms: the model for kvtier serve [default: tiny]."
    ),
    tp: int = typer.Option(1, "--tp", help="ON/OFF arms: tensor-parallel size."),
    hbm_blocks: int | None = typer.Option(
        None, "--hbm-blocks", help="HBM pool in blocks (ON/OFF arms: 128); also the ceiling's."
    ),
    block_size: int | None = typer.Option(
        None, "--block-size", help="Tokens per KV block [default: from the arms, else 16]."
    ),
    chunk_size: int | None = typer.Option(
        None, "--chunk-size", help="kvtier chunk size (ON/OFF arms: 64); the tier ceiling's."
    ),
    tier_tokens: int | None = typer.Option(
        None,
        "--tier-tokens",
        help="Tier capacity in tokens per rank: the ceilings' and, for the ON/OFF arms, the ON "
        "server's memory tier.",
    ),
    max_batched_tokens: int = typer.Option(
        1024, "--max-batched-tokens", help="ON/OFF arms: tokens computed per step."
    ),
    repeat: int = typer.Option(1, "--repeat", help="Repetitions; arm order alternates."),
    aa: bool = typer.Option(
        False,
        "--aa/--no-aa",
        help="ON/OFF arms: OFF once more right after OFF (off_again), the A/A pair that "
        "measures the machine's noise; ratios are then judged against it.",
    ),
    baseline: str | None = typer.Option(
        None, "--baseline", help="The arm others are compared with [default: off]."
    ),
    warmup: int = typer.Option(0, "--warmup", help="Warmup requests per arm, before scraping."),
    reset: bool = typer.Option(
        False, "--reset", help="POST /reset_prefix_cache?reset_external=true before each arm."
    ),
    start_cut: str = typer.Option(
        "0", "--from", help="Start-cut window: requests sent after this (e.g. 600s)."
    ),
    bucket: str = typer.Option("10s", "--bucket", help="Time-series bucket width."),
    scrape_interval: str = typer.Option(
        "2s", "--scrape-interval", help="How often /metrics is sampled during the load."
    ),
    aiperf: list[str] = typer.Option(
        [], "--aiperf", help="NAME=profile_export_aiperf.json to add to the report (repeatable)."
    ),
    api_key: str | None = typer.Option(
        None, "--api-key", envvar="KVTIER_BENCH_API_KEY", help="Bearer token for the endpoint."
    ),
    port: int = typer.Option(8000, "--port", help="Port of an --arm command without {port}."),
    health_path: str = typer.Option("/health", "--health-path", help="Readiness probe path."),
    startup_timeout: float = typer.Option(
        600.0, "--startup-timeout", help="Seconds a server may take to become healthy."
    ),
    html: bool = typer.Option(True, "--html/--no-html", help="Write report.html and the PNGs."),
    load_engine: str = typer.Option(
        KVTIER_CLIENT,
        "--load",
        help="Load engine: kvtier (its own client) or vllm-bench (vLLM's benchmark loop, the "
        "one behind `vllm bench serve`; prefix-pool and trace workloads, no --duration or "
        "--api-key).",
    ),
    vllm_python: Path | None = typer.Option(
        None, "--vllm-python", help="--load vllm-bench: the vLLM venv's python [.venv-vllm]."
    ),
) -> None:
    """A seeded workload against OpenAI-compatible endpoints, arm by arm: latency, hit rates
    next to simulated ceilings, counter identities, time series, HTML report."""
    err = Console(stderr=True)
    try:
        if workload not in WORKLOADS:
            raise ConfigError(f"--workload {workload!r} is not one of {sorted(WORKLOADS)}")
        if history not in HISTORY_MODES:
            raise ConfigError(f"--history {history!r} is not one of {list(HISTORY_MODES)}")
        if cache_bust not in CACHE_BUST:
            raise ConfigError(f"--cache-bust {cache_bust!r} is not one of {list(CACHE_BUST)}")
        if arm and url:
            raise ConfigError("--arm and --url exclude each other: give server commands or one URL")
        python = _load_engine(load_engine, vllm_python, workload, duration, api_key)
        if concurrency < 1:
            raise ConfigError(f"--concurrency {concurrency} must be >= 1")
        if warmup < 0:
            raise ConfigError(f"--warmup {warmup} must be >= 0")
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
        bust = bust_id if bust_id is not None else secrets.randbits(48)
        wc = WorkloadConfig(
            kind=WORKLOADS[workload], seed=seed, vocab=vocab, requests=requests, osl=osl, isl=isl,
            prefixes=prefixes, prefix_len=prefix_len, conversations=conversations, turns=turns,
            trace=None if trace is None else str(trace), trace_block=trace_block,
            trace_source_block=trace_source_block, time_scale=time_scale, rate=rate,
            ignore_timestamps=ignore_timestamps,
            bust=None if cache_bust == "none" else bust,
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
        cfg = RunConfig(
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
            engine=load_engine,
            vllm_python=python,
        )
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from None
    from kvtier.bench import report, table

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
    if html:
        files = report.write_report(doc, run_dir)
        err.print(f"[dim]wrote {files['html']}[/dim]")
    table.print_report(doc["table"])
    typer.echo(f"run directory: {run_dir}")


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
    admission = None  # the tier's admission mode: known for kvtier serve's arms only
    if arm or url:
        arms = tuple(parse_arm(a) for a in arm) if arm else (ArmSpec("endpoint", url=url),)
        if vocab is None:
            if model_dir is None:
                raise ConfigError(
                    "--vocab is needed with --arm or --url (token ids are drawn below it); "
                    "pass the model's vocabulary size, or --model-dir to read it"
                )
            vocab = int(model_config(ensure_model(model_dir))["vocab_size"])
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
    else:  # kvtier serve with --offload and --no-offload: same flags, pool and env
        if tp < 1:
            raise ConfigError(f"--tp {tp} must be >= 1")
        model = ensure_model(model_dir, "tiny")
        config = model_config(model)
        bs, ceiling_hbm = bs or 16, hbm_blocks or 128
        env, _, kv = tier_config(NATIVE, chunk or 64, bs)
        memory = kv.memory_bytes
        if tier_tokens is not None:
            # the ON arm's tier is the size the ceiling and the model are computed for (it was
            # the ceiling's only: a 1M-token ceiling over a 64k-token tier read as lost hits)
            geometry = bytes_per_token_from_hf(config, tp_size=tp, kv_dtype=KV_DTYPE)
            whole = max(1, tier_tokens // kv.chunk_size) * kv.chunk_size
            memory = geometry.bytes_for_tokens(whole)
            env = {**env, "KVTIER_MEMORY_BYTES": str(memory)}
        server = ServerConfig(
            model, tp, ceiling_hbm, bs, concurrency, max_batched_tokens, 1, env=env
        )
        arms = tuple(
            ArmSpec(name, tuple(server.argv("{port}", on)), env=env, offload=on)
            for name, on in (("on", True), ("off", False))
        )
        vocab = vocab or int(config["vocab_size"])
        chunk, min_load = kv.chunk_size, kv.min_load(bs)
        tier_chunks = tier_chunks_per_rank(config, tp, chunk, memory)
        admission = kv.admission
    bs = bs or 16
    return arms, vocab, CeilingConfig(bs, ceiling_hbm, chunk, tier_chunks, min_load, admission)


def _load_engine(
    engine: str, python: Path | None, workload: str, duration: str | None, api_key: str | None
) -> Path | None:
    """The vLLM venv's python for `--load vllm-bench` (None for kvtier's client), once the
    options are ones vLLM's loop can serve."""
    if engine not in LOADS:
        raise ConfigError(f"--load {engine!r} is not one of {list(LOADS)}")
    if engine == KVTIER_CLIENT:
        return None
    refused = {
        "--workload multi-turn (a later turn waits for its previous one)": workload == "multi-turn",
        "--duration": duration is not None,
        "--api-key": api_key is not None,
    }
    if bad := [name for name, on in refused.items() if on]:
        raise ConfigError(f"--load vllm-bench does not take {', '.join(bad)}; use --load kvtier")
    python = python or default_venv() / "bin" / "python"
    if not python.is_file():
        raise ConfigError(
            f"--load vllm-bench: {python} does not exist; build it with `make vllm-env` or pass "
            "--vllm-python"
        )
    return python


def _positive_seconds(text: str, what: str) -> float:
    value = parse_seconds(text, what)
    if value <= 0:
        raise ConfigError(f"{what} {text!r} must be > 0")
    return value
