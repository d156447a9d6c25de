"""The engine's lookup key: 32 random bytes in its run directory, known only to its processes.

Whichever process of the engine asks first (the scheduler's client or a rank's server) creates
`lookup.key`; the others read the same file. It is written under a name of its own, then
hard-linked into place, so a reader never sees a partial key and two processes starting at
once agree on one (the loser of the link reads the winner's). The run directory must be a
private (0700) directory of this user, the file a regular 0600 file of this user: anything
else is refused, because whoever can read or replace the key can speak for the engine.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Final

from kvtier.errors import ConfigError, StartupError
from kvtier.lookup.endpoints import check_private_dir, key_dir_of
from kvtier.private_file import PrivateFileError, create_once, read_private

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
        data = read_private(path)
    except PrivateFileError as e:
        raise ConfigError(
            f"lookup key {str(path)!r} {e.why}: whoever can read or replace it can speak for "
            "the engine; remove it (the engine writes its own, mode 0600)"
        ) from None
    if data is not None and len(data) != ENGINE_KEY_BYTES:
        raise ConfigError(
            f"lookup key {str(path)!r} holds {len(data)} bytes, not {ENGINE_KEY_BYTES}; remove "
            "it while no process of this engine runs (the next one writes a new key)"
        )
    return data


def _publish(path: Path) -> None:
    """A fresh key linked to `path`, unless another process of the engine linked one first."""
    try:
        create_once(path, secrets.token_bytes(ENGINE_KEY_BYTES))
    except OSError as e:
        raise ConfigError(
            f"cannot create the lookup key {str(path)!r} ({e.strerror}); the run dir must "
            "be on a local filesystem with hard links (set lookup_dir, e.g. /tmp)"
        ) from None
