"""The main job's restore check, on the tiny model at TP=1 (the demo itself runs TP=2)."""

from __future__ import annotations

from pathlib import Path

from kvtier.bench.demo import restore_check
from kvtier.native.modelgen import init_model


def test_restore_check_serves_pass_two_from_the_tier(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # the server log goes under ./runs
    model = init_model(tmp_path / "model", dtype="float32")
    env = {"KVTIER_CHUNK_SIZE": "64", "KVTIER_MEMORY_BYTES": "64MiB"}
    res = restore_check(model, 1, env, lambda _msg: None)
    assert res["prompt_tokens"] == 8 * 320
    # every prompt is 5 whole chunks: all but its last token come back from the tier
    assert res["external_hits"] == 8 * 319
    assert res["hbm_hits"] == 0
    assert res["outputs_equal"]
    assert res["per_rank_tokens"] == {"0": 8 * 319}
    assert res["per_rank_loads"] == {"0": 8}
    q, eq = res["identity_queries"]
    assert q == eq
    r, er = res["identity_retrieved"]
    assert r == er == 8 * 319
