"""The engine's lookup key: 32 random bytes in its run directory, known only to its processes.

Whichever process of the engine asks first (the scheduler's client or a rank's server) creates
`lookup.key`; the others read the same file. It is written under a name of its own, then
hard-linked into place, so a reader never sees a partial key and two processes starting at
once agree on one (the loser of the link reads the winner's). The run directory must be a
private (0700) directory of this user, the file a regular 0600 file of this user: anything
else is refused, because whoever can read or replace the key can speak for the engine.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path
from typing import Final

from kvtier.errors import ConfigError, StartupError
from kvtier.lookup.endpoints import check_private_dir, key_dir_of

KEY_FILE: Final = "lookup.key"
ENGINE_KEY_BYTES: Final = 32


def engine_key(run_dir: str | Path) -> bytes:
    """The lookup key of the engine whose run directory is `run_dir`, created if missing."""
    run = Path(run_dir)
    check_run_dir(run)
    path = run / KEY_FILE
    key = read_key(path)
    if key is None:
        _publish(path)
        key = read_key(path)
    if key is None:
        raise StartupError(
            f"lookup key {str(path)!r} vanished right after it was created; is another process "
            "removing this engine's run directory while it starts?"
        )
    return key


def endpoint_key(endpoint: str) -> bytes:
    """The key of the engine `endpoint` belongs to (from the run dir it names)."""
    return engine_key(key_dir_of(endpoint))


def check_run_dir(run: Path) -> None:
    """Raise ConfigError unless `run` is a private directory of ours and not a symlink."""
    if run.is_symlink():
        raise ConfigError(
            f"lookup run dir {str(run)!r} is a symlink; the engine's key must live in a "
            "private directory of its own (make_run_dir(), or remove the link)"
        )
    check_private_dir(run)


def read_key(path: Path) -> bytes | None:
    """The key in `path`, None if there is no such file; ConfigError for a file that is not a
    private 32-byte regular file of this user."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ConfigError(
                f"lookup key {str(path)!r} is a symlink; remove it (the engine writes its own)"
            ) from None
        raise ConfigError(
            f"lookup key {str(path)!r} cannot be opened ({e.strerror}); it must be a regular "
            "file readable by this user"
        ) from None
    try:
        st = os.fstat(fd)
        _check_key_file(path, st)
        data = b""
        while len(data) < ENGINE_KEY_BYTES:
            chunk = os.read(fd, ENGINE_KEY_BYTES - len(data))
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    if len(data) != ENGINE_KEY_BYTES:
        raise ConfigError(
            f"lookup key {str(path)!r} holds {len(data)} bytes, not {ENGINE_KEY_BYTES}; remove "
            "it while no process of this engine runs (the next one writes a new key)"
        )
    return data


def _check_key_file(path: Path, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"lookup key {str(path)!r} is not a regular file; remove it")
    if st.st_uid != os.getuid():
        raise ConfigError(
            f"lookup key {str(path)!r} is owned by uid {st.st_uid}, not by this user (uid "
            f"{os.getuid()}): whoever wrote it can speak for the engine; remove it"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise ConfigError(
            f"lookup key {str(path)!r} has mode {oct(mode)}: the group or others can read it; "
            "remove it (the engine writes a new one with mode 0o600)"
        )
    if st.st_size != ENGINE_KEY_BYTES:
        raise ConfigError(
            f"lookup key {str(path)!r} is {st.st_size} bytes, not {ENGINE_KEY_BYTES}; remove "
            "it while no process of this engine runs (the next one writes a new key)"
        )


def _publish(path: Path) -> None:
    """Write a fresh key aside and link it to `path`; a key already linked there wins."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o600)
    try:
        try:
            # exact mode whatever the umask: the readers refuse anything but owner-only
            os.fchmod(fd, 0o600)
            key = secrets.token_bytes(ENGINE_KEY_BYTES)
            written = 0
            while written < len(key):
                written += os.write(fd, key[written:])
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process of the engine linked its key first: that one is the key
        except OSError as e:
            raise ConfigError(
                f"cannot create the lookup key {str(path)!r} ({e.strerror}); the run dir must "
                "be on a local filesystem with hard links (set lookup_dir, e.g. /tmp)"
            ) from None
    finally:
        tmp.unlink(missing_ok=True)
