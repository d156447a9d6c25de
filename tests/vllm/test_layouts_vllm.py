"""kvtier's torch rebuild of vLLM's KV views (what the CPU and GPU layout matrix runs on) equals
what vLLM 0.32's own helpers build, and kvtier's codec moves blocks over vLLM's own views."""

from __future__ import annotations

from collections.abc import Callable

from tests.offload.vllm_views import SUPPORTED
from tests.vllm.conftest import DriverRun


def test_rebuilt_views_equal_vllms_for_every_layout_and_split(
    run_driver: Callable[..., DriverRun],
) -> None:
    result = run_driver("layouts", {}).result
    cases = result["cases"]
    # MLA latents (one TP shard) are stored once below memory; GQA heads are per rank
    assert result["replicated"] == {"mla_tp2": True, "mla_tp1": False, "gqa_tp2": False}
    # off CPU kvtier asks for a layer-outer layout vLLM can split into kernel blocks (vLLM's CPU
    # attention reads LBHNC only)
    assert result["required_layout"] == {
        "cpu": None,
        "gpu": "LBNHC",
        "gpu_no_preference": None,
        "gpu_blnhc": "BLNHC",
    }
    # 4 layouts x 3 models, the layer-compact ones also with a kernel-block split
    assert len(cases) == 3 * (len(SUPPORTED) + 2)
    assert [c["case"] for c in cases if not c["same"]] == []
    assert [c["case"] for c in cases if not c["moved"]] == []
