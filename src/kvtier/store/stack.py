"""TierStack: the memory tier written synchronously, lower tiers written behind, reads top-down.

A lookup counts the longest prefix held across tiers, leases each counted chunk where it lives
and touches the matched run tail-first in every chain-aware tier (memory, disk), so the chunks
below the HBM floor stay as fresh as the ones loaded; a read fills the caller's tensor from the
highest tier holding a verified copy and promotes lower-tier hits into memory. Writes carry each
chunk's parent key down to every tier, which evicts leaves first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvtier.config import MAX_WRITE_WAIT_MS
from kvtier.keys import state_key
from kvtier.metrics import Metrics
from kvtier.store.base import Tier
from kvtier.store.policy import NO_PARENT
from kvtier.store.retention import RETENTION_FILE, RetentionTable

if TYPE_CHECKING:
    from kvtier.store.memory import MemoryTier

log = logging.getLogger(__name__)

_WRITE_BEHIND = "write_behind"


@dataclass(frozen=True, slots=True)
class _Job:
    """One chunk to copy from memory into every lower tier, pinned under `lease_id` meanwhile."""

    key: bytes
    lease_id: str
    parent: bytes = NO_PARENT


_STOP = object()


class TierStack:
    """Tiers top-down: a `MemoryTier`, then lower tiers (disk, remote) fed by one write-behind
    thread through one bounded queue that sheds writes instead of blocking the caller."""

    def __init__(
        self,
        memory: MemoryTier,
        lower: Sequence[Tier] = (),
        metrics: Metrics | None = None,
        *,
        queue_depth: int = 256,
        max_leases: int = 65536,
        writes_lower: bool = True,
        retention_limit: int = 0,
        clock: Callable[[], float] | None = None,
        state_parts: int = 0,
        retention_share: float = 1.0,
        write_wait_s: float = 0.0,
    ) -> None:
        """`writes_lower=False`: the lower tiers are read only (another rank writes the records
        of a replicated layout there). `retention_limit`: chunks clients may retain on this rank
        (0: none); `retention_share`: of the memory tier's slots, the share retained chunks may
        hold (the limit follows the largest tier: past the share memory evicts them too, and a
        lower tier keeps them); `clock`: wall-clock seconds of retention deadlines (tests pass
        their own).
        `state_parts`: the parts of a hybrid model's boundary state record (0: no state groups),
        which the admin ops carry out on along with the chunk it ends. `write_wait_s`: how
        long `reserve` waits for the write-behind to unpin a slot (0: not at all)."""
        if metrics is None:
            raise ValueError("TierStack needs the rank's Metrics; pass metrics=Metrics(rank)")
        if state_parts < 0:
            raise ValueError(f"state_parts={state_parts} must be >= 0")
        self._state_parts = state_parts
        if not 0 <= write_wait_s <= MAX_WRITE_WAIT_MS / 1000:
            raise ValueError(
                f"write_wait_s={write_wait_s} must lie in [0, {MAX_WRITE_WAIT_MS / 1000:g}] seconds"
            )
        self._write_wait_s = write_wait_s
        if queue_depth <= 0 or max_leases <= 0:
            raise ValueError(
                f"queue_depth ({queue_depth}) and max_leases ({max_leases}) must be > 0"
            )
        names = [memory.name, *(t.name for t in lower)]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be distinct, got {names}")
        self._memory = memory
        self._lower: tuple[Tier, ...] = tuple(lower)
        self._listener: Callable[[str, str, bytes], None] | None = None
        self._writes_lower = writes_lower
        self._m = metrics
        self._queue: queue.Queue[_Job | object] = queue.Queue(maxsize=queue_depth)
        self._depth = metrics.queue(_WRITE_BEHIND)
        self._depth.set(0)
        # jobs enqueued and not yet finished; flush() waits on it reaching zero
        self._pending = 0
        # jobs finished (each unpins its chunk's slot): a reserve waiting for a slot wakes on it
        self._finished = 0
        self._cond = threading.Condition()
        self._seq = itertools.count()
        # lookup lease id -> indices of the tiers that hold it, so a release touches only those
        # (capped: past the cap the oldest entries go; their tier leases expire on their own)
        self._lease_tiers: OrderedDict[str, set[int]] = OrderedDict()
        self._max_leases = max_leases
        self._lease_lock = threading.Lock()
        self._closed = False
        self._abandon = threading.Event()
        self._prefetches: queue.Queue[list[bytes] | object] = queue.Queue(maxsize=64)
        self._prefetcher: threading.Thread | None = None
        self._prefetched = 0
        self.retention = RetentionTable(retention_limit, *(() if clock is None else (clock,)))
        self._retention_file = self._retention_path()
        if self._retention_file is not None:
            kept = self.retention.load(self._retention_file)
            if kept:
                log.info(
                    "kvtier: %d retained chunks carried over from %s", kept, self._retention_file
                )
        memory.protect(self.retention.holds, retention_share)
        for t in (memory, *self._lower):
            if t is not memory:
                t.protect(self.retention.holds)
            t.protect_until(self.retention.until)
        self._thread: threading.Thread | None = None
        if self._lower:
            self._thread = threading.Thread(
                target=self._drain, name="kvtier-write-behind", daemon=True
            )
            self._thread.start()

    # ---- introspection -------------------------------------------------------------------

    @property
    def tiers(self) -> list[str]:
        """Tier names, top-down."""
        return [t.name for t in self._all()]

    @property
    def memory(self) -> MemoryTier:
        """The top (memory) tier."""
        return self._memory

    @property
    def lower(self) -> tuple[Tier, ...]:
        """The tiers below memory, top-down."""
        return self._lower

    def holder(self, key: bytes) -> str | None:
        """Name of the highest tier holding `key`, or None."""
        for t in self._all():
            if t.contains(key):
                return t.name
        return None

    def listen(self, listener: Callable[[str, str, bytes], None]) -> None:
        """Be told `(change, tier, key)` whenever a tier stores ("stored") or drops ("removed") a
        chunk; a tier that cannot tell its evictions (remote) reports its stores only."""
        self._listener = listener
        for t in (self._memory, *self._lower):
            if t.reports_evictions:
                t.listener = lambda change, key, name=t.name: listener(change, name, key)

    def pending_writes(self) -> int:
        """Write-behind jobs queued or in progress."""
        with self._cond:
            return self._pending

    # ---- lookup and leases ---------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes], lease_id: str | None = None) -> int:
        """Longest prefix of `keys` that some tier holds; with `lease_id`, lease each counted
        chunk in the tier that holds it so it cannot be evicted before the load, and touch the
        counted run tail-first in every chain-aware tier (a probe without a lease does not)."""
        return self.lookup_run(keys, lease_id).chunks

    def lookup_run(
        self, keys: Sequence[bytes], lease_id: str | None = None, ends: Sequence[bytes] = ()
    ) -> LookupRun:
        """`lookup`, and the deepest tier any counted chunk lives in (the run's source). With
        `ends`, the run is cut back to end after the deepest chunk `i` whose `ends[i]` some
        tier holds; chunks from `len(ends)` on never end it. Every end held within the run is
        leased with it and named in `.ends` (chunk counts), so the client can cut all ranks
        at an end each of them holds."""
        run = self._lookup_run(keys, lease_id)
        if not ends:
            return run
        # the candidates deepest first: a lower tier is asked about all of them in one batch
        candidates = list(reversed(ends[: min(run.chunks, len(ends))]))
        presence: dict[int, dict[bytes, bool]] = {}
        touched: set[int] = set()
        held: list[int] = []
        for j, key in enumerate(candidates):
            if lease_id is None:
                there = self._memory.contains(key) or (
                    self._lower_holder(candidates, j, presence) is not None
                )
            else:
                there = self._lease_one(candidates, j, lease_id, touched, presence) is not None
            if not there:
                continue
            if not held and lease_id is not None:
                # recency as for the run it ends: a state evicted before its chunks would
                # cost the hit while they stay
                for t in self._all():
                    t.touch([key])
            held.append(len(candidates) - j)
        if lease_id is not None and touched:
            self._remember_lease(lease_id, touched)
        n = held[0] if held else 0
        return dataclasses.replace(self._run_of(run.sources[:n]), ends=tuple(reversed(held)))

    def _lookup_run(self, keys: Sequence[bytes], lease_id: str | None) -> LookupRun:
        sources: list[int] = []  # per counted chunk, the index of the tier serving it
        if lease_id is None:
            # presence per lower tier comes in one batch (one round trip per remote shard)
            known: dict[int, dict[bytes, bool]] = {}
            n = 0
            while n < len(keys):
                where = 0 if self._memory.contains(keys[n]) else self._lower_holder(keys, n, known)
                if where is None:
                    break
                sources.append(where)
                n += 1
            return self._run_of(sources)
        # memory always takes the lease (empty if it holds nothing), so each lookup lease is
        # counted released exactly once there and a second release as a double release
        touched: set[int] = {0}
        # presence in each lower tier, fetched in one batch the first time a key needs it (a
        # remote tier answers a whole batch in one round trip)
        presence: dict[int, dict[bytes, bool]] = {}
        # the run memory holds is leased in one step (key by key it cost ~1.5 us a chunk,
        # which was most of a lookup); the rest goes chunk by chunk through the tiers
        n = self._memory.lease_run(lease_id, keys)
        sources = [0] * n
        while n < len(keys):
            where = self._lease_one(keys, n, lease_id, touched, presence)
            if where is None:
                break
            sources.append(where)
            n += 1
        self._remember_lease(lease_id, touched)
        if n:
            run = keys[:n]
            for t in self._all():
                t.touch(run)
        return self._run_of(sources)

    def _run_of(self, sources: Sequence[int]) -> LookupRun:
        """The answer for chunks served by tiers `sources` (indexes): their count, the deepest
        tier, and the runs of consecutive chunks per tier (the load-or-recompute choice reads
        each run at its own tier's speed)."""
        tiers = self._all()
        runs: list[tuple[str, int]] = []
        for where in sources:
            name = tiers[where].name
            if runs and runs[-1][0] == name:
                runs[-1] = (name, runs[-1][1] + 1)
            else:
                runs.append((name, 1))
        deepest = tiers[max(sources)].name if sources else ""
        return LookupRun(len(sources), deepest, tuple(runs), tuple(sources))

    def _lease_one(
        self,
        keys: Sequence[bytes],
        idx: int,
        lease_id: str,
        touched: set[int],
        presence: dict[int, dict[bytes, bool]],
    ) -> int | None:
        """Lease `keys[idx]` in the highest tier holding it; that tier's index (0 = memory),
        or None if no tier does."""
        key = keys[idx]
        # memory's lease doubles as its presence check (it pins only what it holds)
        if self._memory.lease(lease_id, [key]) > 0:
            return 0
        for i, t in enumerate(self._lower, start=1):
            if not self._present(i, t, keys, idx, presence):
                continue
            if not t.pins:
                # a tier that cannot pin (remote): its batched presence check is the answer,
                # and there is nothing to release later
                return i
            touched.add(i)
            # the lease is the final presence check: a chunk evicted since contains() is not
            # counted, so nothing counted can vanish before the load; memory already counts
            # this lookup's lease, so lower tiers hold it uncounted where they can
            if _leased(t.lease(lease_id, [key], counted=False)):
                return i
        return None

    def _present(
        self,
        i: int,
        tier: Tier,
        keys: Sequence[bytes],
        idx: int,
        presence: dict[int, dict[bytes, bool]],
    ) -> bool:
        """Whether lower tier `i` holds `keys[idx]`, asking it once for the whole rest of the
        keys the first time a key needs it (a remote tier answers a batch in one round trip)."""
        known = presence.get(i)
        if known is None or keys[idx] not in known:
            rest = keys[idx:]
            known = presence[i] = dict(zip(rest, tier.contains_many(rest), strict=True))
        return known[keys[idx]]

    def _lower_holder(
        self, keys: Sequence[bytes], idx: int, presence: dict[int, dict[bytes, bool]]
    ) -> int | None:
        """Index (from 1) of the highest lower tier holding `keys[idx]`, or None."""
        for i, t in enumerate(self._lower, start=1):
            if self._present(i, t, keys, idx, presence):
                return i
        return None

    def release(self, lease_id: str) -> None:
        """Release a lookup's lease in every tier that holds it; an unknown id is a counted
        no-op."""
        with self._lease_lock:
            # an id this stack never saw (or forgot past its cap) is still memory's to judge
            touched = self._lease_tiers.pop(lease_id, {0})
        tiers = self._all()
        for i in sorted(touched):
            tiers[i].release(lease_id)

    def _remember_lease(self, lease_id: str, touched: set[int]) -> None:
        with self._lease_lock:
            prev = self._lease_tiers.pop(lease_id, set())
            self._lease_tiers[lease_id] = prev | touched
            while len(self._lease_tiers) > self._max_leases:
                self._lease_tiers.popitem(last=False)

    # ---- reads ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def pinned_view(self, key: bytes) -> Iterator[torch.Tensor | None]:
        """A zero-copy, verified view of `key`'s payload in memory, its slot pinned until the
        block ends (copy out of it inside the block); None when memory does not hold it:
        `read_into` a buffer instead."""
        with self._memory.pinned_view(key) as view:
            if view is not None:
                self._m.tier_hit(self._memory.name).inc()
            yield view

    def read_into(self, key: bytes, dst: torch.Tensor, parent: bytes = NO_PARENT) -> str | None:
        """Fill `dst` from the highest tier holding a verified copy; the serving tier's name,
        or None on a miss. A lower-tier hit is promoted into memory as the chunk after
        `parent`. Reads change no recency: the lookup that leased them touched the run."""
        flat = _flat_bytes(dst)
        if self._memory.read_into(key, flat):
            self._m.tier_hit(self._memory.name).inc()
            return self._memory.name
        for t in self._lower:
            if t.reads_into and flat.device.type == "cpu":
                # the tier reads and verifies into its own reusable buffer, then into dst
                if not t.read_into(key, flat):
                    continue
                self._m.tier_hit(t.name).inc()
                self._memory.put(key, flat, parent)
                return t.name
            payload = t.get(key)
            if payload is None:
                continue
            src = np.frombuffer(payload, dtype=np.uint8)
            if src.size != flat.numel():
                # the record verified but cannot be this layout's chunk; never copy it
                self._m.verify_failure(t.name, "length_mismatch").inc()
                continue
            _copy_into(flat, src)
            self._m.tier_hit(t.name).inc()
            # promotion is best effort: a full memory tier still served this read
            self._memory.put(key, payload, parent)
            return t.name
        return None

    # ---- writes --------------------------------------------------------------------------

    def put(
        self, key: bytes, payload: bytes | memoryview | torch.Tensor, parent: bytes = NO_PARENT
    ) -> bool:
        """Store in memory now, as the chunk after `parent`, and queue the lower-tier writes;
        False if memory refused it."""
        self._check_open()
        if not self._memory.put(key, payload, parent):
            self._drop_all(key, "memory_full")
            return False
        self._write_behind(key, parent)
        return True

    def reserve(self, key: bytes, parent: bytes = NO_PARENT) -> torch.Tensor | None:
        """A memory slot to fill in place for `key`, the chunk after `parent` (which the slot
        never evicts); `commit` or `abort` it afterwards. When every slot is pinned while
        write-behind jobs are pending, wait up to `write_wait_s` for one to unpin a slot."""
        self._check_open()
        # read before the try (an int read needs no lock): a write that finishes between a
        # failed try and the wait below is then seen, and retried at once
        seen = self._finished
        slot = self._memory.reserve(key, parent)
        if slot is not None or self._write_wait_s <= 0 or self._memory.holds_or_reserves(key):
            return slot
        return self._reserve_after_writes(key, parent, seen)

    def _reserve_after_writes(self, key: bytes, parent: bytes, seen: int) -> torch.Tensor | None:
        """Retry `reserve` each time a write-behind job finishes (the first time: since
        `seen`), until one succeeds, nothing is left pending, or `write_wait_s` passed. Without
        this a memory tier smaller than the lower tiers' backlog drops every save the slow
        writer falls behind on: those chunks reach no tier at all, where waiting costs the save
        lane a few milliseconds a chunk."""
        deadline = time.monotonic() + self._write_wait_s
        with self._cond:
            if self._pending == 0 and self._finished == seen:
                return None  # no write below will unpin anything: not a wait
        while True:
            with self._cond:
                left = deadline - time.monotonic()
                woke = left > 0 and self._cond.wait_for(
                    lambda seen=seen: self._finished != seen or self._closed or self._pending == 0,
                    timeout=left,
                )
                if not woke or self._closed:
                    break
                # taken before the retry: a write finishing during it wakes the next wait
                seen = self._finished
            slot = self._memory.reserve(key, parent, counted=False)
            if slot is not None:
                self._m.slot_wait("slot").inc()
                return slot
            if self._memory.holds_or_reserves(key):
                return None  # another writer stored or reserved it meanwhile
            with self._cond:
                if self._pending == 0 and self._finished == seen:
                    break
        self._m.slot_wait("none").inc()
        return None

    def commit(self, key: bytes, nbytes: int | None = None, parent: bytes = NO_PARENT) -> None:
        """Publish the slot reserved for `key` (its first `nbytes`, default all) as the chunk
        after `parent`, and queue the lower-tier writes. A save commits its chunks deepest
        first, so every tier sees each parent arrive already holding its children."""
        self._check_open()
        self._memory.commit(key, nbytes, parent)
        self._write_behind(key, parent or self._memory.parent_of(key))

    def abort(self, key: bytes) -> None:
        """Give back a reserved slot without publishing it."""
        self._memory.abort(key)

    def _write_behind(self, key: bytes, parent: bytes) -> None:
        if not self._lower or not self._writes_lower:
            return
        lease_id = f"kvtier.write_behind.{next(self._seq)}"
        if self._memory.lease(lease_id, [key], counted=False) == 0:
            # evicted between put and here (a tiny memory tier under pressure)
            self._memory.release(lease_id)
            self._drop_all(key, "evicted")
            return
        with self._cond:
            try:
                self._queue.put_nowait(_Job(key, lease_id, parent))
            except queue.Full:
                enqueued = False
            else:
                enqueued = True
                self._pending += 1
            self._depth.set(self._queue.qsize())
        if not enqueued:
            self._memory.release(lease_id)
            self._drop_all(key, "queue_full")

    def _drop_all(self, key: bytes, reason: str) -> None:
        for t in self._lower:
            self._m.dropped_write(t.name, reason).inc()

    def _drain(self) -> None:
        """The write-behind thread: copy each queued chunk from memory into every lower tier."""
        while True:
            job = self._queue.get()
            self._depth.set(self._queue.qsize())
            if job is _STOP:
                return
            if not isinstance(job, _Job):
                raise TypeError(f"write-behind queue holds {job!r}, not a job")
            try:
                if self._abandon.is_set():
                    self._drop_all(job.key, "closed")
                else:
                    self._write_lower(job)
            finally:
                self._memory.release(job.lease_id)
                with self._cond:
                    self._pending -= 1
                    self._finished += 1
                    self._cond.notify_all()

    def _write_lower(self, job: _Job) -> None:
        for t in self._lower:
            # re-lease before each tier: it refreshes the deadline, so a slow earlier tier
            # cannot let the slot be reused before this tier has checksummed the bytes
            if self._memory.lease(job.lease_id, [job.key], counted=False) == 0:
                self._m.dropped_write(t.name, "not_in_memory").inc()
                continue
            try:
                view = self._memory.view(job.key)
                if view is None:
                    # the slot failed verification (counted by the memory tier)
                    self._m.dropped_write(t.name, "not_in_memory").inc()
                    continue
                # a False return was counted by the tier itself
                data = memoryview(_flat_bytes(view).numpy())
                stored = t.put(job.key, data, parent=job.parent)
                if stored and self._listener is not None and not t.reports_evictions:
                    self._listener("stored", t.name, job.key)
            except Exception:
                # a broken tier must not kill the thread that feeds every lower tier
                log.exception("kvtier: write-behind to %s tier failed", t.name)
                self._m.store_failure(t.name, "error").inc()

    # ---- retention and admin ---------------------------------------------------------------

    def admin(self, op: str, keys: Sequence[bytes], until: float = 0.0) -> int:
        """Carry out an admin request (`lookup.messages.ADMIN_OPS`) on `keys`; how many keys it
        acted on: retained, released, brought into memory, or deleted from some tier."""
        self._check_open()
        if op == "retain":
            n = self.retention.retain(keys, until)
            # a boundary state is a record of its own: without it the retained run's hit ends
            # at an earlier boundary, or at none
            states = self._states_of(keys[:n])
            self.retention.retain(states, until)
            if self._writes_lower:
                for t in self._lower:
                    t.extend_ttl([*keys[:n], *states], until)
        elif op == "release":
            n = self.retention.release(keys)
            self.retention.release(self._states_of(keys))
        elif op == "prefetch":
            return self._queue_prefetch(keys)
        elif op == "forget":
            n = self.forget(keys)
        else:
            raise ValueError(f"admin op {op!r} is not retain, release, prefetch or forget")
        self._save_retention()
        return n

    def prefetch(self, keys: Sequence[bytes]) -> int:
        """Bring the chunks of `keys` that only a lower tier holds into memory (each after the
        key before it), and the boundary states they end; how many chunks came up. Stops at
        the first chunk no tier holds."""
        moved = held = 0
        for i, key in enumerate(keys):
            if not self._memory.contains(key):
                payload = None
                for t in self._lower:
                    payload = t.get(key)
                    if payload is not None:
                        break
                if payload is None:
                    break
                if not self._memory.put(key, payload, keys[i - 1] if i else NO_PARENT):
                    break
                moved += 1
            held += 1
        self._prefetch_states(keys[:held])
        return moved

    def _prefetch_states(self, keys: Sequence[bytes]) -> None:
        """Bring the boundary states `keys` end into memory where only a lower tier holds them
        (asked in one batch per tier: most boundaries have none), parts deepest first: each
        part's parent is the next, the last's the chunk."""
        if not self._state_parts or not keys:
            return
        firsts = [state_key(k, 0) for k in keys]
        below = [False] * len(keys)
        for t in self._lower:
            below = [b or h for b, h in zip(below, t.contains_many(firsts), strict=True)]
        for key, first, there in zip(keys, firsts, below, strict=True):
            if not there or self._memory.contains(first):
                continue
            parts = self._states_of([key])
            payloads = [next((p for t in self._lower if (p := t.get(k)) is not None), None)
                        for k in parts]  # fmt: skip
            if any(p is None for p in payloads):
                continue  # a part is gone: the boundary has no whole state to bring up
            for j in reversed(range(len(parts))):
                up = parts[j + 1] if j + 1 < len(parts) else key
                if not self._memory.put(parts[j], payloads[j], up):
                    break

    def _queue_prefetch(self, keys: Sequence[bytes]) -> int:
        """Hand `keys` to the prefetch thread (reads from disk or the store must not hold up
        the rank's lookups); how many of them only a lower tier holds now."""
        up = [not self._memory.contains(k) for k in keys]
        below: list[bool] = [False] * len(keys)
        for t in self._lower:
            held = t.contains_many(keys)
            below = [b or (u and h) for b, u, h in zip(below, up, held, strict=True)]
        with self._cond:
            if self._closed:
                return 0  # closed meanwhile: no thread may start over closed tiers
            if self._prefetcher is None:
                self._prefetcher = threading.Thread(
                    target=self._prefetch_loop, name="kvtier-prefetch", daemon=True
                )
                self._prefetcher.start()
        try:
            self._prefetches.put_nowait(list(keys))
        except queue.Full:
            log.warning(
                "kvtier: prefetch of %d keys dropped: %d prefetches queued",
                len(keys),
                self._prefetches.maxsize,
            )
            return 0
        return sum(below)

    def _prefetch_loop(self) -> None:
        while True:
            keys = self._prefetches.get()
            if keys is _STOP:
                return
            try:
                moved = self.prefetch(keys)
            except Exception:  # one failed prefetch must not end the rank's later ones
                log.exception("kvtier: prefetch of %d keys failed", len(keys))
                continue
            self._m.prefetched_chunks.inc(moved)
            with self._cond:
                self._prefetched += 1
                self._cond.notify_all()

    def wait_prefetched(self, count: int, timeout_s: float) -> bool:
        """Wait until `count` prefetches in all have finished (for tests and tools)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._prefetched >= count, timeout=timeout_s)

    def forget(self, keys: Sequence[bytes]) -> int:
        """Delete `keys` from every tier (the shared store included) and stop retaining them;
        how many some tier held. The boundary states the keys end go with them (derived from the
        same tokens). A save still in flight may store a key again."""
        states = self._states_of(keys)
        self.retention.release([*keys, *states])
        for key in states:
            self._delete_everywhere(key)
        return sum(self._delete_everywhere(key) for key in keys)

    def _delete_everywhere(self, key: bytes) -> bool:
        """Delete `key` from every tier this rank writes; whether some tier held it."""
        found = False
        for t in self._all():
            if self._writes_lower or t is self._memory:
                found = t.delete(key) or found
        return found

    def _states_of(self, keys: Sequence[bytes]) -> list[bytes]:
        """Every part of the boundary state each of `keys` may end (none without state
        groups); states are saved at some boundaries only, so most may be missing."""
        return [state_key(k, j) for k in keys for j in range(self._state_parts)]

    def _retention_path(self) -> Path | None:
        if not self._writes_lower:
            return None
        for t in self._lower:
            if t.directory is not None:
                return t.directory / RETENTION_FILE
        return None

    def _save_retention(self) -> None:
        if self._retention_file is None:
            return
        try:
            self.retention.save(self._retention_file)
        except OSError as e:
            # retention still holds in this process; only a restart would lose it
            log.warning("kvtier: retention table not saved to %s: %s", self._retention_file, e)

    # ---- lifecycle -----------------------------------------------------------------------

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued write-behind job finished; False if `timeout_s` passed."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending == 0, timeout=timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish queued writes (dropping them if they cannot finish in time), stop the
        write-behind thread and close every tier."""
        with self._cond:  # a prefetch queued meanwhile sees it before starting its thread
            if self._closed:
                return
            self._closed = True
            prefetcher = self._prefetcher
            self._cond.notify_all()  # a reserve waiting for a slot gives up now
        if self._thread is not None:
            if not self.flush(timeout_s):
                log.warning("kvtier: write-behind did not drain in %.1fs; dropping", timeout_s)
                self._abandon.set()
            try:
                self._queue.put(_STOP, timeout=timeout_s)
            except queue.Full:
                log.warning("kvtier: write-behind queue stuck; a lower tier is not returning")
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("kvtier: write-behind thread still busy after %.1fs", timeout_s)
        self._save_retention()
        if prefetcher is not None:
            try:
                self._prefetches.put(_STOP, timeout=timeout_s)
            except queue.Full:
                log.warning("kvtier: prefetch queue stuck; a lower tier is not returning")
            prefetcher.join(timeout_s)
        for t in self._all():
            t.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("TierStack is closed; build a new one")

    def _all(self) -> tuple[Tier, ...]:
        return (self._memory, *self._lower)


@dataclass(frozen=True, slots=True)
class LookupRun:
    """A lookup's answer on one rank: leading chunks held, and the deepest tier among them."""

    chunks: int
    tier: str  # "" when nothing was held
    # (tier, chunks) per run of consecutive chunks one tier serves, in prompt order
    runs: tuple[tuple[str, int], ...] = ()
    # per counted chunk, the index of the tier serving it (0 = memory)
    sources: tuple[int, ...] = ()
    # with ends asked: the chunk counts (ascending) after which this rank holds the end
    ends: tuple[int, ...] = ()


def _leased(result: int | None) -> bool:
    """Whether a tier's `lease()` pinned the one key asked; a tier returning None (the bare
    protocol) is taken at its contains() word."""
    return result is None or result > 0


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """`t` viewed as a flat uint8 tensor over the same memory."""
    if not t.is_contiguous():
        raise ValueError(f"tensor must be contiguous to hold a chunk (shape {tuple(t.shape)})")
    return t.reshape(-1).view(torch.uint8)


def _copy_into(dst: torch.Tensor, src: np.ndarray) -> None:
    if dst.device.type == "cpu":
        dst.numpy()[:] = src
    else:
        # torch wants a writable host buffer; the copy is the staging hop a device needs anyway
        dst.copy_(torch.from_numpy(src.copy()), non_blocking=False)
