"""The startup self-test. On every rank, a known pattern is written into real KV blocks through
the host's own views, saved as a chunk through the full save path, the blocks cleared, the chunk
loaded back into other blocks through the full load path and compared byte for byte; the blocks
are restored. The scheduler then looks the chunk up on every rank. Any failure stops startup
with the rank, the device, the layout and the cause."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import blake3
import torch

from kvtier.errors import StartupError
from kvtier.offload.device import DeviceOps, copy_to
from kvtier.offload.groups import STATE, ChunkGroups
from kvtier.offload.pages import KVCacheDescription, KVPages, manager_view
from kvtier.offload.protocols import LookupPort

SELF_TEST_KEY = blake3.blake3(b"kvtier self-test chunk v2").digest(16)


def _pattern(view: torch.Tensor, blocks: int, seed: int) -> torch.Tensor:
    """Host values for `blocks` manager blocks of `view`: small integers, exact in every KV
    dtype (fp8 included), different per element, block and tensor."""
    g = torch.Generator().manual_seed(0x6B7674 + seed)
    shape = (blocks, *view.shape[1:])
    return torch.randint(0, 16, shape, generator=g, dtype=torch.int16).to(view.dtype)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


# sentinels written into page padding of the saved and of the loaded blocks
SRC_SENTINEL = 0xA5
DST_SENTINEL = 0x5A


@dataclass(frozen=True, slots=True)
class Padding:
    """Bytes of one block inside its block stride that no page covers: `length` bytes at
    `start` of the flat uint8 `storage`."""

    storage: torch.Tensor
    block: int
    start: int
    length: int
    stride: int

    def bytes(self) -> torch.Tensor:
        return self.storage[self.start : self.start + self.length]


def padding(pages: KVPages, blocks: Sequence[int]) -> list[Padding]:
    """The padding of `blocks`: per storage whose segments share one block stride, the bytes
    of each block's stride that no segment's page covers (vLLM pads pages of some groups up to
    a common size; a backend may keep data there, which kvtier does not move)."""
    groups: dict[int, list[torch.Tensor]] = {}
    for seg in pages.segments:
        groups.setdefault(seg.view.untyped_storage().data_ptr(), []).append(seg.view)
    out: list[Padding] = []
    for views in groups.values():
        strides = {int(v.stride(0)) for v in views}
        if len(strides) != 1:
            continue  # groups of several strides share it: a gap may be another group's page
        stride = strides.pop()
        covered = sorted(
            (v.storage_offset() + b * stride, v.storage_offset() + b * stride + int(v.shape[1]))
            for v in views
            for b in blocks
        )
        storage = views[0].untyped_storage()
        flat = torch.empty(0, dtype=torch.uint8, device=views[0].device)
        flat.set_(storage, 0, (storage.nbytes(),), (1,))
        for v in views:
            n = int(v.shape[1])
            for b in blocks:
                lo = v.storage_offset() + b * stride + n
                hi = min(v.storage_offset() + (b + 1) * stride, storage.nbytes())
                for start, end in _uncovered(lo, hi, covered):
                    out.append(Padding(flat, b, start, end - start, stride))
    return out


def _uncovered(lo: int, hi: int, covered: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out = []
    pos = lo
    for start, end in covered:
        if end <= pos or start >= hi:
            continue
        if start > pos:
            out.append((pos, start))
        pos = max(pos, end)
    if pos < hi:
        out.append((pos, hi))
    return out


def codec_round_trip(
    desc: KVCacheDescription,
    ops: DeviceOps,
    blocks_per_chunk: int,
    save: Callable[[Sequence[int]], None],
    load: Callable[[Sequence[int]], None],
    pages: KVPages | None = None,
) -> None:
    """Pattern -> blocks A -> `save(A)` -> clear -> `load(B)` -> compare B; blocks restored.
    With `pages`, sentinels go into the page padding of A and of B: B's must come back as
    they were (kvtier does not move padding: it must never write there either), A's untouched.

    `save` and `load` run the worker's real paths and raise on any failure. Raises ValueError
    naming the first tensor whose bytes did not come back."""
    nb = desc.num_blocks
    units = _units(desc, blocks_per_chunk)
    k = sum(n for _, n in units)
    if nb < k:
        raise ValueError(f"the KV pool has {nb} blocks, fewer than one chunk ({k} blocks)")
    # load into other blocks when the pool has them, so a codec that ignores ids is caught;
    # the groups of a hybrid registration alias one pool, so each gets blocks of its own
    src_all = list(range(k))
    dst_all = list(range(2 * k - 1, k - 1, -1)) if nb >= 2 * k else src_all
    views = {name: manager_view(t, nb) for name, t in desc.tensors.items()}
    plan: dict[str, tuple[list[int], list[int]]] = {}
    pos = 0
    for names, n in units:
        for name in names:
            plan[name] = (src_all[pos : pos + n], dst_all[pos : pos + n])
        pos += n
    touched = sorted(set(src_all) | set(dst_all))
    # blocks are read and written one at a time through the host's own views, never through
    # the codec's index tensors, so a codec that addresses the wrong rows cannot hide
    backup = {name: [v[b].clone() for b in touched] for name, v in views.items()}
    pads = padding(pages, touched) if pages is not None else []
    pad_backup = [p.bytes().clone() for p in pads]
    try:
        for p in pads:
            p.bytes().fill_(SRC_SENTINEL if p.block in src_all else DST_SENTINEL)
        patterns = {
            name: _pattern(v, len(plan[name][0]), i) for i, (name, v) in enumerate(views.items())
        }
        for name, v in views.items():
            for i, b in enumerate(plan[name][0]):
                v[b].copy_(ops.upload(patterns[name][i]))
        save(src_all)
        for v in views.values():
            for b in touched:
                v[b].zero_()
        load(dst_all)
        for name, v in views.items():
            src, dst = plan[name]
            for i, b in enumerate(dst):
                got = copy_to(v[b], torch.device("cpu"))
                if not torch.equal(_as_bytes(got), _as_bytes(patterns[name][i])):
                    raise ValueError(
                        f"KV tensor {name!r}: block {b} did not receive the bytes saved from "
                        f"block {src[i]}"
                    )
        _check_padding(pads, src_all)
    finally:
        # restored in reverse, so aliased groups end with the bytes they had
        for name, v in reversed(views.items()):
            for b, saved in zip(touched, backup[name], strict=True):
                v[b].copy_(saved)
        for p, saved in zip(pads, pad_backup, strict=True):
            p.bytes().copy_(saved)


def _check_padding(pads: Sequence[Padding], src: Sequence[int]) -> None:
    for p in pads:
        want = SRC_SENTINEL if p.block in src else DST_SENTINEL
        got = copy_to(p.bytes(), torch.device("cpu"))
        if not bool((got == want).all()):
            raise ValueError(
                f"page padding of block {p.block} ({p.length} bytes inside its {p.stride}-byte "
                f"block stride) was written by the codec: a save or load touched bytes outside "
                "the pages it moves"
            )


def _units(desc: KVCacheDescription, blocks_per_chunk: int) -> list[tuple[list[str], int]]:
    """(tensor names, chunk positions) per KV cache group, in the chunk's payload order; one
    unit of every tensor for a non-hybrid registration."""
    if not desc.groups:
        return [(list(desc.tensors), blocks_per_chunk)]
    layout = ChunkGroups(desc.groups, blocks_per_chunk * desc.block_size)
    # a state group moves one block, its boundary's state (a record of its own)
    return [
        (list(g.layers), 1 if g.kind == STATE else n)
        for g, n in zip(layout.groups, layout.positions, strict=True)
    ]


def fail_startup(tag: str, device: torch.device, layout: str, err: BaseException) -> StartupError:
    """The StartupError of a failed codec self-test, naming rank, device, layout and cause."""
    return StartupError(
        f"{tag}: self-test failed on device {device}, KV layout {layout}: could not move a "
        f"chunk through the codec and back ({type(err).__name__}: {err}); offload cannot "
        "serve correct KV on this rank"
    )


def check_lookup(client: LookupPort, ranks: Sequence[int]) -> None:
    """Look the self-test chunk up on every rank in scope; raise naming any rank that missed."""
    result = client.lookup([SELF_TEST_KEY], "kvtier-self-test", lease=False)
    per_rank = getattr(result, "per_rank", {})
    missing = [r for r in ranks if per_rank.get(r, 0) < 1]
    if result.hit_chunks < 1 or missing:
        raise StartupError(
            f"kvtier self-test: ranks {missing or list(ranks)} did not report the self-test chunk "
            f"(timed out: {list(result.timed_out)}); every rank in the lookup scope must run an "
            "OffloadWorker with a lookup server reachable from the scheduler"
        )
