"""Fixtures for the vLLM host tests: the isolated `.venv-vllm`, the tiny model, and a runner
for driver scripts (each driver runs under `.venv-vllm/bin/python` and prints one JSON line)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvtier.native.modelgen import init_model
from tests.vllm.drivers.common import RESULT_PREFIX
from tests.vllm.forkclient import server_for

REPO = Path(__file__).resolve().parents[2]
SETUP_SCRIPT = REPO / "scripts" / "setup-vllm-env.sh"
VENV = REPO / ".venv-vllm"
# vLLM's cache for every vLLM process the suite starts (drivers, servers, both xdist workers):
# its model inspection (a subprocess importing vLLM, ~10 s) then runs once per checkout
VLLM_CACHE = REPO / "build" / "vllm-cache"
DRIVERS = Path(__file__).resolve().parent / "drivers"
SETUP_TIMEOUT_S = 1800
CHUNK = 256
# The tier every test starts from: small; the load gate off, because on a loaded 2-core machine
# its measured load/prefill rates swing and it would skip loads nondeterministically; for the
# same reason every load asynchronous (the request parks; test_sync_load_vllm runs them inside
# the forward); and a lookup deadline that a starved worker process still meets (a miss would
# change the counts).
TIER: dict[str, Any] = {
    "memory_bytes": "64MiB",
    "chunk_size": CHUNK,
    "load_gate": False,
    "sync_load_fraction": 0,
    "lookup_timeout_ms": 5000,
}

# kvtier[rank 1/2]: Retrieved 512 of 512 required tokens (0.000 GiB, 0.49 GB/s)[ failed: x]
RETRIEVED_RE = re.compile(
    r"kvtier\[rank (\d+)/(\d+)\]: Retrieved (\d+) of (\d+) required tokens.*?(failed: \S+)?$"
)


@dataclass(frozen=True)
class Retrieved:
    """One per-load log line of an OffloadWorker."""

    rank: int
    world: int
    got: int
    required: int
    failed: str | None


def retrieved_lines(text: str) -> list[Retrieved]:
    """Every `kvtier[rank r/W]: Retrieved ...` line in a log."""
    out = []
    for line in text.splitlines():
        m = RETRIEVED_RE.search(line)
        if m:
            failed = m.group(5)[len("failed: ") :] if m.group(5) else None
            out.append(Retrieved(*(int(m.group(i)) for i in range(1, 5)), failed))
    return out


def loadable_tokens(prompt_lens: list[int], chunk: int) -> int:
    """Tokens a full tier can give back: whole chunks, one token short of a whole prompt."""
    return sum(min(n // chunk * chunk, n - 1) for n in prompt_lens)


@dataclass(frozen=True)
class DriverRun:
    """What a driver printed, and how long it ran."""

    result: dict[str, Any]
    stdout: str
    stderr: str
    seconds: float

    def warnings(self) -> list[str]:
        """kvtier's WARNING lines: what a failed count's message shows to say why."""
        return [x for x in self.stderr.splitlines() if "WARNING" in x and "kvtier" in x]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Whichever driver test runs first may build .venv-vllm (minutes, from PyPI): give every
    test that needs it room for the build on top of the project's 300 s per-test timeout."""
    for item in items:
        if "vllm_python" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.timeout(SETUP_TIMEOUT_S + 300))


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """`.venv-vllm`'s python, built by scripts/setup-vllm-env.sh when missing or stale."""
    proc = subprocess.run(
        ["bash", str(SETUP_SCRIPT)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=SETUP_TIMEOUT_S,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"{SETUP_SCRIPT} failed with exit code {proc.returncode}:\n"
            f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    python = VENV / "bin" / "python"
    assert python.exists(), f"{SETUP_SCRIPT} succeeded but {python} is missing"
    return python


@pytest.fixture(scope="session")
def tiny_vllm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny bf16 Llama (head_dim 64, which vLLM's CPU attention supports)."""
    return init_model(tmp_path_factory.mktemp("vllm-model") / "tiny", dtype="bfloat16")


@pytest.fixture(scope="session")
def tiny_vllm_model_f32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama in float32, for tests whose passes cannot share a batch shape."""
    return init_model(tmp_path_factory.mktemp("vllm-model-f32") / "tiny", dtype="float32")


SLIDING_WINDOW = 128


def make_hybrid_model(
    directory: Path, pattern: tuple[str, ...], window: int, dtype: str = "bfloat16"
) -> Path:
    """The tiny bf16 Llama with per-layer attention kinds (`layer_types`, gpt-oss-shaped:
    sliding-window layers of `window` tokens next to full-attention ones), which vLLM's Llama
    reads and its hybrid memory allocator turns into one KV cache group per kind."""
    model = init_model(directory, dtype=dtype, layers=len(pattern))
    path = model / "config.json"
    config = json.loads(path.read_text())
    config.update({"layer_types": list(pattern), "sliding_window": window})
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return model


@pytest.fixture(scope="session")
def tiny_hybrid_model_f32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """gpt-oss-shaped tiny model, float32: sliding-window (128 tokens) and full attention
    alternating (float32: tests/vllm/test_hybrid_vllm.py says why)."""
    pattern = ("sliding_attention", "full_attention") * 2
    return make_hybrid_model(tmp_path_factory.mktemp("vllm-hybrid-f32") / "tiny", pattern,
                             SLIDING_WINDOW, "float32")  # fmt: skip


@pytest.fixture(scope="session")
def tiny_sliding_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every layer sliding-window attention: one SlidingWindowSpec group (refused)."""
    pattern = ("sliding_attention",) * 2
    return make_hybrid_model(tmp_path_factory.mktemp("vllm-sliding") / "tiny", pattern,
                             SLIDING_WINDOW)  # fmt: skip


# Qwen3-Next-shaped (gated delta net linear attention next to full attention), tiny; vLLM's CPU
# backend starts it with random weights (load_format "dummy")
GDN_HYBRID = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "full_attention"] * 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_value_head_dim": 64,
    "max_position_embeddings": 4096,
    "mlp_only_layers": [],
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "partial_rotary_factor": 0.25,
    "rope_parameters": {
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000.0,
        "rope_type": "default",
    },  # fmt: skip
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
}


def make_hf_model(out: Path, config: dict[str, Any], python: Path, tokenizer: Path) -> Path:
    """A Hugging Face model directory of `config` with random float32 weights (made by
    transformers in .venv-vllm) and the tiny Llama's tokenizer."""
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    script = Path(__file__).with_name("make_hf_model.py")
    proc = subprocess.run([str(python), str(script), str(out)], capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (out / name).write_bytes((tokenizer / name).read_bytes())
    return out


@pytest.fixture(scope="session")
def tiny_gdn_hybrid_model(
    tmp_path_factory: pytest.TempPathFactory, tiny_vllm_model: Path, vllm_python: Path
) -> Path:
    """A Qwen3-Next-shaped model directory with random float32 weights."""
    out = tmp_path_factory.mktemp("vllm-gdn") / "tiny"
    return make_hf_model(out, {**GDN_HYBRID, "dtype": "float32"}, vllm_python, tiny_vllm_model)


# Nemotron-H-shaped (Mamba2 layers next to attention and an MLP layer: "M*M-"), tiny
MAMBA2_HYBRID = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "hybrid_override_pattern": "M*M-",
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "mamba_num_heads": 8,
    "mamba_head_dim": 32,
    "ssm_state_size": 16,
    "n_groups": 1,
    "conv_kernel": 4,
    "expand": 1,
    "chunk_size": 128,
    "mamba_hidden_act": "silu",
    "mlp_hidden_act": "relu2",
    "layer_norm_epsilon": 1e-5,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "use_bias": False,
    "use_conv_bias": True,
    "attention_bias": False,
    "mlp_bias": False,
    "dtype": "bfloat16",
}


@pytest.fixture(scope="session")
def tiny_mamba2_hybrid_model(
    tmp_path_factory: pytest.TempPathFactory, tiny_vllm_model: Path, vllm_python: Path
) -> Path:
    """A Nemotron-H-shaped model directory with random float32 weights."""
    out = tmp_path_factory.mktemp("vllm-mamba2") / "tiny"
    return make_hf_model(out, MAMBA2_HYBRID, vllm_python, tiny_vllm_model)


@pytest.fixture(scope="session")
def vllm_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Environment of every driver: offline, 1 GiB of KV, caches and sockets in the test tmp."""
    root = tmp_path_factory.mktemp("vllm-run")
    (root / "tmp").mkdir()
    env = {
        k: v
        for k, v in os.environ.items()
        # a developer's kvtier/vLLM settings must not leak into the tests
        if not k.startswith(("KVTIER_", "VLLM_")) and k not in ("VIRTUAL_ENV", "PYTHONHOME")
    }
    env.update(
        {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CACHE_ROOT": str(VLLM_CACHE),
            "VLLM_RPC_BASE_PATH": str(root / "tmp"),
            "TMPDIR": str(root / "tmp"),
            "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]),
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def _run(cmd: list[str], env: dict[str, str], timeout_s: float) -> tuple[int, str, str]:
    """Run a driver script (`[python, script, *args]`) under `env`: (exit code, stdout,
    stderr). Scripts under `.venv-vllm` run in a child of a fork server that imported vLLM once
    (tests/vllm/forkserver.py); either way in a session of their own, so a timeout takes vLLM's
    worker processes down with the driver."""
    if Path(cmd[0]).parent.parent == VENV and cmd[1].endswith(".py"):
        server = server_for(cmd[0], env, REPO)
        try:
            return server.run(cmd[1:], env, timeout_s)
        except TimeoutError as exc:
            raise AssertionError(
                f"driver {cmd[1]} timed out after {timeout_s}s\n--- stderr tail ---\n"
                f"{str(exc)[-6000:]}"
            ) from None
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
        raise AssertionError(
            f"driver {cmd[1]} timed out after {timeout_s}s\n--- stderr tail ---\n{err[-6000:]}"
        ) from None
    return proc.returncode, out, err


@pytest.fixture
def run_driver(vllm_python: Path, vllm_env: dict[str, str]) -> Callable[..., DriverRun]:
    """Run `tests/vllm/drivers/<name>.py` with JSON args; returns its parsed result line."""

    def run(
        name: str, args: dict[str, Any], env: dict[str, str] | None = None, timeout_s: float = 240
    ) -> DriverRun:
        cmd = [str(vllm_python), str(DRIVERS / f"{name}.py"), json.dumps(args)]
        t0 = time.perf_counter()
        code, out, err = _run(cmd, {**vllm_env, **(env or {})}, timeout_s)
        seconds = time.perf_counter() - t0
        lines = [line for line in out.splitlines() if line.startswith(RESULT_PREFIX)]
        if code != 0 or len(lines) != 1:
            raise AssertionError(
                f"driver {name} exited {code} with {len(lines)} result lines\n"
                f"--- stdout tail ---\n{out[-4000:]}\n--- stderr tail ---\n{err[-8000:]}"
            )
        result = json.loads(lines[0][len(RESULT_PREFIX) :])
        return DriverRun(result, out, err, seconds)

    return run
