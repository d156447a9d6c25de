"""The worker's device ordering, made visible on the CPU: a scatter into KV blocks waits for the
compute stream's position when its load started (a forward still running there may be using the
blocks), and an op that fails mid-copy waits for its queued copies before it reports or frees.

`StreamOps` numbers the fences the worker takes on the compute stream and gives every lane a
record of the newest fence it was ordered after and of the copies it queued and not yet waited
for; on CUDA these are `Event.record`, `Stream.wait_event` and `Event.synchronize`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import torch

from kvtier.offload.codec import PageCodec
from kvtier.offload.device import DONE, Lane, Mark
from kvtier.offload.messages import ChunkRef, LoadOp, OffloadMeta, SaveOp
from kvtier.offload.pages import KVCacheDescription
from kvtier.offload.selftest import SELF_TEST_KEY
from kvtier.offload.worker import OffloadWorker
from tests.offload.separation import DeviceSeparation, TaggedOps
from tests.offload.test_worker import BS, CHUNK, NB, WAIT_S, config, rank0
from tests.offload.vllm_views import build, gqa

KEY = b"k" * 16


@dataclass
class StreamLane:
    """One lane's stream: the newest fence it waits for, copies queued since its last finish."""

    waited: int = 0
    queued: int = 0
    finishes: int = 0

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        yield

    def after(self, fence: object | None) -> None:
        if fence is not None:
            assert isinstance(fence, int)
            self.waited = max(self.waited, fence)

    def launch(self, fn: Callable[[], object], after: Mark | None = None) -> Mark:
        fn()
        return DONE

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Mark | None = None) -> Mark:
        dst.copy_(src)
        return DONE

    def finish(self) -> None:
        self.queued = 0
        self.finishes += 1


@dataclass
class Scatter:
    thread: str
    waited: int  # the newest fence its lane waited for
    fences: int  # fences taken on the compute stream by then


class StreamOps(TaggedOps):
    """TaggedOps whose fences are numbered and whose lanes record what they were ordered after."""

    def __init__(self, mode: DeviceSeparation) -> None:
        super().__init__(mode)
        self.fences = 0
        self.lanes: dict[str, StreamLane] = {}
        self.scatters: list[Scatter] = []

    def fence(self) -> object | None:
        self.fences += 1
        return self.fences

    def lane(self) -> Lane:
        lane = self.lanes[threading.current_thread().name] = StreamLane()
        return lane

    def current(self) -> StreamLane:
        return self.lanes[threading.current_thread().name]


@dataclass
class Rig:
    worker: OffloadWorker
    ops: StreamOps
    faults: dict[str, bool] = field(default_factory=dict)


@pytest.fixture
def rig(monkeypatch: pytest.MonkeyPatch) -> Iterator[Rig]:
    mode = DeviceSeparation()
    ops = StreamOps(mode)
    rig_ = Rig(None, ops)  # type: ignore[arg-type]
    scatter, gather = PageCodec.scatter, PageCodec.gather

    def logged_scatter(self: PageCodec, src: torch.Tensor, block_ids: list[int]) -> int:
        lane = ops.current()
        ops.scatters.append(Scatter(threading.current_thread().name, lane.waited, ops.fences))
        n = scatter(self, src, block_ids)
        lane.queued += 1  # on CUDA the copy is still landing until the lane's finish
        if rig_.faults.get("scatter"):
            raise RuntimeError("injected: the scatter raised after queueing its copy")
        return n

    def faulty_gather(self: PageCodec, block_ids: list[int], dst: torch.Tensor) -> None:
        gather(self, block_ids, dst)
        ops.current().queued += 1
        if rig_.faults.get("gather"):
            raise RuntimeError("injected: the gather raised after queueing its copy")

    monkeypatch.setattr(PageCodec, "scatter", logged_scatter)
    monkeypatch.setattr(PageCodec, "gather", faulty_gather)
    raw, views = build(gqa(block_size=BS), NB, "LBNHC")
    raw.copy_(torch.randint(-60, 60, raw.shape, generator=torch.Generator().manual_seed(3),
                            dtype=torch.int8))  # fmt: skip
    mode.tag(raw)
    rig_.worker = rank0(config(), ops)
    with mode:
        rig_.worker.register_kv_caches(KVCacheDescription(views, NB, BS, "LBNHC"))
        yield rig_
    rig_.worker.close()


def _saved(rig: Rig) -> None:
    rig.worker.wait_for_save(OffloadMeta(saves=[SaveOp("r1#sv", "r1", [ChunkRef(KEY, [3, 4])],
                                                       CHUNK)]))  # fmt: skip
    assert rig.worker.wait_idle(WAIT_S)
    rig.worker.take_report()
    assert rig.worker.stack is not None and rig.worker.stack.lookup([KEY], "lk1") == 1


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_a_loads_scatter_waits_for_the_compute_stream_as_it_stood_at_start_load_kv(
    rig: Rig, sync: bool
) -> None:
    _saved(rig)
    before, n = rig.ops.fences, len(rig.ops.scatters)
    load = LoadOp("r2#ld", "r2", "lk1", [ChunkRef(KEY, [9, 8])], CHUNK, sync=sync)
    rig.worker.start_load_kv(OffloadMeta(loads=[load]))
    assert rig.worker.wait_idle(WAIT_S)
    assert rig.worker.take_report().results[0].ok
    (s,) = rig.ops.scatters[n:]
    assert s.thread == ("MainThread" if sync else "kvtier-load-0")
    # a fence taken in start_load_kv itself, not one older than it
    assert s.waited > before, s


def test_the_self_tests_scatter_waits_for_the_clearing_of_its_blocks(rig: Rig) -> None:
    # the self-test zeroes the target blocks on the compute stream, then loads into them
    (s,) = rig.ops.scatters[:1]
    assert s.thread == "kvtier-load-0"
    assert s.waited == s.fences > 1, s  # the newest fence: taken after the save's
    assert rig.worker.stack is not None and rig.worker.stack.memory.contains(SELF_TEST_KEY)


def test_a_save_that_raises_mid_copy_waits_for_its_copy_before_its_slot_is_freed(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack = rig.worker.stack
    assert stack is not None
    queued_at_abort: list[int] = []
    abort = stack.abort

    def watched_abort(key: bytes) -> None:
        queued_at_abort.append(rig.ops.current().queued)
        abort(key)

    monkeypatch.setattr(stack, "abort", watched_abort)
    rig.faults["gather"] = True
    rig.worker.wait_for_save(OffloadMeta(saves=[SaveOp("r1#sv", "r1", [ChunkRef(KEY, [3, 4])],
                                                       CHUNK)]))  # fmt: skip
    assert rig.worker.wait_idle(WAIT_S)
    (result,) = rig.worker.take_report().results
    assert (result.ok, result.reason) == (False, "error:RuntimeError")
    assert queued_at_abort == [0]
    assert not stack.memory.contains(KEY)


def test_a_load_that_raises_mid_scatter_waits_for_it_before_reporting(rig: Rig) -> None:
    _saved(rig)
    rig.faults["scatter"] = True
    load = LoadOp("r2#ld", "r2", "lk1", [ChunkRef(KEY, [9, 8])], CHUNK)
    rig.worker.start_load_kv(OffloadMeta(loads=[load]))
    assert rig.worker.wait_idle(WAIT_S)
    report = rig.worker.take_report()
    assert [(r.ok, r.reason) for r in report.results] == [(False, "error:RuntimeError")]
    # reported failed (the host recomputes these blocks) with nothing left landing in them
    assert report.finished_recving == ["r2"]
    assert rig.ops.lanes["kvtier-load-0"].queued == 0


class _FakeStream:
    def __init__(self, log: list[tuple[str, object]], name: str) -> None:
        self.log, self.name = log, name

    def wait_event(self, event: object) -> None:
        self.log.append((f"{self.name}.wait_event", event))


def test_the_cuda_lane_orders_after_fences_of_the_current_stream_and_finish_synchronizes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CudaOps' glue, with torch.cuda's stream and event classes replaced by recorders: a fence
    is an event recorded on the KV device's current stream (the forward's), `after`
    makes the lane's kernel stream wait for it, `finish` records a blocking-sync event on each
    of the lane's streams and waits for it (a default event would spin the thread)."""
    from kvtier.offload.device import CudaOps

    log: list[tuple[str, object]] = []
    compute = _FakeStream(log, "compute")

    class _FakeEvent:
        def __init__(self, blocking: bool = False) -> None:
            self.blocking = blocking

        def record(self, stream: _FakeStream | None = None) -> None:
            log.append(("record", (stream or compute).name))

        def synchronize(self) -> None:
            log.append(("synchronize", self.blocking))

    monkeypatch.setattr(torch.cuda, "Stream", lambda device: _FakeStream(log, "side"))
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    # the KV device's own stream (the fence names it, whatever device is current)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    ops = CudaOps(torch.device("cuda", 0))
    lane = ops.lane()
    fence = ops.fence()
    lane.after(fence)
    lane.after(None)  # no fence (a host-side op): nothing to wait for
    lane.finish()
    assert [e for e, _ in log] == [
        "record",
        "side.wait_event",
        *["record", "synchronize"] * 2,  # the kernel stream, then the copy stream
    ]
    assert log[0] == ("record", "compute") and log[1][1] is fence
    assert log[2] == ("record", "side") and log[4] == ("record", "side")
    # host waits block in the driver instead of spinning a core
    assert log[3] == ("synchronize", True) and log[5] == ("synchronize", True)


def test_cuda_join_orders_the_compute_stream_after_a_mark_without_a_host_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sync load's last scatter is joined into the forward's stream: `wait_event` on the
    current stream, never `synchronize` in the forward's thread."""
    from kvtier.offload.device import CudaOps

    log: list[tuple[str, object]] = []
    compute = _FakeStream(log, "compute")

    class _FakeEvent:
        def __init__(self, blocking: bool = False) -> None:
            self.blocking = blocking

        def record(self, stream: _FakeStream | None = None) -> None:
            log.append(("record", (stream or compute).name))

        def synchronize(self) -> None:
            log.append(("synchronize", self.blocking))

    monkeypatch.setattr(torch.cuda, "Stream", lambda device: _FakeStream(log, "side"))
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    ops = CudaOps(torch.device("cuda", 0))
    lane = ops.lane()
    ran: list[bool] = []
    mark = lane.launch(lambda: ran.append(True))
    ops.join(mark)
    assert ran == [True]
    assert [e for e, _ in log] == ["record", "compute.wait_event"]
    assert log[0] == ("record", "side") and log[1][1] is mark.event  # type: ignore[attr-defined]
    assert mark.event.blocking  # type: ignore[attr-defined]
