"""Chain-aware adaptive replacement, one implementation for the memory tier (slots) and the disk
tier (bytes).

A lookup serves the longest run of leading chunks a tier holds, so a chunk is worth nothing once
a chunk before it is gone. Three rules keep every chain prefix-closed:

* a lookup re-touches the run it matched tail-first (`touch`), so a chain's head is its most
  recent entry; a chunk committed under a resident parent refreshes the parent's chain too;
* the victim is always a leaf: the least recently used entry without resident children, of the
  list the replacement order picks (then of the other);
* a parent is known for every chunk committed with one, even while the parent itself is absent,
  so a parent written after its children (deepest-first commits) is born protected.

The order is ARC (Megiddo and Modha, FAST'03) over sizes: entries seen once live in `recent`,
entries referenced again in `frequent`, and the split between them follows ghost hits. The
ghosts remember only the last `ghost_fraction` of the capacity: a ghost hit then means a slightly
larger list would have hit, so a loop longer than the cache (round-robin conversations) cannot
swing the split, while one-off tails (cache-bust suffixes) stay in `recent` and leave first.
Not thread-safe: each tier calls it under its own lock.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Sequence

# Measured by `kvtier bench cache`: 0.1 wins or ties on every workload there; 0.25 and above let
# round-robin conversations grow `recent` until the tier thrashes.
GHOST_FRACTION = 0.1

NO_PARENT = b""

RECENT = 0
FREQUENT = 1


class ChainPolicy:
    """Replacement order, chain links and ghosts of one tier; sizes in the tier's unit."""

    def __init__(self, capacity: int, *, ghost_fraction: float = GHOST_FRACTION) -> None:
        if capacity <= 0:
            raise ValueError(f"policy capacity must be > 0, got {capacity}")
        if not 0.0 <= ghost_fraction <= 1.0:
            raise ValueError(f"ghost_fraction={ghost_fraction} must lie in [0, 1]; 0.1 is usual")
        self.capacity = capacity
        self._ghost_cap = ghost_fraction * capacity
        self._size: dict[bytes, int] = {}  # resident key -> size
        self._list: dict[bytes, int] = {}  # resident key -> RECENT or FREQUENT
        self._bytes = [0, 0]  # size held by each list
        self._count = [0, 0]  # entries in each list
        # resident key -> position stamp: a list's order is by stamp, oldest first
        self._stamp: dict[bytes, int] = {}
        # resident key -> generation of its last touch; one generation per operation
        self._gen: dict[bytes, int] = {}
        # per list, (stamp, key) of its leaves; an entry is stale once its key moved, left the
        # list, gained a child or went; stale entries are skipped and compacted away
        self._leaves: tuple[list[tuple[int, bytes]], list[tuple[int, bytes]]] = ([], [])
        # evicted keys -> size, oldest first (ARC's B1 and B2)
        self._ghosts: tuple[OrderedDict[bytes, int], OrderedDict[bytes, int]] = (
            OrderedDict(),
            OrderedDict(),
        )
        self._ghost_bytes = [0, 0]
        self._target = 0.0  # what the recent list should hold; ghost hits move it
        self._parent: dict[bytes, bytes] = {}  # resident key -> parent key
        # parent key (resident or not) -> its resident children, oldest first
        self._children: dict[bytes, dict[bytes, None]] = {}
        self._clock = 0
        self._last_walk = 0  # generation of the latest ancestor walk

    # ---- state -------------------------------------------------------------------------------

    def __contains__(self, key: object) -> bool:
        return key in self._size

    def __len__(self) -> int:
        return len(self._size)

    @property
    def used(self) -> int:
        """Size held by resident entries."""
        return self._bytes[RECENT] + self._bytes[FREQUENT]

    @property
    def recent_count(self) -> int:
        """Entries referenced once since they were (re)admitted."""
        return self._count[RECENT]

    @property
    def frequent_count(self) -> int:
        """Entries referenced at least twice, or readmitted from a ghost."""
        return self._count[FREQUENT]

    @property
    def target(self) -> float:
        """The size ARC currently wants the recent list to hold (for tests and stats)."""
        return self._target

    def parent_of(self, key: bytes) -> bytes:
        """The known parent of resident `key` (NO_PARENT for a chain head or an unknown one)."""
        return self._parent.get(key, NO_PARENT)

    def has_children(self, key: bytes) -> bool:
        """True while some resident entry names `key` as its parent."""
        return bool(self._children.get(key))

    # ---- references --------------------------------------------------------------------------

    def insert(self, key: bytes, size: int, parent: bytes = NO_PARENT) -> None:
        """Admit `key` (the caller made room). A key in a ghost list comes back as frequent and
        moves the split; a resident parent's chain is refreshed, as the save uses it."""
        if key in self._size:
            raise ValueError("insert of a resident key; call touch() to reference it")
        if size <= 0:
            raise ValueError(f"entry size must be > 0, got {size}")
        where = RECENT
        for which, direction in ((RECENT, +1), (FREQUENT, -1)):
            if key in self._ghosts[which]:
                self._adapt(direction, self._ghosts[which][key])
                self._ghost_bytes[which] -= self._ghosts[which].pop(key)
                where = FREQUENT
        self._size[key] = size
        self._list[key] = where
        self._bytes[where] += size
        self._gen[key] = self._tick()
        self._count[where] += 1
        if parent:
            self._link(key, parent)
        self._restamp(key)
        self._refresh_ancestors(key)

    def touch(self, keys: Sequence[bytes]) -> None:
        """A lookup used the run `keys` (leading chunks, in chain order): learn the links between
        resident neighbours and reference each resident key, tail first."""
        gen = self._tick()
        resident, parents = self._size, self._parent
        for i in range(len(keys) - 1, -1, -1):
            key = keys[i]
            if key in resident:
                if i and key not in parents:
                    self._link(key, keys[i - 1])
                self._reference(key, gen)

    def link(self, key: bytes, parent: bytes) -> None:
        """Learn that resident `key` follows `parent` (kept if a link is known already)."""
        if parent and key in self._size and key not in self._parent:
            self._link(key, parent)

    # ---- removal -----------------------------------------------------------------------------

    def victim(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        """The next entry to evict: the least recently used leaf with `evictable(key)` true, of
        the list ARC picks, then of the other; None when every leaf is held."""
        first = (
            RECENT if self._bytes[RECENT] > self._target or not self._bytes[FREQUENT] else FREQUENT
        )
        for which in (first, 1 - first):
            key = self._oldest_leaf(which, evictable)
            if key is not None:
                return key
        return None

    def evict(self, key: bytes) -> int:
        """Evict leaf `key` into its ghost list; returns its size."""
        if self._children.get(key):
            raise ValueError("evict of an entry with resident children; evict a leaf (victim())")
        which = self._list[key]
        size = self._unlink(key)
        ghosts = self._ghosts[which]
        ghosts[key] = size
        self._ghost_bytes[which] += size
        while self._ghost_bytes[which] > self._ghost_cap and ghosts:
            self._ghost_bytes[which] -= ghosts.popitem(last=False)[1]
        return size

    def remove(self, key: bytes) -> int:
        """Forget resident `key` without a ghost (a dropped record); returns its size. Its
        children keep their link, so a rewritten `key` is again their protected parent."""
        return self._unlink(key)

    def clear(self) -> None:
        """Forget everything, ghosts and links included."""
        for table in (self._size, self._list, self._stamp, self._gen, self._parent):
            table.clear()
        self._children.clear()
        for heap in self._leaves:
            heap.clear()
        for ghosts in self._ghosts:
            ghosts.clear()
        self._bytes = [0, 0]
        self._count = [0, 0]
        self._ghost_bytes = [0, 0]
        self._target = 0.0

    # ---- internals ---------------------------------------------------------------------------

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _restamp(self, key: bytes) -> None:
        """Move `key` to the most recent end of its list."""
        stamp = self._stamp[key] = self._tick()
        if not self._children.get(key):
            heap = self._leaves[self._list[key]]
            heapq.heappush(heap, (stamp, key))
            if len(heap) > 2 * len(self._size) + 64:
                self._compact(self._list[key])

    def _reference(self, key: bytes, gen: int) -> None:
        """A second reference promotes to frequent; later ones refresh frequent."""
        if self._list[key] == RECENT:
            size = self._size[key]
            self._bytes[RECENT] -= size
            self._bytes[FREQUENT] += size
            self._count[RECENT] -= 1
            self._count[FREQUENT] += 1
            self._list[key] = FREQUENT
        self._gen[key] = gen
        self._restamp(key)

    def _refresh_ancestors(self, key: bytes) -> None:
        """Reference the resident chain above a newly admitted `key`, up to an ancestor that
        the previous such walk refreshed (whose own chain that walk refreshed too): a
        deepest-first save walks its chain once, ascending admissions cost O(1) each."""
        parent = self._parent.get(key)
        if parent is None or parent not in self._size:
            return
        gen = self._tick()
        while parent is not None and parent in self._size:
            if self._gen[parent] == self._last_walk:
                break
            self._reference(parent, gen)
            parent = self._parent.get(parent)
        self._last_walk = gen

    def _link(self, key: bytes, parent: bytes) -> None:
        self._parent[key] = parent
        self._children.setdefault(parent, {})[key] = None

    def _valid_leaf(self, which: int, stamp: int, key: bytes) -> bool:
        return (
            self._stamp.get(key) == stamp
            and self._list.get(key) == which
            and not self._children.get(key)
        )

    def _oldest_leaf(self, which: int, evictable: Callable[[bytes], bool]) -> bytes | None:
        heap = self._leaves[which]
        held: list[tuple[int, bytes]] = []
        found = None
        while heap:
            stamp, key = heap[0]
            if not self._valid_leaf(which, stamp, key):
                heapq.heappop(heap)
                continue
            if evictable(key):
                found = key
                break
            held.append(heapq.heappop(heap))
        for entry in held:
            heapq.heappush(heap, entry)
        return found

    def _compact(self, which: int) -> None:
        heap = [e for e in set(self._leaves[which]) if self._valid_leaf(which, *e)]
        heapq.heapify(heap)
        self._leaves[which][:] = heap

    def _unlink(self, key: bytes) -> int:
        size = self._size.pop(key)
        which = self._list.pop(key)
        self._bytes[which] -= size
        self._count[which] -= 1
        del self._stamp[key], self._gen[key]
        parent = self._parent.pop(key, None)
        if parent is not None:
            siblings = self._children[parent]
            del siblings[key]
            if not siblings:
                del self._children[parent]
                if parent in self._size:
                    # a parent whose last child left becomes a leaf at its own place in the order
                    heapq.heappush(self._leaves[self._list[parent]], (self._stamp[parent], parent))
        return size

    def _adapt(self, direction: int, size: int) -> None:
        """ARC's rule by size: a recent ghost hit grows the recent list's share, a frequent one
        shrinks it, each by the hit's size scaled by how much rarer its kind of ghost is."""
        b1, b2 = self._ghost_bytes
        if direction > 0:
            step = size * max(1.0, b2 / b1) if b1 else float(size)
            self._target = min(float(self.capacity), self._target + step)
        else:
            step = size * max(1.0, b1 / b2) if b2 else float(size)
            self._target = max(0.0, self._target - step)
