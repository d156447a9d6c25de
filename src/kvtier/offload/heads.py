"""The first-chunk keys this scheduler has sent to be saved: a miss known without a round trip.

A lookup counts the leading chunks every rank holds, so a prompt whose first chunk was never
saved cannot hit. Where this scheduler is the only writer of its ranks' tiers (host memory only:
no disk left by an earlier process, no remote shared with other engines), a prompt whose first
key is not here is answered 0 at once: no lookup, no lease, no worker GIL taken. The set is a
superset of what the tiers hold (evictions are not removed), so a key found here still asks the
ranks; it is bounded, oldest untouched first out, so a head evicted from the set while its chunk
survives in the tier costs one lost hit (a recompute), never a wrong byte.
"""

from __future__ import annotations

from collections import OrderedDict

from kvtier.config import KVTierConfig

DEFAULT_CAPACITY = 1 << 16  # keys; about 7 MB of Python objects at the bound


class SavedHeads:
    """A bounded set of first-chunk keys, most recently saved or hit last."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"SavedHeads capacity={capacity} must be >= 1")
        self.capacity = capacity
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys

    def add(self, key: bytes) -> None:
        """Record (or refresh) a first-chunk key that a save or a hit just named."""
        self._keys[key] = None
        self._keys.move_to_end(key)
        if len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def clear(self) -> None:
        """Forget every key (a cache reset: the new epoch's keys are all new)."""
        self._keys.clear()


def private_tiers(config: KVTierConfig, *, saves: bool) -> bool:
    """True when every chunk a lookup could find was saved by this scheduler: it saves, and its
    ranks keep chunks in host memory only (a disk tier may hold an earlier process's records, a
    remote one other engines')."""
    return saves and config.memory_only
