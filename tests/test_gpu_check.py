"""The GPU check runs first time on a GPU because its every path runs here first: the device
strings a CUDA run passes build the same plan on the CPU (here), and `scripts/gpu-check.sh
--device cpu` runs end to end on a machine shaped like the GPU one, kvtier's dependencies
installed offline from the wheels `--prepare` fetched (tests/test_installs.py)."""

from __future__ import annotations

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
    # a GPU's ring and GIL bursts keep their repetitions; the CPU's unjudged quick form runs one
    assert (p.burst_reps, gpu_check.plan(arg, tmp_path, quick=False).burst_reps) == (3, 5)
    assert gpu_check.plan("cpu", tmp_path, quick=True).burst_reps == 1


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


def test_the_state_hybrid_self_test_row_fails_when_the_state_path_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvtier.offload.group_codec import StateCodec

    p = gpu_check.plan("cpu", tmp_path, quick=True)
    assert gpu_check.state_hybrid_row(p)[2] is True
    monkeypatch.setattr(StateCodec, "scatter", lambda self, src, ids, part: 0)
    name, value, ok = gpu_check.state_hybrid_row(p)
    assert ok is False and "KV tensor 'gdn'" in value, value
