"""Local-disk tier: one verified record file per chunk, bounded by bytes with LRU eviction.

Layout: `<dir>/<namespace hex>/<key hex[:2]>/<key hex>.kvr`, so namespaces sharing a directory
stay apart and a restarted engine finds its own records again.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtier.metrics import Metrics
from kvtier.store import record
from kvtier.store.lease import LeaseTable

log = logging.getLogger(__name__)

_RECORD_NAME = re.compile(r"^[0-9a-f]{32}\.kvr$")
_SHARD_NAME = re.compile(r"^[0-9a-f]{2}$")
_TMP_SUFFIX = ".tmp"
# a full disk and an exhausted quota are the same event to an operator
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


@dataclass(frozen=True, slots=True)
class ScanResult:
    """What the start-up scan of the namespace directory found."""

    entries: int
    bytes: int
    stale_temps_removed: int
    ignored_files: int


class DiskTier:
    """Chunk records as files under one namespace directory, LRU-evicted to stay under a byte cap.

    Thread-safe: the stack's write-behind thread writes while the engine thread reads.
    """

    name = "disk"

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
    ) -> None:
        if max_bytes <= 0:
            raise ValueError(f"disk tier max_bytes must be > 0, got {max_bytes}; set a disk size")
        if len(namespace) != record.NAMESPACE_BYTES:
            raise ValueError(
                f"namespace must be {record.NAMESPACE_BYTES} bytes, got {len(namespace)}"
            )
        self._ns = namespace
        self._max = max_bytes
        self._m = metrics
        self._root = Path(directory) / namespace.hex()
        self._root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Condition(threading.RLock())
        # key -> file bytes (header + payload), least recently used first
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._bytes = 0
        # bytes promised to writes in flight, so concurrent puts cannot overshoot the cap
        self._reserved = 0
        self._inflight: set[bytes] = set()
        self._leases = LeaseTable(metrics, lease_ttl_s, max_leases, clock)
        self._closed = False
        self._m.capacity(self.name).set(max_bytes)
        self.scan = self._scan()
        with self._lock:
            self._evict_to(self._max)
            self._publish()

    # ---- Tier protocol -------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        """True if a record file for `key` is indexed (no read)."""
        with self._lock:
            return key in self._index

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """`contains` for a batch (a local index: no I/O)."""
        with self._lock:
            return [k in self._index for k in keys]

    def get(self, key: bytes) -> memoryview | None:
        """The verified payload of `key`, or None. A bad or unreadable file is deleted + counted."""
        with self._lock:
            self._check_open()
            if key not in self._index:
                return None
            self._index.move_to_end(key)
        path = self._path(key)
        try:
            buf, ino = _read_file(path)
        except FileNotFoundError:
            self._drop_bad(key, None, "missing")
            return None
        except OSError as e:
            log.warning("kvtier: disk tier cannot read %s: %s", path, e)
            self._drop_bad(key, None, "io_error")
            return None
        try:
            return record.verify(buf, self._ns, key, expected_length=None)
        except record.RecordError as e:
            log.warning("kvtier: disk record %s failed verification: %s", path, e)
            self._drop_bad(key, ino, e.reason)
            return None

    def put(self, key: bytes, payload: bytes | memoryview) -> bool:
        """Write `payload` atomically (temp file + rename); False (counted) when it cannot."""
        with self._lock:
            self._check_open()
            if key in self._index:
                # keys are content hashes inside the namespace: the file already holds these bytes
                self._index.move_to_end(key)
                return True
        # checksum outside the lock: hashing a 32 MiB chunk must not stall readers
        header = record.encode_header(self._ns, key, payload)
        size = len(header) + memoryview(payload).nbytes
        with self._lock:
            self._check_open()
            # one writer per key; a second put waits for the first and then sees its outcome
            self._lock.wait_for(lambda: key not in self._inflight)
            if key in self._index:
                self._index.move_to_end(key)
                return True
            if size > self._max:
                self._m.store_failure(self.name, "too_large").inc()
                return False
            self._evict_to(self._max - size - self._reserved)
            if self._bytes + self._reserved + size > self._max:
                # what is left is leased by lookups; shedding this write is the bounded choice
                self._m.store_failure(self.name, "full").inc()
                return False
            self._reserved += size
            self._inflight.add(key)
        path = self._path(key)
        ok = False
        try:
            tmp = self._write_temp(path, header, payload)
            with self._lock:
                try:
                    os.replace(tmp, path)
                except OSError:
                    _remove(tmp)
                    raise
                self._index[key] = size
                self._bytes += size
                ok = True
        except OSError as e:
            reason = "enospc" if e.errno in _NO_SPACE else "io_error"
            log.warning("kvtier: disk tier could not store %s (%s): %s", path.name, reason, e)
            self._m.store_failure(self.name, reason).inc()
        finally:
            with self._lock:
                self._reserved -= size
                self._inflight.discard(key)
                self._publish()
                self._lock.notify_all()
        return ok

    def lease(self, lease_id: str, keys: Sequence[bytes], counted: bool = True) -> int:
        """Pin every key of `keys` this tier holds under `lease_id`; returns how many leading
        keys it holds (as MemoryTier does). `counted=False` keeps it out of the lease metrics."""
        with self._lock:
            self._leases.acquire(lease_id, [k for k in keys if k in self._index], counted)
            leading = 0
            for k in keys:
                if k not in self._index:
                    break
                leading += 1
            return leading

    def release(self, lease_id: str) -> None:
        """Release `lease_id`; an unknown id is a counted no-op."""
        with self._lock:
            self._leases.release(lease_id)

    def residency_bytes(self) -> int:
        """Bytes of record files this tier holds now."""
        with self._lock:
            return self._bytes

    def close(self) -> None:
        """Forget the index; files stay on disk for the next start. Unusable afterwards."""
        with self._lock:
            self._closed = True
            self._index.clear()
            self._bytes = 0
            self._publish()

    # ---- extras shared with MemoryTier ---------------------------------------------------

    def lookup_prefix(self, keys: Sequence[bytes]) -> int:
        """Number of leading `keys` this tier holds."""
        with self._lock:
            n = 0
            for k in keys:
                if k not in self._index:
                    break
                n += 1
            return n

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    @property
    def directory(self) -> Path:
        """The namespace directory this tier owns."""
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
        """Write header + payload to a fresh temp file beside `path`; removed again on error."""
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.{threading.get_ident()}{_TMP_SUFFIX}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_all(fd, memoryview(header))
            _write_all(fd, memoryview(payload).cast("B"))
        except OSError:
            _remove(tmp)
            raise
        finally:
            # records are verified on every read, so a torn write after power loss reads as a
            # miss; an fsync per chunk would buy nothing but latency
            os.close(fd)
        return tmp

    def _drop_bad(self, key: bytes, ino: int | None, reason: str) -> None:
        """Forget and delete a record that failed to read back, and count it."""
        self._m.verify_failure(self.name, reason).inc()
        path = self._path(key)
        with self._lock:
            if key not in self._index:
                return
            if ino is not None and _inode(path) not in (ino, None):
                # a concurrent evict + rewrite put a good file there since our read
                return
            self._bytes -= self._index.pop(key)
            _remove(path)
            self._publish()

    def _evict_to(self, budget: int) -> None:
        """Evict least recently used unleased files until resident bytes <= budget."""
        if self._bytes <= budget:
            return
        self._leases.expire()
        for key in list(self._index):
            if self._bytes <= budget:
                break
            if self._leases.is_pinned(key):
                continue
            self._bytes -= self._index.pop(key)
            _remove(self._path(key))
            self._m.eviction(self.name).inc()

    def _publish(self) -> None:
        self._m.residency(self.name).set(self._bytes)

    def _scan(self) -> ScanResult:
        """Index the record files already in the namespace directory, oldest first."""
        found: list[tuple[int, bytes, int]] = []
        stale = ignored = 0
        for shard in self._root.iterdir():
            if not (shard.is_dir() and _SHARD_NAME.match(shard.name)):
                ignored += 1
                continue
            for f in shard.iterdir():
                if f.name.endswith(_TMP_SUFFIX):
                    # a write cut short by a crash; never renamed, so never a record
                    _remove(f)
                    stale += 1
                    continue
                if not (_RECORD_NAME.match(f.name) and f.name[:2] == shard.name and f.is_file()):
                    ignored += 1
                    continue
                st = f.stat()
                found.append((st.st_mtime_ns, bytes.fromhex(f.name[:32]), st.st_size))
        found.sort()
        for _, key, size in found:
            self._index[key] = size
            self._bytes += size
        if ignored:
            log.warning(
                "kvtier: disk tier ignored %d unexpected entries in %s", ignored, self._root
            )
        return ScanResult(len(found), self._bytes, stale, ignored)


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        n = os.write(fd, data)
        data = data[n:]


def _read_file(path: Path) -> tuple[bytearray, int]:
    """The whole file and its inode number."""
    with open(path, "rb", buffering=0) as f:
        st = os.fstat(f.fileno())
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
