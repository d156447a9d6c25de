"""Layer-by-layer loads: which rows of a chunk land in which wave, and after which wave each
layer's pages are complete.

A synchronous load issued wave by wave (every chunk's first layers, then every chunk's next
ones, ...) lets the forward start on layer 0 as soon as the first wave landed, while later
waves are still on the link: a restore then takes about max(transfer, compute) instead of their
sum. The waves are consecutive layers in the forward's order. A stack row (a segment) holding
several layers (a cross-layer page) lands with the latest of them, so such a layout gains
nothing and gets no plan.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvtier.offload.pages import KVPages


@dataclass(frozen=True, slots=True)
class Waves:
    """A load's wave plan: per stack, `(wave, first row, end row)` ranges; per layer, the wave
    after which its pages are complete (-1: it has none)."""

    count: int
    rows: tuple[tuple[tuple[int, int, int], ...], ...]
    of_layer: Mapping[str, int]


def plan_waves(
    pages: KVPages, stack_sizes: Sequence[int], layers: Sequence[str], count: int
) -> Waves | None:
    """Split `layers` (the forward's order) into up to `count` waves of consecutive layers over
    the stacks' rows (`stack_sizes`, payload order); None when every row would land in one
    wave (a cross-layer layout, a single layer, a hybrid's groups). Each wave is one 2-D copy
    per chunk and run (a few microseconds each on CUDA): more waves start the forward sooner
    for more copies (`load_waves`, default 4)."""
    if count < 2 or len(layers) < 2 or pages.groups:
        return None
    if sum(stack_sizes) != len(pages.segments):
        raise ValueError(
            f"stacks of {list(stack_sizes)} rows do not cover {len(pages.segments)} segments"
        )
    wave_of = {name: i * count // len(layers) for i, name in enumerate(layers)}
    row_waves = [
        # a row is complete with the latest layer it holds; a tensor the host did not name
        # lands last
        max(wave_of.get(run.tensor, count - 1) for run in seg.runs)
        for seg in pages.segments
    ]
    if len(set(row_waves)) < 2:
        return None
    of_layer: dict[str, int] = {name: -1 for name in layers}
    for seg, w in zip(pages.segments, row_waves, strict=True):
        for run in seg.runs:
            of_layer[run.tensor] = max(of_layer.get(run.tensor, -1), w)
    rows: list[tuple[tuple[int, int, int], ...]] = []
    first = 0
    for size in stack_sizes:
        ranges: list[tuple[int, int, int]] = []
        for r in range(size):
            w = row_waves[first + r]
            if ranges and ranges[-1][0] == w and ranges[-1][2] == r:
                ranges[-1] = (w, ranges[-1][1], r + 1)
            else:
                ranges.append((w, r, r + 1))
        rows.append(tuple(ranges))
        first += size
    return Waves(count, tuple(rows), of_layer)
