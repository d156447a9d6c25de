"""Review of the integer spans (`dma.Span`, `PageCodec.regions` / `wave_regions`, `dma.issue`)
and the memory tier's cached slot views: geometries and id patterns `test_dma_spans.py` leaves
out (several stacks of one allocation, kernel-block splits, single-segment stacks, the cache's
last block, one block a chunk), bytes around the buffer and the chunk's blocks untouched, wave
splits, the row split in both directions, what a queued span keeps alive, the slot views."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

from kvtier.metrics import Metrics
from kvtier.offload import dma
from kvtier.offload.codec import PageCodec
from kvtier.offload.device import CpuOps
from kvtier.offload.pages import KVCacheDescription, describe_pages
from kvtier.offload.simdevice import SimOps
from kvtier.offload.waves import plan_waves
from kvtier.store.memory import MemoryTier
from tests.offload.vllm_views import SUPPORTED, build, gqa, mla

NB, BS, G = 12, 16, 64  # blocks, tokens a block, guard bytes either side of a chunk buffer
NS = bytes(range(16))
DEADLINE_S = 30.0
SPECS = {
    "mla+indexer": lambda: mla(block_size=BS, indexer=True),  # two stacks of one allocation
    "one layer": lambda: gqa(num_layers=1, block_size=BS),  # a single-segment stack
    "gqa8": lambda: gqa(num_layers=8, block_size=BS),
}
GEOMETRIES = [(lay, s, None) for lay in SUPPORTED for s in SPECS] + [
    ("LBHNC", "gqa8", 4),  # kernel blocks of 4 tokens: 4 per manager block
    ("LBNHC", "mla+indexer", 8),
    ("BLHNC", "one layer", 8),  # a block-outer layout may split when a block is one page
]
IDS = {  # blocks_per_chunk follows from the length; -1: a load's HBM block
    "first block alone": [0],
    "last block alone": [NB - 1],
    "last blocks": [NB - 3, NB - 2, NB - 1],
    "four runs, descending": [NB - 1, 7, 3, 0],
    "skips around the last": [-1, NB - 1, -1, 0],
    "only one kept": [-1, -1, 5, -1],
}


def _codec(layout: str, spec: str, k: int, kb: int | None = None, ops=None):  # type: ignore[no-untyped-def]
    raw, views = build(SPECS[spec](), NB, layout, kernel_block_size=kb)
    raw.copy_(torch.randint(-128, 127, raw.shape, dtype=torch.int8, generator=_gen()))
    pages = describe_pages(KVCacheDescription(views, NB, BS, layout))
    return raw, pages, views, PageCodec(pages, k, ops or CpuOps())


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(41)


def _guarded(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A buffer of `n` bytes with `G` sentinel bytes either side (the whole, the buffer)."""
    whole = torch.full((n + 2 * G,), 0xA5, dtype=torch.uint8)
    return whole, whole[G : G + n]


def _guards_intact(whole: torch.Tensor) -> bool:
    return bool((whole[:G] == 0xA5).all() and (whole[-G:] == 0xA5).all())


@pytest.mark.parametrize("case", list(IDS))
@pytest.mark.parametrize(("layout", "spec", "kb"), GEOMETRIES)
def test_spans_move_the_codecs_bytes_and_nothing_else(
    layout: str, spec: str, kb: int | None, case: str
) -> None:
    ids = IDS[case]
    raw, pages, _, codec = _codec(layout, spec, len(ids), kb)
    if spec == "mla+indexer" and layout.startswith("L"):
        assert len(codec.stack_sizes()) == 2  # the geometry this case is here for
    if spec == "one layer":
        assert codec.stack_sizes() == [1]
    if -1 not in ids:  # toward the host: the gather's bytes, nothing around the buffer
        want = torch.zeros(codec.chunk_bytes, dtype=torch.uint8)
        codec.gather(ids, want)
        whole, buf = _guarded(codec.chunk_bytes)
        spans = codec.regions(ids, buf)
        assert spans is not None
        assert sum(s.nbytes for s in spans) == codec.chunk_bytes
        dma.issue(spans, True, dma.host_memcpy2d)
        assert torch.equal(buf, want) and _guards_intact(whole)
    # toward the KV cache: the scatter's bytes in the named blocks, every other block unchanged
    before, keep = raw.clone(), {b for b in ids if b >= 0}
    old = [s.view.clone() for s in pages.segments]  # row b: block b's bytes of a segment
    whole, src = _guarded(codec.chunk_bytes)
    src.copy_(torch.randint(0, 255, (codec.chunk_bytes,), dtype=torch.uint8, generator=_gen()))
    spans = codec.regions(ids, src, skips=True)
    assert spans is not None
    assert sum(s.nbytes for s in spans) == len(keep) * codec.bytes_per_block
    dma.issue(spans, False, dma.host_memcpy2d)
    got = raw.clone()
    new = [s.view.clone() for s in pages.segments]
    for o, n in zip(old, new, strict=True):
        for b in range(NB):
            assert torch.equal(o[b], n[b]) == (b not in keep), (b, ids)
    raw.copy_(before)
    assert codec.scatter(src, ids) == len(keep)
    assert torch.equal(got, raw) and _guards_intact(whole)


def test_more_than_four_runs_and_no_kept_block_are_the_boundaries() -> None:
    _, _, _, codec = _codec("LBNHC", "gqa8", 5)
    buf = torch.zeros(codec.chunk_bytes, dtype=torch.uint8)
    assert codec.regions([0, 2, 4, 6, 8], buf) is None  # five runs: the kernel path
    assert codec.regions([0, 2, 4, 6, 7], buf) is not None  # four
    assert codec.regions([-1] * 5, buf, skips=True) == []  # nothing to move, nothing queued
    with pytest.raises(ValueError, match="outside"):
        codec.regions([-1, 0, 1, 2, 3], buf)  # -1 only where a load leaves blocks out


@pytest.mark.parametrize("count", [2, 3, 8])
@pytest.mark.parametrize(("layout", "spec"), [("LBHNC", "gqa8"), ("LBNHC", "mla+indexer")])
def test_wave_spans_together_are_the_whole_chunk(layout: str, spec: str, count: int) -> None:
    ids = [-1, 4, 5, NB - 1]
    raw, pages, views, codec = _codec(layout, spec, len(ids))
    waves = plan_waves(pages, codec.stack_sizes(), list(views), count)
    assert waves is not None
    src = torch.randint(0, 255, (codec.chunk_bytes,), dtype=torch.uint8, generator=_gen())
    whole = codec.regions(ids, src, skips=True)
    per_wave = codec.wave_regions(ids, src, waves)
    assert whole is not None and per_wave is not None and len(per_wave) == waves.count
    flat = [s for w in per_wave for s in w]
    assert sum(s.nbytes for s in flat) == sum(s.nbytes for s in whole)
    # no row moved twice: every (kv address) row of a wave span is distinct
    rows = [(s.kv + i * s.kv_pitch, s.buf + i * s.buf_pitch) for s in flat for i in range(s.height)]
    assert len(set(rows)) == len(rows) == sum(s.height for s in whole)
    if count == 8 and spec == "gqa8":
        assert all(s.height == 1 for s in flat)  # a layer a wave: every span one row
    before = raw.clone()
    for w in per_wave:  # wave by wave, as a load issues them
        dma.issue(w, False, dma.host_memcpy2d)
    got = raw.clone()
    raw.copy_(before)
    dma.issue(whole, False, dma.host_memcpy2d)
    assert torch.equal(got, raw) and not torch.equal(got, before)


@pytest.mark.parametrize("to_host", [True, False])
def test_the_row_split_moves_the_same_bytes_both_ways(
    monkeypatch: pytest.MonkeyPatch, to_host: bool
) -> None:
    ids = [-1, 3, 4, NB - 1] if not to_host else [2, 3, 4, NB - 1]
    raw, _, _, codec = _codec("LBHNC", "mla+indexer", len(ids))
    src = torch.randint(0, 255, (codec.chunk_bytes,), dtype=torch.uint8, generator=_gen())
    whole_a, a = _guarded(codec.chunk_bytes)
    whole_b, b = _guarded(codec.chunk_bytes)
    a.copy_(src)
    b.copy_(src)
    before = raw.clone()
    spans = codec.regions(ids, a, skips=not to_host)
    assert spans is not None
    dma.issue(spans, to_host, dma.host_memcpy2d)
    direct = raw.clone()
    raw.copy_(before)
    calls: list[tuple[int, ...]] = []

    def record(*args: int) -> None:
        calls.append(args)
        dma.host_memcpy2d(*args)

    spans = codec.regions(ids, b, skips=not to_host)
    assert spans is not None
    monkeypatch.setattr(dma, "MAX_PITCH", min(s.kv_pitch for s in spans) - 1)
    dma.issue(spans, to_host, record)
    assert torch.equal(raw, direct) and torch.equal(a, b)
    assert _guards_intact(whole_a) and _guards_intact(whole_b)
    assert len(calls) == sum(s.height for s in spans)
    assert all(c[5] == 1 for c in calls)


def test_a_one_row_span_ignores_its_pitches(monkeypatch: pytest.MonkeyPatch) -> None:
    """A single-segment stack's pitch is the whole segment (any size): one row goes as one call
    with pitch = width, however far its rows would be apart."""
    raw, _, _, codec = _codec("BLNHC", "gqa8", 2)
    want = torch.zeros(codec.chunk_bytes, dtype=torch.uint8)
    codec.gather([NB - 1, 0], want)
    got = torch.zeros_like(want)
    spans = codec.regions([NB - 1, 0], got)
    assert spans is not None and all(s.height == 1 for s in spans)
    far = [s._replace(kv_pitch=1 << 40, buf_pitch=1 << 40) for s in spans]
    monkeypatch.setattr(dma, "MAX_PITCH", max(s.width for s in spans))
    calls: list[tuple[int, ...]] = []
    dma.issue(far, True, lambda *a: (calls.append(a), dma.host_memcpy2d(*a)))
    assert torch.equal(got, want)
    assert calls == [(s.buf, s.width, s.kv, s.width, s.width, 1) for s in spans]


def test_a_span_keeps_its_buffer_alive() -> None:
    _, _, _, codec = _codec("LBNHC", "gqa8", 2)
    buf = torch.zeros(codec.chunk_bytes, dtype=torch.uint8)
    alive = weakref.ref(buf)
    spans = codec.regions([1, 2], buf)
    parts = [s.rows(0, 1) for s in spans or []]
    del buf, spans
    gc.collect()
    assert alive() is not None  # a row range of a span keeps it too
    del parts
    gc.collect()
    assert alive() is None


def test_a_span_queued_on_the_simulated_engine_lands_after_its_tier_closed() -> None:
    """A save's spans wait behind the forward's fence; the tier closes meanwhile (without
    abandoning its arena). The queued copy must write memory its span keeps alive: the slot's
    bytes end up the gather's, and nothing holds the slot once the device stopped."""
    ops = SimOps()
    try:
        raw, _, _, codec = _codec("LBHNC", "mla+indexer", 3, ops=ops)
        ids = [NB - 1, 0, 1]
        want = torch.zeros(codec.chunk_bytes, dtype=torch.uint8)
        codec.gather(ids, want)
        tier = MemoryTier(codec.chunk_bytes, 2 * codec.chunk_bytes, NS, Metrics(rank=0),
                          pin_memory=False)  # fmt: skip
        slot = tier.reserve(b"k" * 16)
        assert slot is not None
        alive = weakref.ref(slot)
        gate = threading.Event()
        ops.run_on_compute(lambda: gate.wait(DEADLINE_S))  # the forward still runs
        lane = ops.lane()
        spans = codec.regions(ids, slot)
        assert spans is not None
        mark = lane.copy_regions(spans, to_host=True, fence=ops.fence())
        assert not mark.done()
        del slot, spans
        tier.close()
        gc.collect()
        kept = alive()
        assert kept is not None  # only the queued span holds the slot now
        gate.set()
        mark.wait()
        assert torch.equal(kept, want)
        assert ops.stats.copies == 2 * 2 and ops.stats.copy_bytes == codec.chunk_bytes
        del kept
    finally:
        ops.close()
    gc.collect()
    assert alive() is None  # let go once run (the stream thread holds its last item till then)


def _tier(slots: int = 3, slot: int = 64) -> MemoryTier:
    return MemoryTier(slot, slots * slot, NS, Metrics(rank=0), pin_memory=False)


def test_a_partial_commit_reads_its_length_and_a_whole_one_the_cached_view() -> None:
    tier = _tier()
    k, j = b"a" * 16, b"b" * 16
    slot = tier.reserve(k)
    assert slot is not None
    slot.copy_(torch.arange(64, dtype=torch.uint8))
    tier.commit(k, 10)
    with tier.pinned_view(k) as v:
        assert v is not None and v.numel() == 10 and v.tolist() == list(range(10))
        assert v is not slot and v.data_ptr() == slot.data_ptr()
    tier.delete(k)
    again = tier.reserve(j)  # the same slot, now published whole
    assert again is slot and again.numel() == 64
    again.fill_(7)
    tier.commit(j)
    with tier.pinned_view(j) as v:
        assert v is slot and bool((v == 7).all())
    tier.lease("l", [j])
    view = tier.view(j)
    assert view is slot
    tier.release("l")
    tier.close()
    assert all(v is None for v in tier._views)
    with pytest.raises(RuntimeError, match="closed"):
        tier.reserve(k)
    with pytest.raises(RuntimeError, match="closed"), tier.pinned_view(j):
        pass
    assert bool((slot == 7).all())  # a view handed out before the close still reads its bytes


def test_threads_reading_one_slot_at_once_all_see_its_bytes() -> None:
    tier = _tier(slots=2, slot=4096)
    k = b"c" * 16
    payload = torch.randint(0, 255, (4096,), dtype=torch.uint8, generator=_gen())
    assert tier.put(k, payload)
    start, errors, seen = threading.Barrier(8), [], []

    def read() -> None:
        try:
            start.wait(DEADLINE_S)
            for _ in range(50):
                with tier.pinned_view(k) as v:
                    assert v is not None and torch.equal(v, payload)
                    seen.append(v.data_ptr())
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=read) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    assert not any(t.is_alive() for t in threads) and errors == []
    assert len(seen) == 400 and len(set(seen)) == 1
    tier.close()
