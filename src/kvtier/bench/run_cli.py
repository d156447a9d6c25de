"""`kvtier bench run`'s command line: a run spec (`bench/run_spec.py`), the flags over it, the
run, its analysis and its report."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from kvtier.bench.arms import parse_arm
from kvtier.bench.replay import analyse, load_run, run
from kvtier.bench.run_spec import parse_set, read_spec, to_run_config
from kvtier.bench.table import write_json
from kvtier.errors import ConfigError, StartupError


def bench_run_command(
    spec: Path | None = typer.Argument(
        None, help="Run spec, YAML or TOML (docs/benchmarks.md) [default: every default]."
    ),
    set_: list[str] = typer.Option(
        [], "--set", help="section.key=value over the spec (repeatable): workload.prefixes=4."
    ),
    out: Path | None = typer.Option(
        None, "--out", help="Run directory (report.out) [default: runs/bench-run-<time>]."
    ),
    workload: str | None = typer.Option(
        None, "--workload", help="workload.kind: prefix-pool, multi-turn or trace."
    ),
    requests: int | None = typer.Option(None, "--requests", help="workload.requests."),
    duration: str | None = typer.Option(
        None, "--duration", help="workload.duration: stop sending after this long (10m)."
    ),
    concurrency: int | None = typer.Option(None, "--concurrency", help="workload.concurrency."),
    seed: int | None = typer.Option(None, "--seed", help="workload.seed."),
    trace: Path | None = typer.Option(None, "--trace", help="workload.trace: Mooncake JSONL."),
    arm: list[str] = typer.Option(
        [], "--arm", help="arms.servers: NAME='server command' (repeatable; {port} filled in)."
    ),
    url: str | None = typer.Option(None, "--url", help="arms.url: an endpoint already running."),
    vocab: int | None = typer.Option(None, "--vocab", help="arms.vocab: ids drawn below this."),
    aa: bool | None = typer.Option(
        None, "--aa/--no-aa", help="arms.aa: OFF again after OFF, the A/A pair (ON/OFF arms)."
    ),
    load_engine: str | None = typer.Option(
        None, "--load", help="load.engine: kvtier (its own client) or vllm-bench."
    ),
    html: bool | None = typer.Option(
        None, "--html/--no-html", help="report.html: write report.html and the PNGs."
    ),
    api_key: str | None = typer.Option(
        None, "--api-key", envvar="KVTIER_BENCH_API_KEY", help="arms.api_key: bearer token."
    ),
) -> None:
    """A seeded workload against OpenAI-compatible endpoints, arm by arm: latency, hit rates
    next to simulated ceilings, counter identities, time series, HTML, as a run spec says."""
    err = Console(stderr=True)
    flags: dict[str, object] = {
        "report.out": None if out is None else str(out),
        "workload.kind": workload,
        "workload.requests": requests,
        "workload.duration": duration,
        "workload.concurrency": concurrency,
        "workload.seed": seed,
        "workload.trace": None if trace is None else str(trace),
        "arms.servers": _servers(arm) if arm else None,
        "arms.url": url,
        "arms.vocab": vocab,
        "arms.aa": aa,
        "load.engine": load_engine,
        "report.html": html,
        "arms.api_key": api_key,
    }
    try:
        overrides = [parse_set(item) for item in set_]
        overrides += [(key, value) for key, value in flags.items() if value is not None]
        run_spec = read_spec(spec, overrides)
        cfg = to_run_config(run_spec)
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
    if run_spec.report.html:
        files = report.write_report(doc, run_dir)
        err.print(f"[dim]wrote {files['html']}[/dim]")
    table.print_report(doc["table"])
    typer.echo(f"run directory: {run_dir}")


def _servers(items: list[str]) -> dict[str, str]:
    """`--arm NAME=command` items as arms.servers (name -> command), in order."""
    servers: dict[str, str] = {}
    for item in items:
        arm = parse_arm(item)  # a malformed item is refused here, naming the form
        servers[arm.name] = item.partition("=")[2]
    return servers
