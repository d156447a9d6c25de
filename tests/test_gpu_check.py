"""The GPU check runs first time on a GPU because its every path runs here first: the device
strings a CUDA run passes build the same plan on the CPU, and `scripts/gpu-check.sh --device
cpu` runs end to end on a machine shaped like the GPU one (a Python with torch and nothing
else, kvtier's other dependencies installed offline from the wheels `--prepare` fetched)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtier.errors import ConfigError
from kvtier.native import EngineConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402 - the script, imported as the device run imports it


@pytest.mark.parametrize(
    ("arg", "device", "rank1"),
    [("cuda", "cuda:0", 1), ("cuda:0", "cuda:0", 1), ("cuda:1", "cuda:1", 2)],
)
def test_every_cuda_device_string_builds_its_plan_on_the_cpu(
    tmp_path: Path, arg: str, device: str, rank1: int
) -> None:
    p = gpu_check.plan(arg, tmp_path, quick=True)
    assert p.device == device and p.engine.device == device
    assert p.engine.rank_device(0) == torch.device(device)
    # at TP > 1, rank r runs on the r-th GPU from the first one named
    tp2 = EngineConfig(device=arg, tensor_parallel_size=2)
    assert tp2.rank_device(1) == torch.device("cuda", rank1)
    assert p.tier.chunk_size == gpu_check.RESTORE_CHUNK


def test_a_bad_device_string_is_refused_naming_the_forms(tmp_path: Path) -> None:
    for bad in ("gpu", "cuda:x", "cpu:0", "cuda:-1"):
        with pytest.raises(ValueError, match="use cpu, cuda or cuda:N"):
            gpu_check.plan(bad, tmp_path, quick=True)
        with pytest.raises(ConfigError, match="'cpu', 'cuda' or 'cuda:N'"):
            EngineConfig(device=bad)


def test_cuda_on_a_machine_without_one_exits_2_saying_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert not torch.cuda.is_available()
    assert gpu_check.main(["--device", "cuda:0", "--out", str(tmp_path)]) == 2
    assert "sees no CUDA device" in capsys.readouterr().err


@pytest.mark.timeout(600)
def test_the_cpu_form_runs_every_check_from_offline_wheels(tmp_path: Path) -> None:
    # the GPU machine: a Python with torch and nothing else of kvtier's
    host = tmp_path / "host"
    subprocess.run([sys.executable, "-m", "venv", str(host)], check=True)
    pip = [str(host / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile"]
    if subprocess.run([*pip, "torch==2.13.0+cpu"], check=False).returncode:
        subprocess.run([*pip, "torch==2.13.0"], check=True)
    script = str(ROOT / "scripts" / "gpu-check.sh")
    wheels = tmp_path / "wheels"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    env = {**os.environ, "WHEELS": str(wheels), "PYTHON": str(host / "bin" / "python")}
    env.pop("PYTHONPATH", None)
    prep = subprocess.run([script, "--prepare", "--python-version", version], env=env,
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert prep.returncode == 0, prep.stderr[-3000:]
    out = tmp_path / "out"
    run = subprocess.run([script, "--device", "cpu", "--quick", "--out", str(out)], env=env,
                         capture_output=True, text=True, check=False)  # fmt: skip
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    doc = json.loads((out / "gpu-check.json").read_text())
    rows = {name: (value, ok) for name, value, ok in doc["rows"]}
    assert not [n for n in rows if "crashed" in n], rows
    assert all(ok is not False for _, ok in rows.values()), rows
    assert rows["layout matrix on cpu (pytest)"][0].endswith("s") and "passed" in rows[
        "layout matrix on cpu (pytest)"][0]  # fmt: skip
    assert sum(n.startswith("self-test through the codec") for n in rows) == 6
    for model in ("Llama-3.1-8B (GQA, TP1)", "DeepSeek-V3 (MLA 576)"):
        for n in (4, 16):
            for what in ("save", "load"):
                assert f"bench tier: {model}: {what}, {n} chunks per step" in rows
        assert f"bench tier: {model}: one-chunk load, issue to landed, p50" in rows
    assert rows["two-pass restore: pass-2 tokens from the tier"][0] == "2552 of 2552"
    # the bench rows are bench tier's own: the same report, written beside the table
    bench = json.loads((out / "bench-tier.json").read_text())
    assert {r["id"] for r in bench["rows"] if r["id"].startswith("datapath.cpu.")} >= {
        "datapath.cpu.llama-3.1-8b.save.16chunks", "datapath.cpu.deepseek-v3.load_latency"}
