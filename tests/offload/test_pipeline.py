"""The worker's transfer pipeline, run for real on the simulated device (`SimOps`): bytes
round-trip exactly through saves, asynchronous and synchronous loads; a step's saves keep two
transfers in flight; `start_load_kv` queues synchronous loads without any host wait on the
forward's thread and the forward (the compute stream) still reads the loaded bytes; the lane
threads sleep while copies run; the number of copies and host waits per step is counted.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch

from kvtier.offload.messages import ChunkRef, LoadOp, OffloadMeta, SaveOp
from kvtier.offload.pages import KVCacheDescription, manager_view
from kvtier.offload.simdevice import CopyModel, SimOps
from kvtier.offload.worker import OffloadWorker
from tests.offload.test_worker import BS, CHUNK, WAIT_S, config, rank0
from tests.offload.vllm_views import SUPPORTED, build, gqa, mla

NB = 64
K = CHUNK // BS  # blocks per chunk
N = 8  # chunks per step


@dataclass
class Rig:
    worker: OffloadWorker
    ops: SimOps
    views: dict[str, torch.Tensor]


def _rig(
    latency_us: float, depth: int = 2, layout: str = "LBNHC", spec: str = "gqa"
) -> Iterator[Rig]:
    ops = SimOps(CopyModel(gbps=1.0, latency_us=latency_us))
    specs = gqa(block_size=BS) if spec == "gqa" else mla(block_size=BS)
    raw, views = build(specs, NB, layout)
    raw.copy_(torch.randint(-128, 127, raw.shape, generator=torch.Generator().manual_seed(11),
                            dtype=torch.int8))  # fmt: skip
    worker = rank0(config(memory_bytes="1MiB", transfer_depth=depth), ops)  # type: ignore[arg-type]
    worker.register_kv_caches(KVCacheDescription(views, NB, BS, layout))
    try:
        yield Rig(worker, ops, views)
    finally:
        worker.close()
        ops.close()


@pytest.fixture
def rig() -> Iterator[Rig]:
    # 20 ms a copy: a pipeline that waits where it should not is plainly slower
    yield from _rig(20_000)


def _blocks(views: dict[str, torch.Tensor], ids: list[int]) -> list[torch.Tensor]:
    return [manager_view(v, NB)[b].clone().view(torch.uint8) for v in views.values() for b in ids]


def _key(i: int) -> bytes:
    return bytes([0x40 + i]) * 16


def _chunks(first_block: int) -> list[list[int]]:
    return [list(range(first_block + i * K, first_block + (i + 1) * K)) for i in range(N)]


def _save_step(rig: Rig, first_block: int = 0) -> list[list[int]]:
    ids = _chunks(first_block)
    refs = [ChunkRef(_key(i), b) for i, b in enumerate(ids)]
    # two requests in one step: their chunks share one pipeline
    ops = [SaveOp("r1#sv", "r1", refs[: N // 2], CHUNK * N // 2),
           SaveOp("r2#sv", "r2", refs[N // 2 :], CHUNK * N // 2)]  # fmt: skip
    rig.worker.wait_for_save(OffloadMeta(saves=ops))
    assert rig.worker.wait_idle(WAIT_S)
    report = rig.worker.take_report()
    assert sorted((r.op_id, r.ok) for r in report.results) == [("r1#sv", True), ("r2#sv", True)]
    return ids


def _load_op(rig: Rig, op_id: str, targets: list[list[int]], sync: bool) -> LoadOp:
    lease = f"lk-{op_id}"
    assert rig.worker.stack is not None
    assert rig.worker.stack.lookup([_key(i) for i in range(N)], lease) == N
    refs = [ChunkRef(_key(i), b) for i, b in enumerate(targets)]
    return LoadOp(op_id, f"q-{op_id}", lease, refs, CHUNK * N, sync=sync)


def test_saves_and_async_loads_round_trip_exactly(rig: Rig) -> None:
    src = _save_step(rig)
    want = [_blocks(rig.views, b) for b in src]
    dst = _chunks(N * K)
    rig.worker.start_load_kv(OffloadMeta(loads=[_load_op(rig, "ld1", dst, sync=False)]))
    assert rig.worker.wait_idle(WAIT_S)
    report = rig.worker.take_report()
    assert [(r.ok, r.nbytes) for r in report.results] == [(True, N * rig.worker.codec.chunk_bytes)]
    assert report.finished_recving == ["q-ld1"]
    # the load reported after its scatters landed: no device sync is needed to read them
    for ids, w in zip(dst, want, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(_blocks(rig.views, ids), w, strict=True))


def test_a_steps_saves_keep_two_transfers_in_flight(rig: Rig) -> None:
    _save_step(rig)
    assert rig.worker._path is not None
    assert rig.worker._path.saves.peak_in_flight == 2
    assert rig.ops.stats.peak_in_flight >= 2


def test_sync_loads_leave_start_load_kv_without_a_host_wait_and_the_forward_reads_them(
    rig: Rig,
) -> None:
    src = _save_step(rig)
    want = [_blocks(rig.views, b) for b in src]
    dst = _chunks(N * K)
    for ids in dst:
        for v in rig.views.values():
            for b in ids:
                manager_view(v, NB)[b].zero_()
    waits = rig.ops.stats.host_waits["MainThread"]
    t0 = time.monotonic()
    rig.worker.start_load_kv(OffloadMeta(loads=[_load_op(rig, "ld1", dst, sync=True)]))
    queued_in = time.monotonic() - t0
    # the forward's thread queued 8 copies of 20 ms each and waited for none of them
    assert rig.ops.stats.host_waits["MainThread"] == waits
    assert rig.ops.stats.joins["MainThread"] == 1
    assert queued_in < N * 0.02, queued_in
    # the forward runs on the compute stream, after the loads on the device
    seen: list[list[torch.Tensor]] = []
    rig.ops.run_on_compute(lambda: seen.extend(_blocks(rig.views, ids) for ids in dst)).wait()
    for got, w in zip(seen, want, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(got, w, strict=True))
    report = rig.worker.take_report()
    assert [(r.op_id, r.ok) for r in report.results] == [("ld1", True)]
    assert report.finished_recving == []


def test_lane_threads_sleep_while_their_copies_run(rig: Rig) -> None:
    cpu0 = rig.worker.metrics.value("lane_cpu_seconds_total", lane="save")
    t0 = time.monotonic()
    _save_step(rig)
    wall = time.monotonic() - t0
    cpu = rig.worker.metrics.value("lane_cpu_seconds_total", lane="save") - cpu0
    assert wall >= N * 0.02  # the copies' modelled time, back to back on one engine
    # a spinning wait would burn the whole wall time
    assert cpu < 0.25 * wall, (cpu, wall)


def _paths(rig: Rig) -> dict[tuple[str, str], float]:
    m = rig.worker.metrics
    return {(lane, path): m.value("transfer_chunks_total", lane=lane, path=path)
            for lane in ("save", "load") for path in ("dma", "kernel", "host")}  # fmt: skip


def test_copies_and_host_waits_per_step_are_one_per_chunk(rig: Rig) -> None:
    stats = rig.ops.stats
    before = _paths(rig)
    copies, kernels = stats.copies, stats.kernels
    save_waits = stats.host_waits["kvtier-save-0"]
    _save_step(rig)
    # a chunk of consecutive blocks is one 2-D copy on the copy engine (LBNHC: rows = the
    # layers' K and V runs, one stride apart) and no kernel; the save lane waits once per
    # chunk, to commit it
    assert (stats.copies - copies, stats.kernels - kernels) == (N, 0)
    assert stats.host_waits["kvtier-save-0"] - save_waits == N
    copies, kernels = stats.copies, stats.kernels
    load_waits = stats.host_waits["kvtier-load-0"]
    rig.worker.start_load_kv(OffloadMeta(loads=[_load_op(rig, "ld1", _chunks(N * K), False)]))
    assert rig.worker.wait_idle(WAIT_S)
    assert (stats.copies - copies, stats.kernels - kernels) == (N, 0)
    assert stats.host_waits["kvtier-load-0"] - load_waits == N
    # the forward's thread never waited on the host in any of this
    assert stats.host_waits["MainThread"] == 0
    after = _paths(rig)
    moved = {k: after[k] - before[k] for k in after if after[k] != before[k]}
    assert moved == {("save", "dma"): N, ("load", "dma"): N}


@pytest.mark.parametrize("spec", ["gqa", "mla"])
@pytest.mark.parametrize("layout", SUPPORTED)
def test_a_run_of_blocks_moves_by_the_copy_engine_with_no_kernel_in_every_layout(
    layout: str, spec: str
) -> None:
    """Every vLLM 0.32 layout kvtier takes, GQA and MLA: a chunk of consecutive blocks saves
    and loads with 0 kernels (no gather, no scatter on the SMs), by 2-D copies only, bytes
    exact."""
    for rig in _rig(100.0, layout=layout, spec=spec):
        assert rig.worker.codec is not None
        per_chunk = len(rig.worker.codec.regions(_chunks(0)[0], torch.empty(
            rig.worker.codec.chunk_bytes, dtype=torch.uint8)) or [])  # fmt: skip
        assert per_chunk >= 1
        stats = rig.ops.stats
        copies, kernels = stats.copies, stats.kernels
        src = _save_step(rig)
        want = [_blocks(rig.views, b) for b in src]
        dst = _chunks(N * K)
        rig.worker.start_load_kv(OffloadMeta(loads=[_load_op(rig, "ld", dst, sync=False)]))
        assert rig.worker.wait_idle(WAIT_S)
        assert [r.ok for r in rig.worker.take_report().results] == [True]
        assert stats.kernels - kernels == 0
        assert stats.copies - copies == 2 * N * per_chunk
        for ids, w in zip(dst, want, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(_blocks(rig.views, ids), w, strict=True))


def test_fragmented_block_ids_take_the_kernel_path_and_are_counted(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Block ids in more runs than a few go through a gather (or scatter) kernel and a staging
    buffer, one copy each, and the counter says so; the bytes are the same."""
    from kvtier.offload import codec

    monkeypatch.setattr(codec, "_MAX_RUNS", 1)  # this rig's chunks have 2 blocks: 2 runs
    stats = rig.ops.stats
    before = _paths(rig)
    # every other block: K runs of one block per chunk
    ids = [[2 * (c * K + j) for j in range(K)] for c in range(N // 2)]
    want = [_blocks(rig.views, b) for b in ids]
    refs = [ChunkRef(_key(i), b) for i, b in enumerate(ids)]
    copies, kernels = stats.copies, stats.kernels
    rig.worker.wait_for_save(OffloadMeta(saves=[SaveOp("f#sv", "f", refs, CHUNK * len(ids))]))
    assert rig.worker.wait_idle(WAIT_S)
    assert [r.ok for r in rig.worker.take_report().results] == [True]
    assert (stats.copies - copies, stats.kernels - kernels) == (N // 2, N // 2)
    assert _paths(rig)[("save", "kernel")] - before[("save", "kernel")] == N // 2
    assert _paths(rig)[("save", "dma")] == before[("save", "dma")]
    dst = [[b + 1 for b in c] for c in ids]  # the odd blocks: fragmented again
    lease = "lk-frag"
    assert rig.worker.stack is not None
    assert rig.worker.stack.lookup([_key(i) for i in range(N // 2)], lease) == N // 2
    load = LoadOp("fl", "q-fl", lease, [ChunkRef(_key(i), b) for i, b in enumerate(dst)],
                  CHUNK * len(dst))  # fmt: skip
    rig.worker.start_load_kv(OffloadMeta(loads=[load]))
    assert rig.worker.wait_idle(WAIT_S)
    assert [r.ok for r in rig.worker.take_report().results] == [True]
    assert _paths(rig)[("load", "kernel")] - before[("load", "kernel")] == N // 2
    for b, w in zip(dst, want, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(_blocks(rig.views, b), w, strict=True))


def _hold_scatters(monkeypatch: pytest.MonkeyPatch, until: threading.Event, first_only: bool
                   ) -> None:  # fmt: skip
    """Scatters (only the first, with `first_only`) wait for `until`, at most 1 s, on their
    stream before they write."""
    from kvtier.offload import loading

    real = loading.scatter_call
    calls = [0]

    def held(c: object, s: torch.Tensor, ids: list[int], part: int) -> Callable[[], int]:
        fn = real(c, s, ids, part)  # type: ignore[arg-type]
        calls[0] += 1
        if first_only and calls[0] > 1:
            return fn
        return lambda: (until.wait(1.0), fn())[1]

    monkeypatch.setattr(loading, "scatter_call", held)


def test_a_sync_step_of_kernel_and_dma_chunks_orders_the_forward_after_both_streams(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sync load whose first chunk is fragmented (staging copy, then a scatter kernel on the
    lane's kernel stream) and whose last is a run (the copy engine, on its copy stream): the
    forward waits for both streams. Waiting for the last chunk's mark alone let the forward
    read the scatter's blocks before it wrote them."""
    from kvtier.offload import codec

    monkeypatch.setattr(codec, "_MAX_RUNS", 1)  # a chunk of 2 blocks in 2 runs is fragmented
    src = _save_step(rig)
    want = [_blocks(rig.views, b) for b in src[:2]]
    base = N * K
    dst = [[base + 2 * j for j in range(K)], list(range(base + 2 * K, base + 3 * K))]
    for v in rig.views.values():
        for b in (b for ids in dst for b in ids):
            manager_view(v, NB)[b].zero_()
    lease = "lk-mixed"
    assert rig.worker.stack is not None
    assert rig.worker.stack.lookup([_key(0), _key(1)], lease) == 2
    refs = [ChunkRef(_key(i), b) for i, b in enumerate(dst)]
    op = LoadOp("mx", "q-mx", lease, refs, CHUNK * 2, sync=True)
    read = threading.Event()
    # a forward not ordered after the scatter reads first (and sets `read`); one that is
    # waits for the scatter, held until the deadline
    _hold_scatters(monkeypatch, read, first_only=False)
    rig.worker.start_load_kv(OffloadMeta(loads=[op]))
    seen: list[list[torch.Tensor]] = []

    def forward() -> None:
        seen.extend(_blocks(rig.views, ids) for ids in dst)
        read.set()

    rig.ops.run_on_compute(forward).wait()
    assert [r.ok for r in rig.worker.take_report().results] == [True]
    for got, w in zip(seen, want, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(got, w, strict=True))


def test_a_sync_chunk_on_the_copy_engine_does_not_free_a_staging_buffer_a_scatter_reads(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sync chunks fragmented, run, run, fragmented, fragmented (2 staging buffers): the last
    one's copy into the first one's staging buffer waits for that chunk's scatter. A run of
    blocks uses no staging buffer, so it must not stand as the buffer's last reader (the copy
    overwrote the buffer while the first scatter still read it)."""
    from kvtier.offload import codec

    monkeypatch.setattr(codec, "_MAX_RUNS", 1)  # a chunk of 2 blocks in 2 runs is fragmented
    src = _save_step(rig)
    want = [_blocks(rig.views, b) for b in src[:5]]
    base = N * K

    def frag(i: int) -> list[int]:
        return [base + i * 2 * K + 2 * j for j in range(K)]

    def run(i: int) -> list[int]:
        return list(range(base + i * 2 * K, base + i * 2 * K + K))

    dst = [frag(0), run(1), run(2), frag(3), frag(4)]
    lease = "lk-ring"
    assert rig.worker.stack is not None
    assert rig.worker.stack.lookup([_key(i) for i in range(5)], lease) == 5
    refs = [ChunkRef(_key(i), b) for i, b in enumerate(dst)]
    op = LoadOp("rg", "q-rg", lease, refs, CHUNK * 5, sync=True)
    assert rig.worker._path is not None
    first = rig.worker._path.sync_loads._buffers[0].staging
    assert first is not None
    writes = [0]
    reused = threading.Event()
    real_copy = rig.ops._copy

    def counted_copy(dst: torch.Tensor, src: torch.Tensor, ready: float, ok: bool) -> float:
        done = real_copy(dst, src, ready, ok)
        if dst.untyped_storage().data_ptr() == first.untyped_storage().data_ptr():
            writes[0] += 1
            if writes[0] == 2:
                reused.set()
        return done

    monkeypatch.setattr(rig.ops, "_copy", counted_copy)
    # the first scatter waits: a copy that may overwrite its buffer does so meanwhile
    _hold_scatters(monkeypatch, reused, first_only=True)
    rig.worker.start_load_kv(OffloadMeta(loads=[op]))
    seen: list[list[torch.Tensor]] = []
    rig.ops.run_on_compute(lambda: seen.extend(_blocks(rig.views, ids) for ids in dst)).wait()
    assert [r.ok for r in rig.worker.take_report().results] == [True]
    for i, (got, w) in enumerate(zip(seen, want, strict=True)):
        assert all(torch.equal(a, b) for a, b in zip(got, w, strict=True)), f"chunk {i}"


def test_a_load_job_that_raises_lets_go_of_every_slot_it_was_reading(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A defect of kvtier's own in an async load's report (it raised on the lane) used to end
    the lane's job with chunks still in flight: their memory slots stayed pinned for good
    (never evicted, never reused), and their load never reported. The job now settles the
    lane, lets every one go and reports their load failed."""
    _save_step(rig)
    assert rig.worker._path is not None
    path = rig.worker._path.loads
    real = path._report
    raised = threading.Event()

    def report_once_broken(run: object) -> None:
        if not raised.is_set():
            raised.set()
            raise RuntimeError("a defect in the load's report (injected)")
        real(run)  # type: ignore[arg-type]

    monkeypatch.setattr(path, "_report", report_once_broken)
    # the first load's report runs as the job drains (the ring holds 2), with the second
    # load's one chunk still in flight behind it
    first = _load_op(rig, "lj", _chunks(N * K), sync=False)
    second = _load_op(rig, "lj2", _chunks(N * K), sync=False)
    second = LoadOp("lj2", "q-lj2", second.lookup_id, second.chunks[:1], CHUNK)
    rig.worker.start_load_kv(OffloadMeta(loads=[first, second]))
    memory = rig.worker.stack.memory  # type: ignore[union-attr]
    assert raised.wait(WAIT_S)
    deadline = time.monotonic() + 5.0
    while any(memory._readers) and time.monotonic() < deadline:
        rig.worker.wait_idle(0.05)  # a condition wait on the worker, bounded
    assert not any(memory._readers), memory._readers
    # the chunk still in flight failed its load, which reports (the first load's report was
    # the defect's: a deadline ends that one)
    results: dict[str, bool] = {}
    while "lj2" not in results and time.monotonic() < deadline:
        rig.worker.wait_idle(0.05)
        results.update((r.op_id, r.ok) for r in rig.worker.take_report().results)
    assert results == {"lj2": False}


def test_the_serial_design_keeps_one_transfer_in_flight_and_moves_the_same_bytes() -> None:
    """`transfer_depth: 1` is the design before the pipeline (kept for the bench's comparison):
    one chunk on the link at a time, the same bytes stored. The speed difference is the
    bench's to measure (`kvtier bench tier --device sim`), not a test's on a shared host."""
    for depth in (1, 2):
        for r in _rig(5_000, depth):
            src = _save_step(r)
            dp = r.worker._path
            assert dp is not None and dp.saves.peak_in_flight == depth
            want = [_blocks(r.views, b) for b in src]
            dst = _chunks(N * K)
            r.worker.start_load_kv(OffloadMeta(loads=[_load_op(r, "ld", dst, sync=False)]))
            assert r.worker.wait_idle(WAIT_S)
            assert r.worker.take_report().results[0].ok
            assert dp.loads.peak_in_flight == depth
            for ids, w in zip(dst, want, strict=True):
                assert all(torch.equal(a, b) for a, b in zip(_blocks(r.views, ids), w, strict=True))


def test_a_paths_peak_is_counted_before_it_reports(rig: Rig) -> None:
    """`wait_idle` returns once every op reported: a peak recorded only when the lane's job
    ended (after its reports) was read as 0 by whoever woke first (a flaky CI failure)."""
    dp = rig.worker._path
    assert dp is not None
    seen: list[tuple[str, int]] = []
    for name, path in (("save", dp.saves), ("load", dp.loads)):
        report = path._report
        path._report = lambda run, name=name, path=path, report=report: (  # type: ignore[method-assign]
            seen.append((name, path.peak_in_flight)), report(run))
    src = _save_step(rig)
    rig.worker.start_load_kv(
        OffloadMeta(loads=[_load_op(rig, "ld", _chunks(N * K), sync=False)]))
    assert rig.worker.wait_idle(WAIT_S)
    assert len(src) == N and seen == [("save", 2), ("save", 2), ("load", 2)]


def test_a_preempted_save_commits_nothing_on_the_simulated_device(rig: Rig) -> None:
    ids = _chunks(0)
    refs = [ChunkRef(_key(i), b) for i, b in enumerate(ids)]
    rig.worker.wait_for_save(OffloadMeta(saves=[SaveOp("r1#sv", "r1", refs, CHUNK * N)]))
    rig.worker.handle_preemptions({"r1"})
    assert rig.worker.wait_idle(WAIT_S)
    report = rig.worker.take_report()
    assert [(r.ok, r.reason) for r in report.results] == [(False, "preempted")]
    assert rig.worker.stack is not None
    # whatever was in flight when the cancel came never committed after it
    held = [i for i in range(N) if rig.worker.stack.memory.contains(_key(i))]
    assert len(held) < N


def test_close_keeps_the_arena_when_a_copy_is_still_in_flight(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import kvtier.offload.worker as worker_mod
    from kvtier.store.memory import MemoryTier

    abandoned: list[bool] = []
    monkeypatch.setattr(worker_mod, "_CLOSE_WAIT_S", 0.05)
    monkeypatch.setattr(MemoryTier, "abandon_arena", lambda self: abandoned.append(True))
    gen = _rig(1_000_000)  # 1 s a copy
    r = next(gen)
    try:
        _sync_load_now(r)
        r.worker.close()
        assert abandoned == [True]
    finally:
        r.ops.close()


def _sync_load_now(r: Rig) -> None:
    # a self-test chunk is resident: load it synchronously and close before it lands
    from kvtier.offload.selftest import SELF_TEST_KEY

    assert r.worker.stack is not None
    assert r.worker.stack.lookup([SELF_TEST_KEY], "lk") == 1
    op = LoadOp("ld", "q", "lk", [ChunkRef(SELF_TEST_KEY, [20, 21])], CHUNK, sync=True)
    r.worker.start_load_kv(OffloadMeta(loads=[op]))


def test_transfer_depth_outside_its_range_is_refused_naming_the_fix() -> None:
    from kvtier.config import KVTierConfig
    from kvtier.errors import ConfigError

    for bad in (0, 9):
        with pytest.raises(ConfigError, match=rf"transfer_depth={bad} is outside 1..8; use 2"):
            KVTierConfig(transfer_depth=bad)


@pytest.mark.parametrize("path", ["dma", "kernel"])
def test_a_device_fault_mid_pipeline_fails_the_save_and_commits_none_of_its_chunks(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """A copy (DMA path) or kernel (gather path) that fails on the device surfaces at the
    mark's wait (as CUDA reports an asynchronous error at the next synchronisation): the chunks
    behind it never commit, their slots go back, and the save reports failed."""
    from kvtier.offload.codec import PageCodec

    calls: list[int] = []
    if path == "dma":
        real_copy = SimOps._engine_copy

        def faulty_copy(self: SimOps, dst, src, ready, ok, to_host):  # type: ignore[no-untyped-def]
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("injected device fault")
            return real_copy(self, dst, src, ready, ok, to_host)

        monkeypatch.setattr(SimOps, "_engine_copy", faulty_copy)
    else:
        gather = PageCodec.gather

        def faulty(self: PageCodec, block_ids: list[int], dst: torch.Tensor) -> None:
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("injected device fault")
            gather(self, block_ids, dst)

        monkeypatch.setattr(PageCodec, "regions", lambda *a, **k: None)
        monkeypatch.setattr(PageCodec, "gather", faulty)
    ids = _chunks(0)
    refs = [ChunkRef(_key(i), b) for i, b in enumerate(ids)]
    rig.worker.wait_for_save(OffloadMeta(saves=[SaveOp("r1#sv", "r1", refs, CHUNK * N)]))
    assert rig.worker.wait_idle(WAIT_S)
    (result,) = rig.worker.take_report().results
    assert (result.ok, result.reason) == (False, "error:RuntimeError")
    stack = rig.worker.stack
    assert stack is not None
    # deepest first: the two chunks gathered before the fault committed, none after it
    held = [i for i in range(N) if stack.memory.contains(_key(i))]
    assert held == [N - 2, N - 1]
    assert stack.memory.stats().reserved == 0
