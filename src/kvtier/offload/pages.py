"""KV pages by stride: where each KV block's bytes live, from the host's own description.

A host registers per-layer views of its KV cache (any memory order, any block stride, kernel
blocks finer than manager blocks) and says how many manager blocks there are. Each view's
bytes of one manager block must form one contiguous run; runs of different views that sit next
to each other in one allocation merge into one segment, so a cross-layer layout (one page per
block for all layers) is one copy per block. A segment is a `(num_blocks, nbytes)` uint8 view
whose row `b` is block `b`'s bytes; the codec moves whole rows and never guesses a layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvtier.errors import LayoutError
from kvtier.keys import digest16
from kvtier.offload.groups import GroupSpec

_PAGES_DOMAIN = "kvtier.pages.v1"


@dataclass(frozen=True, slots=True)
class KVCacheDescription:
    """What a host says about its KV cache: per-layer views (manager or kernel blocks on dim 0),
    the manager block count and size, the layout's name, and how a user changes the layout."""

    tensors: Mapping[str, torch.Tensor]
    num_blocks: int
    block_size: int
    layout: str
    layout_fix: str = "register per-layer views whose block pages are contiguous"
    # every TP rank holds these same bytes (MLA, the DSA indexer): stored once below memory
    replicated: bool = False
    # The order of bytes inside a page when the attention kernel picks it by hardware (vLLM's
    # CPU backend writes "amx" pages on AMX CPUs and "vec" pages elsewhere, same shape, other
    # order): part of the fingerprint, so hosts whose kernels disagree never share a record.
    page_format: str = ""
    # A hybrid registration: one entry per KV cache group (its kind, block size and layers).
    # Groups share one block pool, so their tensors may alias: a block id belongs to one group
    # at a time, and each group's pages are described from its own layers only. Empty: every
    # tensor is one group (the layout of every non-hybrid model).
    groups: tuple[GroupSpec, ...] = ()


@dataclass(frozen=True, slots=True)
class PageRun:
    """One view's bytes of one block: `nbytes` at `offset` (bytes) from its storage's start for
    block 0, repeated every `block_stride` bytes; `physical` lists its sub-block axes in memory
    order as flattened (logical axis, extent) pairs."""

    tensor: str
    dtype: str
    offset: int
    nbytes: int
    block_stride: int
    physical: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Segment:
    """Adjacent runs of one storage: row `b` of `view` is block `b`'s bytes of every run."""

    view: torch.Tensor
    runs: tuple[PageRun, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of one block in this segment."""
        return int(self.view.shape[1])


@dataclass(frozen=True)
class KVPages:
    """Every segment of one rank's KV cache, in payload order, with a format fingerprint."""

    num_blocks: int
    block_size: int
    layout: str
    segments: tuple[Segment, ...]
    device: torch.device
    fingerprint: bytes
    dtype: str
    page_format: str = ""
    # a hybrid registration: each group's own pages, in group order (empty otherwise)
    groups: tuple[KVPages, ...] = ()
    group_specs: tuple[GroupSpec, ...] = ()

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block over every segment."""
        return sum(s.nbytes for s in self.segments)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token on this rank."""
        return self.bytes_per_block // self.block_size

    def chunk_bytes(self, blocks_per_chunk: int) -> int:
        """Payload bytes of one chunk of `blocks_per_chunk` blocks."""
        return self.bytes_per_block * blocks_per_chunk

    def describe(self) -> str:
        """One line for the startup log."""
        runs = sum(len(s.runs) for s in self.segments)
        fmt = f", page format {self.page_format}" if self.page_format else ""
        if self.groups:
            fmt += ", groups " + ", ".join(
                f"{spec.describe()} ({len(spec.layers)} layers, {g.bytes_per_block} B/block)"
                for spec, g in zip(self.group_specs, self.groups, strict=True)
            )
        return (
            f"layout {self.layout}{fmt}: {len(self.segments)} segment(s) over {runs} view(s), "
            f"{self.bytes_per_block} B/block, {self.num_blocks} blocks on {self.device}"
        )


def manager_view(t: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """`t` with manager blocks on dim 0 (kernel blocks of one manager block grouped on dim 1)."""
    if t.shape[0] == num_blocks:
        return t
    return t.unflatten(0, (num_blocks, t.shape[0] // num_blocks))


def describe_pages(desc: KVCacheDescription) -> KVPages:
    """Segments of the described KV cache; LayoutError names the view, the layout and the fix."""
    if not desc.tensors:
        raise LayoutError("no KV cache tensors were registered; nothing can be offloaded")
    if desc.groups:
        return _describe_groups(desc)
    if desc.num_blocks <= 0 or desc.block_size <= 0:
        raise LayoutError(
            f"num_blocks={desc.num_blocks} and block_size={desc.block_size} must be positive"
        )
    runs: list[tuple[torch.Tensor, PageRun]] = []
    devices = set()
    for name, t in desc.tensors.items():
        runs.append((t, _run_of(name, t, desc)))
        devices.add(t.device)
    if len(devices) > 1:
        raise LayoutError(
            f"KV tensors live on several devices {sorted(map(str, devices))}; "
            "one rank's KV cache must be on one device"
        )
    segments = _merge(runs, desc)
    dtypes = sorted({r.dtype for _, r in runs})
    return KVPages(
        num_blocks=desc.num_blocks,
        block_size=desc.block_size,
        layout=desc.layout,
        segments=segments,
        device=devices.pop(),
        fingerprint=_fingerprint(desc, segments),
        dtype="+".join(dtypes),
        page_format=desc.page_format,
    )


def _describe_groups(desc: KVCacheDescription) -> KVPages:
    """A hybrid registration's pages: each group described from its own layers (groups alias
    one pool, so their runs are never merged), the fingerprint over every group's spec."""
    owner: dict[str, int] = {}
    for i, spec in enumerate(desc.groups):
        if spec.block_size != desc.block_size:
            raise LayoutError(
                f"KV cache group {i} ({spec.describe()}) has block size {spec.block_size}, the "
                f"registration {desc.block_size}; kvtier needs one block size for every group"
            )
        for name in spec.layers:
            if name in owner:
                raise LayoutError(
                    f"KV tensor {name!r} is in KV cache groups {owner[name]} and {i}; a layer "
                    "belongs to one group"
                )
            owner[name] = i
    missing = sorted(set(desc.tensors) - set(owner))
    absent = sorted(set(owner) - set(desc.tensors))
    if missing or absent:
        raise LayoutError(
            f"the KV cache groups do not match the registered tensors: tensors in no group "
            f"{missing}, group layers with no tensor {absent}; register every group's layers"
        )
    parts = []
    for i, spec in enumerate(desc.groups):
        if not spec.layers:
            raise LayoutError(f"KV cache group {i} ({spec.describe()}) has no layers")
        sub = dataclasses.replace(
            desc, tensors={n: desc.tensors[n] for n in spec.layers}, groups=()
        )
        parts.append(describe_pages(sub))
    devices = {p.device for p in parts}
    if len(devices) > 1:
        raise LayoutError(
            f"KV cache groups live on several devices {sorted(map(str, devices))}; one rank's "
            "KV cache must be on one device"
        )
    fields: list[bytes | str | int] = ["groups", desc.block_size, len(parts)]
    for spec, p in zip(desc.groups, parts, strict=True):
        fields += [spec.kind, spec.block_size, spec.reach, p.fingerprint]
        if spec.detail:  # a state group's mixer, shapes and dtypes (other groups: none)
            fields += ["detail", spec.detail]
    return KVPages(
        num_blocks=desc.num_blocks,
        block_size=desc.block_size,
        layout=desc.layout,
        segments=tuple(s for p in parts for s in p.segments),
        device=devices.pop(),
        fingerprint=digest16(_PAGES_DOMAIN, fields),
        dtype="+".join(sorted({d for p in parts for d in p.dtype.split("+")})),
        page_format=desc.page_format,
        groups=tuple(parts),
        group_specs=desc.groups,
    )


def _run_of(name: str, t: torch.Tensor, desc: KVCacheDescription) -> PageRun:
    """The contiguous run of `t` holding one manager block, or a LayoutError saying why not."""
    where = (
        f"KV tensor {name!r} (layout {desc.layout}, shape {tuple(t.shape)}, "
        f"strides {tuple(t.stride())})"
    )
    if t.dim() < 1 or t.shape[0] % desc.num_blocks:
        raise LayoutError(
            f"{where}: dim 0 must hold the {desc.num_blocks} blocks (or a whole number of "
            f"kernel blocks per block); {desc.layout_fix}"
        )
    # kernel blocks subdivide a manager block: they become one more sub-block axis
    t = manager_view(t, desc.num_blocks)
    item = t.element_size()
    # (logical axis, extent, stride) of every sub-block axis that is not a singleton
    sub = [
        (axis, int(n), int(s))
        for axis, (n, s) in enumerate(zip(t.shape[1:], t.stride()[1:], strict=True))
        if n > 1
    ]
    if any(s <= 0 for _, _, s in sub):
        raise LayoutError(f"{where}: a sub-block axis has stride <= 0; {desc.layout_fix}")
    expected = 1
    for _, n, s in sorted(sub, key=lambda d: d[2]):
        if s != expected:
            raise LayoutError(
                f"{where}: the bytes of one block are not one contiguous run (a sub-block "
                f"axis of {n} has stride {s}, {expected} needed), so a block cannot move as "
                f"one page; {desc.layout_fix}"
            )
        expected *= n
    nbytes = expected * item
    block_stride = int(t.stride(0)) * item
    if desc.num_blocks > 1 and block_stride < nbytes:
        raise LayoutError(
            f"{where}: blocks overlap (block stride {block_stride} B < page {nbytes} B); "
            f"{desc.layout_fix}"
        )
    # memory order as (logical axis, extent) pairs: equal extents in another order differ
    physical = tuple(v for axis, n, _ in sorted(sub, key=lambda d: -d[2]) for v in (axis, n))
    return PageRun(
        tensor=name,
        dtype=str(t.dtype).removeprefix("torch."),
        offset=int(t.storage_offset()) * item,
        nbytes=nbytes,
        block_stride=block_stride,
        physical=physical,
    )


def _merge(
    runs: list[tuple[torch.Tensor, PageRun]], desc: KVCacheDescription
) -> tuple[Segment, ...]:
    """Group runs by storage and block stride, join adjacent ones; registration order kept."""
    groups: dict[tuple[int, int], list[tuple[torch.Tensor, PageRun]]] = {}
    for t, run in runs:
        ptr = t.untyped_storage().data_ptr()
        groups.setdefault((ptr, run.block_stride), []).append((t, run))
    segments: list[Segment] = []
    for members in groups.values():
        members.sort(key=lambda m: m[1].offset)
        joined: list[list[tuple[torch.Tensor, PageRun]]] = []
        for t, run in members:
            if joined:
                last = joined[-1][-1][1]
                end = last.offset + last.nbytes
                if run.offset < end:
                    raise LayoutError(
                        f"KV tensors {last.tensor!r} and {run.tensor!r} (layout "
                        f"{desc.layout}) alias the same bytes of a block; register one KV "
                        "cache group"
                    )
                if run.offset == end:
                    joined[-1].append((t, run))
                    continue
            joined.append([(t, run)])
        for part in joined:
            first_t, first = part[0]
            nbytes = sum(r.nbytes for _, r in part)
            view = _byte_rows(first_t, first, nbytes, desc.num_blocks)
            segments.append(Segment(view, tuple(r for _, r in part)))
    return tuple(segments)


def _byte_rows(t: torch.Tensor, run: PageRun, nbytes: int, num_blocks: int) -> torch.Tensor:
    """A `(num_blocks, nbytes)` uint8 view over `t`'s storage starting at `run.offset`."""
    storage = t.untyped_storage()
    base = torch.empty(0, dtype=torch.uint8, device=t.device)
    base.set_(storage, 0, (storage.nbytes(),), (1,))
    return base.as_strided((num_blocks, nbytes), (run.block_stride, 1), run.offset)


def _fingerprint(desc: KVCacheDescription, segments: tuple[Segment, ...]) -> bytes:
    # The block count is left out: engines with different pool sizes share records. Memory
    # order is in: two layouts of the same model do not share bytes.
    fields: list[bytes | str | int] = [desc.block_size, len(segments)]
    for seg in segments:
        fields += [seg.nbytes, len(seg.runs)]
        for r in seg.runs:
            fields += [r.tensor, r.dtype, r.nbytes, len(r.physical), *r.physical]
    # only where a host names one, so the pages of hosts without one keep their fingerprint
    if desc.page_format:
        fields += ["page_format", desc.page_format]
    return digest16(_PAGES_DOMAIN, fields)
