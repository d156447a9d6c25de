"""On vLLM, an exception inside each kvtier hook in turn costs one request, never the engine
(invariant 18): every request of every pass gets the tokens a pass without the fault gives,
the other requests keep their tier hits, and the hook's failure is counted
(`kvtier_hook_errors_total{hook}`); EngineCore serves a last pass after all of them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.vllm.conftest import CHUNK, TIER, DriverRun

# per request: the hooks that raise for the victim only (the rank's own bookkeeping, raising
# once, turns the tier off on that rank: last)
PER_REQUEST = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_meta_load",
    "build_meta_save",
    "build_connector_meta",
    "request_finished",
    "start_load_kv",
    "save",
)
RANK_WIDE = ("get_finished", "build_connector_worker_meta")
# the counter's label for each injection point
LABEL = {"build_meta_load": "build_meta", "build_meta_save": "build_meta"}


def test_each_hook_that_raises_costs_one_request_and_vllm_serves_on(
    run_driver: Callable[..., DriverRun], tiny_vllm_model_f32: Path
) -> None:
    hooks = [*PER_REQUEST, *RANK_WIDE]
    args = {"model": str(tiny_vllm_model_f32), "extra": TIER, "hooks": hooks}
    run = run_driver("hook_faults", args, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, timeout_s=280)
    r = run.result
    for hook in hooks:
        h = r[hook]
        # the victim recomputed, the others restored: every output is the fault-free one
        assert h["restore"] == h["store"], hook
        label = LABEL.get(hook, hook)
        errors = sum(v for k, v in h["errors"].items() if f"hook={label}" in k)
        assert errors >= 1, (hook, h["errors"])
        if hook in PER_REQUEST:
            # the two other prompts (one whole chunk each) still came from the tier
            assert h["hits"] >= 2 * CHUNK, (hook, h["hits"])
    assert r["last"]["a"] == r["last"]["b"]
    assert "EngineDeadError" not in run.stderr
