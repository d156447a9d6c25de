"""Device ordering that keeps wrong bytes out of KV blocks, each reproduced before its fix on the
simulated device (`SimOps`) or on torch.cuda's classes replaced by recorders; every test is
deterministic (device work is held on events with short deadlines, never ordered by sleeps).

Each test models what CUDA does at the point in question; the docstring says which CUDA path.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from kvtier.offload.messages import ChunkRef, LoadOp, OffloadMeta
from kvtier.offload.pages import manager_view
from kvtier.offload.simdevice import _Item, _SimLane
from tests.offload.test_pipeline import CHUNK, NB, K, N, Rig, _blocks, _key, _rig, _save_step

RECOMPUTED = 3  # what the host's recompute writes into every element of a failed load's blocks


@pytest.fixture
def fast() -> Iterator[Rig]:
    # 1 ms a copy: the tests hold device work on events, not on modelled time
    yield from _rig(1_000)


def _recompute(rig: Rig, ids: list[int]) -> None:
    for v in rig.views.values():
        for b in ids:
            manager_view(v, NB)[b].fill_(RECOMPUTED)


def _is_recomputed(rig: Rig, ids: list[int]) -> bool:
    return all(
        bool((manager_view(v, NB)[b] == RECOMPUTED).all()) for v in rig.views.values() for b in ids
    )


# ---- 1. a deadline expiry vs. an issue that raised after queueing part of its writes ----------


@pytest.mark.parametrize("path", ["dma", "kernel"])
def test_a_deadline_expiry_waits_for_writes_an_issue_queued_before_it_raised(
    fast: Rig, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """An async load's chunk queues KV writes and then raises (CUDA: `dma.issue` returns an
    error on a later piece after earlier `cudaMemcpy2DAsync`s were queued; or a scatter whose
    first stack's `index_copy_` was queued before the second stack's temporary hit an OOM).
    `LoadPath._issue` left `with p.lock` on the raise and only then settled the lane, so a
    deadline expiry that took the lock in between saw no mark of those writes in `p.marks`,
    reported the load failed at once (the host recomputes, or reuses the blocks), and the
    queued write landed afterwards over the recomputed bytes."""
    from kvtier.offload import codec, loading

    rig = fast
    src = _save_step(rig)
    want = _blocks(rig.views, src[0])
    base = N * K
    if path == "kernel":
        monkeypatch.setattr(codec, "_MAX_RUNS", 1)  # a chunk of 2 blocks in 2 runs
        dst = [base + 2 * j for j in range(K)]
    else:
        dst = list(range(base, base + K))
    now = [0.0]
    rig.worker._clock = lambda: now[0]
    assert rig.worker.stack is not None
    assert rig.worker.stack.lookup([_key(0)], "lk-exp") == 1
    op = LoadOp("ex", "q-ex", "lk-exp", [ChunkRef(_key(0), dst)], CHUNK)
    raised = threading.Event()
    recomputed = threading.Event()

    def held() -> None:
        # device work queued by the failing issue runs after the host's recompute (or 1 s)
        recomputed.wait(1.0)

    if path == "dma":
        real_regions = _SimLane.copy_regions

        def failing_regions(self: _SimLane, pieces, to_host, fence=None):  # type: ignore[no-untyped-def]
            if to_host or raised.is_set():
                return real_regions(self, pieces, to_host, fence)
            self.copies.put(_Item("kernel", None, fn=held))
            real_regions(self, pieces, to_host, fence)  # queued, as cudaMemcpy2DAsync did
            raised.set()
            raise RuntimeError("cudaMemcpy2DAsync failed on a later piece (injected)")

        monkeypatch.setattr(_SimLane, "copy_regions", failing_regions)
    else:
        real_launch = _SimLane.launch
        real_scatter = loading.scatter_call

        def held_scatter(c, s, ids, part):  # type: ignore[no-untyped-def]
            fn = real_scatter(c, s, ids, part)
            return lambda: (held(), fn())[1]

        def failing_launch(self: _SimLane, fn: Callable[[], object], after=None):  # type: ignore[no-untyped-def]
            mark = real_launch(self, fn, after)
            if threading.current_thread().name == "kvtier-load-0" and not raised.is_set():
                raised.set()
                raise RuntimeError("CUDA out of memory (injected after the scatter was queued)")
            return mark

        monkeypatch.setattr(loading, "scatter_call", held_scatter)
        monkeypatch.setattr(_SimLane, "launch", failing_launch)

    rig.worker.start_load_kv(OffloadMeta(loads=[op]))
    assert raised.wait(5.0)
    now[0] = 1e9  # past the load's deadline
    # the expiry and the lane's own failure race to report it (either may win, and either
    # comes only after the queued write landed); collect until one has
    results, invalid, recving = [], [], []
    until = time.monotonic() + 5.0
    while not results and time.monotonic() < until:
        rig.worker.wait_idle(0.05)
        report = rig.worker.take_report()
        results += [(r.op_id, r.ok, r.reason) for r in report.results]
        invalid += report.invalid_block_ids
        recving += report.finished_recving
    assert results in ([("ex", False, "deadline")], [("ex", False, "error:RuntimeError")])
    assert sorted(invalid) == sorted(dst)
    assert recving == ["q-ex"]
    # told the load failed, the host recomputes its blocks on the compute stream
    rig.ops.run_on_compute(lambda: (_recompute(rig, dst), recomputed.set())).wait()
    rig.ops.synchronize()  # everything the lane had queued has landed by now
    landed_late = all(torch.equal(a, b) for a, b in zip(_blocks(rig.views, dst), want, strict=True))
    assert not landed_late, "the load's write landed after its deadline reported it failed"
    assert _is_recomputed(rig, dst)


# ---- 2. a fence recorded on the calling thread's current device, not on the KV device --------


def test_a_fence_is_taken_on_the_kv_devices_stream_when_the_thread_is_current_on_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`CudaOps.fence()` called `torch.cuda.Event().record()` with no stream, and torch then
    records on `torch.cuda.current_stream()`: the current *device's* stream, not the KV
    device's (`join` was device-explicit, `fence` was not). A host
    whose forward thread never made the KV device current (the native engine at TP=1 on
    `device="cuda:1"`: only TP worker processes call `torch.cuda.set_device`; `kvtier bench
    --device cuda:N`) gets fences on cuda:0's stream, so a save's gather / 2-D DMA is ordered
    after nothing the forward on cuda:1 did (a chunked-prefill step that samples nothing has no
    host sync either): bytes the forward has not written yet are committed to the tier, and a
    load's scatter can overtake a forward still reading its blocks."""
    from kvtier.offload.device import CudaOps

    current_device = 0  # the forward's thread: torch.cuda.set_device was never called

    class _Stream:
        def __init__(self, device: int, name: str) -> None:
            self.device, self.name = device, name

        def wait_event(self, event: object) -> None:
            pass

    compute = {d: _Stream(d, f"cuda:{d} compute") for d in (0, 1)}

    def current_stream(device: object = None) -> _Stream:
        index = current_device if device is None else torch.device(device).index  # type: ignore[arg-type]
        return compute[index]

    class _Event:
        def __init__(self, blocking: bool = False) -> None:
            self.stream: _Stream | None = None

        def record(self, stream: _Stream | None = None) -> None:
            # torch.cuda.Event.record: `if stream is None: stream = torch.cuda.current_stream()`
            self.stream = torch.cuda.current_stream() if stream is None else stream

    def side_stream(device: object) -> _Stream:
        return _Stream(torch.device(device).index, "side")  # type: ignore[arg-type]

    monkeypatch.setattr(torch.cuda, "Stream", side_stream)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    ops = CudaOps(torch.device("cuda", 1))  # the rank's KV cache (and its forward) on cuda:1
    fence = ops.fence()
    assert isinstance(fence, _Event) and fence.stream is not None
    # the forward that wrote (or still reads) the blocks runs on cuda:1's current stream
    assert fence.stream is compute[1], f"fence recorded on {fence.stream.name}"
