"""`kvtier bench run`'s run spec: one YAML or TOML file read into one typed struct (workload,
arms, load, report), a few command-line flags and `--set section.key=value` over it, and the
`RunConfig` it makes for `bench/replay.py`. Examples live in docs/benchmarks.md."""

from __future__ import annotations

import dataclasses
import secrets
import time
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import yaml

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
    int_or_none,
    is_open_loop,
    named_paths,
    parse_seconds,
)
from kvtier.bench.vllm_host import default_venv
from kvtier.bench.vllm_load import KVTIER_CLIENT, LOADS
from kvtier.errors import ConfigError
from kvtier.layout import bytes_per_token_from_hf

Seconds = str | float | int


class WorkloadSpec(msgspec.Struct, forbid_unknown_fields=True):
    """The request stream (the same in every arm)."""

    kind: str = "prefix-pool"  # prefix-pool, multi-turn or trace
    seed: int = 0
    requests: int | None = None  # prefix pool default 200; others: all
    duration: Seconds | None = None  # stop sending after this long (600s, 10m)
    concurrency: int = 4  # requests in flight (closed loop)
    rate: float | None = None  # open loop: Poisson arrivals per second (seeded)
    osl: int = 16  # output tokens per request (trace: a cap)
    isl: int = 32  # unique tail per request (prefix pool) / new user tokens per turn
    prefixes: int = 8
    prefix_len: int = 256  # tokens per shared prefix (multi-turn: 0 for none)
    conversations: int = 8
    turns: int = 4
    history: str = OUTPUTS  # later turns carry the real outputs or a seeded stand-in
    trace: str | None = None  # Mooncake JSONL trace to replay
    trace_block: int = 512  # tokens per trace hash id
    trace_source_block: int | None = None  # the trace's own block (512 for Mooncake)
    time_scale: float = 1.0  # trace arrival = timestamp x this
    ignore_timestamps: bool = False  # replay a trace closed-loop at `concurrency`
    cache_bust: str = "first-turn-suffix"  # or none
    bust_id: int | None = None  # default: random, kept in meta.json


class ArmsSpec(msgspec.Struct, forbid_unknown_fields=True):
    """What is measured: server commands, one running endpoint, or kvtier serve ON and OFF."""

    servers: dict[str, str] = {}  # name -> 'server command' ({port} filled in)
    url: str | None = None  # an endpoint already running (one arm)
    model: str | None = None  # model name to send [default: the first of /v1/models]
    vocab: int | None = None  # token ids are drawn below this [default: the model's]
    model_dir: str | None = None  # ON/OFF arms: the model for kvtier serve [default: tiny]
    tp: int = 1
    hbm_blocks: int | None = None  # HBM pool in blocks (ON/OFF: 128); also the ceiling's
    block_size: int | None = None  # default: from the arms, else 16
    chunk_size: int | None = None  # kvtier chunk size (ON/OFF: 64); the tier ceiling's
    tier_tokens: int | None = None  # tier capacity per rank: the ceilings' and the ON tier's
    max_batched_tokens: int = 1024  # ON/OFF arms: tokens computed per step
    aa: bool = False  # OFF again right after OFF: the A/A pair ratios are judged against
    baseline: str | None = None  # the arm others are compared with [default: off]
    port: int = 8000  # port of a server command without {port}
    health_path: str = "/health"
    startup_timeout: float = 600.0
    api_key: str | None = None  # bearer token (better: KVTIER_BENCH_API_KEY)


class LoadSpec(msgspec.Struct, forbid_unknown_fields=True):
    """How the stream is sent."""

    engine: str = KVTIER_CLIENT  # kvtier (its own client) or vllm-bench (vLLM's loop)
    vllm_python: str | None = None  # vllm-bench: the vLLM venv's python [.venv-vllm]
    repeat: int = 1  # repetitions; arm order alternates
    warmup: int = 0  # warmup requests per arm, before scraping
    reset: bool = False  # POST /reset_prefix_cache?reset_external=true before each arm


class ReportSpec(msgspec.Struct, forbid_unknown_fields=True):
    """Where the run lands and how it is cut and drawn."""

    out: str | None = None  # run directory [default: runs/bench-run-<time>]
    start_cut: Seconds = 0  # requests sent after this count (600s)
    bucket: Seconds = "10s"  # time-series bucket width
    scrape_interval: Seconds = "2s"  # how often /metrics is sampled
    aiperf: dict[str, str] = {}  # name -> profile_export_aiperf.json to add to the report
    html: bool = True  # write report.html and the PNGs


class RunSpec(msgspec.Struct, forbid_unknown_fields=True):
    """Everything one `kvtier bench run` does."""

    workload: WorkloadSpec = msgspec.field(default_factory=WorkloadSpec)
    arms: ArmsSpec = msgspec.field(default_factory=ArmsSpec)
    load: LoadSpec = msgspec.field(default_factory=LoadSpec)
    report: ReportSpec = msgspec.field(default_factory=ReportSpec)


SECTIONS = ("workload", "arms", "load", "report")
# the spec keys `kvtier bench run` also takes as flags: messages name both
FLAGS = {
    "report.out": "--out",
    "workload.kind": "--workload",
    "workload.requests": "--requests",
    "workload.duration": "--duration",
    "workload.concurrency": "--concurrency",
    "workload.seed": "--seed",
    "workload.trace": "--trace",
    "arms.servers": "--arm",
    "arms.url": "--url",
    "arms.vocab": "--vocab",
    "arms.aa": "--aa",
    "arms.api_key": "--api-key",
    "load.engine": "--load",
    "report.html": "--html",
}


def _k(key: str) -> str:
    """A spec key as messages name it: with its flag where it has one."""
    flag = FLAGS.get(key)
    return f"{key} ({flag})" if flag else key


def read_spec(path: Path | None, overrides: Sequence[tuple[str, Any]] = ()) -> RunSpec:
    """The spec in `path` (YAML, or TOML by its suffix; None: every default) with `overrides`
    (dotted key, value) laid over it; a wrong key or value is a ConfigError naming it."""
    doc: dict[str, Any] = {}
    if path is not None:
        doc = _read_file(path)
    for key, value in overrides:
        _set(doc, key, value)
    try:
        return msgspec.convert(doc, RunSpec)
    except msgspec.ValidationError as e:
        where = f"{path}: " if path is not None else ""
        raise ConfigError(
            f"run spec {where}{e} (`$` is the spec's top; sections: {', '.join(SECTIONS)}; "
            "docs/benchmarks.md lists every key)"
        ) from None


def parse_set(item: str) -> tuple[str, Any]:
    """`--set section.key=value`, the value read as YAML (`4`, `true`, `null`, `10m`)."""
    key, sep, text = item.partition("=")
    if not sep or "." not in key:
        raise ConfigError(
            f"--set {item!r} must look like section.key=value, e.g. workload.prefixes=4"
        )
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        value = text
    return key.strip(), value


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"run spec {path} is not a file; pass a YAML or TOML run spec")
    text = path.read_text()
    try:
        doc = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"run spec {path} does not parse: {e}") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"run spec {path} must be a mapping of sections ({', '.join(SECTIONS)})")
    return doc


def _set(doc: dict[str, Any], key: str, value: Any) -> None:
    section, _, field = key.partition(".")
    if section not in SECTIONS:
        raise ConfigError(f"{key!r}: no section {section!r}; use one of {', '.join(SECTIONS)}")
    part = doc.setdefault(section, {})
    if not isinstance(part, dict):
        raise ConfigError(f"run spec section {section!r} must be a mapping, got {part!r}")
    part[field] = value


def to_run_config(spec: RunSpec) -> RunConfig:
    """The RunConfig `spec` asks for: its settings checked, the arms and the ceiling's cache
    sizes resolved (a model is made for the ON/OFF arms when none is given)."""
    w, a, ld, r = spec.workload, spec.arms, spec.load, spec.report
    if w.kind not in WORKLOADS:
        raise ConfigError(f"{_k('workload.kind')} {w.kind!r} is not one of {sorted(WORKLOADS)}")
    if w.history not in HISTORY_MODES:
        raise ConfigError(f"workload.history {w.history!r} is not one of {list(HISTORY_MODES)}")
    if w.cache_bust not in CACHE_BUST:
        raise ConfigError(f"workload.cache_bust {w.cache_bust!r} is not one of {list(CACHE_BUST)}")
    if a.servers and a.url:
        raise ConfigError(
            f"{_k('arms.servers')} and {_k('arms.url')} exclude each other: give server "
            "commands or one URL"
        )
    python = _load_engine(ld.engine, ld.vllm_python, w.kind, w.duration, a.api_key)
    if w.concurrency < 1:
        raise ConfigError(f"{_k('workload.concurrency')} {w.concurrency} must be >= 1")
    if ld.warmup < 0:
        raise ConfigError(f"load.warmup {ld.warmup} must be >= 0")
    duration_s = None if w.duration is None else parse_seconds(w.duration, _k("workload.duration"))
    if duration_s is not None and duration_s <= 0:
        raise ConfigError(f"{_k('workload.duration')} {w.duration!r} must be > 0")
    if a.aa and (a.servers or a.url):
        raise ConfigError(
            f"{_k('arms.aa')} adds an OFF arm to the default ON/OFF arms; with arms.servers, "
            "add the A/A arm yourself (the baseline's command under another name)"
        )
    arms, vocab, ceiling = _arms_and_ceiling(a, w.concurrency)
    if a.aa:
        off = next(x for x in arms if x.name == OFF)
        arms = (*arms, dataclasses.replace(off, name=OFF_AGAIN))
    bust = w.bust_id if w.bust_id is not None else secrets.randbits(48)
    wc = WorkloadConfig(
        kind=WORKLOADS[w.kind], seed=w.seed, vocab=vocab, requests=w.requests, osl=w.osl,
        isl=w.isl, prefixes=w.prefixes, prefix_len=w.prefix_len, conversations=w.conversations,
        turns=w.turns, trace=w.trace, trace_block=w.trace_block,
        trace_source_block=w.trace_source_block, time_scale=w.time_scale, rate=w.rate,
        ignore_timestamps=w.ignore_timestamps,
        bust=None if w.cache_bust == "none" else bust,
        duration_pool=duration_s is not None and w.requests is None,
    )  # fmt: skip
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    load = LoadOptions(
        concurrency=None if is_open_loop(wc) else w.concurrency,
        open_loop=is_open_loop(wc),
        duration_s=duration_s,
        history=w.history,
        require_token_ids=False,
        model=a.model,
        headers=headers,
    )
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return RunConfig(
        out_dir=Path(r.out) if r.out else Path("runs") / f"bench-run-{stamp}",
        workload=wc,
        load=load,
        arms=arms,
        repeat=ld.repeat,
        warmup=ld.warmup,
        reset_path="/reset_prefix_cache?reset_external=true" if ld.reset else None,
        ceiling=ceiling,
        baseline=a.baseline,
        cut_s=parse_seconds(r.start_cut, "report.start_cut"),
        bucket_s=_positive_seconds(r.bucket, "report.bucket"),
        scrape_interval_s=_positive_seconds(r.scrape_interval, "report.scrape_interval"),
        port=a.port,
        health_path=a.health_path,
        startup_timeout_s=a.startup_timeout,
        aiperf=tuple(named_paths([f"{k}={v}" for k, v in r.aiperf.items()], "report.aiperf")),
        engine=ld.engine,
        vllm_python=python,
    )


def _arms_and_ceiling(
    a: ArmsSpec, concurrency: int
) -> tuple[tuple[ArmSpec, ...], int, CeilingConfig]:
    """The arms (server commands, the URL, or kvtier serve ON/OFF), the vocabulary token ids
    are drawn below, and the ceiling's cache sizes (from the spec, else the arms' flags)."""
    bs = a.block_size
    ceiling_hbm = a.hbm_blocks
    tier_chunks = None
    min_load = 0
    chunk = a.chunk_size
    vocab = a.vocab
    admission = None  # the tier's admission mode: known for kvtier serve's arms only
    step_tokens = None  # and their token budget per step
    model_dir = None if a.model_dir is None else Path(a.model_dir)
    if a.servers or a.url:
        arms = (
            tuple(parse_arm(f"{name}={cmd}") for name, cmd in a.servers.items())
            if a.servers
            else (ArmSpec("endpoint", url=a.url),)
        )
        if vocab is None:
            if model_dir is None:
                raise ConfigError(
                    f"{_k('arms.vocab')} is needed with arms.servers or arms.url (token ids "
                    "are drawn below it); pass the model's vocabulary size, or set "
                    "arms.model_dir to read it"
                )
            vocab = int(model_config(ensure_model(model_dir))["vocab_size"])
        for arm in arms:
            bs = bs or int_or_none(arm.flag("--block-size"))
            ceiling_hbm = ceiling_hbm or int_or_none(
                arm.flag("--hbm-blocks", "--num-gpu-blocks-override")
            )
        if a.tier_tokens is not None:
            if not chunk:
                raise ConfigError(
                    "arms.tier_tokens needs arms.chunk_size (the tier stores whole chunks) for "
                    "the HBM + tier ceiling"
                )
            tier_chunks = a.tier_tokens // chunk
    else:  # kvtier serve with --offload and --no-offload: same flags, pool and env
        if a.tp < 1:
            raise ConfigError(f"arms.tp {a.tp} must be >= 1")
        model = ensure_model(model_dir, "tiny")
        config = model_config(model)
        bs, ceiling_hbm = bs or 16, ceiling_hbm or 128
        env, _, kv = tier_config(NATIVE, chunk or 64, bs)
        memory = kv.memory_bytes
        if a.tier_tokens is not None:
            # the ON arm's tier is the size the ceiling and the model are computed for (it was
            # the ceiling's only: a 1M-token ceiling over a 64k-token tier read as lost hits)
            geometry = bytes_per_token_from_hf(config, tp_size=a.tp, kv_dtype=KV_DTYPE)
            whole = max(1, a.tier_tokens // kv.chunk_size) * kv.chunk_size
            memory = geometry.bytes_for_tokens(whole)
            env = {**env, "KVTIER_MEMORY_BYTES": str(memory)}
        server = ServerConfig(
            model, a.tp, ceiling_hbm, bs, concurrency, a.max_batched_tokens, 1, env=env
        )
        arms = tuple(
            ArmSpec(name, tuple(server.argv("{port}", on)), env=env, offload=on)
            for name, on in (("on", True), ("off", False))
        )
        vocab = vocab or int(config["vocab_size"])
        chunk, min_load = kv.chunk_size, kv.min_load(bs)
        tier_chunks = tier_chunks_per_rank(config, a.tp, chunk, memory)
        admission, step_tokens = kv.admission, a.max_batched_tokens
    bs = bs or 16
    return (
        arms,
        vocab,
        CeilingConfig(bs, ceiling_hbm, chunk, tier_chunks, min_load, admission, step_tokens),
    )


def _load_engine(
    engine: str, python: str | None, workload: str, duration: Seconds | None, api_key: str | None
) -> Path | None:
    """The vLLM venv's python for the vllm-bench engine (None for kvtier's client), once the
    spec is one vLLM's loop can serve."""
    if engine not in LOADS:
        raise ConfigError(f"{_k('load.engine')} {engine!r} is not one of {list(LOADS)}")
    if engine == KVTIER_CLIENT:
        return None
    refused = {
        f"{_k('workload.kind')} multi-turn (a later turn waits for its previous one)": (
            workload == "multi-turn"
        ),
        _k("workload.duration"): duration is not None,
        _k("arms.api_key"): api_key is not None,
    }
    if bad := [name for name, on in refused.items() if on]:
        raise ConfigError(
            f"{_k('load.engine')} vllm-bench does not take {', '.join(bad)}; use kvtier's "
            "client (load.engine kvtier)"
        )
    path = Path(python) if python else default_venv() / "bin" / "python"
    if not path.is_file():
        raise ConfigError(
            f"load.engine vllm-bench: {path} does not exist; build it with `make vllm-env` or "
            "set load.vllm_python"
        )
    return path


def _positive_seconds(text: Seconds, what: str) -> float:
    value = parse_seconds(text, what)
    if value <= 0:
        raise ConfigError(f"{what} {text!r} must be > 0")
    return value
