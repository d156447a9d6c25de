"""A rank's copy lanes leave the cores its host bound compute threads to (`lane_cpus: auto`)
when at least two are free, stay put when fewer are (the one free core is the frontend's) or
with `lane_cpus: inherit`, and a CPU the process may not use fails startup naming it; the lanes
still move the right bytes once moved."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from kvtier import cpus
from kvtier.errors import ConfigError
from kvtier.offload.messages import ChunkRef, LoadOp, OffloadMeta, SaveOp
from kvtier.offload.pages import KVCacheDescription
from kvtier.offload.worker import OffloadWorker
from tests.offload.separation import DeviceSeparation, TaggedOps
from tests.offload.test_worker import BS, CHUNK, NB, WAIT_S, blocks, config, rank0
from tests.offload.vllm_views import build, gqa

HOST = frozenset(os.sched_getaffinity(0))
# one CPU more than this process has: 'auto' then sees two free cores beside one compute core
# on a 2-CPU machine; the kernel drops it from the lanes' mask, which keeps the real free one
WIDE_HOST = HOST | {max(HOST) + 1}


class AffinityOps(TaggedOps):
    """Records, per lane thread, the CPUs it runs on when it binds the device."""

    def __init__(self, mode: DeviceSeparation) -> None:
        super().__init__(mode)
        self.cpus: dict[str, frozenset[int]] = {}

    def bind_thread(self) -> None:
        self.cpus[threading.current_thread().name] = frozenset(os.sched_getaffinity(0))
        super().bind_thread()


def start(
    monkeypatch: pytest.MonkeyPatch,
    compute: frozenset[int] | None,
    host: frozenset[int] = HOST,
    **kw: object,
) -> tuple[OffloadWorker, AffinityOps, dict[str, torch.Tensor], DeviceSeparation]:
    # the host is what this test process may use, whatever the machine's cgroup says
    monkeypatch.setattr(cpus, "host_cpus", lambda: host)
    mode = DeviceSeparation()
    ops = AffinityOps(mode)
    raw, views = build(gqa(block_size=BS), NB, "LBNHC")
    raw.copy_(torch.randint(-60, 60, raw.shape, generator=torch.Generator().manual_seed(3)))
    mode.tag(raw)
    worker = rank0(config(**kw), ops, compute_cpus=compute)
    with mode:
        worker.register_kv_caches(KVCacheDescription(views, NB, BS, "LBNHC"))
    return worker, ops, views, mode


def test_lanes_leave_the_compute_cores_and_still_move_the_right_bytes(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert len(HOST) >= 2, f"this test needs 2 CPUs to split; the process has {sorted(HOST)}"
    caplog.set_level("INFO", logger="kvtier")
    compute = frozenset({min(HOST)})
    worker, ops, views, mode = start(monkeypatch, compute, WIDE_HOST)
    try:
        assert ops.cpus == {"kvtier-load-0": HOST - compute, "kvtier-save-0": HOST - compute}
        assert frozenset(os.sched_getaffinity(0)) == HOST  # the owner thread kept its CPUs
        spare = cpus.describe(WIDE_HOST - compute)
        want = f"copy lanes on CPUs {spare} (compute threads: {min(HOST)}"
        assert want in caplog.text
        with mode:
            expect = blocks(views, [2, 3])
            worker.wait_for_save(
                OffloadMeta(saves=[SaveOp("s", "r1", [ChunkRef(b"k" * 16, [2, 3])], CHUNK)])
            )
            assert worker.wait_idle(WAIT_S)
            assert worker.take_report().results[0].ok
            assert worker.stack is not None and worker.stack.lookup([b"k" * 16], "lk") == 1
            load = LoadOp("l", "r2", "lk", [ChunkRef(b"k" * 16, [7, 6])], CHUNK)
            worker.start_load_kv(OffloadMeta(loads=[load]))
            assert worker.wait_idle(WAIT_S)
            assert worker.take_report().finished_recving == ["r2"]
            got = blocks(views, [7, 6])
        assert all(torch.equal(a, b) for a, b in zip(got, expect, strict=True))
    finally:
        worker.close()


_ONE_FREE = cpus.describe(HOST - {min(HOST)})


@pytest.mark.parametrize(
    ("compute", "setting", "says"),
    [
        (HOST, "auto", f"CPUs {cpus.describe(HOST)} (none free; lane_cpus auto moves them"),
        (frozenset({min(HOST)}), "auto", f"(free: {_ONE_FREE}, left to the frontend; lane_cpus"),
        (None, "auto", None),
        (frozenset({min(HOST)}), "inherit", None),
    ],
    ids=["no-free-core", "one-free-core-is-the-frontends", "host-binds-nothing", "inherit"],
)
def test_lanes_stay_on_the_starting_threads_cpus(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    compute: frozenset[int] | None,
    setting: str,
    says: str | None,
) -> None:
    caplog.set_level("INFO", logger="kvtier")
    worker, ops, _, _ = start(monkeypatch, compute, lane_cpus=setting)
    try:
        assert worker.placement.lanes is None
        assert set(ops.cpus.values()) == {HOST}
        # auto says why it left the lanes where the host bound compute threads, nothing else
        lines = [r.getMessage() for r in caplog.records if "copy lanes" in r.getMessage()]
        if says is None:
            assert lines == []
        else:
            assert len(lines) == 1 and "copy lanes stay with the compute threads" in lines[0]
            assert says in lines[0], lines[0]
    finally:
        worker.close()


def test_an_explicit_list_pins_the_lanes_there(monkeypatch: pytest.MonkeyPatch) -> None:
    one = max(HOST)
    worker, ops, _, _ = start(monkeypatch, frozenset({one}), lane_cpus=str(one))
    try:
        # an explicit list wins over what 'auto' would pick, even the compute core itself
        assert set(ops.cpus.values()) == {frozenset({one})}
    finally:
        worker.close()


def test_a_cpu_the_process_may_not_use_fails_startup_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    absent = max(HOST) + 4096
    with pytest.raises(ConfigError, match=rf"CPUs {absent} .*set lane_cpus to CPUs among"):
        start(monkeypatch, None, lane_cpus=str(absent))
