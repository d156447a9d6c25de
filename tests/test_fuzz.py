"""Fuzz the two parsers that take bytes from outside the process: the lookup wire (a running
LookupServer on a real zmq socket) and chunk records (`record.verify` / `decode_header`).

Nothing may crash or hang: a message under the engine's MAC is answered or (a release)
silently taken, within a deadline, and one without it (no MAC, a wrong one, the wrong number
of frames, an oversized body) is never answered; every rejection is counted under the reason
the wire's own codec gives; the server keeps answering valid lookups afterwards. Records
either verify to the very payload that was written or raise `RecordError`. Hypothesis runs
derandomized, so every run is the same.
"""

from __future__ import annotations

import shutil
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.lookup import (
    PROTOCOL_VERSION,
    Codec,
    FrameError,
    LookupClient,
    LookupReply,
    LookupRequest,
    LookupServer,
    Ping,
    Pong,
    ReleaseRequest,
    endpoint_for,
    engine_key,
    make_run_dir,
)
from kvtier.lookup.auth import MAC_BYTES, REQUESTS, FrameMac
from kvtier.lookup.messages import (
    REJECT_AUTH,
    REJECT_FRAMES,
    REJECT_OVERSIZED,
    REJECT_UNEXPECTED,
)
from kvtier.metrics import Metrics
from kvtier.store import record
from kvtier.store.memory import MemoryTier
from kvtier.store.registry import order
from kvtier.store.stack import TierStack
from tests.lookup_helpers import make_keys, recv_signed, signed
from tests.record_key import codec_for_tests

MAX_FRAME = 1024  # small, so oversized frames are cheap to send
HELD = 3  # leading keys the rank's memory tier holds
KEYS = make_keys(5, salt="fuzz")
NS = bytes(range(16))
REPLY_DEADLINE_S = 5.0
FUZZ = settings(
    max_examples=300,
    derandomize=True,
    deadline=None,  # each round trip has its own deadline below
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

_enc = msgspec.msgpack.encode
VALID_FRAMES: list[bytes] = [
    _enc(LookupRequest(PROTOCOL_VERSION, "fuzz-a", 1, KEYS[:4], True)),
    _enc(LookupRequest(PROTOCOL_VERSION, "fuzz-b", 2, KEYS, False)),
    _enc(ReleaseRequest(PROTOCOL_VERSION, ["fuzz-a", "never-leased"])),
    _enc(Ping(PROTOCOL_VERSION, 99)),
    # valid messages a server never accepts
    _enc(Pong(PROTOCOL_VERSION, 99, 0, 1, 2, 3)),
    _enc(LookupReply(PROTOCOL_VERSION, "fuzz-a", 1, 0, 3, None)),
]
# msgpack headers that announce far more than the frame holds
HUGE_HEADERS = [
    b"\xdd\xff\xff\xff\xff",  # array 32 of 2**32-1 items
    b"\xdf\xff\xff\xff\xff",  # map 32
    b"\xc6\xff\xff\xff\xff",  # bin 32
    b"\xdb\xff\xff\xff\xff",  # str 32
    b"\xc9\xff\xff\xff\xff\x01",  # ext 32
    b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff",  # uint 64 max, where a length or id goes
]
TAGS = ["lookup", "reply", "release", "ping", "pong", "bogus", ""]

TIER_ORDER = order()  # the registry's tier names, accelerator outwards


# ---- strategies -------------------------------------------------------------------------------


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=24),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A valid frame truncated, bit-flipped, with bytes inserted, or spliced with another."""
    base = bytearray(draw(st.sampled_from(VALID_FRAMES)))
    how = draw(st.sampled_from(["truncate", "flip", "insert", "splice"]))
    if how == "truncate":
        return bytes(base[: draw(st.integers(0, len(base) - 1))])
    if how == "flip":
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(base) - 1))
            base[i] ^= 1 << draw(st.integers(0, 7))
        return bytes(base)
    if how == "insert":
        i = draw(st.integers(0, len(base)))
        return bytes(base[:i]) + draw(st.binary(min_size=1, max_size=8)) + bytes(base[i:])
    other = draw(st.sampled_from(VALID_FRAMES))
    return (
        bytes(base[: draw(st.integers(0, len(base)))]) + other[draw(st.integers(0, len(other))) :]
    )


@st.composite
def wrong_types(draw: st.DrawFn) -> bytes:
    """A `[tag, version, fields...]` array of arbitrary msgpack values."""
    version = draw(st.sampled_from([PROTOCOL_VERSION, PROTOCOL_VERSION + 1, 0, -1]))
    fields = draw(st.lists(msgpack_values, max_size=7))
    return _enc([draw(st.sampled_from(TAGS)), version, *fields])


@st.composite
def huge_lengths(draw: st.DrawFn) -> bytes:
    """A valid frame's head, then a length header announcing gigabytes, then a little data."""
    head = draw(st.sampled_from(VALID_FRAMES))
    return (
        head[: draw(st.integers(0, len(head)))]
        + draw(st.sampled_from(HUGE_HEADERS))
        + draw(st.binary(max_size=16))
    )


@st.composite
def deeply_nested(draw: st.DrawFn) -> bytes:
    """Arrays (or maps) nested up to the frame cap: deeper than the recursion limit allows."""
    depth = draw(st.integers(1, MAX_FRAME - 16))
    level = draw(st.sampled_from([b"\x91", b"\x81\xa1k"]))
    head = draw(st.sampled_from([b"", b"\x96\xa6lookup\x01", b"\x93\xa4ping\x01"]))
    return (head + level * depth + b"\xc0")[:MAX_FRAME]


frames = st.one_of(
    st.binary(max_size=64),
    deeply_nested(),
    st.binary(min_size=MAX_FRAME + 1, max_size=2 * MAX_FRAME),  # over the cap, under zmq's
    mutated(),
    wrong_types(),
    huge_lengths(),
    st.sampled_from(VALID_FRAMES),
)
# a message is one frame, or several (the wire takes exactly one frame), sent under the engine's
# MAC (the first frame sealed, MAC || body: the codec behind the MAC is fuzzed) or as it is (no
# MAC, or a made-up one: refused before decoding)
messages = st.tuples(
    st.booleans(),
    st.one_of(frames.map(lambda f: [f]), st.lists(frames, min_size=2, max_size=12)),
)


# ---- the server under test -------------------------------------------------------------------


@dataclass
class Rank:
    """A LookupServer over a real TierStack, a raw DEALER to abuse it (holding the engine's
    key, so it can also send what the engine's client would) and a well-behaved client."""

    server: LookupServer
    metrics: Metrics
    raw: zmq.Socket
    client: LookupClient
    oracle: Codec
    key: bytes
    expected: Counter[str]
    nonce: int = 0


@pytest.fixture(scope="module")
def rank() -> Iterator[Rank]:
    run_dir: Path = make_run_dir()
    metrics = Metrics(0)
    memory = MemoryTier(64, 64 * 8, NS, metrics)
    for key in KEYS[:HELD]:
        assert memory.put(key, bytes(64))
    stack = TierStack(memory, (), metrics)
    endpoint = endpoint_for(0, run_dir=run_dir)
    server = LookupServer(0, stack, endpoint, metrics, max_frame_bytes=MAX_FRAME).start()
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(endpoint)
    client = LookupClient(
        {0: endpoint},
        Metrics("client"),
        chunk_size=16,
        world=1,
        timeout_ms=2000,
        tier_order=TIER_ORDER,
    )
    client.wait_ready(10.0)
    try:
        yield Rank(server, metrics, raw, client, Codec(MAX_FRAME), engine_key(run_dir), Counter())
    finally:
        client.close()
        raw.close()
        server.close()
        stack.close()
        shutil.rmtree(run_dir, ignore_errors=True)


def _wire(key: bytes, message: tuple[bool, list[bytes]]) -> list[bytes]:
    """The frames sent for `message`: under the engine's MAC, or as they are."""
    under_mac, parts = message
    return [*signed(key, parts[0]), *parts[1:]] if under_mac else parts


def _classify(codec: Codec, key: bytes, wire: list[bytes]) -> tuple[str, str]:
    """What the server must do with the frames `wire`: ("refuse", reason) (never answered),
    ("reject", reason), ("answer", kind) or ("silent", "release"), by the wire's own codec."""
    if len(wire) != 1:
        return "refuse", REJECT_FRAMES
    (frame,) = wire
    if len(frame) < MAC_BYTES:
        return "refuse", REJECT_AUTH
    if len(frame) - MAC_BYTES > codec.max_frame_bytes:
        return "refuse", REJECT_OVERSIZED
    body = FrameMac(key, REQUESTS, 0).opened(frame)
    if body is None:
        return "refuse", REJECT_AUTH
    try:
        msg = codec.decode(body)
    except FrameError as e:
        return "reject", e.reason
    if isinstance(msg, LookupRequest):
        return "answer", "lookup"
    if isinstance(msg, Ping):
        return "answer", "ping"
    if isinstance(msg, ReleaseRequest):
        return "silent", "release"
    return "reject", REJECT_UNEXPECTED


def _recv(r: Rank) -> LookupReply | Pong:
    """The next reply within the deadline; whatever the server sends carries the engine's MAC
    and decodes."""
    msg = r.oracle.decode(recv_signed(r.raw, r.key, int(REPLY_DEADLINE_S * 1000)))
    assert isinstance(msg, LookupReply | Pong), msg
    return msg


def _round(r: Rank, batch: list[tuple[bool, list[bytes]]]) -> None:
    """Send `batch`, then a ping; check every reply in order up to that ping's pong (one
    connection's messages are handled in order, so a refused message answered would show)."""
    wires = [_wire(r.key, m) for m in batch]
    plan = [_classify(r.oracle, r.key, w) for w in wires]
    t0 = time.monotonic()
    for wire in wires:
        r.raw.send_multipart(wire)
    r.nonce += 1
    r.raw.send_multipart(signed(r.key, _enc(Ping(PROTOCOL_VERSION, r.nonce))))
    for (what, detail), message in zip(plan, wires, strict=True):
        if what == "refuse":
            r.expected[detail] += 1
            continue
        if what == "silent":
            continue
        reply = _recv(r)
        if what == "reject":
            r.expected[detail] += 1
            assert isinstance(reply, LookupReply), (message, reply)
            assert reply.error is not None and reply.error.startswith(f"rejected: {detail}"), (
                message,
                reply,
            )
            assert (reply.rank, reply.hit_chunks) == (0, 0)
        elif detail == "lookup":
            assert isinstance(reply, LookupReply) and reply.error is None, (message, reply)
            sent = r.oracle.decode(message[0][MAC_BYTES:])
            assert isinstance(sent, LookupRequest)
            assert (reply.lookup_id, reply.req) == (sent.lookup_id, sent.req)
            held = 0
            for key in sent.keys:
                if key not in KEYS[:HELD]:
                    break
                held += 1
            assert reply.hit_chunks == held
        else:
            assert isinstance(reply, Pong), (message, reply)
    pong = _recv(r)
    assert isinstance(pong, Pong) and pong.nonce == r.nonce, pong
    assert time.monotonic() - t0 < REPLY_DEADLINE_S
    # every rejection so far is counted, under the reason it was rejected for
    for reason, n in r.expected.items():
        assert r.metrics.value("rejected_frames_total", reason=reason) == n, reason
    assert r.metrics.total("rejected_frames_total") == sum(r.expected.values())


def test_lookup_server_survives_hostile_frames_and_counts_every_rejection(rank: Rank) -> None:
    @FUZZ
    @given(batch=st.lists(messages, min_size=1, max_size=6))
    def fuzz(batch: list[tuple[bool, list[bytes]]]) -> None:
        _round(rank, batch)
        # a well-formed lookup from the engine's client is still answered correctly
        res = rank.client.lookup(KEYS, "after-fuzz")
        assert (res.hit_chunks, res.timed_out, res.errors) == (HELD, (), {})
        rank.client.release(["after-fuzz"])

    fuzz()
    # the generated frames reached every reason a lone frame can be rejected for
    assert set(rank.expected) >= {
        "auth",
        "garbage",
        "schema",
        "version",
        "oversized",
        "frames",
        "unexpected",
    }
    pong = rank.client.server_stats(2000)[0]
    assert pong is not None and pong.rejected == sum(rank.expected.values())


def test_frame_over_the_hard_cap_drops_only_that_peer(rank: Rank) -> None:
    """zmq itself disconnects a peer sending a body over 4x max_frame_bytes behind its MAC
    (memory stays bounded, no reply, no counter); the server goes on answering everyone else."""
    before = rank.metrics.total("rejected_frames_total")
    hostile = zmq.Context.instance().socket(zmq.DEALER)
    hostile.setsockopt(zmq.LINGER, 0)
    hostile.connect(rank.server.bound_endpoint)
    try:
        hostile.send(b"\x00" * (MAC_BYTES + 4 * MAX_FRAME + 1))
        assert rank.client.lookup(KEYS, "after-hard-cap").hit_chunks == HELD
        rank.client.release(["after-hard-cap"])
        assert hostile.poll(100) == 0
    finally:
        hostile.close()
    assert rank.metrics.total("rejected_frames_total") == before


# ---- records ----------------------------------------------------------------------------------

PAYLOAD = bytes(range(256)) * 3
KEY = KEYS[0]
CODECS = {enc: codec_for_tests(NS, encrypt=enc) for enc in (False, True)}
VALID = {enc: c.encode(KEY, PAYLOAD) for enc, c in CODECS.items()}
# magic 0:4, version 4:6, flags 6:8, namespace 8:24, key 24:40, length 40:48, nonce 48:60,
# tag 60:92
FIELDS = [(0, 4), (4, 6), (6, 8), (8, 24), (24, 40), (40, 48), (48, 60), (60, 92)]


@st.composite
def record_bytes(draw: st.DrawFn) -> tuple[bool, bytes]:
    """(encrypted?, bytes): random bytes, or a valid record truncated, extended, bit-flipped or
    with a header field overwritten (lengths up to 2**64-1 included)."""
    enc = draw(st.booleans())
    how = draw(st.sampled_from(["random", "truncate", "extend", "flip", "field"]))
    data = bytearray(VALID[enc])
    if how == "random":
        return enc, draw(st.binary(max_size=2 * record.HEADER_BYTES))
    if how == "truncate":
        return enc, bytes(data[: draw(st.integers(0, len(data) - 1))])
    if how == "extend":
        return enc, bytes(data) + draw(st.binary(min_size=1, max_size=16))
    if how == "flip":
        for _ in range(draw(st.integers(1, 3))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= 1 << draw(st.integers(0, 7))
        return enc, bytes(data)
    start, end = draw(st.sampled_from(FIELDS))
    data[start:end] = draw(st.binary(min_size=end - start, max_size=end - start))
    return enc, bytes(data)


@FUZZ
@given(case=record_bytes())
def test_record_open_returns_the_written_payload_or_raises_record_error(
    case: tuple[bool, bytes],
) -> None:
    enc, data = case
    codec = CODECS[enc]
    for view in (data, memoryview(data)):
        t0 = time.monotonic()
        try:
            header = record.decode_header(view)
        except record.RecordError as e:
            assert e.reason in {"truncated", "bad_magic", "bad_version"}
        else:
            assert 0 <= header.length < 2**64
        try:
            payload = codec.open(view, KEY)
        except record.RecordError as e:
            assert e.reason in {
                "truncated",
                "bad_magic",
                "bad_version",
                "namespace_mismatch",
                "key_mismatch",
                "length_mismatch",
                "tag_mismatch",
            }
        else:
            # every header field and every payload byte is under the tag: only an unchanged
            # record opens, and it opens to what was written
            assert bytes(payload) == PAYLOAD and data == VALID[enc]
        with pytest.raises(record.RecordError):
            codec.open(view, KEY, expected_length=len(PAYLOAD) + 1)
        assert time.monotonic() - t0 < 1.0
