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
- each rank's client has a keypair derived the same way; the rank's ZAP handler (`ZapGate`,
  answered on the server's own thread) admits only that public key, so a peer that does not
  hold the engine key is refused at the handshake and counted (`rejected_frames{reason="auth"}`).

The frame MACs (`lookup/auth.py`) stay: they bind each frame to a direction and a rank.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Final

import zmq
from zmq.utils import z85

from kvtier.lookup.auth import rank_key

# BLAKE3 key-derivation contexts: globally unique, fixed forever for this handshake
_SERVER: Final = "kvtier 2026-12 lookup curve server keys"
_CLIENT: Final = "kvtier 2026-12 lookup curve client keys"
# ZAP (RFC 27): libzmq asks the handler bound here, in the socket's context, about each peer
ZAP_ENDPOINT: Final = "inproc://zeromq.zap.01"
_ZAP_VERSION: Final = b"1.0"
_CURVE: Final = b"CURVE"


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


def secure_server(sock: zmq.Socket, keys: CurveKeys, domain: str) -> None:
    """Make `sock` (before bind) a CURVE server whose peers `domain`'s ZAP handler vets; with
    no handler bound, libzmq refuses every peer (`ZAP_ENFORCE_DOMAIN`) rather than admit it."""
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
    sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


def secure_client(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make `sock` (before connect) a CURVE client that talks only to `keys`' server."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)


class ZapGate:
    """The ZAP handler of one server's private context: admits a CURVE peer of `domain` whose
    public key is `client_public`, refuses every other request. Served by the caller's thread
    (`answer` when `socket` is readable), so no thread of its own."""

    def __init__(self, ctx: zmq.Context, domain: str, client_public: bytes) -> None:
        self._domain = domain.encode()
        self._client = z85.decode(client_public)
        self.socket = ctx.socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(ZAP_ENDPOINT)

    def answer(self) -> str | None:
        """Answer one waiting ZAP request; returns why the peer was refused, None if admitted
        (or if nothing was waiting)."""
        try:
            msg = self.socket.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None
        why = self._refusal(msg)
        request_id = msg[1] if len(msg) > 1 else b""
        code, text = (b"200", b"OK") if why is None else (b"400", why.encode())
        self.socket.send_multipart([_ZAP_VERSION, request_id, code, text, b"", b""])
        return why

    def _refusal(self, msg: list[bytes]) -> str | None:
        # version, request id, domain, address, identity, mechanism, credentials...
        if len(msg) < 7 or msg[0] != _ZAP_VERSION:
            return f"malformed ZAP request ({len(msg)} frames)"
        if msg[2] != self._domain:
            return f"ZAP domain {msg[2]!r} is not {self._domain!r}"
        if msg[5] != _CURVE:
            return f"mechanism {msg[5]!r} is not CURVE"
        if not hmac.compare_digest(msg[6], self._client):
            peer = msg[3].decode(errors="replace")
            return f"a CURVE client key from {peer} that is not the engine's"
        return None

    def close(self) -> None:
        """Unbind (closes the socket; the caller's thread must own it)."""
        self.socket.close()
