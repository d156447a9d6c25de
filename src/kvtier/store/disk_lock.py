"""One live process per disk namespace directory: an exclusive `flock` on `kvtier.lock` inside
it, held for the tier's lifetime.

Two processes in one directory (two servers, vLLM data-parallel replicas) would each keep their
own index and byte budget (N x disk_bytes on disk), each startup scan would delete the other's
in-flight temp files and each would evict files the other leased. The lock makes the second one
refuse (naming the holder's pid, which the holder writes into the lock file) or, with
`disk_conflict: own_dir`, take `<namespace>.<n>` for the first n whose lock is free.

The directory itself is locked too (a `flock` on its own descriptor): a lock file another
process deleted (a `/tmp` cleaner ages it by its mtime) would let a second process lock a fresh
one, but a directory cannot be unlinked while it holds records.

The kernel drops a `flock` when the last descriptor of its open file goes: at `release()`, and
at the holder's death, however it dies. A child forked while the lock is held would share that
open file and keep the lock past its parent, so the child closes its copy at fork.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import StartupError
from kvtier.store.disk_dirs import PRIVATE_FILE, open_private_dir, untrusted

log = logging.getLogger(__name__)

LOCK_NAME = "kvtier.lock"
# own_dir variants tried before giving up: more live processes than this on one namespace and
# one host is a deployment error, not a conflict to work around
MAX_OWN_DIRS = 64
CONFLICTS = ("refuse", "own_dir")
# a GC of another process may remove a directory between our mkdir and our lock: start over
_CLAIM_TRIES = 8
# a lock held by no live pid is another process's GC looking at an old directory, or a claimer
# that has not written its pid yet: both done in moments, so wait that long before refusing
_TRANSIENT_WAIT_S = 5.0
_POLL_S = 0.05
# module-level so tests step the wait without waiting
_now = time.monotonic
_sleep = time.sleep

# descriptors of locks this process holds, closed in a forked child (see the module docstring)
_held: set[int] = set()
_held_guard = threading.Lock()


def _close_in_child() -> None:
    # the child is single-threaded here: no guard needed, and one held by a dead thread would
    # never be released
    for fd in _held:
        try:
            os.close(fd)
        except OSError as e:
            log.warning("kvtier: forked child could not close a disk lock descriptor: %s", e)
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)


def _release(fds: tuple[int, ...], owner_pid: int) -> None:
    if os.getpid() != owner_pid:
        return  # a forked child: `_close_in_child` closed its copy; this number is not ours
    with _held_guard:
        _held.difference_update(fds)
    for fd in fds:
        os.close(fd)


class DirLock:
    """The held lock of one namespace directory (its lock file's and its own); released by
    `release()`, by garbage collection and by the process's death."""

    def __init__(self, fd: int, directory: Path, dir_fd: int) -> None:
        self.directory = directory
        self._fd = fd
        with _held_guard:
            _held.update((fd, dir_fd))
        self._finalizer = weakref.finalize(self, _release, (fd, dir_fd), os.getpid())

    @property
    def path(self) -> Path:
        """The lock file."""
        return self.directory / LOCK_NAME

    def touch(self) -> None:
        """Mark the directory used now: the lock file's mtime is what GC ages it by after the
        holder is gone."""
        if self._finalizer.alive:
            os.utime(self._fd)

    def release(self) -> None:
        """Drop the lock (idempotent)."""
        self._finalizer()


@dataclass(frozen=True, slots=True)
class Held:
    """The lock of `directory` is held by another process."""

    directory: Path
    pid: int | None  # what the holder wrote; None if it has not yet or wrote no number
    alive: bool  # `pid` is a live process in this pid namespace


class Vanished(Exception):
    """The directory was removed (another process's GC) while this one was locking it."""


def claim(
    base_fd: int,
    base: Path,
    name: str,
    conflict: str,
    *,
    what: str = "disk namespace directory",
    engine: str = "",
) -> DirLock:
    """Lock `base/name` (created 0700 if missing); when another live process holds it, raise a
    StartupError (`conflict="refuse"`) or lock the first free `name.<n>` (`"own_dir"`). The
    lock file names this process's pid and `engine` (its engine replica), by which the ranks
    that only read the directory find it (`find_owned`)."""
    if conflict not in CONFLICTS:
        raise ValueError(
            f"disk conflict={conflict!r} is not one of {CONFLICTS}; use 'refuse' or 'own_dir'"
        )
    first = _try_dir(base_fd, base, name, what, engine)
    if isinstance(first, DirLock):
        return first
    if conflict == "refuse":
        raise StartupError(
            f"{what} {first.directory} is in use by another live process ({_holder(first)}, "
            f"per {first.directory / LOCK_NAME}): two processes in one directory would each "
            "fill it to disk_bytes, delete each other's writes in flight and evict each "
            "other's leased records. Stop that process, set `disk_conflict: own_dir` (this "
            "process then keeps its records in a directory of its own beside it), or give "
            "this process another disk_dir"
        )
    for n in range(1, MAX_OWN_DIRS + 1):
        got = _try_dir(base_fd, base, f"{name}.{n}", what, engine)
        if isinstance(got, DirLock):
            log.warning(
                "kvtier: %s %s is in use by %s; this process uses %s (disk_conflict=own_dir)",
                what,
                first.directory,
                _holder(first),
                got.directory,
            )
            return got
    raise StartupError(
        f"{what} {first.directory} and its {MAX_OWN_DIRS} own_dir variants ({name}.1 .. "
        f"{name}.{MAX_OWN_DIRS}) are all in use by live processes; stop some of them or give "
        "this process another disk_dir"
    )


def _holder_pid(fd: int) -> int | None:
    """The pid written in the open lock file `fd` (its first line), or None."""
    text = os.pread(fd, 32, 0).decode("ascii", "replace").split("\n", 1)[0].strip()
    return int(text) if text.isdigit() else None


def find_owned(base_fd: int, base: Path, name: str, engine: str) -> Path | None:
    """The directory among `base/name` and its own_dir variants whose lock file names
    `engine` (its owner is a rank of that engine replica), or None (not claimed yet)."""
    for candidate in [name, *(f"{name}.{n}" for n in range(1, MAX_OWN_DIRS + 1))]:
        try:
            fd = os.open(f"{candidate}/{LOCK_NAME}", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                         dir_fd=base_fd)  # fmt: skip
        except (FileNotFoundError, NotADirectoryError):
            continue
        try:
            if untrusted(os.fstat(fd)) is not None:
                continue
            lines = os.pread(fd, 4096, 0).decode("utf-8", "replace").split("\n")
        finally:
            os.close(fd)
        if len(lines) > 1 and lines[1] == f"engine {engine}":
            return base / candidate
    return None


def _try_dir(base_fd: int, base: Path, name: str, what: str, engine: str) -> DirLock | Held:
    for _ in range(_CLAIM_TRIES):
        dir_fd = open_private_dir(base_fd, base, name, what)
        try:
            return _try_lock(dir_fd, base / name, engine)
        except Vanished:
            continue
        finally:
            os.close(dir_fd)
    raise StartupError(
        f"{what} {base / name} was removed {_CLAIM_TRIES} times while this process was "
        "locking it (another process's disk GC): retry, or set disk_gc_days=0 on the others"
    )


def _try_lock(dir_fd: int, directory: Path, engine: str = "") -> DirLock | Held:
    """Take the lock of the open directory `dir_fd`, or say who holds it."""
    path = directory / LOCK_NAME
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(LOCK_NAME, flags, PRIVATE_FILE, dir_fd=dir_fd)
    except FileNotFoundError:
        raise Vanished(directory) from None  # the directory itself is gone
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise StartupError(
            f"disk lock file {path} is a symlink; remove it (kvtier creates its own)"
        ) from None
    try:
        st = os.fstat(fd)
        why = untrusted(st)
        if why is not None:
            raise StartupError(
                f"disk lock file {path} is {why}, not a regular file of this process's uid "
                f"{os.geteuid()} that only it can write; remove it (kvtier creates its own)"
            )
        held = _wait_for_lock(fd, dir_fd, st, directory)
        if held is not None:
            os.close(fd)
            return held
        if not _still_linked(dir_fd, st):
            raise Vanished(directory)
        own = lock_directory(dir_fd)
        if own is None:
            # a live process holds the directory through a lock file since deleted
            os.close(fd)
            return Held(directory, None, True)
        try:
            os.ftruncate(fd, 0)
            named = f"engine {engine}\n" if engine else ""
            os.pwrite(fd, f"{os.getpid()}\n{named}".encode(), 0)
        except BaseException:
            os.close(own)
            raise
    except BaseException:
        os.close(fd)
        raise
    # the pid just written also set the lock file's mtime: the directory counts as used now
    return DirLock(fd, directory, own)


def lock_directory(dir_fd: int) -> int | None:
    """A descriptor of the open directory `dir_fd` holding an exclusive `flock` on it, or None
    when another open file holds one (a live tier, or a GC removing it)."""
    own = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        fcntl.flock(own, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(own)
        return None
    except BaseException:
        os.close(own)
        raise
    return own


def _wait_for_lock(fd: int, dir_fd: int, st: os.stat_result, directory: Path) -> Held | None:
    """Lock `fd` (None), or who holds it: a live pid at once, anyone else after
    `_TRANSIENT_WAIT_S`. Raises Vanished when a GC removed the file meanwhile."""
    deadline = _now() + _TRANSIENT_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return None
        except BlockingIOError:
            pid = _holder_pid(fd)
            if pid is not None and _alive(pid):
                return Held(directory, pid, True)
            if not _still_linked(dir_fd, st):
                raise Vanished(directory) from None
            if _now() >= deadline:
                return Held(directory, pid, False)
        # polling: flock has no timeout, and a blocking one could wait forever on a real holder
        _sleep(_POLL_S)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def _still_linked(dir_fd: int, st: os.stat_result) -> bool:
    """A GC that held the lock before us unlinks the file before letting go: locking the
    unlinked file would guard nothing."""
    try:
        now = os.stat(LOCK_NAME, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return stat.S_ISREG(now.st_mode) and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)


def _holder(held: Held) -> str:
    if held.pid is None and held.alive:
        return "a live process whose lock file was deleted (a /tmp cleaner?)"
    if held.pid is None:
        return "a process that wrote no pid"
    if not held.alive:
        return f"pid {held.pid}, which is no process here: one in another container?"
    return f"pid {held.pid}"
