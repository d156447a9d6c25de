"""Chunk records: a fixed header (magic, version, flags, namespace, key, length, nonce, tag) and
the payload, as every tier outside the process keeps them.

A record is authenticated with a key derived from the deployment's secret (`record_key`): a
keyed BLAKE3 tag over the header and payload, or, with `encrypt_at_rest`, AES-GCM, whose tag
authenticates the header and the ciphertext. A record planted or altered by anyone without the
secret, or moved to another namespace, key or tenant, fails its tag and is a counted miss; no
byte of it reaches a KV cache (invariant 7). The keys are per tenant (HKDF from the secret).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import blake3
import xxhash
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

MAGIC = b"KVTR"
VERSION = 2
NAMESPACE_BYTES = 16
KEY_BYTES = 16
NONCE_BYTES = 12
TAG_BYTES = 32
_GCM_TAG_BYTES = 16
FLAG_ENCRYPTED = 1
# magic, version, flags, namespace, key, payload length, nonce, tag
_HEADER = struct.Struct("<4sHH16s16sQ12s32s")
HEADER_BYTES = _HEADER.size
_TAG_AT = HEADER_BYTES - TAG_BYTES
_NO_NONCE = bytes(NONCE_BYTES)


class RecordError(ValueError):
    """A record failed verification; `reason` is a short label used as a metrics label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def checksum(namespace: bytes, key: bytes, payload: bytes | memoryview) -> int:
    """xxh3-64 over namespace, key and payload: the memory tier's optional read check (its
    bytes never leave the process; records outside it carry a keyed tag instead)."""
    h = xxhash.xxh3_64()
    h.update(namespace)
    h.update(key)
    h.update(payload)
    return h.intdigest()


def _derive(secret: bytes, purpose: str, tenant: str) -> bytes:
    info = f"kvtier record v{VERSION} {purpose} tenant={tenant}".encode()
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


@dataclass(frozen=True)
class RecordKeys:
    """One tenant's keys, derived from the deployment secret: a tag key and an AES-256 key."""

    mac_key: bytes
    aes_key: bytes
    aead: AESGCM

    @classmethod
    def derive(cls, secret: bytes, tenant: str = "") -> RecordKeys:
        """The keys of `tenant` (HKDF-SHA256 from `secret`, one purpose each)."""
        if len(secret) < 32:
            raise ValueError("the record secret must be at least 32 bytes")
        aes = _derive(secret, "aes-gcm", tenant)
        return cls(_derive(secret, "tag", tenant), aes, AESGCM(aes))


@dataclass(frozen=True, slots=True)
class RecordHeader:
    """The decoded header of one record."""

    flags: int
    namespace: bytes
    key: bytes
    length: int
    nonce: bytes
    tag: bytes


def decode_header(data: bytes | memoryview) -> RecordHeader:
    """Parse and sanity-check a header; raises RecordError on anything malformed."""
    if len(data) < HEADER_BYTES:
        raise RecordError(
            "truncated", f"{len(data)} bytes is shorter than a {HEADER_BYTES}-byte header"
        )
    magic, version, flags, ns, key, length, nonce, tag = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise RecordError("bad_magic", f"magic {magic!r} is not {MAGIC!r}")
    if version != VERSION:
        raise RecordError("bad_version", f"record version {version} is not {VERSION}")
    return RecordHeader(flags, ns, key, length, nonce, tag)


class RecordCodec:
    """Seals and opens the records of one namespace with one tenant's keys: a keyed BLAKE3 tag
    over header and payload, or AES-GCM (`encrypt`: fresh random nonce per record, the header
    as associated data)."""

    def __init__(self, namespace: bytes, keys: RecordKeys, *, encrypt: bool = False) -> None:
        if len(namespace) != NAMESPACE_BYTES:
            raise ValueError(f"namespace must be {NAMESPACE_BYTES} bytes, got {len(namespace)}")
        self.namespace = namespace
        self.encrypt = encrypt
        self._keys = keys

    def seal(self, key: bytes, payload: bytes | memoryview) -> tuple[bytes, bytes | memoryview]:
        """(header, body) of the record of `payload` under `key`: the body is the payload
        itself (a view, no copy) or, encrypted, its ciphertext."""
        _check_key(key)
        n = memoryview(payload).nbytes
        if self.encrypt:
            nonce = os.urandom(NONCE_BYTES)
            head = _HEADER.pack(MAGIC, VERSION, FLAG_ENCRYPTED, self.namespace, key, n, nonce,
                                bytes(TAG_BYTES))[:_TAG_AT]  # fmt: skip
            sealed = self._keys.aead.encrypt(nonce, payload, head)
            tag = sealed[-_GCM_TAG_BYTES:].ljust(TAG_BYTES, b"\0")
            return head + tag, memoryview(sealed)[:-_GCM_TAG_BYTES]
        head = _HEADER.pack(MAGIC, VERSION, 0, self.namespace, key, n, _NO_NONCE,
                            bytes(TAG_BYTES))[:_TAG_AT]  # fmt: skip
        return head + self._tag(head, payload), payload

    def encode(self, key: bytes, payload: bytes | memoryview) -> bytes:
        """One record as a single bytes object (header then body)."""
        head, body = self.seal(key, payload)
        return head + bytes(body)

    def open(
        self, data: bytes | memoryview, key: bytes, expected_length: int | None = None
    ) -> memoryview:
        """The payload of a whole record read back for `key`, after every check: a view into
        `data`, decrypted in place when it is encrypted and `data` is writable (else a copy);
        RecordError names the first check that failed (`data` is then not to be used)."""
        view = memoryview(data)
        header = decode_header(view)
        if header.namespace != self.namespace:
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
                "length_mismatch",
                f"payload is {header.length} bytes, layout needs {expected_length}",
            )
        encrypted = bool(header.flags & FLAG_ENCRYPTED)
        if encrypted != self.encrypt:
            # neither kind is read as the other: an attacker cannot downgrade to plain records
            raise RecordError(
                "tag_mismatch",
                "record is "
                + ("encrypted" if encrypted else "not encrypted")
                + ", this tier "
                + ("encrypts" if self.encrypt else "does not encrypt"),
            )
        head = bytes(view[:_TAG_AT])
        body = view[HEADER_BYTES:]
        if encrypted:
            if header.tag[_GCM_TAG_BYTES:] != bytes(TAG_BYTES - _GCM_TAG_BYTES):
                # the GCM tag fills half the field: the rest must be as written (zeros)
                raise RecordError("tag_mismatch", "the record's tag padding was altered")
            # the streaming decryptor takes the tag apart and decrypts into one buffer: the
            # one-shot call wants ciphertext+tag in a single bytes object (two more copies,
            # 6x slower at 4 MiB)
            dec = Cipher(
                algorithms.AES(self._keys.aes_key), modes.GCM(header.nonce, header.tag[:16])
            ).decryptor()
            dec.authenticate_additional_data(head)
            # in place where the caller's read buffer is writable (the tiers' are): no fresh
            # 4 MiB to fault in per read; the buffer holds the plaintext afterwards, and
            # unauthenticated bytes until the tag verified (a failure is a miss, dropped)
            out = body if not view.readonly else memoryview(bytearray(len(body)))
            dec.update_into(body, out)
            try:
                dec.finalize()
            except InvalidTag:
                raise RecordError(
                    "tag_mismatch", "the record's AES-GCM tag does not verify"
                ) from None
            return out
        if self._tag(head, body) != header.tag:
            raise RecordError("tag_mismatch", "the record's keyed tag does not verify")
        return body

    def _tag(self, head: bytes, payload: bytes | memoryview) -> bytes:
        h = blake3.blake3(key=self._keys.mac_key)
        h.update(head)
        h.update(payload)
        return h.digest()


def _check_key(key: bytes) -> None:
    if len(key) != KEY_BYTES:
        raise ValueError(f"chunk key must be {KEY_BYTES} bytes, got {len(key)}")
