"""`kvtier bench tier --device sim`: the simulated device's rows, pipelined next to serial on
the same modelled engine, at 25 and 50 GB/s (the fractions themselves are the bench's to judge:
they depend on this host's load)."""

from __future__ import annotations

from kvtier.bench.datapath_sim import SIM_TARGET, run_sim
from kvtier.bench.layerwise_sim import run_layerwise
from kvtier.bench.table import Report


def test_sim_rows_put_the_pipeline_next_to_the_serial_design() -> None:
    report = Report("tier", "sim")
    said: list[str] = []
    run_sim(report, 3, said.append)
    doc = report.to_json()
    rows = {r["id"]: r for r in doc["rows"]}
    want = {
        f"datapath.sim.{g}gbps.{what}.{design}"
        for g in (25, 50)
        for what in ("save", "load")
        for design in ("serial", "pipeline")
    }
    assert set(rows) == want
    for rid, r in rows.items():
        assert 0 < r["value"] <= 1.05, r
        depth = 2 if rid.endswith("pipeline") else 1
        assert r["detail"]["peak_in_flight"] == depth, r
        assert r["detail"]["time_scale"] >= 1.0
        # only the pipeline is held to the target; the serial design is the comparison
        assert (r["target"] is not None) == (depth == 2)
        if depth == 2:
            assert r["target_spec"]["bound"] == SIM_TARGET
    assert any("simulated 50 GB/s engine, pipeline" in m for m in said)


def test_the_layerwise_row_puts_a_restore_in_waves_next_to_one_joined_before_the_forward() -> None:
    """Compute equal to the transfer: in waves the forward overlaps the link (0.625 of the
    joined time at full overlap); joined before it, the two add up."""
    report = Report("tier", "sim")
    run_layerwise(report, 2, lambda m: None)
    (row,) = report.to_json()["rows"]
    assert row["id"] == "datapath.sim.layerwise.restore"
    # the joined restore takes at least transfer + compute; waves well under it
    assert row["raw"] >= 2 * row["detail"]["transfer_ms"] * 0.95, row
    assert row["ratio"] < 0.85, row
