"""`kvtier plan`'s command: the model config from a preset or a file, the workload from the
flags, the plan, and the table or JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from kvtier.cachemodel.curve import CurvePoint
from kvtier.config import parse_size
from kvtier.errors import ConfigError, KVTierError
from kvtier.plan.presets import is_preset, preset, preset_names
from kvtier.plan.report import print_report
from kvtier.plan.sizing import plan
from kvtier.plan.window import trace_curve
from kvtier.plan.workload import SyntheticWorkload, Trace, Workload, read_trace


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
    chunk_size: int = typer.Option(
        256, "--chunk-size", help="kvtier chunk size in tokens (sliding-window tier bytes)."
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
            chunk_size=chunk_size,
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
        unplotted = None
        if isinstance(workload, Trace):
            if not _can_plot():
                # the plain install has no matplotlib: the numbers, without their picture
                unplotted = (
                    "no hit-curve PNG: matplotlib is not installed (pip install 'kvtier[bench]' "
                    "draws it); the hit curve's numbers are in --json"
                )
            target = None if unplotted else png
            curve, drawn = trace_curve(
                workload, result.hbm_pool_tokens, result.tier_tokens, target
            )
    except KVTierError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    if as_json:
        doc = result.to_json()
        if curve:
            doc["hit_curve"] = [p.to_json() for p in curve]
            doc["hit_curve_png"] = None if drawn is None else str(drawn)
        typer.echo(json.dumps(doc, indent=2))
        for w in result.warnings:
            typer.echo(f"WARNING: {w}", err=True)
    else:
        print_report(result)
        if drawn is not None:
            typer.echo(f"hit curve: {drawn}")
    if unplotted is not None:
        typer.echo(f"note: {unplotted}", err=True)


def _can_plot() -> bool:
    """Whether matplotlib (the bench extra) is importable here."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


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
