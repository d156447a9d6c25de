"""Fake lookup backends, a subprocess server entry point and a raw client's framing (the
engine's MAC on what it sends, checked on what it gets) for the lookup tests."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from typing import Any

import zmq

from kvtier.lookup import FrameMac, serve_until
from kvtier.lookup.auth import REPLIES, REQUESTS
from kvtier.lookup.curve import curve_keys, secure_client


def make_keys(n: int, salt: str = "k") -> list[bytes]:
    """`n` deterministic 16-byte chunk keys."""
    return [hashlib.blake2b(f"{salt}{i}".encode(), digest_size=16).digest() for i in range(n)]


class FakeBackend:
    """Dict-backed lookup backend: holds a key set, records leases and releases.

    `events` (a queue) receives `("lease", rank, lookup_id, hit)` and `("release", rank, id)`
    so a test in another process can see what this backend did. With `gate`, each lookup
    computes its answer first, then waits for the gate to open (a slow rank).
    """

    def __init__(
        self,
        rank: int,
        held: Sequence[bytes],
        events: Any = None,
        gate: threading.Event | None = None,
        fail: bool = False,
    ) -> None:
        self.rank = rank
        self.held = set(held)
        self.events = events
        self.gate = gate
        self.fail = fail
        self.leases: dict[str, int] = {}
        self.lookups = 0
        self.releases: list[str] = []

    def lookup(self, keys: Sequence[bytes], lease_id: str | None) -> int:
        if self.fail:
            raise OSError("disk on fire")
        self.lookups += 1
        hit = 0
        for k in keys:
            if k not in self.held:
                break
            hit += 1
        if lease_id is not None:
            self.leases[lease_id] = hit
            if self.events is not None:
                self.events.put(("lease", self.rank, lease_id, hit))
        if self.gate is not None:
            self.gate.wait(30.0)
        return hit

    def release(self, lease_id: str) -> None:
        self.leases.pop(lease_id, None)
        self.releases.append(lease_id)
        if self.events is not None:
            self.events.put(("release", self.rank, lease_id))


def run_fake_server(rank: int, endpoint: str, held: int, events: Any, stop: Any) -> None:
    """Subprocess target: serve a FakeBackend holding the first `held` of `make_keys` until
    `stop` is set."""
    backend = FakeBackend(rank, make_keys(held), events)
    serve_until(stop, rank, backend, endpoint)


def signed(key: bytes, body: bytes, rank: int = 0) -> list[bytes]:
    """The message (one frame, `MAC || body`) the engine's client sends rank `rank`: `body`
    under the engine's `key`."""
    return [FrameMac(key, REQUESTS, rank).seal(body)]


def recv_signed(sock: zmq.Socket, key: bytes, timeout_ms: int = 5000, rank: int = 0) -> bytes:
    """The body of the next message on `sock` within `timeout_ms`, asserting it carries the
    engine's reply MAC of rank `rank`."""
    assert sock.poll(timeout_ms), f"no reply within {timeout_ms} ms"
    (frame,) = sock.recv_multipart()
    body = FrameMac(key, REPLIES, rank).opened(frame)
    assert body is not None, "a reply without the engine's MAC"
    return body


def engine_side(sock: zmq.Socket, key: bytes, rank: int = 0, *, server: bool = False) -> None:
    """Give a test's raw socket (before bind or connect) the engine's CURVE keys for `rank`,
    as a client, or as a server that vets no peers: a process holding the engine key, past
    the TCP handshake, whose frames only the MACs judge."""
    keys = curve_keys(key, rank)
    if server:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
    else:
        secure_client(sock, keys)
