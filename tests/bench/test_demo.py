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


def _doc(mismatches: int = 0, cost: float = 99.0, cost_aa: float = 0.98) -> dict:
    def row(id_: str, value: float, raw: float | None = None, ok: bool | None = None) -> dict:
        return {"id": id_, "label": id_, "value": value, "raw": raw, "pass": ok}

    return {
        "rows": [
            row("prefix_pool.hit_rate_on", 68.3, 68.3),
            row("prefix_pool.hit_rate_off", 39.6, 40.4),
            row("prefix_pool.ttft_p50_ms", 20.0, 40.0),
            row("prefix_pool.ttft_p50_ms.aa_worst_rep", 1.04),
            row("prefix_pool.output_throughput", 150.0, 100.0),
            row("prefix_pool.output_throughput.aa_worst_rep", 0.97),
            row("no_reuse.output_throughput", cost, 100.0, cost >= 97.0),
            row("no_reuse.output_throughput.aa_worst_rep", cost_aa),
            row("outputs.mismatches", mismatches, None, mismatches == 0),
            row("requests.failed", 0, None, True),
            row("identity.hbm_misses_eq_external_queries", 0, None, True),
            row("identity.retrieved_eq_external_hits", 0, None, True),
        ]
    }


RESTORE = {
    "restored_fraction": 0.997,
    "per_rank_tokens": {"0": 2552.0, "1": 2552.0},
    "hbm_hits": 0.0,
    "outputs_equal": True,
    "identity_queries": (2560.0, 2560.0),
    "identity_retrieved": (2552.0, 2552.0),
}


def test_the_demo_tells_one_story_in_at_most_twelve_rows(tmp_path: Path) -> None:
    from kvtier.bench.demo import MAX_ROWS, story, write_figure

    rows = story(RESTORE, _doc(), tp=2)
    assert len(rows) <= MAX_ROWS == 12
    table = {name: (value, verdict) for name, value, verdict in rows}
    assert table["prefix pool: TTFT p50 ON/OFF"] == ("0.50x (A/A 1.04x)", "")
    assert table["prefix pool: output tok/s ON/OFF"] == ("1.50x (A/A 0.97x)", "")
    assert table["prefix pool: hit rate ON vs OFF"][0].startswith("68.3% vs 39.6%")
    assert rows[-1][0] == "verdict" and rows[-1][2] == "PASS"
    # one broken check turns the verdict
    assert story(RESTORE, _doc(mismatches=3), tp=2)[-1][2] == "FAIL"
    uneven = {**RESTORE, "per_rank_tokens": {"0": 2552.0, "1": 0.0}}
    assert story(uneven, _doc(), tp=2)[0][2] == "FAIL"
    png = write_figure(_doc(), tmp_path / "demo.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_tiers_cost_inside_the_runs_own_noise_is_no_failure() -> None:
    """A no-reuse ratio under the 0.97 target but no lower than the A/A pair's own worst
    repetition cannot be told from the machine's noise: said so, not failed (a false alarm
    would fail `make demo`); a cost beyond the noise still fails the verdict."""
    from kvtier.bench.demo import story

    cost = "no reuse: output tok/s ON/OFF (the tier's cost)"
    rows = {name: (value, verdict) for name, value, verdict in story(RESTORE, _doc(), tp=2)}
    assert rows[cost] == ("0.99x (A/A 0.98x)", "PASS")
    noisy = story(RESTORE, _doc(cost=96.0, cost_aa=0.93), tp=2)
    rows = {name: (value, verdict) for name, value, verdict in noisy}
    assert rows[cost] == ("0.96x (A/A 0.93x: inside this run's noise)", "")
    assert noisy[-1][2] == "PASS"
    beyond = story(RESTORE, _doc(cost=90.0, cost_aa=0.98), tp=2)
    rows = {name: (value, verdict) for name, value, verdict in beyond}
    assert rows[cost] == ("0.90x (A/A 0.98x)", "FAIL") and beyond[-1][2] == "FAIL"
