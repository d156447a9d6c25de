"""The `kvtier` console command; subcommands drive hosts over HTTP, never their internals."""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="kvtier: KV-cache offload tier.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print side-by-side ratios.")
app.add_typer(bench_app, name="bench")


@app.command()
def version() -> None:
    """Print the kvtier version."""
    from kvtier import __version__

    typer.echo(__version__)


if __name__ == "__main__":
    app()
