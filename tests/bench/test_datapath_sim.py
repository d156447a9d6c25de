"""`kvtier bench tier --device sim`: the simulated device's rows, pipelined next to serial on
the same modelled engine, at 25 and 50 GB/s (the fractions themselves are the bench's to judge:
they depend on this host's load)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from kvtier.bench.datapath_sim import SIM_MODEL, SIM_TARGET, run_sim
from kvtier.bench.layerwise_sim import run_layerwise
from kvtier.bench.ring_sim import (
    COPY_S,
    PER_STEP,
    STEPS,
    RingTimes,
    measure_ring,
    run_gil,
    run_ring,
)
from kvtier.bench.table import Report
from kvtier.offload.simdevice import CopyModel, SimOps

MORE_REPS = 5  # repetitions when the first are not clear
T = TypeVar("T")
Rows = dict[str, dict[str, Any]]
WHAT = ("save", "load")
# step boundaries a kept ring may leave idle, half of the drained ring's: a quiet host leaves
# none, a lane thread starved by a loaded one misses some
KEPT_GAPS = (STEPS - 1) // 2


def _judged(measure: Callable[[int], T], reps: int, clear: Callable[[T], bool]) -> T:
    """`measure(reps)` when it is `clear`, else `measure(MORE_REPS)`, judged by its medians: a
    host stall that lands in one burst of a loaded host (CI's 3 workers on 2 cores) moves that
    burst, and one burst must not decide."""
    got = measure(reps)
    return got if clear(got) else measure(MORE_REPS)


def _rows(run: Callable[[Report, int, Callable[[str], None]], None]) -> Callable[[int], Rows]:
    """`run`'s rows by id, from a report of `n` repetitions."""

    def measure(n: int) -> Rows:
        report = Report("tier", "sim")
        run(report, n, lambda m: None)
        return {r["id"]: r for r in report.to_json()["rows"]}

    return measure


def test_sim_rows_put_the_pipeline_next_to_the_serial_design() -> None:
    report = Report("tier", "sim")
    said: list[str] = []
    # one measured step per arm after the warm-up: the rows' shape is asserted here, their
    # fractions are the bench's (`kvtier bench tier --device sim` runs its own repetitions)
    run_sim(report, 1, said.append)
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
    rows = _judged(_rows(run_layerwise), 2, lambda rs: all(r["ratio"] < 0.85 for r in rs.values()))
    (row,) = rows.values()
    assert row["id"] == "datapath.sim.layerwise.restore"
    # the joined restore takes at least transfer + compute; waves well under it
    assert row["raw"] >= 2 * row["detail"]["transfer_ms"] * 0.95, row
    assert row["ratio"] < 0.85, row


def test_the_ring_rows_put_a_ring_kept_across_steps_next_to_one_drained_at_each_step() -> None:
    report = Report("tier", "sim")
    said: list[str] = []
    run_ring(report, 1, said.append)
    rows = {r["id"]: r for r in report.to_json()["rows"]}
    assert set(rows) == {"datapath.sim.ring.save", "datapath.sim.ring.load"}
    for r in rows.values():
        busy_ms = STEPS * PER_STEP * COPY_S * 1e3  # what the burst moves, on the engine
        assert r["value"] >= busy_ms * 0.99 and r["raw"] >= busy_ms * 0.99, r
        for arm in ("kept", "drained"):
            assert r["detail"][f"idle_ms_per_step_{arm}"] >= 0, r
            # the lanes' own Python per chunk, the GIL share a forward's Python competes with
            assert r["detail"][f"lane_cpu_us_per_chunk_{arm}"] > 0, r
    assert any("arms kept, drained" in m for m in said)


def test_a_ring_kept_across_steps_leaves_the_engine_no_idle_time_between_them() -> None:
    """Issue 41, item 3: with the ring kept, a burst of queued steps leaves the modelled engine
    no idle time between them; drained at each job's end, the host's wake, commit and report at
    every step boundary are idle time on the engine. 10 ms a chunk: a lane thread of a loaded
    2-core host still issues the next step's chunk well inside one copy."""
    gbps = SIM_MODEL.chunk_bytes / 0.01 / 1e9

    def measure(n: int) -> RingTimes:
        return measure_ring(lambda: SimOps(CopyModel(gbps=gbps)), torch.device("cpu"), n, print)

    def gaps(got: RingTimes, what: str) -> tuple[float, float]:
        return got.median("gaps", what, "kept"), got.median("gaps", what, "drained")

    def clear(got: RingTimes) -> bool:
        return all(k <= KEPT_GAPS and d >= STEPS - 1 for k, d in (gaps(got, w) for w in WHAT))

    got = _judged(measure, 1, clear)
    for what in WHAT:
        # drained: the engine waits at every one of the burst's step boundaries; kept: at none,
        # but a lane thread starved by an overloaded host misses some (beside 8 busy processes
        # on 2 cores 5 and 10 of 15)
        kept, drained = gaps(got, what)
        assert drained >= STEPS - 1 and kept <= KEPT_GAPS, (what, got.gaps, got.idle_s)


def test_the_gil_rows_show_a_python_busy_forward_starving_the_lanes_at_5_ms_and_not_at_05() -> None:
    """Issue 41, item 6: beside a forward thread that runs Python without pause, the lanes get
    the GIL only when the interpreter forces a switch. At 5 ms every step's issue and wake-ups
    wait that long and the engine idles (2.2-2.3x the burst alone with the lanes issuing spans,
    2.6-2.9x before); at kvtier's 0.5 ms the burst keeps the engine busy. Judged by a wide
    margin: a loaded host moves both arms, not the 5 ms arm's waits at every step."""
    rows = _judged(
        _rows(run_gil), 1, lambda rs: all(r["raw"] >= 1.2 * r["value"] for r in rs.values())
    )
    assert set(rows) == {"datapath.sim.gil.save", "datapath.sim.gil.load"}
    busy_ms = STEPS * PER_STEP * COPY_S * 1e3
    for r in rows.values():
        d = r["detail"]
        assert d["alone_ms"] >= busy_ms * 0.99, r
        # 5 ms against 0.5 ms: 2.1-2.4x in 15 of 16 runs, 1.42x the least; beside 3 and 8
        # busy processes on 2 cores 1.4-2.6x a repetition
        assert r["raw"] >= 1.2 * r["value"], r
        assert d["idle_ms_per_step_busy_5ms"] >= 1.0, r
        for arm in ("busy_5ms", "busy_0.5ms"):
            assert f"forward_slowdown_pct_{arm}" in d, r
