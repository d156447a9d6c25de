"""Deterministic chunk keys: chained blake3 over token ids, inside a namespace fingerprint.

Only whole chunks are keyed. Key i depends on every token of chunks 0..i, so equal keys mean equal
prefixes. Nothing here reads Python's `hash()`, so keys survive any `PYTHONHASHSEED`.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import blake3
import numpy as np

KEY_BYTES = 16
FINGERPRINT_BYTES = 16
_TOKEN_LIMIT = 1 << 32
# Bumped whenever the encoding of keys or namespaces changes, so old records stop matching.
_KEYS_DOMAIN = "kvtier.keys.v1"
_NAMESPACE_DOMAIN = "kvtier.namespace.v1"
_STATE_DOMAIN = "kvtier.state.v1"

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

Field = bytes | str | int


def digest16(domain: str, fields: Iterable[Field]) -> bytes:
    """16-byte blake3 over a domain tag and a canonical, typed, length-prefixed field list."""
    h = blake3.blake3()
    for value in (domain, *fields):
        h.update(_encode_field(value))
    return h.digest(length=FINGERPRINT_BYTES)


def _encode_field(value: Field) -> bytes:
    # A type tag plus a length prefix make ("ab", "c") and ("a", "bc") encode differently.
    if isinstance(value, bool):
        raise TypeError(f"bool {value!r} is not a canonical field; pass an int or a str")
    if isinstance(value, int):
        if value < 0 or value >= 1 << 64:
            raise ValueError(f"integer field {value} is outside [0, 2**64)")
        return b"i" + _U64.pack(value)
    if isinstance(value, str):
        raw = value.encode("utf-8")
        return b"s" + _U32.pack(len(raw)) + raw
    if isinstance(value, bytes):
        return b"b" + _U32.pack(len(value)) + value
    raise TypeError(f"field {value!r} of type {type(value).__name__} is not bytes, str or int")


def state_key(chunk_key: bytes, part: int) -> bytes:
    """The key of part `part` of the state record at the end of the chunk keyed `chunk_key`
    (a hybrid model's Mamba / linear-attention state after that chunk's last token)."""
    return digest16(_STATE_DOMAIN, (chunk_key, part))


def num_full_chunks(n_tokens: int, chunk_size: int) -> int:
    """How many whole chunks `n_tokens` tokens hold; a trailing partial chunk is never keyed."""
    _check_chunk_size(chunk_size)
    if n_tokens < 0:
        raise ValueError(f"n_tokens {n_tokens} is negative; pass a token count >= 0")
    return n_tokens // chunk_size


def key_seed(model_id: str, chunk_size: int, epoch: bytes = b"") -> bytes:
    """The 16-byte chain seed for `model_id` at `chunk_size`; identical on every rank. A
    non-empty `epoch` (a namespace reset) gives a seed no earlier chain shares."""
    if not model_id:
        raise ValueError("model_id is empty; pass the served model's name or path")
    _check_chunk_size(chunk_size)
    fields: tuple[Field, ...] = ("seed", model_id, chunk_size)
    return digest16(_KEYS_DOMAIN, (*fields, "epoch", epoch) if epoch else fields)


def chain_keys(
    token_ids: Sequence[int] | np.ndarray,
    chunk_size: int,
    seed: bytes,
    start: int = 0,
    prev: bytes | None = None,
) -> list[bytes]:
    """Keys of the whole chunks of `token_ids` from chunk index `start` on.

    key_i = blake3(key_{i-1} or seed || chunk i as little-endian uint32)[:16]. To extend a chain,
    pass the full token list, `start` = chunks already keyed and `prev` = the last key returned.
    """
    _check_chunk_size(chunk_size)
    if len(seed) != KEY_BYTES:
        raise ValueError(f"seed is {len(seed)} bytes; pass the {KEY_BYTES}-byte key_seed(...)")
    if start < 0:
        raise ValueError(f"start {start} is negative; pass a chunk index >= 0")
    if start == 0 and prev is not None:
        raise ValueError("prev was given with start=0; the chain starts from the seed")
    if start > 0:
        if prev is None:
            raise ValueError(f"start={start} needs prev, the key of chunk {start - 1}")
        if len(prev) != KEY_BYTES:
            raise ValueError(f"prev is {len(prev)} bytes; pass a {KEY_BYTES}-byte chunk key")

    n_chunks = len(token_ids) // chunk_size
    if start > n_chunks:
        raise ValueError(
            f"start={start} is past the {n_chunks} whole chunks in {len(token_ids)} tokens"
        )
    if start == n_chunks:
        return []
    lo, hi = start * chunk_size, n_chunks * chunk_size
    raw = memoryview(_as_le_u32(token_ids, lo, hi))
    stride = chunk_size * 4
    keys: list[bytes] = []
    link = seed if start == 0 else prev
    assert link is not None  # guaranteed by the checks above
    for off in range(0, len(raw), stride):
        h = blake3.blake3(link)
        h.update(raw[off : off + stride])
        link = h.digest(length=KEY_BYTES)
        keys.append(link)
    return keys


class KeySpace:
    """One engine's chunk keys: its model and chunk size, chained from the current epoch's
    seed. A new epoch draws a random seed, so nothing keyed before is reachable again."""

    def __init__(self, model_id: str, chunk_size: int) -> None:
        self.model_id = model_id
        self.chunk = chunk_size
        self.epoch = 0
        self._seed = key_seed(model_id, chunk_size)

    def keys(self, prompt: Sequence[int] | np.ndarray) -> list[bytes]:
        """The prompt's whole-chunk keys in the current epoch."""
        return chain_keys(prompt, self.chunk, self._seed)

    def new_epoch(self) -> int:
        """Start the next epoch (a namespace reset); its number."""
        self.epoch += 1
        self._seed = key_seed(self.model_id, self.chunk, epoch=os.urandom(16))
        return self.epoch


def _as_le_u32(token_ids: Sequence[int] | np.ndarray, lo: int, hi: int) -> bytes:
    """Tokens [lo, hi) as little-endian uint32 bytes, converted once; out-of-range ids raise."""
    if isinstance(token_ids, np.ndarray):
        arr = token_ids[lo:hi]
    else:
        arr = np.asarray(token_ids[lo:hi])
    if arr.ndim != 1:
        raise ValueError(f"token_ids has shape {arr.shape}; pass a flat sequence of ids")
    if arr.dtype.kind == "O":
        # Python ints beyond int64 land here; find the culprit so the message can name it.
        for pos, tok in enumerate(arr.tolist(), start=lo):
            _check_token(tok, pos)
        arr = np.asarray(arr.tolist(), dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token_ids have dtype {arr.dtype}; pass integer token ids")
    bad = np.flatnonzero((arr < 0) | (arr >= _TOKEN_LIMIT))
    if bad.size:
        i = int(bad[0])
        _check_token(int(arr[i]), lo + i)
    return arr.astype("<u4", copy=False).tobytes()


def _check_token(tok: object, pos: int) -> None:
    if isinstance(tok, bool) or not isinstance(tok, int):
        raise ValueError(f"token id {tok!r} at position {pos} is not an integer")
    if not 0 <= tok < _TOKEN_LIMIT:
        raise ValueError(f"token id {tok} at position {pos} is outside [0, 2**32)")


def _check_chunk_size(chunk_size: int) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size {chunk_size!r} must be a positive integer, such as 256")


@dataclass(frozen=True, slots=True)
class Namespace:
    """Where one rank's records live: model, layout, dtype, chunking, TP size and rank, tenant.
    With `replicated`, the rank is left out: every rank of the replica reads the same records.

    The same chunk key under two namespaces never names the same record.
    """

    model_id: str
    layout_fingerprint: bytes
    dtype: str
    chunk_size: int
    tp_size: int
    tp_rank: int
    tenant: str = ""
    # every TP rank holds the same bytes (MLA, the DSA indexer): one namespace for all ranks
    replicated: bool = False
    _fingerprint: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.model_id:
            raise ValueError("Namespace.model_id is empty; pass the served model's name")
        if not isinstance(self.layout_fingerprint, bytes) or len(self.layout_fingerprint) != 16:
            raise ValueError(
                f"Namespace.layout_fingerprint {self.layout_fingerprint!r} is not 16 bytes; "
                "pass KVPages.fingerprint (kvtier.offload.pages)"
            )
        if not self.dtype:
            raise ValueError("Namespace.dtype is empty; pass the KV dtype name, e.g. 'bfloat16'")
        _check_chunk_size(self.chunk_size)
        if isinstance(self.tp_size, bool) or not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"Namespace.tp_size {self.tp_size!r} must be an integer >= 1")
        if (
            isinstance(self.tp_rank, bool)
            or not isinstance(self.tp_rank, int)
            or not 0 <= self.tp_rank < self.tp_size
        ):
            raise ValueError(
                f"Namespace.tp_rank {self.tp_rank!r} must be in [0, {self.tp_size}) "
                f"for tp_size={self.tp_size}"
            )
        # a replicated layout names the replica set instead of the rank, so it never shares a
        # fingerprint with any per-rank namespace (whose last fields are rank and tenant)
        rank: tuple[str | int, ...] = ("replicated",) if self.replicated else (self.tp_rank,)
        fp = digest16(
            _NAMESPACE_DOMAIN,
            (
                self.model_id,
                self.layout_fingerprint,
                self.dtype,
                self.chunk_size,
                self.tp_size,
                *rank,
                self.tenant,
            ),
        )
        object.__setattr__(self, "_fingerprint", fp)

    @property
    def fingerprint(self) -> bytes:
        """16-byte blake3 of the canonical encoding of every field."""
        return self._fingerprint

    @property
    def hex(self) -> str:
        """The fingerprint as 32 lowercase hex digits (for logs, paths and remote keys)."""
        return self._fingerprint.hex()
