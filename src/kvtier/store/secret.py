"""The deployment secret that authenticates (and encrypts) records outside the process.

From `record_key` (or KVTIER_RECORD_KEY), from `record_key_file`, or, for a disk tier with no
shared store, a key kvtier generates once in `disk_dir` (0600, owner only): a private disk
tier needs no setup, and every rank and restart of the deployment reads the same key. A shared
store never gets a generated key: engines that share it must share the secret (the config
refuses a remote_url without one).
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from kvtier.config import KVTierConfig
from kvtier.errors import StartupError
from kvtier.store.disk_dirs import open_disk_dir
from kvtier.store.record import RecordCodec, RecordKeys

GENERATED_NAME = ".kvtier-record-key"
_MIN_CHARS = 32


def record_secret(config: KVTierConfig) -> bytes | None:
    """The secret bytes, or None when no tier keeps records outside the process."""
    if config.record_key is not None:
        return config.record_key.encode()
    if config.record_key_file is not None:
        return _read(Path(config.record_key_file), "record_key_file")
    if config.disk_bytes > 0 and config.disk_dir is not None:
        return generated_secret(Path(config.disk_dir))
    return None


def generated_secret(disk_dir: Path) -> bytes:
    """The key a disk tier generates for itself in `disk_dir` (made once, 0600), the directory
    made and checked as the disk tier makes it (private, ours, no symlink)."""
    os.close(open_disk_dir(disk_dir))
    return _generated(disk_dir / GENERATED_NAME)


def codec_for(config: KVTierConfig, namespace: bytes) -> RecordCodec:
    """The record codec of `namespace` under this deployment's secret and tenant."""
    secret = record_secret(config)
    if secret is None:
        raise StartupError(
            "no record key: a disk or remote tier needs one; set KVTIER_RECORD_KEY or "
            "record_key_file"
        )
    keys = RecordKeys.derive(secret, config.tenant)
    return RecordCodec(namespace, keys, encrypt=config.encrypt_at_rest)


def _read(path: Path, what: str) -> bytes:
    """A key file's secret, refused unless it is a regular file of ours that only we read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise StartupError(
            f"{what} {path} cannot be opened ({e.strerror}); it must be a regular file (not a "
            "symlink) readable by this user"
        ) from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise StartupError(f"{what} {path} is not a regular file")
        if st.st_uid != os.geteuid():
            raise StartupError(
                f"{what} {path} is owned by uid {st.st_uid}, not by this user "
                f"(uid {os.geteuid()}): anyone who can replace it can forge records; "
                f"`chown {os.geteuid()} {path}`"
            )
        if st.st_mode & 0o077:
            raise StartupError(
                f"{what} {path} has mode {stat.S_IMODE(st.st_mode):o}: the group or others can "
                f"read or change the secret; `chmod 600 {path}`"
            )
        text = f.read().strip()
    if len(text) < _MIN_CHARS:
        raise StartupError(
            f"{what} {path} holds {len(text)} characters (not shown); use at least "
            f"{_MIN_CHARS}, e.g. `python -c 'import secrets; print(secrets.token_hex(32))' > "
            f"{path}`"
        )
    return text


def _generated(path: Path) -> bytes:
    """The disk tier's generated key: made once (written aside, then linked into place, so a
    rank starting at the same moment reads a whole key or makes its own attempt fail)."""
    if not path.exists():
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32) + "\n")
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass  # another rank linked its key first: that one is the deployment's
        finally:
            tmp.unlink(missing_ok=True)
    return _read(path, "the disk tier's generated record key")
