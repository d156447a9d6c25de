"""The model identity inside every key namespace: which weights computed a chunk's KV.

Both hosts call `model_identity` on the model directory. The digest covers config.json, the
revision an operator sets (`model_revision`) and either the Hugging Face snapshot revision (a
`.../snapshots/<commit>` directory is immutable) or, for any other directory, every weight
file's name, size, safetensors header and a hash of sampled windows of its content. Two
checkpoints with the same config and directory name but different weights get different
identities, so neither is ever served the other's KV. Modification times are never read: a copy
or a `touch` keeps the identity, so a persistent tier survives them.
"""

from __future__ import annotations

import struct
from pathlib import Path

import blake3

from kvtier.errors import ConfigError
from kvtier.keys import digest16

__all__ = ["WEIGHT_SUFFIXES", "model_identity", "snapshot_revision"]

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".npz")
_DOMAIN = "kvtier.identity.v1"
_WINDOWS = 16  # sampled windows per weight file, evenly spread, first and last included
_WINDOW_BYTES = 64 << 10
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit


def model_identity(model_dir: str | Path, revision: str | None = None) -> str:
    """`<name>:<digest>` for the weights in `model_dir`; `revision` (the `model_revision`
    config key) is folded in when set."""
    path = Path(model_dir)
    config = path / "config.json"
    if not config.is_file():
        raise ConfigError(
            f"model directory {str(path)!r} has no config.json, so kvtier cannot tell which "
            "weights it serves; point the engine at a Hugging Face model directory"
        )
    fields: list[bytes | str | int] = ["config", config.read_bytes()]
    snapshot = snapshot_revision(path)
    if snapshot is not None:
        fields += ["snapshot", snapshot]
    else:
        weights = _weight_files(path)
        if not weights:
            raise ConfigError(
                f"model directory {str(path)!r} holds no weight files "
                f"({', '.join(WEIGHT_SUFFIXES)}); kvtier keys its tier by the weights"
            )
        for f in weights:
            fields += ["weight", f.relative_to(path).as_posix(), f.stat().st_size, _sample(f)]
    if revision:
        fields += ["revision", revision]
    return f"{_name(path)}:{digest16(_DOMAIN, fields).hex()[:16]}"


def snapshot_revision(model_dir: str | Path) -> str | None:
    """The commit of a Hugging Face cache snapshot (`.../snapshots/<commit>`), else None."""
    path = Path(model_dir).resolve()
    if path.parent.name == "snapshots" and len(path.name) == 40:
        try:
            int(path.name, 16)
        except ValueError:
            return None
        return path.name
    return None


def _name(path: Path) -> str:
    resolved = path.resolve()
    if snapshot_revision(resolved) is not None:
        repo = resolved.parent.parent.name  # models--org--name
        return repo.removeprefix("models--").replace("--", "/")
    return resolved.name


def _weight_files(path: Path) -> list[Path]:
    return sorted(
        f
        for f in path.rglob("*")
        if f.suffix in WEIGHT_SUFFIXES
        and f.is_file()
        and not any(p.startswith(".") for p in f.relative_to(path).parts)
    )


def _sample(path: Path) -> bytes:
    """blake3 of a safetensors header (tensor names, shapes, offsets) and sampled windows."""
    h = blake3.blake3()
    size = path.stat().st_size
    with path.open("rb") as f:
        start = 0
        if path.suffix == ".safetensors" and size >= 8:
            (n,) = struct.unpack("<Q", f.read(8))
            if 8 + n <= min(size, 8 + _MAX_HEADER_BYTES):
                f.seek(0)
                h.update(f.read(8 + n))
                start = 8 + n
        body = size - start
        if body <= _WINDOWS * _WINDOW_BYTES:
            f.seek(start)
            h.update(f.read(body))
        else:
            for i in range(_WINDOWS):  # the last window ends at the file's last byte
                f.seek(start + (body - _WINDOW_BYTES) * i // (_WINDOWS - 1))
                h.update(f.read(_WINDOW_BYTES))
    return h.digest(length=16)
