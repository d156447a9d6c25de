"""Review of the one-frame lookup wire (`MAC || body`) and the cached metric children."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from kvtier.lookup import (
    PROTOCOL_VERSION,
    LookupClient,
    LookupReply,
    LookupRequest,
    LookupServer,
    Ping,
    Pong,
    endpoint_for,
    engine_key,
    make_run_dir,
)
from kvtier.lookup.auth import MAC_BYTES, REQUESTS, FrameMac
from kvtier.metrics import Metrics
from kvtier.store.registry import order
from tests.lookup_helpers import FakeBackend, make_keys, recv_signed, signed

CHUNK = 16
TIER_ORDER = order()


@pytest.fixture
def run_dir() -> Iterator[Path]:
    d = make_run_dir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_a_reply_whose_body_fits_the_clients_cap_is_received(run_dir: Path) -> None:
    """The cap (`max_frame_bytes`) is on the body: a client whose cap its own request and the
    reply's body both fit must get the answer. The client's DEALER still sets
    MAXMSGSIZE = max_frame_bytes, which now also has to hold the 32-byte MAC in the same
    frame, so libzmq drops the connection on such a reply and the lookup times out."""
    keys = make_keys(1)
    lookup_id = "x" * 80
    enc = msgspec.msgpack.encode
    request = enc(LookupRequest(PROTOCOL_VERSION, lookup_id, 5, list(keys), True, []))
    reply = enc(LookupReply(PROTOCOL_VERSION, lookup_id, 5, 0, 1))
    cap = len(request)
    # the reply's body fits the cap, its one frame (MAC || body) does not
    assert MAC_BYTES <= len(reply) <= cap < len(reply) + MAC_BYTES
    ep = endpoint_for(0, run_dir=run_dir)
    server = LookupServer(0, FakeBackend(0, keys), ep, Metrics(0)).start()
    m = Metrics(0)
    c = LookupClient({0: ep}, m, chunk_size=CHUNK, world=1, timeout_ms=2000,
                     tier_order=TIER_ORDER, max_frame_bytes=cap)  # fmt: skip
    try:
        c.wait_ready(10.0)  # a pong (small) goes through
        res = c.lookup(keys, lookup_id, lease=False)
        # the server answered (it counts before sending: a count read once the reply is in
        # hand is never one behind) ...
        assert server.served == 1
        assert (res.hit_chunks, res.timed_out) == (1, ()), res  # ... and the answer must arrive
    finally:
        c.close()
        server.close()


def _raw(ep: str) -> zmq.Socket:
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(ep)
    return raw


def _pong(raw: zmq.Socket, key: bytes, nonce: int) -> Pong:
    raw.send_multipart(signed(key, msgspec.msgpack.encode(Ping(PROTOCOL_VERSION, nonce))))
    msg = msgspec.msgpack.decode(recv_signed(raw, key, timeout_ms=5000), type=Pong)
    assert msg.nonce == nonce
    return msg


CAP = 4096


@pytest.fixture
def capped(run_dir: Path) -> Iterator[tuple[LookupServer, bytes, zmq.Socket]]:
    """Rank 0 with a frame cap of `CAP` bytes, the engine's key and a raw socket to it."""
    ep = endpoint_for(0, run_dir=run_dir)
    server = LookupServer(0, FakeBackend(0, []), ep, Metrics(0), max_frame_bytes=CAP).start()
    raw = _raw(ep)
    try:
        yield server, engine_key(run_dir), raw
    finally:
        raw.close()
        server.close()


def test_a_body_up_to_the_hard_limit_is_read_and_counted_as_oversized(
    capped: tuple[LookupServer, bytes, zmq.Socket],
) -> None:
    """server.py: "zmq drops (disconnects) peers sending more than [4x] the frame cap ...;
    frames between the cap and this are read and counted". The cap is on the body, but the
    ROUTER's MAXMSGSIZE (4 * max_frame_bytes) now also has to hold the MAC: a body of
    4 * cap bytes (counted `oversized` under [MAC, body]) gets its sender disconnected, and is
    never counted."""
    server, key, raw = capped
    _pong(raw, key, 1)
    raw.send_multipart(signed(key, b"\x00" * (4 * CAP)))
    # one connection's messages are handled in order: the pong says the frame was handled
    _pong(raw, key, 2)
    assert server._m.value("rejected_frames_total", reason="oversized") == 1


def test_guard_body_boundaries_of_the_one_frame(
    capped: tuple[LookupServer, bytes, zmq.Socket],
) -> None:
    """GUARD (passes): a body of exactly max_frame_bytes is read (not oversized); a frame of
    exactly MAC_BYTES under the engine's MAC is an empty body (answered `garbage`); 32 bytes
    of another MAC and a frame shorter than the MAC are refused as `auth`, unanswered."""
    server, key, raw = capped
    for body in (b"\xc1" * CAP, b""):
        raw.send_multipart(signed(key, body))
        reply = msgspec.msgpack.decode(recv_signed(raw, key), type=LookupReply)
        assert reply.error is not None and reply.error.startswith("rejected: garbage")
    for frame in (b"\x00" * MAC_BYTES, FrameMac(key, REQUESTS, 0).of(b"")[:-1]):
        raw.send_multipart([frame])
    _pong(raw, key, 3)  # the refused frames got no answer: the pong is next
    sm = server._m
    assert sm.value("rejected_frames_total", reason="garbage") == 2
    assert sm.value("rejected_frames_total", reason="oversized") == 0
    assert sm.value("rejected_frames_total", reason="auth") == 2


def test_guard_a_squatters_short_reply_is_counted_as_auth(run_dir: Path) -> None:
    """GUARD (passes): a reply on a rank's endpoint shorter than a MAC, or exactly a MAC
    long, is dropped and counted `auth` on the client; the lookup times out with no hits."""
    ep = endpoint_for(0, run_dir=run_dir)
    squatter = zmq.Context.instance().socket(zmq.ROUTER)
    squatter.setsockopt(zmq.LINGER, 0)
    squatter.bind(ep)
    m = Metrics(0)
    c = LookupClient({0: ep}, m, chunk_size=CHUNK, world=1, timeout_ms=1000,
                     tier_order=TIER_ORDER)  # fmt: skip
    try:
        assert c.wait_connected(10.0) == []
        pending = c.begin(make_keys(2), "lk0")
        assert squatter.poll(5000)
        peer, _frame = squatter.recv_multipart()
        squatter.send_multipart([peer, b""])
        squatter.send_multipart([peer, b"\x01" * (MAC_BYTES - 1)])
        squatter.send_multipart([peer, b"\x01" * MAC_BYTES])
        res = c.poll(pending, wait_ms=5000)
        assert res is not None and (res.hit_chunks, res.timed_out) == (0, (0,))
        assert m.value("rejected_frames_total", reason="auth") == 3
    finally:
        c.close()
        squatter.close()
