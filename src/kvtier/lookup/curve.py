"""The TCP lookup channel's handshake: CURVE (libzmq's, on libsodium) under keys derived from the
engine key, so only the engine's own processes get past it.

On ipc the socket lives in the engine's private run directory and no other user can connect.
On TCP anyone on the host can: before this handshake a process that bound a rank's port first
could send a zmq message that never ends (zmq's limits are per frame), buffered whole in the
client's memory, or in a rank's by connecting to it. Under CURVE nothing reaches a socket's
queue before both sides proved they hold the engine key:

- each rank's server has a keypair derived from the engine key and the rank; a client that
  reached an impostor on the port fails the handshake (the impostor cannot answer for the
  server's secret), and with `ZMQ_IMMEDIATE` it never queues a frame to it;
- a client's HELLO is sealed to the server's public key, which is derived from the engine key
  and written nowhere: a peer that does not hold the engine key cannot make one, and libzmq
  drops it at the handshake, before any frame (so it is not counted; the MACs count frames).
  No ZAP handler: libzmq's ZAP path has aborted processes on shutdown races before, and the
  secret server key already admits only the engine's processes.

The frame MACs (`lookup/auth.py`) stay: they bind each frame to a direction and a rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import zmq
from zmq.utils import z85

from kvtier.lookup.auth import rank_key

# BLAKE3 key-derivation contexts: globally unique, fixed forever for this handshake
_SERVER: Final = "kvtier 2026-12 lookup curve server keys"
_CLIENT: Final = "kvtier 2026-12 lookup curve client keys"


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """One rank's CURVE keys (Z85 text, as libzmq takes them): its server's and its client's."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def curve_keys(key: bytes, rank: int) -> CurveKeys:
    """Rank `rank`'s CURVE keys under the engine key `key`; the same on every process of it."""
    # any 32 bytes are a Curve25519 secret key: libsodium clamps them
    server = z85.encode(rank_key(key, _SERVER, rank))
    client = z85.encode(rank_key(key, _CLIENT, rank))
    return CurveKeys(zmq.curve_public(server), server, zmq.curve_public(client), client)


def secure_server(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make `sock` (before bind) a CURVE server of `keys`: only a client that knows its
    public key (a process holding the engine key) completes the handshake."""
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)


def secure_client(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make `sock` (before connect) a CURVE client that talks only to `keys`' server."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)
