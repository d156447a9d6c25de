"""Removal of disk namespace directories nobody used for `disk_gc_days` days.

Each model revision, TP size or layout gets a namespace directory of its own; nothing else
ever removes the old ones, and they fill the filesystem until the startup space check refuses
to start. At startup, before that check, a tier removes the namespace directories of its
disk_dir that are:

- kvtier's: named `<32 hex digits>` or `<32 hex digits>.<n>` (disk_conflict=own_dir), a real
  directory (not a symlink) of ours that nobody else can write, holding kvtier's lock file;
- unused: their newest mtime (the directory, the lock file, which a tier touches when it
  starts, closes and reads; each shard directory, which every write changes) older than the
  cutoff, and their lock free (no live process holds it). Only such old directories are locked
  (never a recent one: the other ranks of this server are claiming theirs right now), and the
  lock keeps a starting process out while the directory goes.

Oldest first, each logged with its path, size and age. Nothing else in disk_dir is touched.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from kvtier.store.disk_dirs import private_dir_problem, untrusted
from kvtier.store.disk_lock import LOCK_NAME, lock_directory

log = logging.getLogger(__name__)

NAMESPACE_DIR = re.compile(r"^[0-9a-f]{32}(\.[1-9][0-9]*)?$")
DAY_S = 86400.0
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True, slots=True)
class Collected:
    """A namespace directory GC removed."""

    path: Path
    bytes: int  # file bytes it held
    age_days: float  # since its newest mtime


@dataclass
class _Candidate:
    name: str
    dir_fd: int
    lock_fd: int  # locked: nobody can start in it while it is looked at and removed
    newest: float
    own_fd: int | None = None  # the directory's own lock, once taken

    def close(self) -> None:
        if self.own_fd is not None:
            os.close(self.own_fd)
        os.close(self.lock_fd)
        os.close(self.dir_fd)


def collect(
    base_fd: int, base: Path, gc_days: float, *, now: float | None = None
) -> tuple[Collected, ...]:
    """Remove the namespace directories of the disk_dir `base` (open as `base_fd`) unused for
    more than `gc_days` days, oldest first; what was removed. `gc_days` 0 removes nothing."""
    if gc_days <= 0:
        return ()
    now = time.time() if now is None else now
    cutoff = now - gc_days * DAY_S
    old: list[_Candidate] = []
    try:
        for name in sorted(os.listdir(base_fd)):
            if not NAMESPACE_DIR.match(name):
                continue
            found = _inspect(base_fd, base, name, cutoff)
            if found is not None:
                old.append(found)
        old.sort(key=lambda c: c.newest)
        done: list[Collected] = []
        for c in old:
            removed = _remove(base_fd, base, c, now)
            if removed is not None:
                log.info(
                    "kvtier: disk GC removed %s (%d bytes, unused for %.1f days; disk_gc_days=%g)",
                    removed.path,
                    removed.bytes,
                    removed.age_days,
                    gc_days,
                )
                done.append(removed)
        return tuple(done)
    finally:
        for c in old:
            c.close()


def _inspect(base_fd: int, base: Path, name: str, cutoff: float) -> _Candidate | None:
    """`name` locked with its newest mtime, or None when it is not a free kvtier namespace
    directory of ours unused since `cutoff`."""
    try:
        st = os.stat(name, dir_fd=base_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None  # removed meanwhile
    if private_dir_problem(base / name, st, "namespace directory") is not None:
        return None  # a symlink, another user's or writable by others: not ours to remove
    try:
        dir_fd = os.open(name, _OPEN_DIR, dir_fd=base_fd)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
            return None  # swapped or removed since the stat
        raise
    try:
        lock_fd = os.open(LOCK_NAME, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        os.close(dir_fd)
        if e.errno in (errno.ENOENT, errno.ELOOP):
            return None  # no kvtier lock file: not a namespace directory kvtier made
        raise
    candidate = _Candidate(name, dir_fd, lock_fd, 0.0)
    try:
        if untrusted(os.fstat(lock_fd)) is not None or _newest_mtime(dir_fd) >= cutoff:
            candidate.close()
            return None
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            candidate.close()
            return None  # a live process holds it
        candidate.own_fd = lock_directory(dir_fd)
        if candidate.own_fd is None:
            candidate.close()
            return None  # a live process holds it through a lock file since deleted
        # again under the lock: a process may have started in it and let go since the look
        candidate.newest = _newest_mtime(dir_fd)
        if candidate.newest >= cutoff:
            candidate.close()
            return None
    except BaseException:
        candidate.close()
        raise
    return candidate


def _newest_mtime(dir_fd: int) -> float:
    """Newest mtime of the directory and its entries (shard directories change with every
    record written or removed in them)."""
    newest = os.fstat(dir_fd).st_mtime
    with os.scandir(dir_fd) as entries:
        for entry in entries:
            newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
    return newest


def _remove(base_fd: int, base: Path, c: _Candidate, now: float) -> Collected | None:
    """Delete the locked candidate's contents, its lock file last, then the directory."""
    path = base / c.name
    try:
        size = _tree_bytes(c.dir_fd)
        with os.scandir(c.dir_fd) as it:
            entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
        for name, is_dir in entries:
            if name == LOCK_NAME:
                continue
            if is_dir:
                shutil.rmtree(name, dir_fd=c.dir_fd)
            else:
                os.unlink(name, dir_fd=c.dir_fd)
        # last: until now a starting process found the lock held and stayed out
        os.unlink(LOCK_NAME, dir_fd=c.dir_fd)
        os.rmdir(c.name, dir_fd=base_fd)
    except OSError as e:
        # ENOTEMPTY: a process started in it after the lock file went; it is theirs now
        log.warning("kvtier: disk GC could not remove %s: %s; left in place", path, e)
        return None
    return Collected(path, size, (now - c.newest) / DAY_S)


def _tree_bytes(dir_fd: int) -> int:
    total = 0
    for _, _, files, root_fd in os.fwalk(".", dir_fd=dir_fd):
        for name in files:
            st = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total
