"""kvtier inside a MultiConnector: vLLM reads the parent's kv_load_failure_policy, so kvtier
says the truth about it at startup, exports it for doctor, and with the parent set as the
README documents a corrupted chunk is recomputed with the right output."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.vllm.conftest import TIER, DriverRun, retrieved_lines


def _run(run_driver: Callable[..., DriverRun], model: Path, tmp: Path, policy: str) -> DriverRun:
    args = {
        "model": str(model),
        "extra": TIER,
        "example_dir": str(tmp / f"example-{policy}"),
        "parent_policy": policy,
    }
    return run_driver("multiconnector", args, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})


def test_with_the_parent_set_to_recompute_a_corrupted_chunk_is_recomputed(
    run_driver: Callable[..., DriverRun], tiny_vllm_model: Path, tmp_path: Path
) -> None:
    run = _run(run_driver, tiny_vllm_model, tmp_path, "recompute")
    r = run.result
    assert r["out2"] == r["out1"] and set(r["why2"]) == {"length"}
    assert r["verify"] == {"rank=0,reason=checksum_mismatch,tier=memory": 1.0}
    assert any(x.failed for x in retrieved_lines(run.stderr))
    assert "inside a MultiConnector whose kv_load_failure_policy is recompute" in run.stderr
    assert r["fails_request"].get("scheduler") == 0.0


def test_with_the_parent_left_at_fail_kvtier_names_the_fix_and_doctor_sees_it(
    run_driver: Callable[..., DriverRun], tiny_vllm_model: Path, tmp_path: Path
) -> None:
    run = _run(run_driver, tiny_vllm_model, tmp_path, "fail")
    assert (
        "runs inside a MultiConnector whose kv_load_failure_policy='fail': vLLM reads the "
        "MultiConnector's policy, so a failed tier load FAILS its request. Set "
        '"kv_load_failure_policy": "recompute" at the top level of the MultiConnector\'s '
        "--kv-transfer-config" in run.stderr
    )
    assert "changed to 'recompute'" not in run.stderr  # the child does not claim a change
    assert run.result["fails_request"].get("scheduler") == 1.0
