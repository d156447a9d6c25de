"""The disk tier's directories, opened without trusting what is already there.

A disk_dir like /tmp or /dev/shm is writable by every local user, and namespace names are
deterministic, so anyone could create `<disk_dir>/<namespace>` first (or a symlink of that name)
and have the tier serve, read or overwrite files they control. So:

- what kvtier creates is private from the first syscall: directories `mkdir(0o700)`, files
  `O_CREAT | O_EXCL` with 0o600 (the umask can only take bits away);
- the disk_dir and every directory under it that kvtier uses is opened with `O_NOFOLLOW` and
  checked on the open descriptor: a symlink, another owner or a mode that lets others write
  stops startup with a StartupError naming the path, what is wrong and the fix;
- a record file found at startup is used only when it is a regular file of ours that nobody
  else can write (`untrusted`).

The disk_dir itself may be shared when it is sticky and owned by root or us (as /tmp is):
others then cannot rename or remove what is ours in it.
"""

from __future__ import annotations

import errno
import logging
import os
import pwd
import stat
from pathlib import Path

from kvtier.errors import StartupError

log = logging.getLogger(__name__)

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600
# bits that let someone other than the owner add, remove or rename entries, or rewrite a file
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_ROOT_UID = 0


def open_disk_dir(path: Path) -> int:
    """An open descriptor of disk_dir `path`, created (each missing component 0700) when it is
    not there; refused when it is a symlink, is owned by someone other than us or root, or lets
    others write without the sticky bit. The caller closes it."""
    try:
        fd = _open_dir(path, "disk_dir", os.fspath(path), None)
    except FileNotFoundError:
        _make_dirs(path)
        fd = _open_dir(path, "disk_dir", os.fspath(path), None)
    try:
        st = os.fstat(fd)
        me = os.geteuid()
        if st.st_uid not in (me, _ROOT_UID):
            raise StartupError(
                f"disk_dir {path} is owned by uid {st.st_uid}{_user(st.st_uid)}, not by this "
                f"process's uid {me}{_user(me)} or root: its owner could swap kvtier's "
                "directories in it for their own; set disk_dir to a directory of your own (a "
                f"missing one is created with mode 0700), or `chown {me} {path}` if it is yours"
            )
        mode = stat.S_IMODE(st.st_mode)
        if mode & _OTHERS_WRITE and not mode & stat.S_ISVTX:
            raise StartupError(
                f"disk_dir {path} has mode {mode:04o}: {_who_writes(mode)} can write it without "
                "the sticky bit, so they could rename kvtier's directories in it and put their "
                f"own in their place; `chmod go-w {path}` (or `chmod +t {path}` for a shared "
                "directory like /tmp), or set disk_dir to a directory of your own"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_private_dir(parent_fd: int, parent: Path, name: str, what: str) -> int:
    """An open descriptor of `parent/name`, a directory kvtier keeps its records in: created
    0700 when missing; refused when it is a symlink, not a directory, not ours or writable by
    others; made 0700 when ours but readable by others (as kvtier left it before modes were
    set). The caller closes it."""
    path = parent / name
    try:
        os.mkdir(name, PRIVATE_DIR, dir_fd=parent_fd)
    except FileExistsError:
        pass
    fd = _open_dir(path, what, name, parent_fd)
    try:
        st = os.fstat(fd)
        check_private(path, st, what)
        mode = stat.S_IMODE(st.st_mode)
        if mode != PRIVATE_DIR:
            # readable by others but writable by nobody else: nothing in it can be planted, so
            # it is ours to keep private from now on
            log.info("kvtier: %s %s had mode %04o; made it 0700", what, path, mode)
            os.fchmod(fd, PRIVATE_DIR)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_private(path: Path, st: os.stat_result, what: str) -> None:
    """Refuse `path` (lstat'ed as `st`) unless it is a directory of ours that nobody else can
    write."""
    problem = private_dir_problem(path, st, what)
    if problem is not None:
        raise problem


def private_dir_problem(path: Path, st: os.stat_result, what: str) -> StartupError | None:
    """The startup error `path` (lstat'ed as `st`) deserves, or None when it is a directory of
    ours that nobody else can write."""
    if stat.S_ISLNK(st.st_mode):
        return _symlink_error(path, what)
    if not stat.S_ISDIR(st.st_mode):
        return _not_a_dir_error(path, what, st)
    me = os.geteuid()
    if st.st_uid != me:
        return StartupError(
            f"{what} {path} is owned by uid {st.st_uid}{_user(st.st_uid)}, not by this "
            f"process's uid {me}{_user(me)}: its owner could plant records in it or read "
            f"them; remove it (it holds only kvtier records), `chown {me} {path}` if it is "
            "yours, or set disk_dir to a directory of your own"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & _OTHERS_WRITE:
        return StartupError(
            f"{what} {path} has mode {mode:04o}: {_who_writes(mode)} can write it, so anyone "
            f"there could have planted files in it; check what is in it, then `chmod -R go-rwx "
            f"{path}`, or remove it (it holds only kvtier records)"
        )
    return None


def make_private_dir(path: Path) -> None:
    """Create the shard directory `path` (0700) if it is missing."""
    try:
        os.mkdir(path, PRIVATE_DIR)
    except FileExistsError:
        return


def untrusted(st: os.stat_result) -> str | None:
    """Why a record file (lstat'ed as `st`) must not be used, or None when it is a regular file
    of ours that nobody else can write."""
    if not stat.S_ISREG(st.st_mode):
        return _kind(st.st_mode)
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}"
    if st.st_mode & _OTHERS_WRITE:
        return f"mode {stat.S_IMODE(st.st_mode):04o}"
    return None


def _open_dir(path: Path, what: str, name: str, dir_fd: int | None) -> int:
    """`os.open` of a directory that must not be a symlink, errors naming `path`."""
    try:
        return os.open(name, _OPEN_DIR, dir_fd=dir_fd)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            raise _symlink_error(path, what) from None
        if not stat.S_ISDIR(st.st_mode):
            raise _not_a_dir_error(path, what, st) from None
        raise  # a loop or a non-directory above it: the system's own words name it


def _make_dirs(path: Path) -> None:
    """Create `path` and its missing parents, each 0700 (unlike `mkdir -p`, whose parents take
    the umask's default)."""
    missing: list[Path] = []
    p = path
    while not os.path.lexists(p):
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for p in reversed(missing):
        try:
            os.mkdir(p, PRIVATE_DIR)
        except FileExistsError:
            continue  # another rank created it meanwhile; it is checked like any other


def _symlink_error(path: Path, what: str) -> StartupError:
    try:
        target = os.readlink(path)
    except OSError as e:
        target = f"<unreadable: {e.strerror}>"
    return StartupError(
        f"{what} {path} is a symlink to {target!r}; kvtier uses no directory it reaches "
        "through a symlink (whoever made the link chooses where records go and come from): "
        f"remove the link, or set disk_dir to the real directory ({target!r}) if it is yours"
    )


def _not_a_dir_error(path: Path, what: str, st: os.stat_result) -> StartupError:
    return StartupError(
        f"{what} {path} is not a directory ({_kind(st.st_mode)}); move it away, or set "
        "disk_dir to a directory of your own"
    )


def _who_writes(mode: int) -> str:
    if mode & stat.S_IWGRP and mode & stat.S_IWOTH:
        return "its group and every other user"
    return "its group" if mode & stat.S_IWGRP else "every other user"


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symlink"
    if stat.S_ISDIR(mode):
        return "a directory"
    return "a regular file" if stat.S_ISREG(mode) else "a special file"


def _user(uid: int) -> str:
    """` (name)` of `uid` for a message, or nothing when it has no name here."""
    try:
        return f" ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return ""
