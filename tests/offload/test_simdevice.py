"""The simulated device itself: copies take their modelled time on the engine, their bytes land
when their mark is reached (not before), marks block without spinning, a failed kernel surfaces
at the next wait, and one engine is shared by both directions while two run them side by side.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvtier.offload.device import DONE
from kvtier.offload.simdevice import CopyModel, SimOps
from kvtier.offload.transfer import Flights, Peak

WAIT_S = 30.0


@pytest.fixture
def sim() -> SimOps:
    ops = SimOps(CopyModel(gbps=1.0, latency_us=40_000))  # 40 ms a copy: visible, not slow
    yield ops
    ops.close()


def _lane(ops: SimOps):  # type: ignore[no-untyped-def]
    out = []
    t = threading.Thread(target=lambda: out.append(ops.lane()), name="test-lane")
    t.start()
    t.join()
    return out[0]


def test_a_copy_lands_when_its_mark_is_reached_and_not_before(sim: SimOps) -> None:
    lane = _lane(sim)
    staging = sim.staging(4096)
    assert staging is not None
    staging.fill_(7)
    host = torch.zeros(4096, dtype=torch.uint8)
    t0 = time.monotonic()
    mark = lane.copy(host, staging)
    # queued, not landed: a reader that did not wait for the mark sees the old bytes
    assert not mark.done() and int(host.sum()) == 0
    mark.wait()
    assert time.monotonic() - t0 >= 0.04
    assert torch.equal(host, torch.full((4096,), 7, dtype=torch.uint8))
    assert sim.stats.copies == 1 and sim.stats.d2h == 1
    assert sim.stats.host_waits["MainThread"] == 1


def test_one_engine_runs_copies_one_after_another_and_two_engines_side_by_side() -> None:
    for engines, at_least, below in ((1, 0.16, None), (2, 0.08, 0.155)):
        ops = SimOps(CopyModel(gbps=1.0, latency_us=40_000, engines=engines))
        try:
            a, b = _lane(ops), _lane(ops)
            dev = [ops.staging(64) for _ in range(4)]
            host = [torch.zeros(64, dtype=torch.uint8) for _ in range(4)]
            t0 = time.monotonic()
            # two each way, on two lanes
            marks = [a.copy(host[0], dev[0]), a.copy(dev[1], host[1])]  # type: ignore[arg-type]
            marks += [b.copy(host[2], dev[2]), b.copy(dev[3], host[3])]  # type: ignore[arg-type]
            for m in marks:
                m.wait()
            took = time.monotonic() - t0
            assert took >= at_least, (engines, took)
            if below is not None:
                # the model's own end, not this thread's wake-up: a loaded host wakes it late
                modelled = max(m.t_done for m in marks) - t0
                assert modelled < below, (engines, modelled, took)
            assert ops.stats.engine_busy_s == pytest.approx(0.16, rel=0.01)
        finally:
            ops.close()


def test_stream_order_a_kernel_after_a_copy_reads_the_landed_bytes(sim: SimOps) -> None:
    lane = _lane(sim)
    staging = sim.staging(256)
    assert staging is not None
    staging.zero_()
    host = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    seen: list[torch.Tensor] = []
    copied = lane.copy(staging, host)
    done = lane.launch(lambda: seen.append(staging.clone()), after=copied)
    done.wait()
    assert torch.equal(seen[0], host)


def test_a_kernel_that_raises_fails_the_next_wait_on_its_stream(sim: SimOps) -> None:
    lane = _lane(sim)

    def broken() -> None:
        raise ValueError("injected kernel fault")

    mark = lane.launch(broken)
    with pytest.raises(RuntimeError, match="injected kernel fault"):
        mark.wait()


def test_a_copy_must_cross_between_device_and_host(sim: SimOps) -> None:
    lane = _lane(sim)
    a, b = torch.zeros(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="must cross between a staging buffer and host"):
        lane.copy(a, b).wait()


def test_a_waiting_thread_sleeps_instead_of_spinning(sim: SimOps) -> None:
    lane = _lane(sim)
    staging = sim.staging(64)
    assert staging is not None
    mark = lane.copy(torch.zeros(64, dtype=torch.uint8), staging)
    c0, t0 = time.thread_time(), time.monotonic()
    mark.wait()
    cpu, wall = time.thread_time() - c0, time.monotonic() - t0
    assert wall >= 0.03
    assert cpu < 0.25 * wall, (cpu, wall)


def test_the_compute_stream_runs_after_a_joined_mark(sim: SimOps) -> None:
    lane = _lane(sim)
    staging = sim.staging(64)
    assert staging is not None
    staging.fill_(3)
    host = torch.zeros(64, dtype=torch.uint8)
    mark = lane.copy(host, staging)
    sim.join(mark)  # no host wait here
    assert sim.stats.host_waits["MainThread"] == 0
    seen: list[int] = []
    sim.run_on_compute(lambda: seen.append(int(host.sum()))).wait()
    assert seen == [3 * 64]


def test_flights_reuse_a_buffer_only_after_its_transfer_retired() -> None:
    order: list[str] = []
    peak = Peak()
    flights: Flights[str] = Flights(["b0", "b1"], peak)
    got = []
    for i in range(5):
        buf = flights.acquire()
        got.append(buf)
        flights.push(DONE, lambda err, i=i: order.append(f"landed {i}"))
        assert len(flights) <= 2
    flights.drain()
    assert got == ["b0", "b1", "b0", "b1", "b0"]
    assert order == [f"landed {i}" for i in range(5)]
    assert peak.value == 2


def test_a_copy_model_refuses_nonsense_naming_the_value() -> None:
    with pytest.raises(ValueError, match="gbps=0"):
        CopyModel(gbps=0)
    with pytest.raises(ValueError, match="engines=3 must be 1 or 2"):
        CopyModel(engines=3)
