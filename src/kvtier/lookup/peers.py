"""The client's end of every rank: one zmq DEALER socket per rank, connecting in the background
with heartbeats, and its miss record. A rank that misses `miss_limit` deadlines in a row is
down: it is skipped except for one probe per `probe_s`, and its socket is replaced, so requests
queued behind a stuck server are dropped. Any answer brings it back. A TCP rank's socket is a
CURVE client of that rank's server keys (`lookup/curve.py`), so it never queues a frame to a
process that took the port without the engine key."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence

import zmq

from kvtier.lookup.auth import MAC_BYTES
from kvtier.lookup.curve import CurveKeys, secure_client
from kvtier.lookup.endpoints import parse_endpoint
from kvtier.lookup.messages import REJECT_WRONG_RANK
from kvtier.metrics import Metrics

log = logging.getLogger("kvtier")

_RECONNECT_IVL_MS = 20
_RECONNECT_IVL_MAX_MS = 500
# Detects a silently vanished tcp peer (no RST); ipc peers are noticed by the kernel.
_HEARTBEAT_IVL_MS = 1000
_HEARTBEAT_TIMEOUT_MS = 3000


class Peer:
    """One rank's DEALER socket and its miss record (consecutive misses, next probe time)."""

    __slots__ = ("curve", "endpoint", "misses", "rank", "retry_at", "sock")

    def __init__(self, rank: int, endpoint: str, sock: zmq.Socket, curve: CurveKeys | None) -> None:
        self.rank = rank
        self.endpoint = endpoint
        self.curve = curve
        self.sock = sock
        self.misses = 0
        self.retry_at = 0.0


class Peers:
    """The sockets of every rank, by rank; not thread-safe (the client serialises calls)."""

    def __init__(
        self,
        ctx: zmq.Context,
        metrics: Metrics,
        *,
        max_frame_bytes: int,
        miss_limit: int,
        probe_s: float,
    ) -> None:
        self._ctx = ctx
        self._m = metrics
        self._max_frame = max_frame_bytes
        self._miss_limit = miss_limit
        self._probe_s = probe_s
        self._poller = zmq.Poller()
        self._rank_of: dict[zmq.Socket, int] = {}
        self.by_rank: dict[int, Peer] = {}
        self.socket_resets: dict[int, int] = {}

    def connect(self, rank: int, endpoint: str, curve: CurveKeys | None) -> Peer:
        """A new socket for `rank` at `endpoint` (replacing none: see `reset`); `curve` is
        required on a TCP endpoint, the handshake that keeps the port's impostors out."""
        if (parse_endpoint(endpoint)[0] == "tcp") != (curve is not None):
            raise ValueError(f"rank {rank} at {endpoint}: CURVE keys go with tcp endpoints only")
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # Queue only to live connections: a send to a dead rank fails at once instead of
        # piling requests up for a server that may come back and lease them all.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.RECONNECT_IVL, _RECONNECT_IVL_MS)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, _RECONNECT_IVL_MAX_MS)
        sock.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)
        # zmq's cap is on the whole frame: the body's cap and the MAC in front of it
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_frame + MAC_BYTES)
        if curve is not None:
            secure_client(sock, curve)
        sock.connect(endpoint)
        peer = self.by_rank[rank] = Peer(rank, endpoint, sock, curve)
        self.socket_resets.setdefault(rank, 0)
        self._rank_of[sock] = rank
        self._poller.register(sock, zmq.POLLIN)
        return peer

    def is_down(self, peer: Peer, now: float) -> bool:
        """Down ranks are skipped, except for one probe lookup per probe interval."""
        return peer.misses >= self._miss_limit and now < peer.retry_at

    def missed(self, peer: Peer, now: float) -> None:
        """`peer` missed a deadline at `now`: the `miss_limit`-th in a row takes it down."""
        peer.misses += 1
        if peer.misses == 1:
            log.warning("kvtier: lookup rank %d missed its deadline", peer.rank)
        if peer.misses < self._miss_limit:
            return
        peer.retry_at = now + self._probe_s
        if peer.misses == self._miss_limit:
            log.warning(
                "kvtier: lookup rank %d missed %d deadlines in a row: counting it as 0 without "
                "waiting, probing every %.1fs",
                peer.rank,
                peer.misses,
                self._probe_s,
            )
            # Whatever is queued for it (lookups a stuck server would still answer and lease)
            # goes with the old socket; the new one connects afresh.
            self.reset(peer)

    def answered(self, peer: Peer) -> None:
        """`peer` answered: it is up again."""
        if peer.misses:
            log.info("kvtier: lookup rank %d answers again", peer.rank)
            peer.misses = 0

    def wrong_rank(self, rank: int, got: int) -> None:
        """Rank `got` answered on `rank`'s endpoint: counted and logged."""
        self._m.rejected_frame(REJECT_WRONG_RANK).inc()
        log.error(
            "kvtier: lookup endpoint of rank %d is served by rank %d; two ranks share an "
            "endpoint (one run_dir per replica?)",
            rank,
            got,
        )

    def reset(self, peer: Peer) -> None:
        """Replace a rank's socket, dropping whatever is queued on it (late replies included)."""
        self._poller.unregister(peer.sock)
        del self._rank_of[peer.sock]
        peer.sock.close()
        self.socket_resets[peer.rank] += 1
        fresh = self.connect(peer.rank, peer.endpoint, peer.curve)
        fresh.misses, fresh.retry_at = peer.misses, peer.retry_at

    def unwritable(self, ranks: Iterable[int], timeout_ms: int) -> list[int]:
        """Wait up to `timeout_ms` for any of `ranks` to be writable; returns the unwritable."""
        socks = {self.by_rank[r].sock: r for r in ranks}
        down = [r for s, r in socks.items() if not s.getsockopt(zmq.EVENTS) & zmq.POLLOUT]
        if not down or timeout_ms <= 0:
            return down
        poller = zmq.Poller()
        for r in down:
            poller.register(self.by_rank[r].sock, zmq.POLLOUT)
        ready = {socks[s] for s, _ in poller.poll(timeout_ms)}
        return [r for r in down if r not in ready]

    def send_all(
        self, frames: Mapping[int, Sequence[bytes]], peers: list[Peer]
    ) -> tuple[set[int], set[int]]:
        """Send each of `peers` its message (`frames[rank]`) without blocking; returns (sent,
        unsendable) ranks. zmq queues a message whole or not at all."""
        pending: set[int] = set()
        unsent: set[int] = set()
        for peer in peers:
            try:
                peer.sock.send_multipart(frames[peer.rank], zmq.NOBLOCK)
            except zmq.Again:
                # No live connection, or a full queue behind a stuck server.
                unsent.add(peer.rank)
            else:
                pending.add(peer.rank)
        return pending, unsent

    def received(self, timeout_ms: int) -> Iterator[tuple[int, list[bytes]]]:
        """Every message (its frames) waiting on any socket within `timeout_ms`, with its rank;
        each readable socket is drained."""
        for sock, _ in self._poller.poll(timeout_ms):
            rank = self._rank_of[sock]
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                yield rank, frames

    def close(self) -> None:
        """Close every socket (no linger)."""
        for peer in self.by_rank.values():
            self._poller.unregister(peer.sock)
            peer.sock.close()
        self.by_rank.clear()
        self._rank_of.clear()
