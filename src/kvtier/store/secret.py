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
from pathlib import Path

from kvtier.config import KVTierConfig
from kvtier.errors import StartupError
from kvtier.private_file import PrivateFileError, create_once, read_private
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
        data = read_private(path)
    except PrivateFileError as e:
        raise StartupError(
            f"{what} {path} {e.why}: whoever can read or replace it can forge records; make it "
            f"a regular file of this user with `chmod 600 {path}` (and `chown`)"
        ) from None
    if data is None:
        raise StartupError(f"{what} {path} does not exist; create it or unset it")
    text = data.strip()
    if len(text) < _MIN_CHARS:
        raise StartupError(
            f"{what} {path} holds {len(text)} characters (not shown); use at least "
            f"{_MIN_CHARS}, e.g. `python -c 'import secrets; print(secrets.token_hex(32))' > "
            f"{path}`"
        )
    return text


def _generated(path: Path) -> bytes:
    """The disk tier's generated key: made once, so every rank and restart reads the same."""
    if not path.exists():
        create_once(path, secrets.token_hex(32).encode() + b"\n")
    return _read(path, "the disk tier's generated record key")
