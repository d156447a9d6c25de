"""Local-disk tier: one verified record file per chunk, bounded by bytes, evicted by the same
chain-aware `ChainPolicy` as the memory tier (weighted by file bytes).

Layout: `<dir>/<namespace hex>/<key hex[:2]>/<key hex>.kvr`, so namespaces sharing a directory
stay apart and a restarted engine finds its own records again (their chain links are learned
again from the first lookups that touch them).

The budget is checked against the filesystem at startup; if the filesystem still fills up (other
files, other ranks), a write that hits ENOSPC on a filesystem that really lacks the room lowers
the budget by what is missing, evicts that much and retries, so the tier keeps storing instead
of failing every write; the budget follows the room back up as it returns.

Data at rest belongs to its owner: what the tier creates is 0700/0600, it refuses directories
others own, can write or redirect with a symlink, and indexes only record files of ours that
nobody else can write (`disk_dirs`); one live process holds a namespace directory, by `flock`
(`disk_lock`: a second one refuses, or uses `<namespace>.<n>` with disk_conflict=own_dir); and
namespace directories unused for `gc_days` are removed at startup (`disk_gc`).

Why one module over 500 lines: one class, the files and the byte budget under one lock; the
record format (`record`) and the eviction order (`policy`) are apart already.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtier.config import format_size
from kvtier.errors import StartupError
from kvtier.metrics import Metrics
from kvtier.store import record
from kvtier.store.base import TierBase
from kvtier.store.disk_dirs import (
    PRIVATE_FILE,
    check_private,
    make_private_dir,
    open_disk_dir,
    open_private_dir,
    untrusted,
)
from kvtier.store.disk_gc import Collected, collect
from kvtier.store.disk_lock import CONFLICTS, LOCK_NAME, DirLock, claim, find_owned
from kvtier.store.lease import LeaseTable
from kvtier.store.policy import NO_PARENT, ChainPolicy
from kvtier.store.retention import RETENTION_FILE, RETENTION_TEMP_PREFIX
from kvtier.store.secret import generated_secret
from kvtier.throttled_log import ThrottledLog

log = logging.getLogger(__name__)

_RECORD_NAME = re.compile(r"^[0-9a-f]{32}\.kvr$")
_SHARD_NAME = re.compile(r"^[0-9a-f]{2}$")
_TMP_SUFFIX = ".tmp"
_MISSING = "missing"  # an indexed record whose file another process removed
_TRUNCATED = "truncated"  # a record file shorter than a header: never written whole
# a full disk and an exhausted quota are the same event to an operator
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
# ENOSPC retries per write: each one lowers the budget and evicts what the filesystem lacks
_NO_SPACE_RETRIES = 3
# a tier that only reads marks its directory used this often (GC ages it by the lock's mtime)
_TOUCH_EVERY_S = 3600.0
_NAMESPACE_DIR = "disk namespace directory"
_SHARD_DIR = "disk tier shard directory"
# untrusted record files named in the startup warning; the count says how many there are
_UNTRUSTED_NAMED = 10
# how long a follower waits for its engine's owner rank to lock a directory (own_dir)
_FOLLOW_WAIT_S = 60.0


@dataclass(frozen=True, slots=True)
class ScanResult:
    """What the start-up scan of the namespace directory found."""

    entries: int
    bytes: int
    stale_temps_removed: int
    ignored_files: int
    # record files not indexed: not a regular file of ours, or writable by others
    untrusted_files: int = 0


class DiskTier(TierBase):
    """Chunk records as files under one namespace directory, evicted leaves-first to stay under a
    byte cap that the filesystem can really hold.

    Thread-safe: the stack's write-behind thread writes while the engine thread reads.
    """

    name = "disk"
    reports_evictions = True

    def __init__(
        self,
        directory: str | Path,
        max_bytes: int,
        namespace: bytes,
        metrics: Metrics,
        *,
        lease_ttl_s: float = 30.0,
        max_leases: int = 65536,
        clock: Callable[[], float] = time.monotonic,
        follower: bool = False,
        gc_days: float = 30.0,
        conflict: str = "refuse",
        codec: record.RecordCodec | None = None,
        engine: str = "",
    ) -> None:
        """`follower`: another process (rank 0 of a replicated layout) owns the directory and
        writes and evicts its records; this tier only reads them, finding new ones on disk
        (it takes no lock and removes nothing). `gc_days` (disk_gc_days): namespace
        directories of `directory` unused this long are removed at startup, 0 = never.
        `conflict` (disk_conflict): when another live process holds the namespace directory,
        "refuse" (StartupError naming its pid) or "own_dir" (use `<namespace>.<n>`). `codec`
        seals and opens the records (the deployment's `record_key`); without one, a key this
        disk tier generates once in `directory` (a private disk tier needs no setup).
        `engine` names the engine replica this rank belongs to: the owner writes it in its
        lock, and a follower under "own_dir" reads the directory whose lock names it."""
        if max_bytes <= 0:
            raise ValueError(f"disk tier max_bytes must be > 0, got {max_bytes}; set a disk size")
        if len(namespace) != record.NAMESPACE_BYTES:
            raise ValueError(
                f"namespace must be {record.NAMESPACE_BYTES} bytes, got {len(namespace)}"
            )
        if conflict not in CONFLICTS:
            raise ValueError(
                f"disk tier conflict={conflict!r} is not one of {CONFLICTS}; use 'refuse' or "
                "'own_dir' (disk_conflict)"
            )
        if not gc_days >= 0:
            raise ValueError(
                f"disk tier gc_days={gc_days!r} must be >= 0 (disk_gc_days); 0 never removes"
            )
        self._ns = namespace
        if codec is None:
            keys = record.RecordKeys.derive(generated_secret(Path(directory)))
            codec = record.RecordCodec(namespace, keys)
        elif codec.namespace != namespace:
            raise ValueError("the record codec was built for another namespace")
        self.codec = codec
        self._codec = codec
        self._limit = max_bytes  # disk_bytes, as configured
        self._max = max_bytes  # the budget in force: lower while the filesystem is full
        self._m = metrics
        self.follower = follower
        self._engine = engine
        self._lock = threading.Condition(threading.RLock())
        self._index: dict[bytes, int] = {}  # key -> file bytes (header + payload)
        self._policy = ChainPolicy(max_bytes)
        # told ("stored" | "removed", key) on every change of what the tier holds
        self.listener: Callable[[str, bytes], None] | None = None
        self._bytes = 0
        # bytes promised to writes in flight, so concurrent puts cannot overshoot the cap
        self._reserved = 0
        self._inflight: set[bytes] = set()
        # parents of writes in flight: room for a child is never made by evicting its parent
        self._writing: Counter[bytes] = Counter()
        # chunks a client asked to keep (`protect`): never victims while retained
        self._retained: Callable[[bytes], bool] = _never
        self._leases = LeaseTable(metrics, lease_ttl_s, max_leases, clock)
        self._bad_records = ThrottledLog(log, clock=clock)
        self._closed = False
        # keys a follower found untrusted on disk, counted once each
        self._untrusted: set[bytes] = set()
        # held for the tier's lifetime by the owner of the directory; a follower holds none
        self._dir_lock: DirLock | None = None
        self._touched = time.monotonic()
        # namespace directories the startup GC removed
        self.collected: tuple[Collected, ...] = ()
        self._root = self._open_root(Path(directory), conflict, gc_days)
        try:
            self._m.capacity(self.name).set(max_bytes)
            self.scan = self._scan()
            if not follower:
                self._check_filesystem(directory)
                with self._lock:
                    self._evict_to(self._max)
                    self._publish()
        except BaseException:
            self._release_dir()
            raise

    def _open_root(self, base: Path, conflict: str, gc_days: float) -> Path:
        """Check (and create) disk_dir and the namespace directory; the owner locks it (or its
        own_dir variant) and removes unused namespaces beside it."""
        base_fd = open_disk_dir(base)
        try:
            name = self._ns.hex()
            if self.follower:
                os.close(open_private_dir(base_fd, base, name, _NAMESPACE_DIR))
                if conflict == "own_dir" and self._engine:
                    # another engine may hold `name`: the owner of ours took the first free one
                    return self._owners_dir(base_fd, base, name)
                return base / name
            self._dir_lock = claim(
                base_fd, base, name, conflict, what=_NAMESPACE_DIR, engine=self._engine
            )
            try:
                # before the space check: what GC frees is room this tier may use
                self.collected = collect(base_fd, base, gc_days)
            except BaseException:
                self._release_dir()
                raise
            return self._dir_lock.directory
        finally:
            os.close(base_fd)

    def _owners_dir(self, base_fd: int, base: Path, name: str) -> Path:
        """The namespace directory this engine's owner rank locked (it may start after this
        rank: waited for, bounded)."""
        deadline = time.monotonic() + _FOLLOW_WAIT_S
        pause = threading.Event()
        while True:
            found = find_owned(base_fd, base, name, self._engine)
            if found is not None:
                return found
            if time.monotonic() >= deadline:
                raise StartupError(
                    f"no {_NAMESPACE_DIR} under disk_dir={str(base)!r} is locked by this "
                    f"engine's writing rank (engine {self._engine!r}) after "
                    f"{_FOLLOW_WAIT_S:.0f}s; did rank 0 of the stage start? With "
                    "disk_conflict=own_dir the other ranks read the directory it took"
                )
            pause.wait(0.05)

    # ---- Tier protocol -------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        """True if a record file for `key` is indexed (no read; a follower looks on disk: the
        owner writes and evicts behind its back)."""
        with self._lock:
            return self._has(key)

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """`contains` for a batch (a local index: no I/O, but a follower's stat of each file)."""
        with self._lock:
            return [self._has(k) for k in keys]

    def _has(self, key: bytes) -> bool:
        """Whether a record of `key` is held (under the lock): the index; a follower stats the
        file, indexing one the owner wrote since and forgetting one it evicted."""
        if not self.follower:
            return key in self._index
        path = self._path(key)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            self._forget(key)  # the owner evicted it
            return False
        if key in self._index:
            return True
        why = untrusted(st)
        if why is None and st.st_size < record.HEADER_BYTES:
            # renamed into place with no data (a power cut before the write reached the disk)
            why = _TRUNCATED
        if why is not None:
            if key not in self._untrusted:  # counted and logged once a key
                self._untrusted.add(key)
                reason = _TRUNCATED if why == _TRUNCATED else "untrusted_file"
                self._m.verify_failure(self.name, reason).inc()
                log.warning("kvtier: disk tier follower did not index %s: %s", path, why)
            return False
        size = st.st_size
        self._index[key] = size
        self._bytes += size
        self._policy.insert(key, size)
        # the owner keeps the files within the budget; this index of them stays within it too
        while self._bytes > self._max and len(self._index) > 1:
            victim = self._policy.victim(lambda k: k != key and not self._leases.is_pinned(k))
            if victim is None:
                break
            self._forget(victim)
        self._publish()
        return True

    def get(self, key: bytes) -> bytes | memoryview | None:
        """The verified payload of `key`, or None. A bad or unreadable file is deleted + counted."""
        with self._lock:
            self._check_open()
            if not self._has(key):
                return None
            size = self._index[key]
        path = self._path(key)
        try:
            buf, ino = _read_file(path, size)
        except RefusedFile as e:
            # another process put something else under the record's name (a FIFO would block
            # the lane forever, a sparse giant file would be read whole into memory)
            log.warning("kvtier: disk tier refused %s: %s", path, e)
            self._drop_bad(key, None, e.reason)
            return None
        except FileNotFoundError:
            if self.follower:
                # the owner evicted it: a miss, not a bad record
                self._forget(key)
                return None
            self._drop_bad(key, None, _MISSING)
            return None
        except OSError as e:
            log.warning("kvtier: disk tier cannot read %s: %s", path, e)
            self._drop_bad(key, None, "io_error")
            return None
        try:
            payload = self._codec.open(buf, key)
        except record.RecordError as e:
            # files in the tier's directory are untrusted: a flood of bad ones may not fill
            # the log (the counter carries the rate)
            self._bad_records.warning(
                e.reason, "kvtier: disk record %s failed verification: %s", path, e
            )
            self._drop_bad(key, ino, e.reason)
            return None
        self._touch_if_due()
        return payload

    def put(self, key: bytes, payload: bytes | memoryview, parent: bytes = NO_PARENT) -> bool:
        """Write `payload` atomically (temp file + rename) as the chunk after `parent`; False
        (counted) when it cannot."""
        if self.follower:
            raise RuntimeError(
                "put on a follower disk tier: only the owner of a replicated layout writes"
            )
        with self._lock:
            self._check_open()
            if key in self._index:
                # keys are content hashes inside the namespace: the file already holds these bytes
                self._resident_again(key, parent)
                return True
        # sealed outside the lock: tagging (or encrypting) a 32 MiB chunk must not stall readers
        header, payload = self._codec.seal(key, payload)
        size = len(header) + memoryview(payload).nbytes
        with self._lock:
            self._check_open()
            # one writer per key; a second put waits for the first and then sees its outcome
            self._lock.wait_for(lambda: key not in self._inflight)
            if key in self._index:
                self._resident_again(key, parent)
                return True
            if self._max < self._limit:
                self._regrow()
            if size > self._max:
                self._m.store_failure(self.name, "too_large").inc()
                return False
            self._writing[parent] += 1
            self._evict_to(self._max - size - self._reserved)
            if self._bytes + self._reserved + size > self._max:
                # what is left is leased by lookups; shedding this write is the bounded choice
                self._done_writing(parent)
                self._m.store_failure(self.name, "full").inc()
                return False
            self._reserved += size
            self._inflight.add(key)
        path = self._path(key)
        ok = False
        try:
            for attempt in range(_NO_SPACE_RETRIES + 1):
                try:
                    self._write(key, path, header, payload, size, parent)
                    ok = True
                    break
                except OSError as e:
                    full = e.errno in _NO_SPACE
                    if full and attempt < _NO_SPACE_RETRIES and self._make_room(size):
                        continue
                    reason = "enospc" if full else "io_error"
                    log.warning(
                        "kvtier: disk tier could not store %s (%s): %s", path.name, reason, e
                    )
                    self._m.store_failure(self.name, reason).inc()
                    break
        finally:
            with self._lock:
                self._done_writing(parent)
                self._reserved -= size
                self._inflight.discard(key)
                self._publish()
                self._lock.notify_all()
        return ok

    def lease(self, lease_id: str, keys: Sequence[bytes], counted: bool = True) -> int:
        """Pin every key of `keys` this tier holds under `lease_id`; returns how many leading
        keys it holds (as MemoryTier does). `counted=False` keeps it out of the lease metrics."""
        with self._lock:
            held = [self._has(k) for k in keys]
            self._leases.acquire(lease_id, [k for k, h in zip(keys, held, strict=True) if h],
                                 counted)  # fmt: skip
            leading = 0
            for h in held:
                if not h:
                    break
                leading += 1
            return leading

    def release(self, lease_id: str) -> None:
        """Release `lease_id`; an unknown id is a counted no-op."""
        with self._lock:
            self._leases.release(lease_id)

    def delete(self, key: bytes) -> bool:
        """Delete the record of `key`, adopted or not; whether there was one."""
        with self._lock:
            self._check_open()
            known = key in self._index
            if known:
                self._bytes -= self._index.pop(key)
                self._policy.remove(key)
                self._publish()
                self._tell("removed", key)
            path = self._path(key)
            existed = known or path.exists()
            _remove(path)
        return existed

    def protect(self, retained: Callable[[bytes], bool]) -> None:
        """Never evict a record while `retained(key)` is true (a client's retention hint)."""
        self._retained = retained

    def residency_bytes(self) -> int:
        """Bytes of record files this tier holds now."""
        with self._lock:
            return self._bytes

    def close(self) -> None:
        """Forget the index and release the directory's lock; files stay on disk for the next
        start. Unusable afterwards."""
        with self._lock:
            self._closed = True
            self._index.clear()
            self._policy.clear()
            self._bytes = 0
            self._publish()
            self._release_dir()

    # ---- extras shared with MemoryTier ---------------------------------------------------

    def lookup_prefix(self, keys: Sequence[bytes]) -> int:
        """Number of leading `keys` this tier holds; the run counted is touched tail-first."""
        with self._lock:
            n = 0
            for k in keys:
                if not self._has(k):
                    break
                n += 1
            self._policy.touch(keys[:n])
            return n

    def touch(self, keys: Sequence[bytes]) -> None:
        """A lookup used the run `keys` (leading chunks in chain order): reference the resident
        ones tail-first and learn their chain links."""
        with self._lock:
            self._check_open()
            self._policy.touch(keys)

    @property
    def budget_bytes(self) -> int:
        """The byte cap in force: `max_bytes`, or lower once the filesystem filled up."""
        with self._lock:
            return self._max

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    @property
    def directory(self) -> Path:
        """The namespace directory this tier owns: `<disk_dir>/<namespace hex>`, or
        `<namespace hex>.<n>` when another process held that one (disk_conflict=own_dir)."""
        return self._root

    # ---- internals -----------------------------------------------------------------------

    def _path(self, key: bytes) -> Path:
        if len(key) != record.KEY_BYTES:
            raise ValueError(f"chunk key must be {record.KEY_BYTES} bytes, got {len(key)}")
        h = key.hex()
        return self._root / h[:2] / f"{h}.kvr"

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("DiskTier is closed; build a new one to use the directory again")

    def _write_temp(self, path: Path, header: bytes, payload: bytes | memoryview) -> Path:
        """Write header + payload to a fresh private temp file beside `path`; removed again on
        error."""
        make_private_dir(path.parent)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.{threading.get_ident()}{_TMP_SUFFIX}")
        fd = _create_private(tmp)
        try:
            try:
                _write_all(fd, memoryview(header))
                _write_all(fd, memoryview(payload).cast("B"))
            finally:
                # records are verified on every read, so a torn write after power loss reads
                # as a miss; an fsync per chunk would buy nothing but latency. NFS, FUSE and
                # quotas report ENOSPC or EDQUOT here, at close
                os.close(fd)
        except OSError:
            _remove(tmp)
            raise
        return tmp

    def _drop_bad(self, key: bytes, ino: int | None, reason: str) -> None:
        """Forget and delete a record that failed to read back, and count it; nothing when an
        eviction took it, or a new record replaced it, since the read (a miss, not damage)."""
        path = self._path(key)
        with self._lock:
            if key not in self._index:
                return
            now = _inode(path)
            if ino is not None and now not in (ino, None):
                # a concurrent evict + rewrite put a good file there since our read
                return
            if reason == _MISSING and now is not None:
                # evicted, then stored again, between the read and this lock
                return
            self._m.verify_failure(self.name, reason).inc()
            self._bytes -= self._index.pop(key)
            self._policy.remove(key)
            _remove(path)
            self._publish()
            self._tell("removed", key)

    def _forget(self, key: bytes) -> None:
        with self._lock:
            if key in self._index:
                self._bytes -= self._index.pop(key)
                self._policy.remove(key)
                self._publish()

    def _resident_again(self, key: bytes, parent: bytes) -> None:
        """A write of a chunk the tier holds is a use of it."""
        self._policy.link(key, parent)
        self._policy.touch([key])

    def _write(
        self,
        key: bytes,
        path: Path,
        header: bytes,
        payload: bytes | memoryview,
        size: int,
        parent: bytes,
    ) -> None:
        """One attempt: temp file, rename, index. OSError leaves nothing behind."""
        tmp = self._write_temp(path, header, payload)
        with self._lock:
            try:
                os.replace(tmp, path)
            except OSError:
                _remove(tmp)
                raise
            self._index[key] = size
            self._bytes += size
            self._policy.insert(key, size, parent)
            self._tell("stored", key)

    def _tell(self, change: str, key: bytes) -> None:
        # under the tier's lock: a listener only records (KV events for routers)
        if self.listener is not None:
            self.listener(change, key)

    def _make_room(self, size: int) -> bool:
        """A write hit ENOSPC. When the filesystem really lacks the room (statvfs), lower the
        budget by what is missing and evict that much, so this write and the next ones fit;
        False when the filesystem has room (a quota, a transient error) or nothing of ours can
        go, and the write is lost (counted by the caller)."""
        free, block = self._fs_space()
        need = size + block - free
        if need <= 0:
            return False
        with self._lock:
            self._m.tier_full(self.name).inc()
            budget = max(size, min(self._max, self._bytes + self._reserved - need))
            if budget < self._max:
                log.warning(
                    "kvtier: disk tier %s: the filesystem is full with %s held (disk_bytes=%s); "
                    "budget lowered to %s while it stays full, evicting to make room",
                    self._root,
                    format_size(self._bytes),
                    format_size(self._limit),
                    format_size(budget),
                )
                self._set_budget(budget)
            before = self._bytes
            self._evict_to(self._max - self._reserved)
            return self._bytes < before

    def _regrow(self) -> None:
        """A budget lowered by a full filesystem follows the room that comes back."""
        free, block = self._fs_space()
        room = min(self._limit, self._bytes + self._reserved + free - block)
        if room > self._max:
            log.info(
                "kvtier: disk tier %s: room is back on the filesystem; budget %s (disk_bytes=%s)",
                self._root,
                format_size(room),
                format_size(self._limit),
            )
            self._set_budget(room)

    def _touch_if_due(self) -> None:
        """A tier that only reads still marks its directory used (for other processes' GC)."""
        if self._dir_lock is None or time.monotonic() - self._touched < _TOUCH_EVERY_S:
            return
        self._touched = time.monotonic()
        try:
            self._dir_lock.touch()
        except OSError as e:
            log.warning("kvtier: disk tier could not touch %s: %s", self._dir_lock.path, e)

    def _release_dir(self) -> None:
        """Mark the directory used now and let go of its lock (idempotent)."""
        held, self._dir_lock = self._dir_lock, None
        if held is None:
            return
        try:
            held.touch()
        except OSError as e:
            log.warning("kvtier: disk tier could not touch %s: %s", held.path, e)
        held.release()

    def _set_budget(self, budget: int) -> None:
        self._max = budget
        self._m.capacity(self.name).set(budget)

    def _fs_space(self) -> tuple[int, int]:
        """Bytes free to this process on the tier's filesystem, and its block size."""
        st = os.statvfs(self._root)
        return st.f_bavail * st.f_frsize, st.f_frsize

    def _evict_to(self, budget: int) -> None:
        """Evict unleased leaves, least recently used first, until resident bytes <= budget."""
        if self._bytes <= budget:
            return
        self._leases.expire()
        while self._bytes > budget:
            key = self._policy.victim(self._evictable)
            if key is None:
                return
            self._policy.evict(key)
            self._bytes -= self._index.pop(key)
            _remove(self._path(key))
            self._m.eviction(self.name).inc()
            self._tell("removed", key)

    def _evictable(self, key: bytes) -> bool:
        return (
            not self._leases.is_pinned(key) and key not in self._writing and not self._retained(key)
        )

    def _done_writing(self, parent: bytes) -> None:
        left = self._writing[parent] - 1
        if left:
            self._writing[parent] = left
        else:
            del self._writing[parent]

    def _check_filesystem(self, directory: str | Path) -> None:
        """A budget the filesystem can never hold is a startup error, not a tier that fills
        the disk and then fails every write."""
        free, _ = self._fs_space()
        room = free + self._bytes
        if self._max > room:
            raise StartupError(
                f"disk_bytes={self._max} ({format_size(self._max)}) is more than the filesystem "
                f"of disk_dir={str(directory)!r} can hold: {format_size(free)}"
                f" free plus {format_size(self._bytes)} of this tier's records; set disk_bytes to "
                f"at most {room} ({format_size(room)}), free space there, or point disk_dir at a "
                "larger filesystem"
            )

    def _publish(self) -> None:
        self._m.residency(self.name).set(self._bytes)

    def _scan(self) -> ScanResult:
        """Index the record files already in the namespace directory, oldest first: only
        regular files of ours that nobody else can write; the owner removes temp files of
        writes a crash cut short (the lock says no live process is writing here)."""
        found: list[tuple[int, bytes, int]] = []
        stale = ignored = short = 0
        distrusted: list[str] = []
        with os.scandir(self._root) as it:
            # the lock and the rank's retention table live beside the shards
            shards = [
                e
                for e in it
                if e.name not in (LOCK_NAME, RETENTION_FILE)
                and not e.name.startswith(RETENTION_TEMP_PREFIX)
            ]
        for shard in shards:
            if not _SHARD_NAME.match(shard.name):
                ignored += 1
                continue
            # writes go through it: a symlink, another user's or writable by others stops here
            check_private(Path(shard.path), shard.stat(follow_symlinks=False), _SHARD_DIR)
            with os.scandir(shard.path) as files:
                for f in files:
                    if f.name.endswith(_TMP_SUFFIX):
                        if not self.follower:
                            # a write cut short by a crash; never renamed, so never a record
                            _remove(Path(f.path))
                            stale += 1
                        continue
                    if not (_RECORD_NAME.match(f.name) and f.name[:2] == shard.name):
                        ignored += 1
                        continue
                    st = f.stat(follow_symlinks=False)
                    why = untrusted(st)
                    if why is not None:
                        distrusted.append(f"{f.path} ({why})")
                        continue
                    if st.st_size < record.HEADER_BYTES:
                        # renamed into place with no data (a power cut before the write
                        # reached the disk): never a record
                        short += 1
                        if not self.follower:
                            _remove(Path(f.path))
                        continue
                    found.append((st.st_mtime_ns, bytes.fromhex(f.name[:32]), st.st_size))
        found.sort()
        for _, key, size in found:
            self._index[key] = size
            self._bytes += size
            self._policy.insert(key, size)
        if ignored:
            log.warning(
                "kvtier: disk tier ignored %d unexpected entries in %s", ignored, self._root
            )
        if short:
            self._m.verify_failure(self.name, _TRUNCATED).inc(short)
            log.warning(
                "kvtier: disk tier %s %d record files in %s shorter than a record header "
                "(renamed into place before their bytes reached the disk: a power cut)",
                "skipped" if self.follower else "removed",
                short,
                self._root,
            )
        if distrusted:
            self._m.verify_failure(self.name, "untrusted_file").inc(len(distrusted))
            log.warning(
                "kvtier: disk tier did not index %d record files in %s that are not regular "
                "files of uid %d or that others can write: %s%s; remove them (a record this "
                "tier writes under the same key replaces its file)",
                len(distrusted),
                self._root,
                os.geteuid(),
                ", ".join(distrusted[:_UNTRUSTED_NAMED]),
                " ..." if len(distrusted) > _UNTRUSTED_NAMED else "",
            )
        return ScanResult(len(found), self._bytes, stale, ignored, len(distrusted))


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        n = os.write(fd, data)
        data = data[n:]


def _create_private(path: Path) -> int:
    """A new file only this uid can read or write, opened for writing; never through a
    symlink, never an existing file (one left by an earlier attempt of this thread is
    replaced)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags, PRIVATE_FILE)
    except FileExistsError:
        # the name holds this pid and thread: only a write of ours that failed to clean up
        _remove(path)
        return os.open(path, flags, PRIVATE_FILE)


class RefusedFile(OSError):
    """A record's file that must not be read: not a regular file of ours, or not the size the
    tier indexed; `reason` is its verify-failure label."""

    def __init__(self, reason: str, why: str) -> None:
        super().__init__(why)
        self.reason = reason


def _read_file(path: Path, size: int) -> tuple[bytearray, int]:
    """The whole file and its inode number: never through a symlink, never a FIFO or device
    (opened without blocking, checked on the open descriptor), never more than the `size`
    bytes the tier indexed for it."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    with open(fd, "rb", buffering=0) as f:
        st = os.fstat(f.fileno())
        why = untrusted(st)
        if why is not None:
            raise RefusedFile("untrusted_file", why)
        if st.st_size != size:
            raise RefusedFile(
                "length_mismatch", f"{st.st_size} bytes where the tier indexed {size}"
            )
        buf = bytearray(st.st_size)
        view = memoryview(buf)
        got = 0
        while got < len(buf):
            n = f.readinto(view[got:])
            if not n:
                break
            got += n
        # a file that shrank under us keeps its short length and fails verification
        return (buf if got == len(buf) else buf[:got]), st.st_ino


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


def _remove(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return
    except OSError as e:
        log.warning("kvtier: disk tier could not delete %s: %s", path, e)


def _never(key: bytes) -> bool:
    return False
