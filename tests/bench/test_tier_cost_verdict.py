"""The demo's verdict on the tier's cost, on a real `kvtier serve` ON arm: kvtier's own time on
the step (its hooks' wall time plus its copy lanes' CPU, share of the step, read within one
window) passes a correct tier, and fails once a real cost is planted in kvtier's path (a save
hook that sleeps 10% of each step, through a test-only sitecustomize, not a product flag)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier.bench.arms import Drive, ServerConfig, Workload, post_reset
from kvtier.bench.breakdown import COST_SHARE_LIMIT, breakdown
from kvtier.bench.client import LoadOptions
from kvtier.bench.e2e import MODEL_PRESETS, NO_REUSE
from kvtier.bench.workload import no_reuse
from kvtier.native.modelgen import init_model

PLANTED = Path(__file__).resolve().parent / "planted_cost"


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # the demo's model: its steps are what the limit was measured on
    path = tmp_path_factory.mktemp("cost") / "small-model"
    return init_model(path, dtype="float32", **MODEL_PRESETS["small"])


def _cost_share(model: Path, out: Path, planted: float) -> tuple[float, int]:
    env = {"KVTIER_CHUNK_SIZE": "64", "KVTIER_MEMORY_BYTES": "64MiB"}
    if planted:
        path = os.environ.get("PYTHONPATH", "")
        env["PYTHONPATH"] = f"{PLANTED}:{path}" if path else str(PLANTED)
        env["PLANTED_COST_SHARE"] = str(planted)
    server = ServerConfig(model_dir=model, tp=1, hbm_blocks=128, max_num_seqs=4, env=env)
    specs = no_reuse(12, 288, seed=1, vocab=2000, max_tokens=8)
    drive = Drive(
        [Workload(NO_REUSE, specs)],
        out,
        LoadOptions(concurrency=4, require_token_ids=True),
        reset=post_reset("/reset_prefix_cache"),
        progress=False,
    )
    run = drive.run("on", 0, True, server.process(out / "server.log"))
    window = run.windows[NO_REUSE]
    steps = breakdown(window.delta, world=1)
    assert steps.cost_share is not None, steps
    done = sum(r.error is None and len(r.output_ids) == 8 for r in window.load.records)
    return steps.cost_share, done


@pytest.mark.timeout(240)
@pytest.mark.parametrize("planted", [0.0, 0.1])
def test_the_tier_cost_verdict_fails_a_planted_cost_and_passes_without(
    small_model: Path, tmp_path: Path, planted: float
) -> None:
    share, completed = _cost_share(small_model, tmp_path, planted)
    assert completed == 12
    if planted:
        # the planted sleep alone is 10% of each step: the verdict fails it
        assert share >= 0.75 * planted > COST_SHARE_LIMIT, share
    else:
        assert share <= COST_SHARE_LIMIT, share
