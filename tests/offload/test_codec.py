"""BlockCodec: blocks round-trip bit-exactly through chunk bytes; skipped positions stay put."""

from __future__ import annotations

import pytest
import torch

from kvtier.errors import LayoutError
from kvtier.offload.codec import BlockCodec


def caches(num_blocks: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        f"layer{i}": torch.randn(num_blocks, 2, 4, 2, 8, generator=g).to(torch.bfloat16)
        for i in range(3)
    } | {"layer0.idx": torch.randint(0, 255, (num_blocks, 4, 132), generator=g, dtype=torch.uint8)}


def test_pack_unpack_round_trip_is_bit_exact():
    src = caches(seed=1)
    dst = caches(seed=2)
    a, b = BlockCodec(src, 2, 8), BlockCodec(dst, 2, 8)
    buf = torch.empty(a.chunk_bytes, dtype=torch.uint8)
    a.pack([5, 2], buf)
    assert b.unpack(buf, [0, 7]) == 2
    for name in src:
        assert torch.equal(dst[name][0].view(torch.uint8), src[name][5].view(torch.uint8))
        assert torch.equal(dst[name][7].view(torch.uint8), src[name][2].view(torch.uint8))


def test_skipped_positions_are_never_written():
    src, dst = caches(seed=1), caches(seed=2)
    before = {n: t.clone() for n, t in dst.items()}
    a, b = BlockCodec(src, 2, 8), BlockCodec(dst, 2, 8)
    buf = torch.empty(a.chunk_bytes, dtype=torch.uint8)
    a.pack([1, 3], buf)
    assert b.unpack(buf, [-1, 4]) == 1
    for name in dst:
        assert torch.equal(dst[name][4].view(torch.uint8), src[name][3].view(torch.uint8))
        others = [i for i in range(8) if i != 4]
        assert torch.equal(dst[name][others], before[name][others])


def test_bad_block_ids_and_shapes_are_errors():
    c = BlockCodec(caches(), 2, 8)
    buf = torch.empty(c.chunk_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="outside"):
        c.pack([0, 8], buf)
    with pytest.raises(ValueError, match="2 blocks"):
        c.pack([0], buf)
    with pytest.raises(LayoutError, match="blocks on dim 0"):
        BlockCodec({"a": torch.zeros(8, 4), "b": torch.zeros(7, 4)}, 2, 8)
