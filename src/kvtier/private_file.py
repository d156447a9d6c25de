"""Secret files kvtier creates and reads (the lookup key of an engine, the record key of a disk
tier): regular files of this user that only it can read, made once and never rewritten.

Whoever can read such a file can speak for kvtier, and whoever can replace it can forge what
it authenticates, so a reader refuses a symlink, another user's file or one the group or
others can reach. A creator writes the content under a name of its own (0600 whatever the
umask), then hard-links it into place: a reader never sees a partial file, and processes that
start together agree on one (the link that lost reads the winner's).
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path


class PrivateFileError(Exception):
    """A secret file that is not a private regular file of this user; `why` says what."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


def read_private(path: Path) -> bytes | None:
    """The contents of secret file `path` (None when there is none); PrivateFileError when it
    is a symlink, not a regular file, another user's, or reachable by the group or others."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise PrivateFileError("is a symlink") from None
        raise PrivateFileError(f"cannot be opened ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        why = _not_private(os.fstat(f.fileno()))
        if why is not None:
            raise PrivateFileError(why)
        return f.read()


def create_once(path: Path, content: bytes) -> None:
    """Write `content` aside and link it to `path`; a file already linked there wins. OSError
    when the link cannot be made (a filesystem without hard links)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o600)
    try:
        try:
            os.fchmod(fd, 0o600)  # exact, whatever the umask: readers refuse anything wider
            written = 0
            while written < len(content):
                written += os.write(fd, content[written:])
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process linked its file first: that one is the file
    finally:
        tmp.unlink(missing_ok=True)


def _not_private(st: os.stat_result) -> str | None:
    me = os.geteuid()
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != me:
        return f"is owned by uid {st.st_uid}, not by this user (uid {me})"
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        return f"has mode {oct(mode)}: the group or others can read or change it"
    return None
