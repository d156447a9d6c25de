"""Lookup wire messages: msgspec Structs, msgpack-encoded, one tagged union, no pickle.

Every message is encoded as an array `[tag, version, fields...]`, so `version` is always at index
1 and a frame from another protocol version is recognised even when its layout differs. On the
wire a message travels as one zmq frame, `MAC || body`: the body is these bytes, the MAC their
keyed BLAKE3 under the engine's key (`lookup/auth.py`), checked before the body is decoded. One
frame, never a multipart message: libzmq 4.3.5 aborts the process when a connection drops while
its engine holds part of an outgoing multipart message (`session_base.cpp:233`, zeromq/libzmq
#3442), which a peer hanging up mid-reply could cause.
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec

PROTOCOL_VERSION: Final = 1
KEY_BYTES: Final = 16
MAX_LOOKUP_ID_CHARS: Final = 256
DEFAULT_MAX_FRAME_BYTES: Final = 4 * 1024 * 1024

# Reasons a frame is rejected (label of `kvtier_rejected_frames_total`).
REJECT_AUTH: Final = "auth"  # no MAC, or one the engine's key did not make (lookup/auth.py)
REJECT_OVERSIZED: Final = "oversized"  # longer than max_frame_bytes
REJECT_FRAMES: Final = "frames"  # a multipart message (the protocol's are one frame)
REJECT_GARBAGE: Final = "garbage"  # not msgpack at all
REJECT_SCHEMA: Final = "schema"  # msgpack, but not a known message of this version
REJECT_VERSION: Final = "version"  # a message of another protocol version
REJECT_UNEXPECTED: Final = "unexpected"  # a valid message this side does not accept
REJECT_WRONG_RANK: Final = "wrong_rank"  # a reply from another rank than the socket's (client)
REJECT_RANGE: Final = "range"  # a reply claiming more chunks than were asked (client)

Key = Annotated[bytes, msgspec.Meta(min_length=KEY_BYTES, max_length=KEY_BYTES)]
LookupId = Annotated[str, msgspec.Meta(max_length=MAX_LOOKUP_ID_CHARS)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
TierName = Annotated[str, msgspec.Meta(max_length=32)]
# (tier, chunks) per run of consecutive chunks one tier serves
TierRun = tuple[TierName, Annotated[int, msgspec.Meta(ge=1)]]


class LookupRequest(msgspec.Struct, tag="lookup", array_like=True, frozen=True):
    """How many leading `keys` does the rank hold? With `lease`, lease them under `lookup_id`.

    `req` is the client's request number, echoed in the reply: lookup ids may be reused (a
    re-lookup of the same sequence), so only (lookup_id, req) identifies one answer. With
    `ends`, the run is cut back to end after a chunk `i` whose `ends[i]` the rank holds too
    (a hybrid model's boundary state), leased with it; chunks past `len(ends)` never end it.
    """

    version: int
    lookup_id: LookupId
    req: int
    keys: list[Key]
    lease: bool
    ends: list[Key] = []


class LookupReply(msgspec.Struct, tag="reply", array_like=True, frozen=True):
    """A rank's answer: `hit_chunks` leading chunks held; `error` set when it could not answer;
    `tier` the deepest tier any of those chunks lives in ("memory", "disk", "remote"; "" when
    none or unknown); `runs` the tier of each run of consecutive chunks (empty: all `tier`);
    `ends_held` (a request with `ends`) the chunk counts, ascending, after which the rank holds
    the end: the client cuts every rank at the deepest one all of them hold."""

    version: int
    lookup_id: str
    req: int
    rank: int
    hit_chunks: NonNegative
    error: str | None = None
    tier: str = ""
    runs: tuple[TierRun, ...] = ()
    ends_held: tuple[NonNegative, ...] = ()


class ReleaseRequest(msgspec.Struct, tag="release", array_like=True, frozen=True):
    """Release the leases of `lookup_ids`. Fire-and-forget: the server sends no reply."""

    version: int
    lookup_ids: list[LookupId]


class Ping(msgspec.Struct, tag="ping", array_like=True, frozen=True):
    """Health probe; the server answers with a `Pong` echoing `nonce`."""

    version: int
    nonce: int


class Pong(msgspec.Struct, tag="pong", array_like=True, frozen=True):
    """Answer to `Ping`, with the server's rank and running totals (for health and self-tests)."""

    version: int
    nonce: int
    rank: int
    served: int
    released: int
    rejected: int


# What an `AdminRequest` asks of a rank's tiers (`store/stack.py` carries them out).
ADMIN_RETAIN: Final = "retain"  # keep `keys` until `until` (wall-clock seconds)
ADMIN_RELEASE: Final = "release"  # stop retaining `keys`
ADMIN_PREFETCH: Final = "prefetch"  # bring `keys` from disk or the shared store into memory
ADMIN_FORGET: Final = "forget"  # delete `keys` from every tier, the shared store included
ADMIN_OPS: Final = (ADMIN_RETAIN, ADMIN_RELEASE, ADMIN_PREFETCH, ADMIN_FORGET)
AdminOp = Annotated[str, msgspec.Meta(pattern="^(retain|release|prefetch|forget)$")]


class AdminRequest(msgspec.Struct, tag="admin", array_like=True, frozen=True):
    """Retain, release, prefetch or forget `keys` on the rank; answered by an `AdminReply`."""

    version: int
    req: int
    op: AdminOp
    keys: list[Key]
    until: float = 0.0
    reply: bool = True  # False: fire-and-forget (a hook's retain), no AdminReply


class AdminReply(msgspec.Struct, tag="admin_reply", array_like=True, frozen=True):
    """How many of the request's keys the rank acted on (retained, released, brought into
    memory, deleted from at least one tier); `error` set when it could not."""

    version: int
    req: int
    rank: int
    count: NonNegative
    error: str | None = None


Message = LookupRequest | LookupReply | ReleaseRequest | Ping | Pong | AdminRequest | AdminReply


# What decoding hostile bytes raises besides a schema mismatch: malformed msgpack, a str that is
# not UTF-8 (msgspec raises UnicodeDecodeError, not DecodeError), nesting deeper than the
# interpreter's recursion limit.
_NOT_MSGPACK: Final = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)


class FrameError(ValueError):
    """A frame that is not a valid message of this protocol version; `reason` labels the metric."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class Codec:
    """One encoder and one decoder for the whole union; one Codec per socket-owning thread."""

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        if max_frame_bytes <= 0:
            raise ValueError(f"max_frame_bytes={max_frame_bytes} must be > 0 (default 4 MiB)")
        self.max_frame_bytes = max_frame_bytes
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(Message)

    def encode(self, msg: Message) -> bytes:
        """The msgpack bytes of `msg`."""
        return self._enc.encode(msg)

    def decode(self, frame: bytes | memoryview) -> Message:
        """Decode one frame, or raise `FrameError` naming why it was rejected."""
        if len(frame) > self.max_frame_bytes:
            raise FrameError(
                REJECT_OVERSIZED, f"{len(frame)} bytes > max_frame_bytes={self.max_frame_bytes}"
            )
        try:
            msg = self._dec.decode(frame)
        except msgspec.ValidationError as e:
            if _foreign_version(frame):
                raise FrameError(REJECT_VERSION, str(e)) from None
            raise FrameError(REJECT_SCHEMA, str(e)) from None
        except _NOT_MSGPACK as e:
            raise FrameError(REJECT_GARBAGE, f"{type(e).__name__}: {e}") from None
        if msg.version != PROTOCOL_VERSION:
            raise FrameError(
                REJECT_VERSION, f"version {msg.version}, this side speaks {PROTOCOL_VERSION}"
            )
        return msg


def _foreign_version(frame: bytes | memoryview) -> bool:
    """True if `frame` is `[tag, version, ...]` with another version (error path only)."""
    try:
        raw = msgspec.msgpack.decode(frame)
    except _NOT_MSGPACK:
        return False
    return (
        isinstance(raw, list)
        and len(raw) >= 2
        and isinstance(raw[1], int)
        and raw[1] != PROTOCOL_VERSION
    )
