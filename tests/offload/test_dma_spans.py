"""The 2-D copies a lane issues for a contiguous run (`PageCodec.regions`, `dma.issue`) are
integer spans: the same bytes as the codec's gather and scatter in every vLLM 0.32 layout, a
pitch past the runtime's cap split per row, and no torch op per chunk (issue 41, item 6: each
one let a thread running Python beside the lane take the GIL, up to a switch interval a time).
`host_memcpy2d` takes `cudaMemcpy2DAsync`'s arguments, so these run the CUDA lane's issue code
on host memory."""

from __future__ import annotations

import pytest
import torch

from kvtier.offload import dma
from kvtier.offload.device import CpuOps
from kvtier.offload.group_codec import codec_for
from kvtier.offload.pages import KVCacheDescription, describe_pages
from tests.offload.vllm_views import SUPPORTED, build, gqa, mla
from tests.torch_ops import TorchOps

NB, BS, K = 24, 16, 4  # blocks, tokens a block, blocks a chunk
CASES = {  # name: block ids of one chunk (-1: left out, a load's HBM block)
    "one run": [4, 5, 6, 7],
    "two runs": [9, 10, 2, 3],
    "four runs": [20, 1, 13, 7],
    "skips": [-1, -1, 11, 12],
}


def _codec(layout: str, specs=None):  # type: ignore[no-untyped-def]
    raw, views = build(specs or gqa(block_size=BS), NB, layout)
    raw.copy_(torch.randint(-128, 127, raw.shape, dtype=torch.int8))
    pages = describe_pages(KVCacheDescription(views, NB, BS, layout))
    return raw, codec_for(pages, K, CpuOps())


def _toward_host(codec, ids):  # type: ignore[no-untyped-def]
    """What the codec gathers for `ids`, an empty buffer, and the spans into that buffer."""
    want = torch.zeros(codec.chunk_bytes, dtype=torch.uint8)
    codec.gather(ids, want)
    got = torch.zeros_like(want)
    spans = codec.regions(ids, got)
    assert spans is not None
    return want, got, spans


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.cuda's stream (handle 0x5EED) and event classes replaced by inert ones."""

    class _Stream:
        cuda_stream = 0x5EED

        def __init__(self, device: object = None) -> None:
            pass

    class _Event:
        def __init__(self, blocking: bool = False) -> None:
            pass

        def record(self, stream: object = None) -> None:
            pass

    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "Event", _Event)


@pytest.mark.parametrize("specs", ["gqa", "mla"])
@pytest.mark.parametrize("layout", SUPPORTED)
@pytest.mark.parametrize("case", list(CASES))
def test_spans_move_the_bytes_the_codec_gathers_and_scatters(
    layout: str, case: str, specs: str
) -> None:
    raw, codec = _codec(layout, gqa(block_size=BS) if specs == "gqa" else mla(block_size=BS))
    ids = CASES[case]
    skips = -1 in ids
    if not skips:
        want, got, spans = _toward_host(codec, ids)
        dma.issue(spans, True, dma.host_memcpy2d)
        assert torch.equal(got, want)
    # toward the KV cache: only the named blocks change, to the scatter's bytes
    src = torch.randint(0, 255, (codec.chunk_bytes,), dtype=torch.uint8)
    expect = raw.clone()
    spans = codec.regions(ids, src, skips=skips)
    assert spans is not None
    dma.issue(spans, False, dma.host_memcpy2d)
    got_kv = raw.clone()
    raw.copy_(expect)
    codec.scatter(src, ids)
    assert torch.equal(got_kv, raw)
    assert not torch.equal(got_kv, expect)  # it wrote something


def test_a_pitch_over_the_cap_goes_row_by_row_with_the_same_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, codec = _codec("LBNHC")
    ids = CASES["two runs"]
    want, got, spans = _toward_host(codec, ids)
    assert all(s.height > 1 for s in spans)
    calls: list[tuple[int, ...]] = []

    def record(*args: int) -> None:
        calls.append(args)
        dma.host_memcpy2d(*args)

    monkeypatch.setattr(dma, "MAX_PITCH", spans[0].kv_pitch - 1)
    dma.issue(spans, True, record)
    assert torch.equal(got, want)
    assert len(calls) == sum(s.height for s in spans)
    assert all(c[5] == 1 and c[1] == c[3] == c[4] for c in calls)  # 1-D rows


def test_a_span_split_by_rows_moves_the_same_bytes_as_the_whole() -> None:
    _, codec = _codec("LBHNC", gqa(num_layers=8, block_size=BS))
    ids = CASES["one run"]
    want, got, spans = _toward_host(codec, ids)
    parts = [s.rows(r, r + 1) for s in spans for r in range(s.height)]
    assert sum(p.nbytes for p in parts) == sum(s.nbytes for s in spans)
    dma.issue(parts, True, dma.host_memcpy2d)
    assert torch.equal(got, want)


@pytest.mark.parametrize("layout", SUPPORTED)
def test_a_chunks_spans_are_made_without_a_torch_op(layout: str) -> None:
    """Before: a slice, a view and two as_strided per stack and run, each a GIL release; under
    a forward running Python each cost the lane up to a switch interval (3 ms measured at 5)."""
    _, codec = _codec(layout)
    buf = torch.zeros(codec.chunk_bytes, dtype=torch.uint8)
    with TorchOps() as seen:
        spans = codec.regions(CASES["two runs"], buf)
        skipped = codec.regions(CASES["skips"], buf, skips=True)
    assert spans and skipped
    assert seen.ops == []


def test_a_buffer_of_the_wrong_shape_is_refused_naming_its_size() -> None:
    _, codec = _codec("LBNHC")
    with pytest.raises(ValueError, match=r"contiguous uint8 of \d+ bytes, got torch.uint8 of 8"):
        codec.regions(CASES["one run"], torch.zeros(8, dtype=torch.uint8))
    strided = torch.zeros(2 * codec.chunk_bytes, dtype=torch.uint8)[::2]
    with pytest.raises(ValueError, match="contiguous uint8"):
        codec.regions(CASES["one run"], strided)


def test_the_cuda_lane_issues_each_span_as_cudamemcpy2dasync_on_its_copy_stream(
    monkeypatch: pytest.MonkeyPatch, fake_cuda: None
) -> None:
    """The CUDA lane's own code with the runtime's function replaced by one that copies host
    memory: the arguments in `cudaMemcpy2DAsync`'s order, the copy stream's handle, the right
    bytes; an error code raises naming the runtime's message."""
    from kvtier.offload.device import CudaOps

    calls: list[tuple[int, ...]] = []
    failing = [False]

    def memcpy2d(d, dp, s, sp, w, h, kind, handle):  # type: ignore[no-untyped-def]
        calls.append((kind, handle.value))
        if failing[0]:
            return 11  # cudaErrorInvalidValue
        dma.host_memcpy2d(d, dp, s, sp, w, h)
        return 0

    monkeypatch.setattr(dma, "_memcpy2d", memcpy2d)
    monkeypatch.setattr(dma, "_memcpy2d_held", None)  # pageable host memory: never used
    monkeypatch.setattr(dma, "_error_string", lambda code: b"invalid argument")
    ops = CudaOps(torch.device("cuda", 0))
    assert ops.dma
    lane = ops.lane()
    _, codec = _codec("LBNHC")
    ids = CASES["two runs"]
    want, got, spans = _toward_host(codec, ids)
    lane.copy_regions(spans, to_host=True)
    assert torch.equal(got, want)
    assert calls == [(dma.CUDA_MEMCPY_DEFAULT, 0x5EED)] * len(spans)
    failing[0] = True
    with pytest.raises(RuntimeError, match=r"cudaMemcpy2DAsync of \d+ x \d+ bytes failed: 11 "
                                           r"\(invalid argument\)"):  # fmt: skip
        lane.copy_regions(spans, to_host=True)


@pytest.mark.parametrize("locked", [False, True])
def test_the_cuda_lane_issues_holding_the_gil_only_when_the_arena_is_page_locked(
    monkeypatch: pytest.MonkeyPatch, fake_cuda: None, locked: bool
) -> None:
    """From page-locked memory `cudaMemcpy2DAsync` only queues the copy, so the lane makes the
    call without releasing the GIL (ctypes.PyDLL's binding); from pageable memory the call
    copies, and it must release it. The worker tells the ops which it is."""
    from kvtier.offload.device import CudaOps
    from kvtier.store.memory import MemoryTier
    from tests.offload.test_worker import config, rank0

    used: list[str] = []

    def binding(name: str):  # type: ignore[no-untyped-def]
        def call(d, dp, s, sp, w, h, kind, handle):  # type: ignore[no-untyped-def]
            used.append(name)
            dma.host_memcpy2d(d, dp, s, sp, w, h)
            return 0

        return call

    monkeypatch.setattr(dma, "_memcpy2d", binding("released"))
    monkeypatch.setattr(dma, "_memcpy2d_held", binding("held"))
    monkeypatch.setattr(dma, "_error_string", lambda code: b"")

    # what the worker tells the ops: its memory tier's arena, page-locked or not
    told: list[bool] = []

    class _Recording(CpuOps):
        def host_locked(self, value: bool) -> None:
            told.append(value)

    monkeypatch.setattr(MemoryTier, "page_locked", property(lambda self: locked))
    _, views = build(gqa(block_size=BS), NB, "LBNHC")
    worker = rank0(config(), _Recording())
    try:
        worker.register_kv_caches(KVCacheDescription(views, NB, BS, "LBNHC"))
    finally:
        worker.close()
    assert told == [locked]

    ops = CudaOps(torch.device("cuda", 0))
    ops.host_locked(told[0])
    lane = ops.lane()
    _, codec = _codec("BLHNC")
    want, got, spans = _toward_host(codec, CASES["one run"])
    lane.copy_regions(spans, to_host=True)
    assert torch.equal(got, want)
    assert used == ["held" if locked else "released"] * len(spans)
