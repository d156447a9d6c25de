"""The chunks other requests' operations are moving right now, indexed by chunk key.

- A load with its blocks allocated brings its chunks into HBM when it ends: a request asking
  for the same chunks waits for it instead of a second tier read.
- A save sent to the ranks stores its chunks a step or more later: a request asking for them
  meanwhile would miss, and recompute, a chunk the tier is about to hold.
- A hybrid save reads sliding-window blocks the host may hand to another request before the
  save copied them: such a save is cancelled (`reused`).

Every entry belongs to an operation in flight and leaves with its terminal, so the index is
bounded by the operations the scheduler tracks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Container, Iterable, Sequence


class InFlight:
    """Keys of loads and saves not yet terminal, and the window blocks saves read."""

    def __init__(self) -> None:
        self._loading: Counter[bytes] = Counter()
        self._saving: Counter[bytes] = Counter()
        self._save_keys: dict[str, list[bytes]] = {}
        self._window_reads: dict[str, set[int]] = {}

    def track_load(self, keys: Iterable[bytes], delta: int) -> None:
        """Count (+1) or forget (-1) the chunk keys an allocated load brings into HBM."""
        for key in keys:
            self._loading[key] += delta
            if self._loading[key] <= 0:
                del self._loading[key]

    def loading(self, keys: Iterable[bytes]) -> bool:
        """Whether a load in flight brings any of `keys` into HBM."""
        return any(k in self._loading for k in keys)

    def open_save(self, op_id: str, keys: Sequence[bytes], window: set[int] | None) -> None:
        """A save of `keys` was sent; `window`: the sliding-window blocks it reads."""
        self._save_keys[op_id] = list(keys)
        self._saving.update(keys)
        if window:
            self._window_reads[op_id] = window

    def close_save(self, op_id: str) -> None:
        """The save's terminal (or its forgetting): its keys are no longer awaited."""
        self._window_reads.pop(op_id, None)
        for key in self._save_keys.pop(op_id, ()):
            self._saving[key] -= 1
            if self._saving[key] <= 0:
                del self._saving[key]

    def saving_for_others(self, keys: Iterable[bytes], own: Iterable[str]) -> bool:
        """Whether a save other than the `own` ops stores any of `keys` now."""
        mine: Counter[bytes] = Counter()
        for op_id in own:
            mine.update(self._save_keys.get(op_id, ()))
        return any(self._saving[k] > mine[k] for k in keys)

    def reused(self, block_ids: Iterable[int], live: Container[str]) -> set[str]:
        """The `live` saves that read one of `block_ids` as a sliding-window block."""
        if not self._window_reads:
            return set()
        fresh = set(block_ids)
        return {
            op_id
            for op_id, reads in self._window_reads.items()
            if op_id in live and not reads.isdisjoint(fresh)
        }
