"""Chunk records: a fixed header (magic, version, namespace, key, length, checksum) + payload.

Every tier that keeps bytes outside the process keeps them as records, and every read verifies
the whole header and the checksum before a byte reaches a KV cache.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

MAGIC = b"KVTR"
VERSION = 1
NAMESPACE_BYTES = 16
KEY_BYTES = 16
# magic, version, reserved, namespace, key, payload length, checksum
_HEADER = struct.Struct("<4sHH16s16sQQ")
HEADER_BYTES = _HEADER.size


class RecordError(ValueError):
    """A record failed verification; `reason` is a short label used as a metrics label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def checksum(namespace: bytes, key: bytes, payload: bytes | memoryview) -> int:
    """xxh3-64 over namespace, key and payload, so a record moved under another key fails."""
    h = xxhash.xxh3_64()
    h.update(namespace)
    h.update(key)
    h.update(payload)
    return h.intdigest()


@dataclass(frozen=True, slots=True)
class RecordHeader:
    """The decoded header of one record."""

    namespace: bytes
    key: bytes
    length: int
    checksum: int


def encode_header(namespace: bytes, key: bytes, payload: bytes | memoryview) -> bytes:
    """Header bytes for `payload` stored under (namespace, key)."""
    _check_ids(namespace, key)
    n = memoryview(payload).nbytes
    return _HEADER.pack(MAGIC, VERSION, 0, namespace, key, n, checksum(namespace, key, payload))


def encode(namespace: bytes, key: bytes, payload: bytes | memoryview) -> bytes:
    """One record: header followed by the payload bytes."""
    return encode_header(namespace, key, payload) + bytes(payload)


def decode_header(data: bytes | memoryview) -> RecordHeader:
    """Parse and sanity-check a header; raises RecordError on anything malformed."""
    if len(data) < HEADER_BYTES:
        raise RecordError(
            "truncated", f"{len(data)} bytes is shorter than a {HEADER_BYTES}-byte header"
        )
    magic, version, _reserved, ns, key, length, csum = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise RecordError("bad_magic", f"magic {magic!r} is not {MAGIC!r}")
    if version != VERSION:
        raise RecordError("bad_version", f"record version {version} is not {VERSION}")
    return RecordHeader(ns, key, length, csum)


def verify(
    data: bytes | memoryview, namespace: bytes, key: bytes, expected_length: int | None = None
) -> memoryview:
    """Verify a whole record read back for (namespace, key); return a view of its payload."""
    view = memoryview(data)
    header = decode_header(view)
    if header.namespace != namespace:
        raise RecordError("namespace_mismatch", "record belongs to another namespace")
    if header.key != key:
        raise RecordError("key_mismatch", "record holds another chunk key")
    if len(view) != HEADER_BYTES + header.length:
        raise RecordError(
            "length_mismatch",
            f"record has {len(view) - HEADER_BYTES} payload bytes, header says {header.length}",
        )
    if expected_length is not None and header.length != expected_length:
        raise RecordError(
            "length_mismatch", f"payload is {header.length} bytes, layout needs {expected_length}"
        )
    payload = view[HEADER_BYTES:]
    if checksum(namespace, key, payload) != header.checksum:
        raise RecordError("checksum_mismatch", "payload checksum does not match its header")
    return payload


def _check_ids(namespace: bytes, key: bytes) -> None:
    if len(namespace) != NAMESPACE_BYTES:
        raise ValueError(f"namespace must be {NAMESPACE_BYTES} bytes, got {len(namespace)}")
    if len(key) != KEY_BYTES:
        raise ValueError(f"chunk key must be {KEY_BYTES} bytes, got {len(key)}")
