"""The load gate's choice of where a load runs: inside the coming forward when its predicted
transfer fits a share of the measured step, else asynchronously."""

from __future__ import annotations

from kvtier.offload.gate import LoadGate

# 1 M tokens/s from memory, 100 k tokens/s from disk: 10 k tokens take 10 ms and 100 ms
GATE_SEEDS = {"memory": 1e6, "disk": 1e5}


def gate(step_s: float | None = 0.1) -> LoadGate:
    g = LoadGate.seeded(2000.0, 1e6, GATE_SEEDS)
    if step_s is not None:
        g.observe_step(step_s)
    return g


def test_no_load_runs_in_the_forward_before_a_step_was_measured() -> None:
    assert not gate(None).runs_in_forward(1, fraction=1.0)


def test_a_load_runs_in_the_forward_when_it_fits_the_share_of_a_step() -> None:
    g = gate(0.1)  # 100 ms steps; a quarter of one is 25 ms
    assert g.runs_in_forward(10_000, fraction=0.25)  # 10 ms
    assert g.runs_in_forward(25_000, fraction=0.25)  # 25 ms: at the bound
    assert not g.runs_in_forward(30_000, fraction=0.25)  # 30 ms
    # the step's other synchronous loads count against the same share
    assert not g.runs_in_forward(10_000, fraction=0.25, booked_s=0.02)
    # 0 turns synchronous loads off
    assert not g.runs_in_forward(1, fraction=0.0)


def test_a_slow_tier_stays_asynchronous_where_memory_would_not() -> None:
    g = gate(0.1)
    assert g.runs_in_forward(10_000, fraction=0.25, tier="memory")
    assert not g.runs_in_forward(10_000, fraction=0.25, tier="disk")  # 100 ms


def test_the_step_estimate_follows_measured_steps() -> None:
    g = gate(0.1)
    for _ in range(50):
        g.observe_step(0.01)  # steps got 10x shorter: the same load no longer fits
    assert not g.runs_in_forward(10_000, fraction=0.25)
    assert g.step.value is not None and abs(g.step.value - 0.01) < 1e-3
    # measured loads move the transfer estimate: slower reads, fewer synchronous loads
    for _ in range(50):
        g.observe_step(0.1)
        g.observe_load(10_000, 0.05, "memory")
    assert not g.runs_in_forward(10_000, fraction=0.25)  # 50 ms now
    assert g.runs_in_forward(10_000, fraction=0.6)
