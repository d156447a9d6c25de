"""The remote tier's transport over valkey-glide (sync): one server or a Valkey/Redis Cluster.

glide routes each key to its slot's owner, follows MOVED/ASK, refreshes the topology and sends a
batch to every shard at once (one round trip per shard). kvtier keeps its own copy of the slot
map only to name the shard a key lives on, so its breakers work per shard. Three clients with
their own connections keep lookups from queueing behind a load's or a save's big value on one
multiplexed connection, and give each kind of call its own timeout.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from glide_shared.commands.batch_options import BatchOptions, ClusterBatchOptions
from glide_shared.commands.core_options import ExpirySet, ExpiryType
from glide_shared.config import (
    AdvancedGlideClientConfiguration,
    AdvancedGlideClusterClientConfiguration,
    TlsAdvancedConfiguration,
)
from glide_shared.exceptions import ClosingError, GlideError
from glide_shared.exceptions import TimeoutError as GlideTimeout
from glide_shared.protobuf.command_request_pb2 import RequestType
from glide_shared.routes import AllPrimaries
from glide_sync import (
    BackoffStrategy,
    Batch,
    ClusterBatch,
    GlideClient,
    GlideClientConfiguration,
    GlideClusterClient,
    GlideClusterClientConfiguration,
    Logger,
    LogLevel,
    NodeAddress,
    ReadFrom,
    Script,
    ServerCredentials,
)
from redis.crc import key_slot

from kvtier.remote_endpoint import RemoteEndpoint
from kvtier.store.remote_transport import (
    DELETE_IF_SCRIPT,
    CredentialsRefused,
    StoreError,
    Timeouts,
    parse_info_memory,
)

log = logging.getLogger(__name__)
_DELETE_IF = Script(DELETE_IF_SCRIPT)

_Client = GlideClient | GlideClusterClient
_C = TypeVar("_C", GlideClient, GlideClusterClient)
_RECONNECT = BackoffStrategy(num_of_retries=4, factor=5, exponent_base=2)
# the slot map is re-read at most this often, however many calls report a moved shard, and
# at least this often, so shard names follow a failover or migration glide handled silently
_REFRESH_MIN_S = 0.5
_REFRESH_MAX_S = 10.0
# a refused connect answers at once; a listener slower than this counts as one
_LISTEN_PROBE_S = 0.5
# replies a live server gives promptly: (text in glide's message, reason label)
_REFUSALS: tuple[tuple[str, str], ...] = (
    ("OOM", "oom"),
    ("READONLY", "read_only"),
    ("NOPERM", "no_permission"),
    ("PermissionDenied", "no_permission"),  # glide's name for a NOPERM reply (ACL key patterns)
    ("Moved", "moved"),
    ("MOVED", "moved"),
    ("Ask:", "moved"),
    ("ClusterDown", "cluster_down"),
    ("CLUSTERDOWN", "cluster_down"),
    ("TryAgain", "cluster_down"),
    ("TRYAGAIN", "cluster_down"),
    ("exceeds buffer capacity", "too_large"),
)
# glide reports a dead or unreachable node as a RequestError carrying the I/O cause
_OUTAGES = (
    "IoError",
    "BrokenPipe",
    "FatalSendError",
    "FatalReceiveError",
    "channel closed",
    "connect failed",
    "Connection refused",
    "disconnected",
    # a cluster node that died mid-call: "Received connection error `Cluster: Failed to receive
    # command response from internal sender. RecvError(())`"
    "connection error",
    "RecvError",
    "WRONGPASS",
    "NOAUTH",
)
_AUTH = ("WRONGPASS", "NOAUTH", "invalid username-password")

_quiet = threading.Lock()
_quieted = False


def _quiet_glide() -> None:
    """kvtier counts and logs store failures itself (one line per breaker transition), so
    glide's own log (a line per disconnect, refresh and retry) is turned off once."""
    global _quieted
    with _quiet:
        if not _quieted:
            Logger.set_logger_config(LogLevel.OFF)
            _quieted = True


class GlideTransport:
    """A server (`redis://`, `rediss://`) or cluster (`redis+cluster://`) through valkey-glide.

    `tls_files` are PEM paths (ca, cert, key; any may be None), read once here.
    """

    # glide's FFI prints this on stderr for every timed-out call, whatever its log level
    timeout_stderr = "Error executing command: timed out"

    def __init__(
        self,
        endpoint: RemoteEndpoint,
        timeouts: Timeouts,
        *,
        username: str | None,
        password: str | None,
        read_from_replica: bool,
        tls_ca_file: str | None,
        tls_cert_file: str | None,
        tls_key_file: str | None,
        tls_insecure: bool,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        _quiet_glide()
        self._cluster = endpoint.cluster
        self._timeouts = timeouts
        self._clock = clock
        self._seed = _addr(*endpoint.seeds[0])
        self._seeds = list(endpoint.seeds)
        tls = _tls_config(endpoint.tls, tls_ca_file, tls_cert_file, tls_key_file, tls_insecure)
        creds = None
        if password is not None or username is not None:
            creds = ServerCredentials(password=password, username=username)
        addresses = [NodeAddress(host, port) for host, port in endpoint.seeds]
        connect_ms = max(1, round(timeouts.presence_s * 1000))

        def make(timeout_s: float, replica: bool) -> _Client:
            ms = max(1, round(timeout_s * 1000))
            if self._cluster:
                return _create(
                    GlideClusterClient,
                    GlideClusterClientConfiguration(
                        addresses,
                        use_tls=endpoint.tls,
                        credentials=creds,
                        read_from=ReadFrom.PREFER_REPLICA if replica else ReadFrom.PRIMARY,
                        request_timeout=ms,
                        # fail fast while the cluster reconnects: the breaker sheds, not a queue
                        recovery_requests_queue_size=0,
                        advanced_config=AdvancedGlideClusterClientConfiguration(
                            connection_timeout=connect_ms, tls_config=tls
                        ),
                        lazy_connect=True,
                    ),
                )
            return _create(
                GlideClient,
                GlideClientConfiguration(
                    addresses,
                    use_tls=endpoint.tls,
                    credentials=creds,
                    request_timeout=ms,
                    # reconnect attempts at most 80 ms apart, so a store that is back is found
                    # by the next probe rather than after a long back-off
                    reconnect_strategy=_RECONNECT,
                    database_id=endpoint.db,
                    advanced_config=AdvancedGlideClientConfiguration(
                        connection_timeout=connect_ms, tls_config=tls
                    ),
                    lazy_connect=True,
                ),
            )

        self._make = lambda: (
            _Held(make(timeouts.presence_s, read_from_replica)),
            _Held(make(timeouts.read_s, read_from_replica)),
            _Held(make(timeouts.write_s, False)),
        )
        self._presence, self._reader, self._writer = self._make()
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._ranges: list[tuple[int, int, str]] = []
        self._refreshed_at = -_REFRESH_MIN_S
        self._epoch = 0
        if self._cluster:
            self._refresh(force=True)

    # ---- topology ------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._epoch

    def shard_of(self, rkey: bytes) -> str:
        if not self._cluster:
            return self._seed
        slot = key_slot(rkey)
        if self._clock() - self._refreshed_at > _REFRESH_MAX_S:
            self._refresh(force=False)
        with self._lock:
            i = bisect.bisect_right(self._starts, slot) - 1
            if i >= 0:
                start, end, owner = self._ranges[i]
                if start <= slot <= end:
                    return owner
        # no map yet (cluster unreachable at startup) or an uncovered slot
        return self._seed

    def shards(self) -> list[str]:
        if not self._cluster:
            return [self._seed]
        with self._lock:
            owners = sorted({owner for _, _, owner in self._ranges})
        return owners or [self._seed]

    def refresh(self) -> None:
        if self._cluster:
            self._refresh(force=False)

    def _refresh(self, *, force: bool) -> None:
        now = self._clock()
        with self._lock:
            if not force and now - self._refreshed_at < _REFRESH_MIN_S:
                return
            self._refreshed_at = now
        try:
            with self._use("_presence") as client:
                reply = client.custom_command(["CLUSTER", "SLOTS"])
        except GlideError as e:
            log.debug("kvtier: CLUSTER SLOTS failed (%s); keeping the last slot map", e)
            return
        ranges = sorted(
            (int(r[0]), int(r[1]), _addr(_text(r[2][0]), int(r[2][1])))
            for r in reply  # type: ignore[union-attr]
        )
        with self._lock:
            if ranges != self._ranges:
                self._epoch += 1
            self._ranges = ranges
            self._starts = [r[0] for r in ranges]

    # ---- calls ---------------------------------------------------------------------------

    def check(self) -> None:
        # every client connects now (they are lazy so that a dead store does not stop startup)
        for which in ("_presence", "_reader", "_writer"):
            try:
                with self._use(which) as client:
                    client.ping()
            except GlideError as e:
                if any(text in str(e) for text in _AUTH):
                    raise CredentialsRefused(str(e)) from None
                error = self._error(e, self._seed)
                if error.reason == "timeout" and not any(_listening(*a) for a in self._seeds):
                    # glide reports a refused connect as timed out, once its retries are spent
                    error = StoreError(
                        "connection", True, self._seed, f"{str(e).rstrip()}; connection refused"
                    )
                raise error from None
        self.refresh()

    def max_value_bytes(self) -> int | None:
        command = ["CONFIG", "GET", "proto-max-bulk-len"]
        try:
            with self._use("_presence") as client:
                if self._cluster:
                    reply: Any = client.custom_command(command, AllPrimaries())
                else:
                    reply = client.custom_command(command)
        except GlideError as e:
            log.debug("kvtier: CONFIG GET proto-max-bulk-len refused: %s", e)
            return None
        values = [int(v) for v in _find(reply, b"proto-max-bulk-len")]
        return min(values) if values else None

    def memory_policies(self) -> list[tuple[int, str]]:
        try:
            with self._use("_presence") as client:
                if self._cluster:
                    reply: Any = client.custom_command(["INFO", "memory"], AllPrimaries())
                else:
                    reply = client.custom_command(["INFO", "memory"])
        except GlideError as e:
            log.debug("kvtier: INFO memory refused: %s", e)
            return []
        texts = list(reply.values()) if isinstance(reply, dict) else [reply]
        return [p for p in map(parse_info_memory, texts) if p is not None]

    def exists(self, rkeys: Sequence[bytes]) -> list[bool | StoreError]:
        batch = self._batch()
        for rkey in rkeys:
            batch.exists([rkey])
        replies = self._exec("_presence", batch, rkeys, self._timeouts.presence_s)
        return [r if isinstance(r, StoreError) else bool(r) for r in replies]

    def get(self, rkey: bytes, limit: int | None = None) -> bytes | None:
        try:
            with self._use("_reader") as client:
                if limit is None:
                    return client.get(rkey)
                # GETRANGE: at most `limit` bytes cross the wire, whatever the store holds
                data = client.getrange(rkey, 0, limit - 1)
        except GlideError as e:
            raise self._error(e, self.shard_of(rkey)) from None
        return data or None  # a missing key reads as an empty range: a miss

    def get_into(self, rkey: bytes, buf: memoryview) -> int | None:
        # GETRANGE, not GET: at most the buffer's bytes cross the wire, whatever the store holds
        # under the key (a GET of a huge value cost its whole size in memory before it was
        # refused); glide writes the reply straight into `buf` as its `get(buffer=)` does
        try:
            with self._use("_reader") as client:
                n = client._execute_command(
                    RequestType.GetRange, [rkey, b"0", str(buf.nbytes - 1).encode()],
                    response_buffer=buf,
                )  # fmt: skip
        except GlideError as e:
            raise self._error(e, self.shard_of(rkey)) from None
        # a missing key reads as an empty range: a miss (an empty record is none anyway)
        return int(n) or None  # type: ignore[arg-type]

    def get_many(
        self, rkeys: Sequence[bytes], limit: int | None = None
    ) -> list[bytes | None | StoreError]:
        batch = self._batch()
        for rkey in rkeys:
            if limit is None:
                batch.get(rkey)
            else:
                batch.getrange(rkey, 0, limit - 1)  # at most `limit` bytes of each value
        # a batch of n records may take n reads' time on one shard
        timeout_s = self._timeouts.presence_s + len(rkeys) * (
            self._timeouts.read_s - self._timeouts.presence_s
        )
        replies = self._exec("_reader", batch, rkeys, timeout_s)
        if limit is not None:
            # a missing key reads as an empty range: a miss
            replies = [None if r == b"" else r for r in replies]
        return replies  # type: ignore[return-value]

    def put(self, rkey: bytes, value: memoryview, ttl_s: int) -> bool:
        batch = self._batch()
        # EXISTS rides along (same slot, one round trip) so a rewrite is not counted twice
        batch.exists([rkey])
        expiry = ExpirySet(ExpiryType.SEC, ttl_s) if ttl_s > 0 else None
        batch.set(rkey, value, expiry=expiry)
        existed, done = self._exec("_writer", batch, [rkey, rkey], self._timeouts.write_s)
        for reply in (done, existed):
            if isinstance(reply, StoreError):
                raise reply
        return bool(existed)

    def expire(self, rkey: bytes, ttl_s: int) -> bool:
        try:
            with self._use("_writer") as client:
                return bool(client.expire(rkey, ttl_s))
        except GlideError as e:
            raise self._error(e, self.shard_of(rkey)) from None

    def delete(self, rkey: bytes) -> bool:
        try:
            with self._use("_writer") as client:
                return bool(client.delete([rkey]))
        except GlideError as e:
            raise self._error(e, self.shard_of(rkey)) from None

    def delete_if(self, rkey: bytes, sha1_hex: bytes, longer_than: int | None = None) -> bool:
        args = [sha1_hex] if longer_than is None else [sha1_hex, str(longer_than).encode()]
        try:
            with self._use("_writer") as client:
                return bool(client.invoke_script(_DELETE_IF, keys=[rkey], args=args))
        except GlideError as e:
            raise self._error(e, self.shard_of(rkey)) from None

    def reconnect(self) -> None:
        # glide keeps a connection whose request timed out; if its reply never comes (dropped
        # by a middlebox), every later reply on it answers the request before: new clients
        # (connecting lazily) for the next calls, and the old ones closed
        fresh = self._make()
        with self._lock:
            old = (self._presence, self._reader, self._writer)
            self._presence, self._reader, self._writer = fresh
        for held in old:
            held.close()

    def close(self) -> None:
        for held in (self._presence, self._reader, self._writer):
            held.close()

    # ---- internals -----------------------------------------------------------------------

    @contextlib.contextmanager
    def _use(self, which: str) -> Iterator[_Client]:
        """The client named `which` for one call. A call that finds it replaced by `reconnect`
        takes its successor: a connection swapped under it is no store failure to count."""
        for _ in range(3):
            held: _Held = getattr(self, which)
            if held.enter():
                try:
                    yield held.client
                finally:
                    held.leave()
                return
        raise ClosingError("the remote tier's connection is closed")

    def _batch(self) -> Batch | ClusterBatch:
        return ClusterBatch(is_atomic=False) if self._cluster else Batch(is_atomic=False)

    def _exec(
        self,
        which: str,
        batch: Batch | ClusterBatch,
        rkeys: Sequence[bytes],
        timeout_s: float,
    ) -> list[object]:
        """Run a non-atomic batch; one reply per command, a StoreError where a command failed
        (a whole-batch failure is charged to every shard the batch touched)."""
        ms = max(1, round(timeout_s * 1000))
        try:
            with self._use(which) as client:
                if isinstance(client, GlideClusterClient):
                    replies = client.exec(
                        batch,  # type: ignore[arg-type]
                        raise_on_error=False,
                        options=ClusterBatchOptions(timeout=ms),
                    )
                else:
                    replies = client.exec(
                        batch,  # type: ignore[arg-type]
                        raise_on_error=False,
                        options=BatchOptions(timeout=ms),
                    )
        except GlideError as e:
            errors = {shard: self._error(e, shard) for shard in {self.shard_of(k) for k in rkeys}}
            return [errors[self.shard_of(k)] for k in rkeys]
        if replies is None or len(replies) != len(rkeys):
            raise RuntimeError(f"glide answered a batch of {len(rkeys)} with {replies!r}")
        out: list[object] = []
        for rkey, reply in zip(rkeys, replies, strict=True):
            out.append(self._error(reply, self.shard_of(rkey)) if _is_error(reply) else reply)
        return out

    def _error(self, e: BaseException, shard: str) -> StoreError:
        text = str(e)
        if isinstance(e, GlideTimeout) or "timed out" in text:
            error = StoreError("timeout", True, shard, text)
        elif isinstance(e, ClosingError) or any(t in text for t in _OUTAGES):
            error = StoreError("connection", True, shard, text)
        else:
            reason = next((r for t, r in _REFUSALS if t in text), "rejected")
            error = StoreError(reason, False, shard, text)
        if error.outage or error.reason in ("moved", "cluster_down"):
            # the owner may have changed (failover, migration): name shards by the new map
            self.refresh()
        return error


# glide_sync's create() registers an at-fork handler per client that holds the client for good:
# 6 KiB a reconnect, and a reconnect comes with every breaker probe of a store that is down.
# kvtier creates its clients itself, under one handler for them all that holds none
_live: weakref.WeakSet[_Client] = weakref.WeakSet()


def _recreate_in_child() -> None:
    # a forked child has none of the parent's runtime threads: each live client connects anew
    # (what glide's own handler does; a closed client does nothing)
    for client in list(_live):
        client._create_core_client()


os.register_at_fork(after_in_child=_recreate_in_child)


def _create(cls: type[_C], config: GlideClientConfiguration | GlideClusterClientConfiguration
            ) -> _C:  # fmt: skip
    """`cls.create(config)` (glide_sync 2.5.3's steps) without its per-client fork handler."""
    client = cls(config)  # type: ignore[arg-type]
    client._config = config
    client._is_closed = False
    _live.add(client)
    client._create_core_client()
    return client


class _Held:
    """A glide client closed only once no call is inside it: glide_sync's close() frees the
    native client at once, and a call another thread already began (it read the pointer, the
    FFI call not yet made) then runs on freed memory (a double free, a crash of the engine)."""

    def __init__(self, client: _Client) -> None:
        self.client = client  # tests count its calls; every kvtier call enters and leaves
        self._calls = 0
        self._closing = False
        self._lock = threading.Lock()

    def enter(self) -> bool:
        """Count a call in; False once the client is closed or replaced (the call not made)."""
        with self._lock:
            if self._closing:
                return False
            self._calls += 1
            return True

    def leave(self) -> None:
        """Count a call out; the last one out of a closed client closes it."""
        with self._lock:
            self._calls -= 1
            last = self._closing and self._calls == 0
        if last:
            self._release()

    def close(self) -> None:
        """Closes now if idle, else when the last call in flight returns (within its timeout)."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            idle = self._calls == 0
        if idle:
            self._release()

    def _release(self) -> None:
        try:
            self.client.close()
        except ClosingError:
            pass  # already closed by the library after a fatal error


def _is_error(reply: object) -> bool:
    return isinstance(reply, GlideError | Exception)


def _listening(host: str, port: int) -> bool:
    """Whether a TCP connect to host:port is not refused (a timeout may be a busy host: True)."""
    try:
        socket.create_connection((host, port), timeout=_LISTEN_PROBE_S).close()
    except ConnectionRefusedError:
        return False
    except OSError:
        return True
    return True


def _addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _find(reply: object, name: bytes) -> list[bytes]:
    """Every value stored under `name` in a (possibly per-node nested) CONFIG GET reply."""
    if isinstance(reply, dict):
        found: list[bytes] = []
        for key, value in reply.items():
            if key == name and isinstance(value, bytes | str | int):
                found.append(value if isinstance(value, bytes) else str(value).encode())
            else:
                found.extend(_find(value, name))
        return found
    if isinstance(reply, list):
        # RESP2 replies come as a flat [name, value, ...] list
        pairs = list(zip(reply[::2], reply[1::2], strict=False))
        return [v for k, v in pairs if k == name and isinstance(v, bytes)]
    return []


def _tls_config(
    tls: bool,
    ca_file: str | None,
    cert_file: str | None,
    key_file: str | None,
    insecure: bool,
) -> TlsAdvancedConfiguration | None:
    if not tls:
        return None
    return TlsAdvancedConfiguration(
        use_insecure_tls=insecure or None,
        root_pem_cacerts=_pem(ca_file, "remote_tls_ca_file"),
        client_cert_pem=_pem(cert_file, "remote_tls_cert_file"),
        client_key_pem=_pem(key_file, "remote_tls_key_file"),
    )


def _pem(path: str | None, key: str) -> bytes | None:
    if path is None:
        return None
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(
            f"{key}={path!r} cannot be read ({e.strerror}); point it at a PEM file"
        ) from None
    if not data.strip():
        raise ValueError(f"{key}={path!r} is empty; point it at a PEM file")
    return data
