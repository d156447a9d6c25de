"""The host-memory tier: one preallocated (pinned where CUDA is present) uint8 buffer cut into
fixed slots, one chunk per slot, evicted by the chain-aware `ChainPolicy` (leaves first, chains
touched tail-first) and verified by xxh3 on every read.

Why one module over 500 lines: one class, the tier's slot table under one lock (reserve, commit,
lease, evict, verify); the buffer (`arena`) and the eviction order (`policy`) are apart already.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from kvtier.metrics import Metrics
from kvtier.store.arena import HostArena
from kvtier.store.base import TierBase
from kvtier.store.lease import LeaseTable
from kvtier.store.policy import GHOST_FRACTION, NO_PARENT, ChainPolicy
from kvtier.store.record import KEY_BYTES, NAMESPACE_BYTES, checksum

TIER = "memory"

Payload = bytes | bytearray | memoryview | torch.Tensor


# slot views kept at most (10 MiB of them): 512 GiB of 32 MiB chunks
_VIEWS = 16384


@dataclass(frozen=True, slots=True)
class MemoryTierStats:
    """Slot accounting at one instant; `free + used + reserved + quarantined == num_slots`."""

    num_slots: int
    slot_bytes: int
    free: int
    used: int
    reserved: int
    quarantined: int
    recent: int  # resident chunks referenced once since admission
    frequent: int  # resident chunks referenced again
    leases: int = 0


class MemoryTier(TierBase):
    """Chunks in fixed slots of one host buffer, with chain-aware eviction, leases and verified
    reads. Recency comes from `touch` (a lookup's matched run) and from commits; reads do not
    change it, so a load that reads a run upward cannot leave its head the oldest entry.

    Thread-safe: one lock guards the metadata; large copies run outside it on slots that no one
    can evict or reuse meanwhile (private to a writer, or pinned by an in-flight read).
    """

    name = TIER
    reads_into = True
    reports_evictions = True

    def __init__(
        self,
        slot_bytes: int,
        capacity_bytes: int,
        namespace: bytes,
        metrics: Metrics,
        *,
        lease_ttl_s: float = 30.0,
        max_leases: int = 65536,
        ghost_fraction: float = GHOST_FRACTION,
        verify_reads: bool = True,
        clock: Callable[[], float] = time.monotonic,
        pin_memory: bool | None = None,
    ) -> None:
        if slot_bytes <= 0:
            raise ValueError(f"memory tier slot_bytes must be > 0, got {slot_bytes}")
        num_slots = capacity_bytes // slot_bytes if capacity_bytes > 0 else 0
        if num_slots == 0:
            raise ValueError(
                f"memory tier capacity_bytes={capacity_bytes} holds no slot of "
                f"slot_bytes={slot_bytes}; raise the capacity to at least {slot_bytes} bytes "
                "or use a smaller chunk size"
            )
        if len(namespace) != NAMESPACE_BYTES:
            raise ValueError(
                f"memory tier namespace must be {NAMESPACE_BYTES} bytes, got {len(namespace)}"
            )
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        if pin and not torch.cuda.is_available():
            raise ValueError(
                "pin_memory=True needs CUDA, which this torch build cannot see; "
                "pass pin_memory=None (pin when CUDA is present) or False"
            )

        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.namespace = bytes(namespace)
        self.verify_reads = verify_reads
        self._m = metrics
        # exact size (torch's pinned allocator would round it up to a power of two)
        self._arena = HostArena(num_slots * slot_bytes, pin=pin, align=slot_bytes)
        self._buf = self._arena.tensor
        # a numpy view of the same memory: zero-copy hashing and bytes-like copies
        self._np = self._buf.numpy()
        # whole-slot views, each sliced once: a slice is a torch op, and every torch op lets a
        # thread running Python beside the copy lanes take the GIL for up to a switch interval
        # (about 600 bytes each: the first _VIEWS slots only)
        self._views: list[torch.Tensor | None] = [None] * min(num_slots, _VIEWS)
        self._lock = threading.Lock()
        self._leases = LeaseTable(metrics, lease_ttl_s, max_leases, clock)
        self._policy = ChainPolicy(num_slots, ghost_fraction=ghost_fraction)

        # stack of free slot numbers; slot 0 is handed out first
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._index: dict[bytes, int] = {}  # visible key -> slot
        self._length = [0] * num_slots
        self._sum = [0] * num_slots
        # reads copying outside the lock; a slot with readers is neither evicted nor reused
        self._readers = [0] * num_slots
        self._reserved: dict[bytes, int] = {}  # key -> slot being written through reserve()
        self._reserved_parent: dict[bytes, bytes] = {}  # key -> parent given to reserve()
        # parents of chunks being written: a slot for a child never comes from its parent
        self._writing: Counter[bytes] = Counter()
        # chunks a client asked to keep (`protect`): never victims while retained
        self._retained: Callable[[bytes], bool] = _never
        self._retained_cap = num_slots  # of them, how many slots they may hold (`protect`)
        # slots of entries dropped as corrupt while a lease or a reader could still see them
        self._quarantine: dict[int, bytes] = {}
        self._closed = False

        # told ("stored" | "removed", key) on every change of what the tier holds
        self.listener: Callable[[str, bytes], None] | None = None
        self._residency = metrics.residency(TIER)
        self._evictions = metrics.eviction(TIER)
        self._all_pinned = metrics.store_failure(TIER, "all_pinned")
        self._mismatch = metrics.verify_failure(TIER, "checksum_mismatch")
        metrics.capacity(TIER).set(num_slots * slot_bytes)
        self._residency.set(0)

    # ---- reads ---------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._index)

    @property
    def page_locked(self) -> bool:
        """The arena is page-locked for CUDA DMA."""
        return self._arena.pinned

    def contains(self, key: bytes) -> bool:
        """True if `key` is resident (no recency change, no verification)."""
        self._check_open()
        return key in self._index

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """`contains` for a batch."""
        with self._lock:
            return [k in self._index for k in keys]

    def lookup_prefix(self, keys: Iterable[bytes]) -> int:
        """How many leading `keys` are resident; the run counted is touched tail-first."""
        keys = list(keys)
        with self._lock:
            self._check_open()
            n = self._leading(keys)
            self._policy.touch(keys[:n])
        return n

    def parent_of(self, key: bytes) -> bytes:
        """The parent chunk key the tier knows for resident `key` (NO_PARENT if none)."""
        with self._lock:
            return self._policy.parent_of(key)

    def touch(self, keys: Sequence[bytes]) -> None:
        """A lookup used the run `keys` (leading chunks in chain order): reference the resident
        ones tail-first and learn their chain links."""
        with self._lock:
            self._check_open()
            self._policy.touch(keys)

    def get(self, key: bytes) -> bytes | None:
        """A verified copy of the payload of `key`, or None on a miss or a checksum mismatch."""
        slot, n, want = self._begin_read(key)
        if slot < 0:
            return None
        bad = False
        try:
            off = slot * self.slot_bytes
            # hash the copy, not the slot: the bytes returned are exactly the bytes verified
            data = self._np[off : off + n].tobytes()
            bad = self.verify_reads and checksum(self.namespace, key, data) != want
        finally:
            self._end_read(key, slot, bad)
        return None if bad else data

    def read_into(self, key: bytes, dst: torch.Tensor) -> bool:
        """Copy the payload of `key` into uint8 `dst` (any device) after verifying it.

        False on a miss, or on a checksum mismatch (dropped and counted; `dst` untouched).
        `dst` must hold exactly the payload length."""
        if dst.dtype != torch.uint8:
            raise ValueError(f"read_into needs a uint8 dst tensor, got {dst.dtype}")
        slot, n, want = self._begin_read(key)
        if slot < 0:
            return False
        bad = False
        try:
            if dst.numel() != n:
                raise ValueError(
                    f"read_into dst holds {dst.numel()} bytes but the payload of this key is "
                    f"{n} bytes; pass a dst of exactly {n} bytes"
                )
            off = slot * self.slot_bytes
            if self.verify_reads:
                bad = checksum(self.namespace, key, memoryview(self._np[off : off + n])) != want
            if not bad:
                # blocking copy: the slot may be reused as soon as the read pin is dropped
                dst.copy_(self._buf[off : off + n])
        finally:
            self._end_read(key, slot, bad)
        return not bad

    def is_leased(self, key: bytes) -> bool:
        """True if `key` is resident and pinned by a lease (so a `view` of it stays valid)."""
        with self._lock:
            return key in self._index and self._leases.is_pinned(key)

    @contextlib.contextmanager
    def pinned_view(self, key: bytes) -> Iterator[torch.Tensor | None]:
        """A zero-copy, verified uint8 view of `key`'s payload (None on a miss or mismatch),
        its slot pinned against eviction and reuse until the block ends: a copy out of the view
        must finish inside the block. No lease is needed, and none can end it early."""
        slot, n, want = self._begin_read(key)
        if slot < 0:
            yield None
            return
        bad = False
        try:
            off = slot * self.slot_bytes
            if self.verify_reads:
                bad = checksum(self.namespace, key, memoryview(self._np[off : off + n])) != want
            yield None if bad else self._slot_view(slot, n)
        finally:
            self._end_read(key, slot, bad)

    def view(self, key: bytes) -> torch.Tensor | None:
        """A zero-copy, verified uint8 view of the payload of `key`, or None on a miss/mismatch.

        The caller must hold a lease on `key`; the view is valid only until that lease ends."""
        with self._lock:
            self._check_open()
            if key in self._index and not self._leases.is_pinned(key):
                raise ValueError(
                    "view(key) is only safe under a lease on key; call lease(lease_id, [key]) "
                    "first and release it when done with the view"
                )
        slot, n, want = self._begin_read(key)
        if slot < 0:
            return None
        bad = False
        try:
            off = slot * self.slot_bytes
            if self.verify_reads:
                bad = checksum(self.namespace, key, memoryview(self._np[off : off + n])) != want
        finally:
            self._end_read(key, slot, bad)
        return None if bad else self._slot_view(slot, n)

    # ---- writes --------------------------------------------------------------------------------

    def put(self, key: bytes, payload: Payload, parent: bytes = NO_PARENT) -> bool:
        """Copy `payload` (at most slot_bytes) into a slot under `key`, the chunk after `parent`
        in its chain (NO_PARENT: a head, or not known).

        True when stored or already resident (referenced, not rewritten); False, counted as
        store failure `all_pinned`, when every slot is leased or being read."""
        _check_key(key)
        src, n = _source(payload)
        if n > self.slot_bytes:
            raise ValueError(
                f"payload of {n} bytes does not fit a memory-tier slot of {self.slot_bytes} "
                "bytes; the slot size must be the chunk size in bytes"
            )
        with self._lock:
            self._check_open()
            self._leases.expire()
            if key in self._index:
                self._policy.link(key, parent)
                self._policy.touch([key])
                return True
            self._writing[parent] += 1
            slot = self._allocate()
            if slot < 0:
                self._done_writing(parent)
                return False
        try:
            off = slot * self.slot_bytes
            if n:
                self._buf[off : off + n].copy_(src)
            want = self._checksum(key, slot, n)
        except BaseException:
            with self._lock:
                self._free.append(slot)
                self._done_writing(parent)
            raise
        with self._lock:
            self._done_writing(parent)
            self._check_open()
            self._publish(key, slot, n, want, parent)
        return True

    def reserve(
        self, key: bytes, parent: bytes = NO_PARENT, counted: bool = True
    ) -> torch.Tensor | None:
        """A writable uint8 slot view for `key`, the chunk after `parent`; `commit(key)`
        publishes it, `abort(key)` frees it. The slot is never `parent`'s, and `parent` stays
        until the commit or abort.

        None when `key` is already resident (referenced) or reserved, or when every slot is
        pinned (counted as store failure `all_pinned` unless `counted=False`: a retry of a
        reserve already counted); `holds_or_reserves(key)` tells them apart."""
        _check_key(key)
        with self._lock:
            self._check_open()
            self._leases.expire()
            if key in self._index:
                self._policy.touch([key])
                return None
            if key in self._reserved:
                return None
            self._writing[parent] += 1
            slot = self._allocate(counted)
            if slot < 0:
                self._done_writing(parent)
                return None
            self._reserved[key] = slot
            self._reserved_parent[key] = parent
        return self._slot_view(slot, self.slot_bytes)

    def commit(self, key: bytes, nbytes: int | None = None, parent: bytes = NO_PARENT) -> None:
        """Publish the slot reserved for `key`, holding its first `nbytes` (default: all), as
        the chunk after `parent` in its chain (default: the parent given to `reserve`). Commit
        a save's chunks deepest-first: each parent then arrives already holding its children."""
        n = self.slot_bytes if nbytes is None else nbytes
        if not 0 <= n <= self.slot_bytes:
            raise ValueError(f"commit nbytes={nbytes} must lie in [0, {self.slot_bytes}]")
        with self._lock:
            self._check_open()
            slot = self._reserved.get(key)
        if slot is None:
            raise ValueError("commit(key) of a key that is not reserved; call reserve(key) first")
        # the slot is private to this reservation, so hashing it needs no lock
        want = self._checksum(key, slot, n)
        with self._lock:
            self._check_open()
            if self._reserved.pop(key, None) != slot:
                raise ValueError("commit(key) raced an abort(key) of the same reservation")
            reserved_parent = self._reserved_parent.pop(key)
            self._done_writing(reserved_parent)
            self._publish(key, slot, n, want, parent or reserved_parent)

    def holds_or_reserves(self, key: bytes) -> bool:
        """Whether `key` is resident or has a slot reserved (a `reserve` of it returns None for
        that reason, not for want of a slot)."""
        with self._lock:
            return key in self._index or key in self._reserved

    def abort(self, key: bytes) -> None:
        """Give back the slot reserved for `key` without publishing anything."""
        with self._lock:
            self._check_open()
            slot = self._reserved.pop(key, None)
            if slot is None:
                raise ValueError("abort(key) of a key that is not reserved")
            self._done_writing(self._reserved_parent.pop(key))
            self._free.append(slot)

    def delete(self, key: bytes) -> bool:
        """Drop `key` now (False when absent): no read can find it from here on; its slot is
        freed once the reads and leases that hold it end."""
        with self._lock:
            self._check_open()
            slot = self._index.get(key)
            if slot is None:
                return False
            self._unlink(key)
            self._quarantine[slot] = key
            self._reclaim()
            return True

    def protect(self, retained: Callable[[bytes], bool], share: float = 1.0) -> None:
        """Never evict a chunk while `retained(key)` is true (a client's retention hint), as
        long as retained chunks hold at most `share` of the slots: past it the least recently
        used of them goes first, so saves never all fail for retention."""
        self._retained = retained
        self._retained_cap = int(share * self.num_slots)

    # ---- leases --------------------------------------------------------------------------------

    def lease(self, lease_id: str, keys: Sequence[bytes], counted: bool = True) -> int:
        """Pin every resident key of `keys` under `lease_id`; returns how many leading keys are
        resident. An empty lease is still recorded so its release is not a double release.
        `counted=False` keeps an internal pin out of the lease metrics."""
        with self._lock:
            self._check_open()
            present = [k for k in keys if k in self._index]
            leading = self._leading(keys)
            self._leases.acquire(lease_id, present, counted)
        return leading

    def lease_run(self, lease_id: str, keys: Sequence[bytes]) -> int:
        """Pin the leading run of `keys` this tier holds under `lease_id`, in one step; its
        length. (A lookup leases its run here at once instead of key by key.)"""
        with self._lock:
            self._check_open()
            leading = self._leading(keys)
            self._leases.acquire(lease_id, keys[:leading])
        return leading

    def release(self, lease_id: str) -> None:
        """Release `lease_id`; an unknown or already released id is a counted no-op."""
        with self._lock:
            self._check_open()
            self._leases.release(lease_id)
            self._reclaim()

    def expire_leases(self) -> int:
        """Drop leases past their deadline (counted); returns how many keys became unpinned."""
        with self._lock:
            self._check_open()
            freed = self._leases.expire()
            self._reclaim()
        return len(freed)

    # ---- accounting ----------------------------------------------------------------------------

    def residency_bytes(self) -> int:
        """Bytes held by resident chunks (whole slots)."""
        return len(self._index) * self.slot_bytes

    def stats(self) -> MemoryTierStats:
        """Slot accounting now (for tests, doctor and logs)."""
        with self._lock:
            return MemoryTierStats(
                num_slots=self.num_slots,
                slot_bytes=self.slot_bytes,
                free=len(self._free),
                used=len(self._index),
                reserved=len(self._reserved),
                quarantined=len(self._quarantine),
                recent=self._policy.recent_count,
                frequent=self._policy.frequent_count,
                leases=len(self._leases),
            )

    def abandon_arena(self) -> None:
        """A device copy may still use the arena: `close` keeps it allocated and registered."""
        self._arena.abandon()

    def close(self) -> None:
        """Free the buffer; every later read, write or lease call raises RuntimeError."""
        with self._lock:
            self._closed = True
            self._index.clear()
            self._policy.clear()
            self._reserved.clear()
            self._reserved_parent.clear()
            self._writing.clear()
            self._quarantine.clear()
            self._free.clear()
            self._arena.close()
            self._views = [None] * len(self._views)
            self._buf = self._arena.tensor
            self._np = self._buf.numpy()
            self._residency.set(0)

    # ---- internals (callers hold the lock unless noted) ----------------------------------------

    def _slot_view(self, slot: int, n: int) -> torch.Tensor:
        """The first `n` bytes of `slot` (no lock needed: two threads filling one cache entry
        make equal views)."""
        if n != self.slot_bytes or slot >= len(self._views):
            off = slot * self.slot_bytes
            return self._buf[off : off + n]
        view = self._views[slot]
        if view is None:
            off = slot * self.slot_bytes
            view = self._views[slot] = self._buf[off : off + n]
        return view

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("memory tier is closed")

    def _checksum(self, key: bytes, slot: int, n: int) -> int:
        # no lock needed: the caller owns the slot. Skipped when reads never verify.
        if not self.verify_reads:
            return 0
        off = slot * self.slot_bytes
        return checksum(self.namespace, key, memoryview(self._np[off : off + n]))

    def _begin_read(self, key: bytes) -> tuple[int, int, int]:
        """Pin the slot of `key` against reuse; (-1, 0, 0) on a miss. No lock."""
        with self._lock:
            self._check_open()
            slot = self._index.get(key)
            if slot is None:
                return -1, 0, 0
            self._readers[slot] += 1
            return slot, self._length[slot], self._sum[slot]

    def _end_read(self, key: bytes, slot: int, bad: bool) -> None:
        """Drop the read pin; drop the entry if it failed verification. No lock."""
        with self._lock:
            self._readers[slot] -= 1
            if bad and self._index.get(key) == slot:
                self._mismatch.inc()
                self._unlink(key)
                self._quarantine[slot] = key
            if slot in self._quarantine:
                self._reclaim()

    def _leading(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` are resident (under the lock)."""
        n = 0
        for key in keys:
            if key not in self._index:
                break
            n += 1
        return n

    def _unpinned(self, key: bytes) -> bool:
        return (
            not self._leases.is_pinned(key)
            and self._readers[self._index[key]] == 0
            and key not in self._writing
        )

    def _victim(self) -> bytes | None:
        """The least recently used unpinned leaf that is not retained; a retained one instead
        when more retained leaves than memory's share came before it."""
        skipped: list[bytes] = []

        def evictable(key: bytes) -> bool:
            if not self._unpinned(key):
                return False
            if self._retained(key):
                skipped.append(key)
                return False
            return True

        key = self._policy.victim(evictable)
        # the rank's limit follows its largest tier (a disk tier keeps them too)
        return skipped[0] if len(skipped) > self._retained_cap else key

    def _done_writing(self, parent: bytes) -> None:
        left = self._writing[parent] - 1
        if left:
            self._writing[parent] = left
        else:
            del self._writing[parent]

    def _allocate(self, counted: bool = True) -> int:
        """A private slot: free, reclaimed or evicted; -1 (counted unless `counted=False`) when
        every slot is pinned."""
        if not self._free and self._quarantine:
            self._reclaim()
        if self._free:
            return self._free.pop()
        key = self._victim()
        if key is None:
            if counted:
                self._all_pinned.inc()
            return -1
        slot = self._index.pop(key)
        self._policy.evict(key)
        self._residency.set(len(self._index) * self.slot_bytes)
        self._evictions.inc()
        self._tell("removed", key)
        return slot

    def _publish(self, key: bytes, slot: int, n: int, want: int, parent: bytes) -> None:
        if key in self._index:
            # another writer published the same key while this copy ran; keep theirs
            self._free.append(slot)
            self._policy.touch([key])
            return
        self._index[key] = slot
        self._length[slot] = n
        self._sum[slot] = want
        self._policy.insert(key, 1, parent)
        self._residency.set(len(self._index) * self.slot_bytes)
        self._tell("stored", key)

    def _unlink(self, key: bytes) -> None:
        """Forget a resident key without a ghost (its slot is the caller's to free or reuse)."""
        del self._index[key]
        self._policy.remove(key)
        self._residency.set(len(self._index) * self.slot_bytes)
        self._tell("removed", key)

    def _tell(self, change: str, key: bytes) -> None:
        # under the tier's lock: a listener only records (KV events for routers)
        if self.listener is not None:
            self.listener(change, key)

    def _reclaim(self) -> None:
        """Free quarantined slots that no lease or reader can still see."""
        if not self._quarantine:
            return
        for slot, key in list(self._quarantine.items()):
            if self._readers[slot] == 0 and not self._leases.is_pinned(key):
                del self._quarantine[slot]
                self._free.append(slot)


def _check_key(key: bytes) -> None:
    if len(key) != KEY_BYTES:
        raise ValueError(f"chunk key must be {KEY_BYTES} bytes, got {len(key)}")


def _source(payload: Payload) -> tuple[torch.Tensor, int]:
    """The payload as a flat byte source for a copy (no copy made here), and its length."""
    if isinstance(payload, torch.Tensor):
        # byte reinterpretation needs unit stride; contiguous() copies only when it must
        flat = payload.contiguous().reshape(-1)
        if flat.dtype != torch.uint8:
            flat = flat.view(torch.uint8)
        return flat, flat.numel()
    view = memoryview(payload)
    if not view.c_contiguous:
        raise ValueError("payload memoryview must be C-contiguous; pass bytes(payload)")
    if view.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8), 0
    # torch's multi-threaded copy_ beats numpy's single memcpy for large slots
    return torch.frombuffer(view, dtype=torch.uint8), view.nbytes


def _spend_readonly_buffer_warning() -> None:
    # torch warns once per process that a tensor over a read-only buffer (bytes) is writable.
    # The tier only ever reads such tensors, so spend that one warning here, silenced.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.frombuffer(b"\0", dtype=torch.uint8)


_spend_readonly_buffer_warning()


def _never(key: bytes) -> bool:
    return False
