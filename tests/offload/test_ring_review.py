"""Review of the transfer ring kept across a lane's jobs (commit 0fcbaef): defects it brought,
each proven by a test on the simulated device (or the real lane), and guards of behaviour
verified correct and untested before."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from kvtier.offload.messages import ChunkRef, OffloadMeta, SaveOp
from kvtier.offload.worker import OffloadWorker
from tests.offload.test_persistent_ring import Rig, sim_rig
from tests.offload.test_worker import BS, CHUNK, WAIT_S

K = CHUNK // BS  # blocks per chunk


@pytest.fixture
def rig() -> Iterator[Rig]:
    yield from sim_rig(seed=5)  # persistent_ring: the default


def _key(i: int) -> bytes:
    return bytes([0x60 + i]) * 16


def _ids(chunk: int) -> list[int]:
    return list(range(chunk * K, (chunk + 1) * K))


def _until(cond: object, timeout_s: float) -> bool:
    """Poll `cond()` every 10 ms until true or `timeout_s` passed (a deadline, not a sleep)."""
    deadline = time.monotonic() + timeout_s
    pause = threading.Event()
    while not cond():  # type: ignore[operator]
        if time.monotonic() >= deadline:
            return False
        pause.wait(0.01)
    return True


def _results(w: OffloadWorker, want: set[str]) -> dict[str, tuple[bool, str]]:
    got: dict[str, tuple[bool, str]] = {}

    def seen() -> bool:
        got.update((r.op_id, (r.ok, r.reason)) for r in w.take_report().results)
        return want <= set(got)

    assert _until(seen, WAIT_S), got
    return got


# ---- defects ---------------------------------------------------------------------------------


def test_a_step_saving_a_chunk_the_last_step_still_has_on_the_link_does_not_fail(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two requests share a prefix (vLLM's prefix cache: the same blocks): the first saves the
    chunk at one step, the second re-saves it (under its HBM floor) at the next. Before the
    kept ring the first job's chunk was committed when the second job ran (resident: skipped);
    now it is still reserved in the ring, `reserve` returns None and the save fails no_slot."""
    w, ops = rig.worker, rig.ops
    assert w._path is not None and w.stack is not None
    reserved: list[bytes] = []
    reserve = w.stack.reserve

    def spy(key: bytes, parent: bytes = b"") -> torch.Tensor | None:
        reserved.append(key)
        return reserve(key, parent)

    monkeypatch.setattr(w.stack, "reserve", spy)
    forward = threading.Event()  # the forward that computed the blocks is still running
    ops.run_on_compute(lambda: forward.wait(WAIT_S))
    lane_gate = threading.Event()
    w._path.save_lane.submit(lambda _lane: lane_gate.wait(WAIT_S))
    ref = ChunkRef(_key(0), _ids(0))
    w.wait_for_save(OffloadMeta(saves=[SaveOp("sv-a", "ra", [ref], CHUNK)]))
    w.wait_for_save(OffloadMeta(saves=[SaveOp("sv-b", "rb", [ref], CHUNK)]))
    lane_gate.set()
    # the second job reaches the chunk while the first one's copy waits for the forward (a
    # design that waits for it first just takes the deadline here)
    _until(lambda: reserved.count(_key(0)) >= 2, 2.0)
    forward.set()
    assert w.wait_idle(WAIT_S)
    got = _results(w, {"sv-a", "sv-b"})
    assert got == {"sv-a": (True, ""), "sv-b": (True, "")}, got
    # and the tier holds the chunk
    assert w.stack.memory.contains(_key(0))


# ---- passing guards (behaviour verified correct, untested before) ------------------------------


def test_guard_close_settles_a_save_still_on_the_link_and_it_reports_stored(rig: Rig) -> None:
    """PASSING GUARD. `close()` while a step's last chunk is still in the kept ring (its copy
    waits for the forward): the lane settles before it stops, so the save commits and reports
    stored before the tiers close (nothing left unreported, no arena abandoned)."""
    w, ops = rig.worker, rig.ops
    assert w._path is not None
    forward = threading.Event()
    ops.run_on_compute(lambda: forward.wait(WAIT_S))
    ref = ChunkRef(_key(1), _ids(1))
    w.wait_for_save(OffloadMeta(saves=[SaveOp("sv-c", "rc", [ref], CHUNK)]))
    closer = threading.Thread(target=w.close, name="closer")
    closer.start()
    forward.set()
    closer.join(WAIT_S)
    assert not closer.is_alive()
    got = _results(w, {"sv-c"})
    assert got == {"sv-c": (True, "")}, got
