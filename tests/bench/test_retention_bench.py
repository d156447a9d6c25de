"""`kvtier bench retention --quick`: both arms run through real servers, hints are granted,
the agents' returning turns read more of their prompt from the tier with hints than without,
outputs are equal between the arms, and the other conversations' traffic still runs."""

from __future__ import annotations

from pathlib import Path

from kvtier.bench import retention
from kvtier.native.modelgen import init_model


def test_the_quick_retention_bench_measures_both_arms(tmp_path: Path, monkeypatch) -> None:
    model = init_model(tmp_path / "model", dtype="float32")  # the tiny preset's shape
    monkeypatch.chdir(tmp_path)  # the servers' logs go under ./runs
    # hit shares are compared: a lookup a loaded host answers after the 200 ms default is a hit
    # lost to the host, not to the hints
    monkeypatch.setenv("KVTIER_LOOKUP_TIMEOUT_MS", "2000")
    doc = retention.run(
        quick=True, model_dir=model, json_path=tmp_path / "r.json", progress=lambda m: None
    )
    rows = {r["id"]: r for r in doc["rows"]}
    plan = retention.QUICK
    returning = plan.agents * (plan.turns - 1)
    assert rows["granted"]["detail"]["sent"] == plan.agents * plan.turns
    assert rows["granted"]["value"] == plan.agents * plan.turns  # the budget holds them all
    cached = rows["agents.cached"]
    assert cached["value"] > cached["detail"]["no_hints"] + 20  # percentage points
    assert rows["outputs.equal"]["value"] == plan.conversations * plan.turns
    assert rows["agents.ttft"]["raw"] > 0 and returning > 0
    assert (tmp_path / "r.json").is_file()
