"""OffloadWorker on a vLLM-shaped KV cache: the whole save/load path and the self-test run under
the device-separation harness; saves leave `wait_for_save`; preemption cancels in-flight saves;
the self-test stops startup when the codec cannot move a block; lanes bind the rank's device."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest
import torch
from prometheus_client import CollectorRegistry

from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError, StartupError
from kvtier.metrics import Metrics
from kvtier.offload.codec import PageCodec
from kvtier.offload.device import CpuOps, CudaOps, Lane, Mark
from kvtier.offload.messages import ChunkRef, LoadOp, OffloadMeta, SaveOp
from kvtier.offload.pages import KVCacheDescription, manager_view
from kvtier.offload.selftest import SELF_TEST_KEY
from kvtier.offload.worker import PREEMPTED, OffloadWorker
from tests.offload.separation import DeviceSeparation, TaggedOps
from tests.offload.vllm_views import build, gqa

NB, BS, CHUNK = 12, 16, 32
KEY_A, KEY_B = b"a" * 16, b"b" * 16
WAIT_S = 30.0


class GatedOps(TaggedOps):
    """Save-lane device work waits for `gate` (a test hook on the device, not in the worker)."""

    def __init__(self, mode: DeviceSeparation) -> None:
        super().__init__(mode)
        self.gate = threading.Event()
        self.gate.set()
        self.waiting = threading.Event()

    def lane(self) -> Lane:
        ops = self
        inner = super().lane()

        class _Gated:
            def active(self):  # type: ignore[no-untyped-def]
                return inner.active()

            def after(self, fence: object | None) -> None:
                inner.after(fence)

            def launch(self, fn: Callable[[], object], after: Mark | None = None) -> Mark:
                if threading.current_thread().name.startswith("kvtier-save"):
                    ops.waiting.set()
                    assert ops.gate.wait(WAIT_S), "gate never opened"
                return inner.launch(fn, after)

            def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Mark | None = None) -> Mark:
                return inner.copy(dst, src, after)

            def finish(self) -> None:
                inner.finish()

        return _Gated()


def config(**kw: object) -> KVTierConfig:
    return KVTierConfig.from_dict({"memory_bytes": "8MiB", "chunk_size": CHUNK, **kw})


def rank0(cfg: KVTierConfig, ops: TaggedOps, **kw: object) -> OffloadWorker:
    """A world-1 worker on `ops`, with metrics of its own and no lookup server."""
    return OffloadWorker(
        cfg,
        rank=0,
        world=1,
        model_id="m",
        metrics=Metrics(rank=0, registry=CollectorRegistry()),
        lookup_endpoint=None,
        ops=ops,
        **kw,  # type: ignore[arg-type]
    )


@pytest.fixture
def rig() -> Iterator[tuple[OffloadWorker, GatedOps, dict[str, torch.Tensor]]]:
    mode = DeviceSeparation()
    ops = GatedOps(mode)
    raw, views = build(gqa(block_size=BS), NB, "LBNHC")
    g = torch.Generator().manual_seed(5)
    raw.copy_(torch.randint(-60, 60, raw.shape, generator=g, dtype=torch.int8))
    mode.tag(raw)
    worker = rank0(config(), ops)
    with mode:
        worker.register_kv_caches(KVCacheDescription(views, NB, BS, "LBNHC"))
        yield worker, ops, views
    worker.close()


def blocks(views: dict[str, torch.Tensor], ids: list[int]) -> list[torch.Tensor]:
    # host copies through an explicit copy: the harness refuses device bytes in host ops
    out = []
    for v in views.values():
        rows = manager_view(v, NB)
        for b in ids:
            host = torch.empty(rows[b].shape, dtype=rows[b].dtype)
            host.copy_(rows[b])
            out.append(host.view(torch.uint8))  # bytes: random bits make NaNs
    return out


def save(worker: OffloadWorker, req: str, key: bytes, ids: list[int]) -> None:
    op = SaveOp(f"{req}#sv", req, [ChunkRef(key, ids)], CHUNK)
    worker.wait_for_save(OffloadMeta(saves=[op]))


def test_save_then_load_moves_real_blocks_under_the_harness(rig) -> None:  # type: ignore[no-untyped-def]
    worker, ops, views = rig
    assert worker.stack is not None
    # the self-test left its chunk for the scheduler's lookup, and every block as it was
    assert worker.stack.memory.contains(SELF_TEST_KEY)
    want = blocks(views, [3, 4])
    save(worker, "r1", KEY_A, [3, 4])
    assert worker.wait_idle(WAIT_S)
    report = worker.take_report()
    assert [(r.ok, r.nbytes) for r in report.results] == [(True, worker.codec.chunk_bytes)]
    # the first report carries the self-test's load through the real path, once (the
    # scheduler's load gate starts from it)
    tokens, seconds = report.selftest_load or (0, 0.0)
    assert tokens == CHUNK and seconds > 0
    assert worker.stack.lookup([KEY_A], "lk1") == 1
    load = LoadOp("r2#ld", "r2", "lk1", [ChunkRef(KEY_A, [9, 8])], CHUNK)
    worker.start_load_kv(OffloadMeta(loads=[load]))
    assert worker.wait_idle(WAIT_S)
    report = worker.take_report()
    assert report.finished_recving == ["r2"] and report.results[0].ok
    assert report.selftest_load is None
    assert all(torch.equal(a, b) for a, b in zip(blocks(views, [9, 8]), want, strict=True))
    # both lanes bound the device in their own thread (CUDA: set_device there)
    assert {"kvtier-load-0", "kvtier-save-0"} <= set(ops.bound)
    assert ops.mode.checked > 100


def test_wait_for_save_returns_while_the_copy_is_still_gated(rig) -> None:  # type: ignore[no-untyped-def]
    worker, ops, views = rig
    ops.gate.clear()
    save(worker, "r1", KEY_A, [3, 4])
    assert ops.waiting.wait(WAIT_S)
    # the next step runs: its report has no save yet, and a load goes through meanwhile
    assert worker.take_report().results == []
    assert worker.stack.lookup([SELF_TEST_KEY], "lk") == 1
    load = LoadOp("r2#ld", "r2", "lk", [ChunkRef(SELF_TEST_KEY, [10, 11])], CHUNK)
    worker.start_load_kv(OffloadMeta(loads=[load], delayed_free=["r1"]))
    deadline = threading.Event()
    for _ in range(300):
        report = worker.take_report()
        if report.finished_recving:
            break
        deadline.wait(0.01)
    assert report.finished_recving == ["r2"]
    # r1's blocks stay held while its save is in flight
    assert "r1" not in report.finished_sending
    ops.gate.set()
    assert worker.wait_idle(WAIT_S)
    report = worker.take_report()
    assert [r.ok for r in report.results] == [True] and report.finished_sending == ["r1"]
    assert worker.stack.memory.contains(KEY_A)


def test_preemption_during_an_in_flight_save_commits_nothing(rig) -> None:  # type: ignore[no-untyped-def]
    worker, ops, views = rig
    ops.gate.clear()
    save(worker, "r1", KEY_A, [3, 4])
    assert ops.waiting.wait(WAIT_S)
    worker.handle_preemptions({"r1"})
    # the host reuses the blocks at once
    for v in views.values():
        manager_view(v, NB)[3].zero_()
    ops.gate.set()
    assert worker.wait_idle(WAIT_S)
    report = worker.take_report()
    assert [(r.ok, r.reason) for r in report.results] == [(False, PREEMPTED)]
    assert not worker.stack.memory.contains(KEY_A)
    # a save that had committed before the preemption keeps its chunk
    save(worker, "r3", KEY_B, [5, 6])
    assert worker.wait_idle(WAIT_S)
    worker.handle_preemptions({"r3"})
    assert worker.take_report().results[0].ok and worker.stack.memory.contains(KEY_B)


def test_a_save_cancelled_by_op_id_commits_nothing_and_spares_the_others(rig) -> None:  # type: ignore[no-untyped-def]
    worker, ops, views = rig
    ops.gate.clear()
    # two saves of one request in flight; the host hands one's blocks out (cancel_saves)
    a = SaveOp("a", "r1", [ChunkRef(KEY_A, [3, 4])], CHUNK)
    b = SaveOp("b", "r1", [ChunkRef(KEY_B, [5, 6])], CHUNK)
    worker.wait_for_save(OffloadMeta(saves=[a, b]))
    assert ops.waiting.wait(WAIT_S)
    worker.handle_preemptions((), ["a"])
    ops.gate.set()
    assert worker.wait_idle(WAIT_S)
    results = {r.op_id: (r.ok, r.reason) for r in worker.take_report().results}
    assert results == {"a": (False, PREEMPTED), "b": (True, "")}
    assert not worker.stack.memory.contains(KEY_A) and worker.stack.memory.contains(KEY_B)


def test_sync_load_is_in_the_blocks_when_start_load_kv_returns(rig, caplog) -> None:  # type: ignore[no-untyped-def]
    worker, ops, views = rig
    want = blocks(views, [3, 4])
    save(worker, "r1", KEY_A, [3, 4])
    assert worker.wait_idle(WAIT_S)
    worker.take_report()
    assert worker.stack.lookup([KEY_A], "lk1") == 1
    # the load lane is stuck behind nothing of ours: a sync load never goes through it
    load = LoadOp("r2#ld", "r2", "lk1", [ChunkRef(KEY_A, [9, 8])], CHUNK, sync=True)
    with caplog.at_level("INFO", logger="kvtier"):
        worker.start_load_kv(OffloadMeta(loads=[load]))
    # no wait: the forward that follows start_load_kv reads these blocks
    assert all(torch.equal(a, b) for a, b in zip(blocks(views, [9, 8]), want, strict=True))
    report = worker.take_report()
    # its request runs in this step, so it is never finished_recving; the scheduler gets its result
    assert report.finished_recving == [] and report.invalid_block_ids == []
    assert [(r.op_id, r.ok) for r in report.results] == [("r2#ld", True)]
    lines = [r for r in caplog.records if "Retrieved" in r.getMessage()]
    assert len(lines) == 1
    line = lines[0].getMessage()
    assert line.startswith("kvtier[rank 0/1]: Retrieved 32 of 32 required tokens (")
    assert line.endswith(", in the forward)")
    assert lines[0].threadName == threading.current_thread().name  # not the load lane
    # counted once, when the agreed terminal arrives (a repeat of it counts nothing)
    assert worker.metrics.value("retrieved_tokens_total") == 0
    worker.start_load_kv(OffloadMeta(load_terminals={"r2#ld": True}))
    worker.start_load_kv(OffloadMeta(load_terminals={"r2#ld": True}))
    assert worker.metrics.value("retrieved_tokens_total") == CHUNK
    # the load released its lease: releasing it again is a counted no-op
    worker.stack.release("lk1")
    assert worker.metrics.value("lease_double_releases_total") == 1


def test_failed_sync_load_reports_its_blocks_in_its_own_step(rig) -> None:  # type: ignore[no-untyped-def]
    worker, ops, views = rig
    assert worker.stack.lookup([KEY_B], "lk1") == 0
    load = LoadOp("r2#ld", "r2", "lk1", [ChunkRef(KEY_B, [9, 8])], CHUNK, sync=True)
    worker.start_load_kv(OffloadMeta(loads=[load]))
    report = worker.take_report()
    # the host recomputes the request from its first bad block, in the step that follows
    assert sorted(report.invalid_block_ids) == [8, 9]
    assert report.finished_recving == []
    assert [(r.ok, r.reason) for r in report.results] == [(False, "miss")]
    assert worker.metrics.value("load_failures_total", reason="miss") == 1


@pytest.mark.parametrize("fault", ["drop", "raise"])
def test_the_self_test_stops_startup_when_the_codec_cannot_move_a_block(
    fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: PageCodec, src: torch.Tensor, block_ids: list[int]) -> int:
        if fault == "raise":
            raise RuntimeError("injected codec fault")
        return 0

    monkeypatch.setattr(PageCodec, "scatter", broken)
    mode = DeviceSeparation()
    raw, views = build(gqa(block_size=BS), NB, "BLHNC")
    mode.tag(raw)
    worker = OffloadWorker(
        config(),
        rank=1,
        world=2,
        model_id="m",
        metrics=Metrics(rank=1, registry=CollectorRegistry()),
        lookup_endpoint=None,
        ops=TaggedOps(mode),
    )
    match = r"kvtier\[rank 1/2\]: self-test failed on device cpu, KV layout BLHNC"
    with mode, pytest.raises(StartupError, match=match):
        worker.register_kv_caches(KVCacheDescription(views, NB, BS, "BLHNC"))
    assert worker.stack is None  # closed: nothing half-built serves


def test_cuda_lanes_bind_the_ranks_device(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(d))
    ops = CudaOps(torch.device("cuda", 3))
    t = threading.Thread(target=ops.bind_thread)
    t.start()
    t.join()
    assert calls == [torch.device("cuda", 3)]


def test_a_tier_over_the_hosts_ram_is_refused_before_anything_is_allocated() -> None:
    raw, views = build(gqa(block_size=BS), NB, "LBHNC")
    worker = OffloadWorker(
        KVTierConfig.from_dict({"memory_bytes": "1TiB", "chunk_size": CHUNK}),
        rank=0,
        world=8,
        model_id="m",
        metrics=Metrics(rank=0, registry=CollectorRegistry()),
        lookup_endpoint=None,
        ranks_on_host=8,
    )
    with pytest.raises(ConfigError, match=r"memory_bytes=1TiB per rank x 8 rank\(s\)"):
        worker.register_kv_caches(KVCacheDescription(views, NB, BS, "LBHNC"))
    assert worker.stack is None


def test_a_zero_copy_load_holds_its_slot_until_the_scatter_copied_it() -> None:
    """A CPU load scatters straight from the memory tier's slot. Only the lookup's lease kept
    that slot, and a lease can expire (or be pushed out by max_leases) while the scatter runs:
    the slot was then free to be reused by another chunk, and the KV blocks got its bytes."""
    # host KV blocks and the CPU's own ops: the load scatters from the slot, no staging copy
    raw, views = build(gqa(block_size=BS), NB, "LBNHC")
    raw.copy_(torch.randint(-60, 60, raw.shape, generator=torch.Generator().manual_seed(9),
                            dtype=torch.int8))  # fmt: skip
    worker = rank0(config(memory_bytes="64KiB"), CpuOps())
    worker.register_kv_caches(KVCacheDescription(views, NB, BS, "LBNHC"))
    try:
        stack, codec = worker.stack, worker.codec
        assert stack is not None and codec is not None
        want = blocks(views, [3, 4])
        save(worker, "r1", KEY_A, [3, 4])
        assert worker.wait_idle(WAIT_S)
        worker.take_report()
        assert stack.lookup([KEY_A], "lk1") == 1
        entered, proceed = threading.Event(), threading.Event()
        scatter = codec.scatter

        def held_scatter(src: torch.Tensor, block_ids: list[int]) -> None:
            entered.set()
            assert proceed.wait(WAIT_S), "the test never let the scatter go on"
            scatter(src, block_ids)

        codec.scatter = held_scatter  # type: ignore[method-assign]
        load = LoadOp("ld1", "r2", "lk1", [ChunkRef(KEY_A, [9, 8])], CHUNK)
        worker.start_load_kv(OffloadMeta(loads=[load]))
        assert entered.wait(WAIT_S)
        # mid-scatter: the lease ends, and chunks used more often than A take every slot the
        # tier can give (each is touched twice, so A is the policy's oldest frequent entry)
        stack.release("lk1")
        memory = stack.memory
        for i in range(4 * memory.num_slots):
            key = bytes([0xEE, i]) * 8
            slot = memory.reserve(key)
            if slot is None:
                continue
            slot.fill_(0x55)
            memory.commit(key)
            memory.touch([key])
            memory.touch([key])
        evicted = not memory.contains(KEY_A)
        proceed.set()
        assert worker.wait_idle(WAIT_S)
        report = worker.take_report()
        assert [r.ok for r in report.results] == [True]
        assert all(torch.equal(a, b) for a, b in zip(blocks(views, [9, 8]), want, strict=True))
        # the scatter's pin kept A's slot: A could not even be evicted while it was read
        assert not evicted
    finally:
        worker.close()
