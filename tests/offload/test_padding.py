"""Page padding: bytes inside a block's stride that no page covers (vLLM pads some groups'
pages up to a common size; a backend may keep data there). kvtier does not move them, so the
startup self-test writes sentinels into the padding of the blocks it saves and loads and stops
startup when a save or load wrote there; the padding is restored afterwards."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry

from kvtier.errors import StartupError
from kvtier.metrics import Metrics
from kvtier.offload import selftest
from kvtier.offload.codec import PageCodec
from kvtier.offload.device import CpuOps
from kvtier.offload.pages import KVCacheDescription, describe_pages
from kvtier.offload.simdevice import SimOps
from kvtier.offload.worker import OffloadWorker
from tests.offload.test_worker import config

NB, BS, HEADS, C = 12, 16, 2, 32  # C: content bytes per token and head
PAGE = HEADS * BS * C
STRIDE = PAGE + 256  # 256 bytes of padding after every block's page


def padded() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    raw = torch.randint(-128, 127, (NB * STRIDE,), dtype=torch.int8,
                        generator=torch.Generator().manual_seed(4))  # fmt: skip
    layer = torch.as_strided(raw, (NB, HEADS, BS, C), (STRIDE, BS * C, C, 1))
    return raw, {"model.layers.0.self_attn.attn": layer.view(torch.bfloat16)}


def _worker(ops) -> OffloadWorker:  # type: ignore[no-untyped-def]
    return OffloadWorker(
        config(),
        rank=0,
        world=1,
        model_id="m",
        metrics=Metrics(rank=0, registry=CollectorRegistry()),
        lookup_endpoint=None,
        ops=ops,
    )


def test_the_padding_of_a_block_is_found_inside_its_stride() -> None:
    _, views = padded()
    pages = describe_pages(KVCacheDescription(views, NB, BS, "LBHNC"))
    pads = selftest.padding(pages, [0, 3])
    assert [(p.block, p.start, p.length) for p in pads] == [
        (0, PAGE, 256),
        (3, 3 * STRIDE + PAGE, 256),
    ]


@pytest.mark.parametrize("backend", ["cpu", "sim"])
def test_the_self_test_writes_sentinels_into_padding_and_restores_it(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    raw, views = padded()
    before = raw.clone()
    checked: list[int] = []
    check = selftest._check_padding

    def counted(pads, src):  # type: ignore[no-untyped-def]
        checked.append(len(pads))
        # the sentinels are in place when the check runs
        assert {int(p.bytes()[0]) for p in pads} == {selftest.SRC_SENTINEL, selftest.DST_SENTINEL}
        check(pads, src)

    monkeypatch.setattr(selftest, "_check_padding", counted)
    ops = CpuOps() if backend == "cpu" else SimOps()
    worker = _worker(ops)
    try:
        worker.register_kv_caches(KVCacheDescription(views, NB, BS, "LBHNC"))
    finally:
        worker.close()
        if isinstance(ops, SimOps):
            ops.close()
    # blocks 0-1 saved, 3-2 loaded: four blocks' padding, each checked
    assert checked == [4]
    assert torch.equal(raw, before)  # every page and every padding byte as it was


def test_a_codec_that_writes_into_padding_stops_startup(monkeypatch: pytest.MonkeyPatch) -> None:
    raw, views = padded()
    scatter = PageCodec.scatter

    def spills(self: PageCodec, src: torch.Tensor, block_ids: list[int]) -> int:
        n = scatter(self, src, block_ids)
        for b in block_ids:  # a codec that moves whole strides, over the padding
            raw[b * STRIDE + PAGE : (b + 1) * STRIDE].fill_(0)
        return n

    monkeypatch.setattr(PageCodec, "scatter", spills)
    worker = _worker(CpuOps())
    with pytest.raises(StartupError, match=r"page padding of block [23] \(256 bytes inside its "):
        worker.register_kv_caches(KVCacheDescription(views, NB, BS, "LBHNC"))
