"""The model identity inside every key namespace: which weights computed a chunk's KV.

Both hosts call `model_identity` on the model directory. The digest covers config.json, the
revision an operator sets (`model_revision`), settings outside the files that change the KV (a
host's `runtime` fields: vLLM's hf_overrides, KV cache dtype, scales) and either the Hugging
Face snapshot revision (a `.../snapshots/<commit>` directory is immutable) or, for any other
directory, every weight file's name, size and a blake3 of every byte of it. Two checkpoints
with the same config and directory name but different weights (a partial fine-tune included)
get different identities, so neither is ever served the other's KV. A copy or a `touch` keeps
the identity (content only), so a persistent tier survives them.

Hashing every byte costs seconds per 10 GB, once: each file's digest is cached under
`$XDG_CACHE_HOME/kvtier` (private to the user) by path, size, mtime, inode and device, so a
restart or the other ranks of the engine read it instead; a changed file is hashed again.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import stat
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import blake3

from kvtier.errors import ConfigError
from kvtier.keys import digest16

log = logging.getLogger("kvtier")

__all__ = ["WEIGHT_SUFFIXES", "model_identity", "snapshot_revision"]

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".npz")
_DOMAIN = "kvtier.identity.v2"
_CACHE_VERSION = 1
_CACHE_ENTRIES = 4096  # weight files remembered (a few models of a few hundred shards)


def model_identity(
    model_dir: str | Path, revision: str | None = None, runtime: Sequence[str] = ()
) -> str:
    """`<name>:<digest>` for the weights in `model_dir`; `revision` (the `model_revision`
    config key) and `runtime` (a host's settings that change the KV without changing the
    files) are folded in when set."""
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
        for f, digest in zip(weights, _digests(path, weights), strict=True):
            fields += ["weight", f.relative_to(path).as_posix(), f.stat().st_size, digest]
    if revision:
        fields += ["revision", revision]
    for item in runtime:
        fields += ["runtime", item]
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


def _hash_file(path: Path) -> bytes:
    """blake3 of every byte of `path` (memory-mapped, all cores)."""
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    if path.stat().st_size:
        h.update_mmap(path)
    return h.digest(length=16)


def _digests(model_dir: Path, weights: list[Path]) -> list[bytes]:
    """Every weight file's digest: from the cache where its file is unchanged, else hashed
    (under the cache's lock, so the ranks of an engine starting together hash once)."""
    cache_dir = _cache_dir()
    with _locked(cache_dir) as cache:
        out: list[bytes] = []
        hashed, nbytes, t0 = 0, 0, time.perf_counter()
        for f in weights:
            st = f.stat()
            stamp = [st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev]
            entry = cache.get(str(f.resolve())) if cache is not None else None
            if entry is not None and entry.get("stamp") == stamp:
                out.append(bytes.fromhex(entry["digest"]))
                continue
            digest = _hash_file(f)
            hashed, nbytes = hashed + 1, nbytes + st.st_size
            if cache is not None:
                cache[str(f.resolve())] = {"stamp": stamp, "digest": digest.hex()}
            out.append(digest)
        if hashed:
            where = f"later starts read it from {cache_dir}" if cache is not None else (
                "no private cache to keep it in: every start hashes again"
            )  # fmt: skip
            log.info(
                "kvtier: model identity of %s: hashed %d weight files (%.2f GB) in %.1f s; %s",
                model_dir, hashed, nbytes / 1e9, time.perf_counter() - t0, where,
            )  # fmt: skip
    return out


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvtier"


@contextlib.contextmanager
def _locked(cache_dir: Path) -> Iterator[dict[str, dict] | None]:
    """The digest cache, read and written under an exclusive lock; None (no caching) when the
    directory is not private to this user (another could plant digests in it)."""
    try:
        cache_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(cache_dir)
    except OSError as e:
        log.warning("kvtier: weights digest cache %s unusable (%s): hashing every start",
                    cache_dir, e)  # fmt: skip
        yield None
        return
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        log.warning(
            "kvtier: weights digest cache %s is not a directory private to this user (mode "
            "%o, uid %d): not trusted, every start hashes the weights; `chmod 700 %s`",
            cache_dir, stat.S_IMODE(st.st_mode), st.st_uid, cache_dir,
        )  # fmt: skip
        yield None
        return
    path = cache_dir / f"weights-digests-v{_CACHE_VERSION}.json"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            cache = json.loads(f.read() or "{}")
        except ValueError:
            cache = {}  # a torn or foreign file: hashing again rebuilds it
        if not isinstance(cache, dict):
            cache = {}
        before = json.dumps(cache, sort_keys=True)
        yield cache
        # bounded: files that are gone (rebuilt models, test runs) leave, then the oldest
        for name in [n for n in cache if not os.path.exists(n)]:
            del cache[name]
        for name in list(cache)[: max(0, len(cache) - _CACHE_ENTRIES)]:
            del cache[name]
        after = json.dumps(cache, sort_keys=True)
        if after != before:
            f.seek(0)
            f.truncate()
            f.write(after)
