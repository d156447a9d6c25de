"""Layer-by-layer sync loads on the simulated device: the copies go wave by wave (every chunk's
first layers, then the next ones), a layer's `wait_for_layer_load` joins only the waves that
hold its pages, so the forward computes layer 0 while later layers are still on the link, and
every layer still reads its loaded bytes. A forward that skips a layer's call gets the waves
joined after it and the plan turned off; layouts where a page holds every layer get no plan."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from kvtier.errors import ConfigError
from kvtier.offload.device import CpuOps
from kvtier.offload.messages import ChunkRef, LoadOp, OffloadMeta, SaveOp
from kvtier.offload.pages import KVCacheDescription, describe_pages, manager_view
from kvtier.offload.simdevice import CopyModel, SimEvent, SimOps, _Item, _SimLane
from kvtier.offload.waves import plan_waves
from kvtier.offload.worker import OffloadWorker
from tests.offload.test_worker import BS, CHUNK, WAIT_S, config, rank0
from tests.offload.vllm_views import build, gqa

NB = 64
LAYERS = 8
K = CHUNK // BS
N = 4  # chunks in the load
WAVES = 4


def _views(layout: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    raw, views = build(gqa(num_layers=LAYERS, block_size=BS), NB, layout)
    gen = torch.Generator().manual_seed(5)
    raw.copy_(torch.randint(-128, 127, raw.shape, generator=gen, dtype=torch.int8))
    return raw, views


@pytest.fixture
def rig() -> Iterator[tuple[OffloadWorker, SimOps, dict[str, torch.Tensor]]]:
    # slow copies, little latency each: the link, not the per-copy cost, is what waves hide
    ops = SimOps(CopyModel(gbps=0.05, latency_us=10))
    _, views = _views("LBNHC")
    worker = rank0(config(memory_bytes="1MiB"), ops)  # type: ignore[arg-type]
    worker.register_kv_caches(KVCacheDescription(views, NB, BS, "LBNHC"))
    try:
        yield worker, ops, views
    finally:
        worker.close()
        ops.close()


def _layer(views: dict[str, torch.Tensor], name: str, ids: list[int]) -> list[torch.Tensor]:
    return [manager_view(views[name], NB)[b].clone().view(torch.uint8) for b in ids]


def _save_and_clear(worker: OffloadWorker, views: dict[str, torch.Tensor]) -> tuple[
    list[list[int]], dict[str, list[list[torch.Tensor]]]
]:  # fmt: skip
    src = [list(range(c * K, (c + 1) * K)) for c in range(N)]
    refs = [ChunkRef(bytes([0x70 + c]) * 16, b) for c, b in enumerate(src)]
    worker.wait_for_save(OffloadMeta(saves=[SaveOp("w#sv", "w", refs, CHUNK * N)]))
    assert worker.wait_idle(WAIT_S)
    assert [r.ok for r in worker.take_report().results] == [True]
    want = {name: [_layer(views, name, b) for b in src] for name in views}
    dst = [[b + N * K for b in ids] for ids in src]
    for v in views.values():
        for b in (b for ids in dst for b in ids):
            manager_view(v, NB)[b].zero_()
    return dst, want


def _sync_load(worker: OffloadWorker, dst: list[list[int]], op_id: str) -> LoadOp:
    keys = [bytes([0x70 + c]) * 16 for c in range(N)]
    assert worker.stack is not None
    assert worker.stack.lookup(keys, f"lk-{op_id}") == N
    refs = [ChunkRef(k, b) for k, b in zip(keys, dst, strict=True)]
    return LoadOp(op_id, f"q-{op_id}", f"lk-{op_id}", refs, CHUNK * N, sync=True)


def test_layer_zero_computes_while_the_last_wave_is_on_the_link_and_every_layer_reads_its_bytes(
    rig: tuple[OffloadWorker, SimOps, dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch
) -> None:
    worker, ops, views = rig
    names = list(views)
    assert worker.enable_layer_waves(names)
    dst, want = _save_and_clear(worker, views)
    # the last wave's copies wait for a gate that layer 0's compute opens (or a 2 s deadline:
    # a forward that waited for every wave before layer 0 would otherwise never start)
    gate = SimEvent(ops)
    deadline = threading.Timer(2.0, lambda: gate.done() or gate._complete(time.monotonic()))
    deadline.start()
    calls = [0]
    real = _SimLane.copy_regions

    def gated(self: _SimLane, pieces, to_host, fence=None):  # type: ignore[no-untyped-def]
        if calls[0] == (WAVES - 1) * N:
            self.copies.put(_Item("wait", None, dep=gate))
        calls[0] += 1
        return real(self, pieces, to_host, fence)

    monkeypatch.setattr(_SimLane, "copy_regions", gated)
    joins = ops.stats.joins["MainThread"]
    worker.start_load_kv(OffloadMeta(loads=[_sync_load(worker, dst, "ld")]))
    assert calls[0] == WAVES * N  # every chunk once per wave
    assert ops.stats.joins["MainThread"] == joins  # nothing joined before the forward
    seen: dict[str, list[list[torch.Tensor]]] = {}
    last_unloaded: list[bool] = []

    def compute(name: str, first: bool) -> None:
        seen[name] = [_layer(views, name, ids) for ids in dst]
        if first:
            # the last layer's pages are still on the link while layer 0 computes
            last = _layer(views, names[-1], dst[-1])
            last_unloaded.append(all(int(t.abs().sum()) == 0 for t in last))
            gate._complete(time.monotonic())

    for i, name in enumerate(names):
        worker.wait_for_layer_load(name)
        ops.run_on_compute(lambda name=name, i=i: compute(name, i == 0))
    ops.compute.record().wait()
    deadline.cancel()
    worker.wait_for_save(OffloadMeta())
    assert last_unloaded == [True]
    # one join per wave, each by the first layer that reads it
    assert ops.stats.joins["MainThread"] - joins == WAVES
    for name in names:
        for got, w in zip(seen[name], want[name], strict=True):
            assert all(torch.equal(a, b) for a, b in zip(got, w, strict=True)), name
    assert [r.ok for r in worker.take_report().results] == [True]


def test_a_forward_that_skips_a_layers_call_gets_the_waves_joined_after_it_and_waves_off(
    rig: tuple[OffloadWorker, SimOps, dict[str, torch.Tensor]], caplog: pytest.LogCaptureFixture
) -> None:
    worker, ops, views = rig
    names = list(views)
    assert worker.enable_layer_waves(names)
    dst, _ = _save_and_clear(worker, views)
    worker.start_load_kv(OffloadMeta(loads=[_sync_load(worker, dst, "ld1")]))
    worker.wait_for_layer_load(names[0])  # a host that announces layer 0 only
    joins = ops.stats.joins["MainThread"]
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        worker.wait_for_save(OffloadMeta())
    assert ops.stats.joins["MainThread"] - joins == WAVES - 1  # the waves left, joined now
    assert "without wait_for_layer_load" in caplog.text
    # from now on one join before the forward, as without waves
    worker.start_load_kv(OffloadMeta(loads=[_sync_load(worker, dst, "ld2")]))
    assert ops.stats.joins["MainThread"] - joins == WAVES
    ops.synchronize()
    assert all(r.ok for r in worker.take_report().results)


def test_no_plan_where_a_page_holds_every_layer_or_the_device_copies_synchronously() -> None:
    _, views = _views("BLHNC")  # cross-layer: one page per block for all layers
    pages = describe_pages(KVCacheDescription(views, NB, BS, "BLHNC"))
    assert plan_waves(pages, [len(pages.segments)], list(views), WAVES) is None
    _, views = _views("LBNHC")
    pages = describe_pages(KVCacheDescription(views, NB, BS, "LBNHC"))
    plan = plan_waves(pages, [len(pages.segments)], list(views), WAVES)
    assert plan is not None
    # consecutive layers, two per wave; every layer complete after its own wave
    assert [plan.of_layer[n] for n in views] == [0, 0, 1, 1, 2, 2, 3, 3]
    cpu = rank0(config(memory_bytes="1MiB"), CpuOps())
    try:
        cpu.register_kv_caches(KVCacheDescription(views, NB, BS, "LBNHC"))
        assert not cpu.enable_layer_waves(list(views))
    finally:
        cpu.close()
    # load_waves: 1 turns them off on a device that could have them
    ops = SimOps(CopyModel(gbps=1.0))
    one = rank0(config(memory_bytes="1MiB", load_waves=1), ops)  # type: ignore[arg-type]
    try:
        one.register_kv_caches(KVCacheDescription(views, NB, BS, "LBNHC"))
        assert not one.enable_layer_waves(list(views))
    finally:
        one.close()
        ops.close()
    with pytest.raises(ConfigError, match="load_waves"):
        config(load_waves=0)
