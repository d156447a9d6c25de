"""The `kvtier` console command; subcommands drive hosts over HTTP, never their internals."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="kvtier: KV-cache offload tier.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print side-by-side ratios.")
app.add_typer(bench_app, name="bench")


@app.command()
def version() -> None:
    """Print the kvtier version."""
    from kvtier import __version__

    typer.echo(__version__)


@bench_app.command("tier")
def bench_tier(
    quick: bool = typer.Option(False, "--quick", help="Fewer repetitions (tests and CI)."),
    json_path: Path | None = typer.Option(
        None, "--json", help="Where to write the JSON results [default: runs/bench-tier.json]."
    ),
    disk_dir: Path | None = typer.Option(
        None, "--disk-dir", help="Directory for the disk tier's temp files [default: runs]."
    ),
) -> None:
    """Memory and disk tier GB/s against raw copies, and all-rank lookup latency."""
    from rich.console import Console

    from kvtier.bench import table, tier

    progress = Console(stderr=True)
    doc = tier.run(
        quick=quick,
        json_path=json_path,
        disk_dir=disk_dir,
        progress=lambda msg: progress.print(f"[dim]{msg}[/dim]"),
    )
    table.print_report(doc)


if __name__ == "__main__":
    app()
