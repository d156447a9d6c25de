"""`LookupServer`: one per rank; answers lookups from the rank's TierStack on its own thread."""

from __future__ import annotations

import itertools
import logging
import operator
import stat
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import zmq

from kvtier.errors import ConfigError, StartupError
from kvtier.lookup.auth import MAC_BYTES, REPLIES, REQUESTS, FrameMac, RefusalLog, check_key
from kvtier.lookup.curve import curve_keys, secure_server
from kvtier.lookup.endpoints import (
    check_ipc_path,
    check_tcp_host,
    ensure_ipc_free,
    ipc_served,
    parse_endpoint,
    tcp_host,
)
from kvtier.lookup.keyfile import endpoint_key
from kvtier.lookup.messages import (
    DEFAULT_MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    REJECT_AUTH,
    REJECT_FRAMES,
    REJECT_OVERSIZED,
    REJECT_UNEXPECTED,
    AdminReply,
    AdminRequest,
    Codec,
    FrameError,
    LookupReply,
    LookupRequest,
    Ping,
    Pong,
    ReleaseRequest,
)
from kvtier.metrics import Metrics

log = logging.getLogger("kvtier")

# Messages handled per wake-up before the stop signal is checked again.
_BATCH = 64
# zmq drops (disconnects) peers sending a body of more than this many times the frame cap,
# which bounds the memory a hostile frame can take; bodies between the cap and this are read
# and counted.
_HARD_FRAME_FACTOR = 4
_JOIN_TIMEOUT_S = 5.0
_UNBIND_TIMEOUT_S = 1.0
_UNBIND_POLL_S = 0.001
_inproc_ids = itertools.count()


class LookupBackend(Protocol):
    """What a server needs from a rank's store (the TierStack has these methods, and also
    `lookup_run(keys, lease_id)` returning `.chunks` and `.tier`, which the server prefers so
    the reply can say which tier the run comes from)."""

    def lookup(self, keys: Sequence[bytes], lease_id: str | None) -> int:
        """Number of leading `keys` held; with `lease_id`, lease those chunks under it."""
        ...

    def release(self, lease_id: str) -> None:
        """Release the lease `lease_id` (an unknown id is a counted no-op)."""
        ...


class AdminBackend(Protocol):
    """What a server needs to carry out `AdminRequest`s (the TierStack has it); a backend
    without it answers every admin request with an error."""

    def admin(self, op: str, keys: Sequence[bytes], until: float) -> int:
        """Carry out `op` (`lookup.messages.ADMIN_OPS`) on `keys`; how many it acted on."""
        ...


class LookupServer:
    """Rank `rank`'s lookup service: a zmq ROUTER on `endpoint`, served by one daemon thread.

    Counts `metrics.lookups` (one per lookup answered) and `metrics.rejected_frame(reason)`.
    Hit tokens and latency are counted by the client, which knows the chunk size.

    A message is one frame, `MAC || body` (`lookup/auth.py`). One that is not, whose body is
    over the frame cap, or whose MAC the engine's `key` did not make is refused before it is
    decoded: counted (`frames`, `oversized`, `auth`), never answered, leased or released for.
    Without `key`, the key is read from the run dir the endpoint names (`lookup/keyfile.py`).

    On TCP the socket is a CURVE server under keys derived from the engine key and the rank
    (`lookup/curve.py`): a peer without the engine key is dropped at the handshake, before any
    frame of it is queued.
    """

    def __init__(
        self,
        rank: int,
        backend: LookupBackend,
        endpoint: str,
        metrics: Metrics,
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        allow_remote_bind: bool = False,
        key: bytes | None = None,
    ) -> None:
        if rank < 0:
            raise ConfigError(f"lookup server rank={rank} must be >= 0")
        transport, address = parse_endpoint(endpoint)
        if transport == "tcp":
            check_tcp_host(tcp_host(address), allow_remote_bind)
        else:
            check_ipc_path(address)
        key = endpoint_key(endpoint) if key is None else check_key(key)
        self._mac_in = FrameMac(key, REQUESTS, rank)
        self._mac_out = FrameMac(key, REPLIES, rank)
        self._refusals = RefusalLog(log, f"lookup server rank {rank}")
        self.rank = rank
        self.endpoint = endpoint
        self._transport = transport
        self._address = address
        self._backend = backend
        self._m = metrics
        self._codec = Codec(max_frame_bytes)
        self._curve = curve_keys(key, rank) if transport == "tcp" else None
        # a context of its own: another library in the engine's process may term() or
        # destroy() the process-wide one at its shutdown, ending this rank's serving thread
        self._ctx = zmq.Context()
        self._close_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._bound: str | None = None
        self._wake_send: zmq.Socket | None = None
        self._closed = False
        # Running totals reported in Pong; written only by the serving thread.
        self.served = 0
        self.released = 0
        self.rejected = 0

    @property
    def bound_endpoint(self) -> str:
        """The endpoint actually bound (resolves a `tcp://host:*` wildcard port)."""
        if self._bound is None:
            raise RuntimeError("lookup server not started; call start() first")
        return self._bound

    def start(self) -> LookupServer:
        """Bind (raising StartupError on failure) and start serving on a daemon thread."""
        if self._thread is not None or self._closed:
            raise RuntimeError(f"lookup server rank {self.rank} already started or closed")
        if self._transport == "ipc":
            _check_socket_dir(Path(self._address).parent)
            ensure_ipc_free(self._address)
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        # on the whole frame: the MAC travels in front of the body
        hard = _HARD_FRAME_FACTOR * self._codec.max_frame_bytes + MAC_BYTES
        router.setsockopt(zmq.MAXMSGSIZE, hard)
        if self._curve is not None:
            secure_server(router, self._curve)
        try:
            router.bind(self.endpoint)
        except zmq.ZMQError as e:
            router.close()
            raise StartupError(
                f"lookup server rank {self.rank} cannot bind {self.endpoint}: {e}"
            ) from e
        wake_addr = f"inproc://kvtier-lookup-stop-{id(self)}-{next(_inproc_ids)}"
        wake_recv = self._ctx.socket(zmq.PAIR)
        wake_recv.setsockopt(zmq.LINGER, 0)
        wake_recv.bind(wake_addr)
        wake_send = self._ctx.socket(zmq.PAIR)
        wake_send.setsockopt(zmq.LINGER, 0)
        wake_send.connect(wake_addr)
        last = router.getsockopt(zmq.LAST_ENDPOINT)
        self._bound = last.decode() if isinstance(last, bytes) else str(last)
        self._wake_send = wake_send
        # Sockets move to the serving thread; Thread.start() is the memory barrier zmq requires.
        self._thread = threading.Thread(
            target=self._serve,
            args=(router, wake_recv),
            name=f"kvtier-lookup-server-{self.rank}",
            daemon=True,
        )
        self._thread.start()
        log.debug("kvtier: lookup server rank %d on %s", self.rank, self.endpoint)
        return self

    def close(self) -> None:
        """Stop serving and unbind; returns as soon as the thread is out of its current message."""
        with self._close_lock:  # two closers would use one zmq socket from two threads
            if self._closed:
                return
            self._closed = True
        if self._thread is None:
            self._ctx.destroy(linger=0)
            return
        assert self._wake_send is not None
        try:
            # never blocking: a PAIR whose peer is gone (the serving thread ended) would
            # block a send, and the engine's shutdown with it, forever
            self._wake_send.send(b"", zmq.NOBLOCK)
        except zmq.ZMQError as e:
            log.warning("kvtier: lookup server rank %d: its thread had ended (%s)", self.rank, e)
        self._thread.join(_JOIN_TIMEOUT_S)
        self._wake_send.close()
        if self._thread.is_alive():
            log.error(
                "kvtier: lookup server rank %d still inside its backend %.0fs after close()",
                self.rank,
                _JOIN_TIMEOUT_S,
            )
            return
        self._ctx.destroy(linger=0)  # its sockets are closed: returns at once
        if self._transport == "ipc":
            self._wait_unbound()

    def _wait_unbound(self) -> None:
        """zmq closes the listener on its IO thread after the socket's close(): wait (bounded)
        until the ipc endpoint refuses connections, so a rank restarted at once can bind it."""
        deadline = time.monotonic() + _UNBIND_TIMEOUT_S
        while ipc_served(self._address):
            if time.monotonic() >= deadline:
                log.error(
                    "kvtier: lookup server rank %d: %s still accepts connections %.1fs after "
                    "close()",
                    self.rank,
                    self.endpoint,
                    _UNBIND_TIMEOUT_S,
                )
                return
            time.sleep(_UNBIND_POLL_S)

    def __enter__(self) -> LookupServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _serve(self, router: zmq.Socket, wake: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if wake in ready:
                    return
                for _ in range(_BATCH):
                    try:
                        frames = router.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        self._handle(router, frames)
                    except (Exception, SystemExit):
                        # one bad message (a backend calling sys.exit included) must not stop
                        # the rank's lookups: every later one would time out, silently
                        log.exception("kvtier: lookup server rank %d failed a message", self.rank)
        except BaseException:
            log.exception("kvtier: lookup server rank %d stopped serving", self.rank)
            raise
        finally:
            router.close()
            wake.close()

    def _handle(self, router: zmq.Socket, frames: list[bytes]) -> None:
        peer = frames[0]
        body = self._authentic(frames)
        if body is None:
            return
        try:
            msg = self._codec.decode(body)
        except FrameError as e:
            self._reject(router, peer, e)
            return
        if isinstance(msg, LookupRequest):
            self._lookup(router, peer, msg)
        elif isinstance(msg, ReleaseRequest):
            self._release(msg)
        elif isinstance(msg, AdminRequest):
            self._admin(router, peer, msg)
        elif isinstance(msg, Ping):
            pong = Pong(
                PROTOCOL_VERSION, msg.nonce, self.rank, self.served, self.released, self.rejected
            )
            self._send(router, peer, self._codec.encode(pong))
        else:
            self._reject(router, peer, FrameError(REJECT_UNEXPECTED, type(msg).__name__))

    def _lookup(self, router: zmq.Socket, peer: bytes, req: LookupRequest) -> None:
        error: str | None = None
        tier = ""
        runs: tuple[tuple[str, int], ...] = ()
        ends: tuple[int, ...] = ()
        lease = req.lookup_id if req.lease else None
        try:
            run = getattr(self._backend, "lookup_run", None)
            if req.ends and run is None:
                raise TypeError(
                    f"{type(self._backend).__name__} has no lookup_run, so it cannot end a run "
                    "at a held boundary state"
                )
            if run is not None:
                answer = run(req.keys, lease, req.ends) if req.ends else run(req.keys, lease)
                hit, tier = operator.index(answer.chunks), str(answer.tier)
                runs = tuple((str(t), operator.index(c)) for t, c in answer.runs)
                ends = tuple(operator.index(e) for e in getattr(answer, "ends", ()))
            else:
                hit = operator.index(self._backend.lookup(req.keys, lease))
        except Exception as e:  # a failing store costs hits, never the server (invariant 9)
            log.warning(
                "kvtier: lookup %r failed on rank %d", req.lookup_id, self.rank, exc_info=True
            )
            hit, error = 0, f"backend: {type(e).__name__}: {e}"
        else:
            if not 0 <= hit <= len(req.keys):
                error = f"backend returned {hit} hits for {len(req.keys)} keys"
                log.error("kvtier: lookup %r on rank %d: %s", req.lookup_id, self.rank, error)
                hit = 0
        if not hit or sum(c for _, c in runs) != hit:
            runs = ()
        reply = LookupReply(
            PROTOCOL_VERSION, req.lookup_id, req.req, self.rank, hit, error,
            tier if hit else "", runs, tuple(e for e in ends if 0 < e <= hit),
        )  # fmt: skip
        # counted before the reply leaves, as a rejection is: a client holding the reply (or
        # pinging after it) sees it in the count, never a count one behind
        self.served += 1
        self._m.lookups.inc()
        self._send(router, peer, self._codec.encode(reply))

    def _admin(self, router: zmq.Socket, peer: bytes, req: AdminRequest) -> None:
        admin = getattr(self._backend, "admin", None)
        count, error = 0, None
        if admin is None:
            error = f"rank {self.rank}'s store takes no admin requests"
        else:
            try:
                count = operator.index(admin(req.op, req.keys, req.until))
            except Exception as e:  # a failing store fails this request, never the server
                log.warning(
                    "kvtier: admin %s of %d keys failed on rank %d",
                    req.op,
                    len(req.keys),
                    self.rank,
                    exc_info=True,
                )
                error = f"backend: {type(e).__name__}: {e}"
        if req.reply:
            reply = AdminReply(PROTOCOL_VERSION, req.req, self.rank, max(count, 0), error)
            self._send(router, peer, self._codec.encode(reply))

    def _release(self, msg: ReleaseRequest) -> None:
        for lookup_id in msg.lookup_ids:
            try:
                self._backend.release(lookup_id)
            except Exception:  # one bad release must not strand the rest of the batch
                log.warning(
                    "kvtier: release %r failed on rank %d", lookup_id, self.rank, exc_info=True
                )
            else:
                self.released += 1

    def _authentic(self, frames: list[bytes]) -> bytes | None:
        """The body of a `[peer, MAC || body]` message whose MAC the engine's key made; None
        for anything else, counted and never answered (its sender need not be the engine's)."""
        refusal: tuple[str, str] | None = None
        body: bytes | None = None
        if len(frames) != 2:
            refusal = REJECT_FRAMES, f"{len(frames) - 1} frames, expected 1"
        elif len(frames[1]) < MAC_BYTES:
            refusal = REJECT_AUTH, f"a frame of {len(frames[1])} bytes, too short for a MAC"
        elif len(frames[1]) - MAC_BYTES > self._codec.max_frame_bytes:
            # refused before any work on it: hashing is linear in its length
            cap = self._codec.max_frame_bytes
            size = len(frames[1]) - MAC_BYTES
            refusal = REJECT_OVERSIZED, f"{size} bytes > max_frame_bytes={cap}"
        else:
            body = self._mac_in.opened(frames[1])
            if body is None:
                refusal = REJECT_AUTH, (
                    f"its MAC was not made with the engine's key for rank {self.rank} (another "
                    "engine, or a rank of this one sent to the wrong socket)"
                )  # fmt: skip
        if refusal is None and body is not None:
            return body
        reason, detail = refusal
        self.rejected += 1
        self._m.rejected_frame(reason).inc()
        # a flood of them must not fill the log
        self._refusals.refused(f"{reason}: {detail}")
        return None

    def _reject(self, router: zmq.Socket, peer: bytes, err: FrameError) -> None:
        """Answer an authenticated message this side cannot take (the engine's own client,
        of another version or with a bug) with an error reply naming why."""
        self.rejected += 1
        self._m.rejected_frame(err.reason).inc()
        log.warning("kvtier: lookup server rank %d rejected a frame: %s", self.rank, err)
        reply = LookupReply(PROTOCOL_VERSION, "", -1, self.rank, 0, f"rejected: {err}")
        self._send(router, peer, self._codec.encode(reply))

    def _send(self, router: zmq.Socket, peer: bytes, body: bytes) -> None:
        # the ROUTER takes `peer` off: one frame goes on the wire (messages.py says why)
        router.send_multipart((peer, self._mac_out.seal(body)))


def _check_socket_dir(directory: Path) -> None:
    """Refuse to put a socket in a directory that other users can read or write."""
    try:
        mode = stat.S_IMODE(directory.stat().st_mode)
    except FileNotFoundError:
        raise ConfigError(
            f"ipc socket directory {str(directory)!r} does not exist; create it with make_run_dir()"
        ) from None
    if mode & 0o077:
        raise ConfigError(
            f"ipc socket directory {str(directory)!r} has mode {oct(mode)}; lookup sockets must "
            "live in a private directory (mode 0o700): use make_run_dir() and endpoint_for()"
        )


def serve_until(
    stop: threading.Event,
    rank: int,
    backend: LookupBackend,
    endpoint: str,
    metrics: Metrics | None = None,
    *,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    key: bytes | None = None,
) -> None:
    """Serve `rank` on `endpoint` until `stop` is set (a subprocess target for tests/benches).

    `stop` may be a `multiprocessing.Event`; it only needs `wait()`.
    """
    metrics = metrics if metrics is not None else Metrics(rank)
    with LookupServer(rank, backend, endpoint, metrics, max_frame_bytes=max_frame_bytes, key=key):
        stop.wait()
