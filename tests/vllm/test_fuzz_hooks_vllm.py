"""Arbitrary request ids (any length, any characters) and token lists through vLLM's scheduler
hooks into KVTierConnector: no kvtier hook fails, every request ends with its tokens, and the
tier is really used (lookups, loads and saves ran). Hypothesis generates the examples inside the
vLLM driver (`drivers/fuzz_hooks.py`), derandomized so a failure reproduces."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.vllm.conftest import TIER, DriverRun


def _total(counter: dict[str, float], rank: str) -> float:
    return sum(v for k, v in counter.items() if f"rank={rank}" in k.split(","))


def test_hypothesis_ids_and_tokens_never_fail_a_hook(
    run_driver: Callable[..., DriverRun], tiny_vllm_model: Path
) -> None:
    args = {"model": str(tiny_vllm_model), "extra": TIER, "examples": 25}
    r = run_driver("fuzz_hooks", args, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}).result
    assert "failure" not in r, r.get("failure")
    assert r["examples"] == 25 and r["requests"] >= 25
    t = r["totals"]
    assert not any(t["hook_errors"].values()), t["hook_errors"]
    # the examples reached the tier: lookups ran, prefixes loaded and new chunks saved
    assert _total(t["lookups"], "scheduler") > 0
    assert _total(t["retrieved_tokens"], "0") > 0 and _total(t["stored_tokens"], "0") > 0
