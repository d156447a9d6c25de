"""Shared tier on Valkey/Redis: authenticated records under
`kvtier:<tenant>:<namespace hex>:<key hex>`.

One server (`redis://`, `rediss://`, `unix://`) or a Valkey/Redis Cluster (`redis+cluster://`,
`rediss+cluster://`): each chunk lives on its own slot's shard (no hash tags, so a prefix spreads
over every shard), and a batch is one round trip per shard, all shards at once. The key holds
nothing but the tenant, the namespace and the chunk key, so any layout whose namespace leaves
the rank out shares its records between ranks.

Every call runs under a timeout and behind its shard's circuit breaker, so a slow or dead shard
costs hits, never requests: network errors and timeouts become misses (reads) or counted False
(writes), and after `breaker.failures` of them in a row that shard's calls are skipped without
touching the network until a probe finds it again; the other shards keep serving. Read and
write timeouts grow with the record size (`timeout_gbps`), so a big chunk is not a failure.

Redis cannot pin: a chunk counted by `lookup_prefix` may be evicted by the server (maxmemory
policy, TTL) or deleted by another process before the load reads it. That load then misses, the
load fails, and the request recomputes the prefix.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvtier import remote_endpoint
from kvtier.config import mask_url
from kvtier.errors import ConfigError, StartupError
from kvtier.metrics import Metrics
from kvtier.store import record
from kvtier.store.base import TierBase
from kvtier.store.breaker import ShardBreakers
from kvtier.store.policy import NO_PARENT
from kvtier.store.remote_guard import ShardGuard
from kvtier.store.remote_transport import CredentialsRefused, StoreError, Timeouts, Transport
from kvtier.store.secret import codec_for
from kvtier.throttled_log import ThrottledLog

_TENANT = re.compile(r"[A-Za-z0-9._-]{0,64}")
# verification failures that say the bytes are another chunk's record, not this one damaged
_ANOTHER_KEYS = ("key_mismatch", "namespace_mismatch")
# connections replaced after a read got another key's record, at most this often: one
# replacement fixes a reply out of step, while copies planted under our keys by another
# writer of the store (untrusted) cost two new connections per read, a storm of sockets
RECONNECT_MIN_S = 1.0

if TYPE_CHECKING:
    from kvtier.config import KVTierConfig

log = logging.getLogger(__name__)

_DEFAULT_WRITE_TIMEOUT_MS = 1000
# how long startup asks a store that times out before opening its breaker: a busy host's late
# answer is not an outage, while a store that is really gone costs startup at most this
STARTUP_PATIENCE_S = 3.0
_STARTUP_RETRY_S = 0.05
_DEFAULT_TIMEOUT_GBPS = 0.1
# Redis' and Valkey's default `proto-max-bulk-len`, assumed when the server will not say
_DEFAULT_MAX_VALUE = 512 << 20


class RemoteTier(TierBase):
    """Chunk records in a Valkey/Redis server or cluster shared by every engine with the same
    namespace.

    Thread-safe. Never raises for a slow, dead or refusing store after construction;
    construction raises `StartupError` when the server answers but rejects the credentials, or
    when one record (`payload_bytes` + header) is over the server's `proto-max-bulk-len`.
    Presence checks time out after `timeout_ms`; a record read after `timeout_ms`, a write after
    `write_timeout_ms`, each plus the record's bytes at `timeout_gbps`. Without `breakers` the
    per-shard breakers take the config defaults (failures=5, probe_s=5.0) on `clock`.
    """

    name = "remote"
    # the store cannot pin, so a lookup's batched presence check is its whole answer
    pins = False
    reads_into = True

    def __init__(
        self,
        url: str,
        namespace: bytes,
        metrics: Metrics,
        *,
        username: str | None = None,
        password: str | None = None,
        ttl_s: int = 0,
        timeout_ms: int = 100,
        write_timeout_ms: int | None = None,
        timeout_gbps: float = _DEFAULT_TIMEOUT_GBPS,
        payload_bytes: int | None = None,
        read_from: str = "primary",
        tls_ca_file: str | None = None,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
        tls_insecure: bool = False,
        breakers: ShardBreakers | None = None,
        max_connections: int = 16,
        clock: Callable[[], float] = time.monotonic,
        codec: record.RecordCodec,
        tenant: str = "",
        full: str = "refuse",
        endpoint: remote_endpoint.RemoteEndpoint | None = None,
    ) -> None:
        """`endpoint`: `url` already parsed (the config's); parsed here when not given."""
        shown = mask_url(url)
        if write_timeout_ms is None:
            write_timeout_ms = max(timeout_ms, _DEFAULT_WRITE_TIMEOUT_MS)
        _check_arguments(
            namespace, ttl_s, timeout_ms, write_timeout_ms, timeout_gbps, payload_bytes,
            read_from, max_connections,
        )  # fmt: skip
        try:
            endpoint = endpoint or remote_endpoint.parse(url)
        except ValueError as e:
            raise ConfigError(
                f"remote_url={shown!r} is not a usable remote URL: {e}; {remote_endpoint.URL_FORMS}"
            ) from None
        record_bytes = record.HEADER_BYTES + (payload_bytes or 0)
        transfer_s = record_bytes / (timeout_gbps * 1e9) if payload_bytes else 0.0
        # the longest record any writer of the namespace stores (its layout fixes the chunk's
        # bytes); None: unknown, reads take whole values
        self._max_record = record_bytes if payload_bytes else None
        self.timeouts = Timeouts(
            presence_s=timeout_ms / 1000.0,
            read_s=timeout_ms / 1000.0 + transfer_s,
            write_s=write_timeout_ms / 1000.0 + transfer_s,
        )
        self._url = shown
        self._ns = namespace
        if codec.namespace != namespace:
            raise ValueError("the record codec was built for another namespace")
        self._codec = codec
        if not _TENANT.fullmatch(tenant):
            raise ValueError(f"tenant={tenant!r} must be at most 64 of [A-Za-z0-9._-]")
        # kvtier:<tenant>:<namespace>:<key>: a Redis/Valkey ACL user per tenant
        # (`~kvtier:<tenant>:*`) reaches its own records only; the default tenant's segment is
        # empty, which no tenant name is
        self.tenant = tenant
        self._prefix = b"kvtier:%s:%s:" % (tenant.encode("ascii"), namespace.hex().encode("ascii"))
        self._m = metrics
        self._ttl = ttl_s
        self._retained_until: Callable[[bytes], float | None] = _unretained
        self._breakers = breakers if breakers is not None else ShardBreakers(5, 5.0, clock)
        self._lock = threading.Lock()
        self._clock = clock
        self._reconnected_at = -RECONNECT_MIN_S
        self._bad_records = ThrottledLog(log, clock=clock)
        self._local = threading.local()
        self._resident = 0
        self._closed = False
        self._transport = self._connect(
            url,
            endpoint,
            username=username,
            password=password,
            read_from_replica=read_from == "replica",
            tls=(tls_ca_file, tls_cert_file, tls_key_file, tls_insecure),
            max_connections=max_connections,
            clock=clock,
        )
        self._guard = ShardGuard(
            self._transport, self._breakers, metrics, shown, self.name, clock=clock
        )
        self._publish()
        reachable = self._check_server()
        self.max_value_bytes = self._value_limit(reachable, payload_bytes)
        if reachable:
            self._check_eviction(full)

    @classmethod
    def from_config(
        cls,
        config: KVTierConfig,
        namespace: bytes,
        metrics: Metrics,
        *,
        payload_bytes: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> RemoteTier:
        """The remote tier `config` describes (`remote_*` and `breaker_*` fields), for records
        of `payload_bytes` (one chunk; sizes the timeouts and the startup size check)."""
        if config.remote_url is None:
            raise ConfigError(
                "remote_url is not set, so there is no remote tier to build; "
                "set remote_url (redis://host:6379/0) or leave the remote tier out"
            )
        return cls(
            config.remote_url,
            namespace,
            metrics,
            username=config.remote_username,
            password=config.remote_password,
            ttl_s=config.remote_ttl_s,
            timeout_ms=config.remote_timeout_ms,
            write_timeout_ms=config.remote_write_timeout_ms,
            timeout_gbps=config.remote_timeout_gbps,
            payload_bytes=payload_bytes,
            read_from=config.remote_read_from,
            tls_ca_file=config.remote_tls_ca_file,
            tls_cert_file=config.remote_tls_cert_file,
            tls_key_file=config.remote_tls_key_file,
            tls_insecure=config.remote_tls_insecure,
            breakers=ShardBreakers(config.breaker_failures, config.breaker_probe_s, clock),
            clock=clock,
            codec=codec_for(config, namespace),
            tenant=config.tenant,
            full=config.remote_full,
            endpoint=config.store_endpoint,
        )

    # ---- Tier protocol -------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        """True if the store holds a value under `key` (EXISTS; no payload read)."""
        return self.contains_many([key])[0]

    def get(self, key: bytes) -> memoryview | None:
        """The verified payload of `key` (a fresh buffer), or None on a miss, a failure or an
        open breaker. With `payload_bytes` known, at most one byte past the longest record
        crosses the wire (GETRANGE): a longer value under the key fails verification by length
        without being read whole."""
        self._check_open()
        rkey = self._rkey(key)
        limit = self._read_limit()
        data = self._guard.call(rkey, lambda: self._transport.get(rkey, limit), write=False)
        if data is None:
            return None
        return self._verified(key, rkey, data)

    def read_into(self, key: bytes, dst: torch.Tensor) -> bool:
        """Read `key` straight into this thread's record buffer, verify it there and copy the
        payload into uint8 `dst` (any device; exactly one payload long). False on a miss."""
        self._check_open()
        if dst.dtype != torch.uint8:
            raise ValueError(f"read_into needs a uint8 dst tensor, got {dst.dtype}")
        rkey = self._rkey(key)
        n = dst.numel()
        # one byte past the record: a longer value fills it, and fails verification by length
        # (what else the store holds under the key never crosses the wire)
        buf = self._buffer("read", record.HEADER_BYTES + n + 1)
        got = self._guard.call(rkey, lambda: self._transport.get_into(rkey, buf), write=False)
        if got is None:
            return False
        payload = self._verified(key, rkey, buf[:got], expected_length=n)
        if payload is None:
            return False
        src = np.frombuffer(payload, dtype=np.uint8)
        if dst.device.type == "cpu":
            dst.numpy()[:] = src
        else:
            dst.copy_(torch.from_numpy(src), non_blocking=False)
        return True

    def put(self, key: bytes, payload: bytes | memoryview, parent: bytes = NO_PARENT) -> bool:
        """SET the record (EX ttl_s when > 0); False, counted, when refused, skipped or failed.

        Header and payload are laid into this thread's record buffer, reused put after put,
        and sent as one value: no fresh buffer to fault in per record. A shared store keeps
        no chains: `parent` is not stored."""
        self._check_open()
        rkey = self._rkey(key)
        view = memoryview(payload).cast("B")
        total = record.HEADER_BYTES + view.nbytes  # a sealed body is as long as its payload
        # over the server's limit it would drop the connection mid-value (never an outage of
        # the store); over the longest record, every reader would delete it unread
        limits = [(self.max_value_bytes, "the server's proto-max-bulk-len")]
        if self._max_record is not None:
            limits.append((self._max_record, "this tier's longest record (payload_bytes)"))
        over = [(n, what) for n, what in limits if total > n]
        if over:
            self._m.dropped_write(self.name, "too_large").inc()
            self._guard.log_once(
                "too_large",
                "kvtier: remote tier %s refuses a %d-byte record: over %s=%d; counted as "
                "dropped_writes{reason=too_large}",
                self._url,
                total,
                over[0][1],
                over[0][0],
            )
            return False
        shard = self._guard.shard(rkey)
        if not self._breakers[shard].allow():
            self._m.dropped_write(self.name, "breaker_open").inc()
            return False
        header, body = self._codec.seal(key, view)
        buf = self._buffer("write", total)
        buf[: record.HEADER_BYTES] = header
        buf[record.HEADER_BYTES :] = body
        try:
            existed = self._transport.put(rkey, buf, self._ttl_for(self._retained_until(key)))
        except StoreError as e:
            self._guard.failed(e, write=True)
            return False
        self._guard.succeeded(shard)
        self._guard.write_accepted()
        if not existed:
            with self._lock:
                self._resident += total
                self._publish_locked()
        return True

    def delete(self, key: bytes) -> bool:
        """DEL the record of `key`; whether there was one (False too when the store failed,
        counted by the breaker)."""
        self._check_open()
        rkey = self._rkey(key)
        return bool(self._guard.call(rkey, lambda: self._transport.delete(rkey), write=True))

    def protect_until(self, until: Callable[[bytes], float | None]) -> None:
        """`until(key)`: the wall-clock deadline a client retains `key` to, or None; a put of a
        retained chunk lives at least that long where records expire."""
        self._retained_until = until

    def extend_ttl(self, keys: Sequence[bytes], until: float) -> int:
        """Where records expire (`remote_ttl_s` > 0), let those of `keys` live until `until`
        (wall clock) when that is later; how many records were extended."""
        ttl = self._ttl_for(until)
        if ttl <= self._ttl:
            return 0
        extended = 0
        for key in keys:
            rkey = self._rkey(key)
            extended += bool(
                self._guard.call(rkey, lambda r=rkey: self._transport.expire(r, ttl), write=True)
            )
        return extended

    def _ttl_for(self, until: float | None) -> int:
        if self._ttl <= 0 or until is None:
            return self._ttl  # records without expiry, or nothing retained
        return max(self._ttl, math.ceil(until - time.time()))

    def lease(self, lease_id: str, keys: Sequence[bytes], counted: bool = True) -> int:
        """Redis cannot pin, so this only counts: the leading run of `keys` present now (one
        batch). `TierStack` never calls it (`pins` is False)."""
        return self.lookup_prefix(keys)

    def release(self, lease_id: str) -> None:
        """Nothing to release: `lease` pins nothing."""

    def residency_bytes(self) -> int:
        """Estimate: record bytes this process wrote as new keys, minus what it deleted.

        The server is not scanned; TTL expiry, server-side eviction and other writers are not
        seen, so this over-counts a shared or expiring store."""
        with self._lock:
            return self._resident

    def close(self) -> None:
        """Drop every connection; the tier is unusable afterwards."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._transport.close()

    # ---- batched extras ------------------------------------------------------------------

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """`contains` for a batch: one EXISTS batch, one round trip per shard, shards at once.
        Keys on a shard whose breaker is open read False without touching the network."""
        self._check_open()
        if not keys:
            return []
        rkeys = [self._rkey(k) for k in keys]
        replies = self._guard.batch(rkeys, self._transport.exists, write=False)
        return [r is True for r in replies]

    def lookup_prefix(self, keys: Sequence[bytes]) -> int:
        """Number of leading `keys` the store holds, from one batch of EXISTS."""
        n = 0
        for hit in self.contains_many(keys):
            if not hit:
                break
            n += 1
        return n

    def get_many(self, keys: Sequence[bytes]) -> list[memoryview | None]:
        """Verified payloads of `keys` (None per miss), one batch of reads (GETRANGE bounded
        as `get`'s): one round trip per shard, shards at once."""
        self._check_open()
        if not keys:
            return []
        rkeys = [self._rkey(k) for k in keys]
        limit = self._read_limit()
        replies = self._guard.batch(
            rkeys, lambda rks: self._transport.get_many(rks, limit), write=False
        )
        out: list[memoryview | None] = []
        for key, rkey, data in zip(keys, rkeys, replies, strict=True):
            ok = isinstance(data, bytes | bytearray | memoryview)
            out.append(self._verified(key, rkey, data) if ok else None)  # type: ignore[arg-type]
        return out

    # ---- introspection -------------------------------------------------------------------

    @property
    def breaker(self) -> ShardBreakers:
        """The per-shard breakers guarding this tier (`is_open` while any shard is shed)."""
        return self._breakers

    @property
    def url(self) -> str:
        """The server URL with any password masked (safe to log)."""
        return self._url

    def shard_of(self, key: bytes) -> str:
        """The shard (owner address) chunk `key` lives on, as this tier knows the topology."""
        return self._transport.shard_of(self._rkey(key))

    def redis_key(self, key: bytes) -> bytes:
        """The server-side key of chunk `key` (`kvtier:<tenant>:<namespace hex>:<key hex>`)."""
        return self._rkey(key)

    def __repr__(self) -> str:
        return (
            f"RemoteTier(url={self._url!r}, namespace={self._ns.hex()}, "
            f"breaker={self._breakers.state.value})"
        )

    # ---- internals -----------------------------------------------------------------------

    def _connect(
        self,
        url: str,
        endpoint: remote_endpoint.RemoteEndpoint,
        *,
        username: str | None,
        password: str | None,
        read_from_replica: bool,
        tls: tuple[str | None, str | None, str | None, bool],
        max_connections: int,
        clock: Callable[[], float],
    ) -> Transport:
        # explicit credentials win over the URL's userinfo
        username = username if username is not None else endpoint.username
        password = password if password is not None else endpoint.password
        if endpoint.unix:
            from kvtier.store.remote_socket import SocketTransport

            try:
                return SocketTransport(
                    endpoint,
                    self.timeouts,
                    username=username,
                    password=password,
                    max_connections=max_connections,
                )
            except ValueError as e:
                # the parser's message may quote parts of the URL; name only the masked URL
                raise ConfigError(
                    f"remote_url={self._url!r} is not a usable Redis URL ({type(e).__name__}); "
                    f"{remote_endpoint.URL_FORMS}"
                ) from None
        from kvtier.store.remote_glide import GlideTransport

        ca, cert, key, insecure = tls
        try:
            return GlideTransport(
                endpoint,
                self.timeouts,
                username=username,
                password=password,
                read_from_replica=read_from_replica,
                tls_ca_file=ca,
                tls_cert_file=cert,
                tls_key_file=key,
                tls_insecure=insecure,
                clock=clock,
            )
        except ValueError as e:
            raise StartupError(f"remote tier {self._url}: {e}") from None

    def _check_server(self) -> bool:
        """PING every shard: bad credentials stop startup; a store that does not answer within
        `STARTUP_PATIENCE_S` opens the breakers. Whether the store answered."""
        try:
            self._check_patiently()
        except CredentialsRefused as e:
            self.close()
            raise StartupError(
                f"remote tier {self._url} refused the credentials ({e}); "
                "set remote_username/remote_password (or the URL's user:password) to an "
                "account the server accepts"
            ) from None
        except StoreError as e:
            if not e.outage:
                self._guard.rejected(e, write=False)
                return True
            # degrade, never break: serve without the remote until a probe finds it
            for shard in self._transport.shards():
                self._guard.transition(shard, self._breakers[shard].trip(), e, at_startup=True)
            return False
        for shard in self._transport.shards():
            self._guard.transition(shard, self._breakers[shard].success(), None)
        return True

    def _check_patiently(self) -> None:
        """`Transport.check`, asked again while it times out, for up to `STARTUP_PATIENCE_S`.
        A host busy starting the engine answers one PING late; opening the breaker for that
        dropped every write until the first probe, `breaker_probe_s` later. A refused
        connection is no slowness: it ends the check at once."""
        t0 = time.monotonic()
        tries = 0
        while True:
            tries += 1
            try:
                self._transport.check()
            except StoreError as e:
                if e.reason != "timeout":
                    raise
                waited = time.monotonic() - t0
                if waited >= STARTUP_PATIENCE_S:
                    # the startup warning quotes it: patience was spent, not skipped
                    e.args = (f"{e.args[0].rstrip()}; {tries} tries in {waited:.1f} s",)
                    raise
                log.debug("kvtier: remote tier %s startup check timed out (%s)", self._url, e)
                time.sleep(_STARTUP_RETRY_S)  # a pause between tries, not a wait for a thread
                continue
            if tries > 1:
                log.info(
                    "kvtier: remote tier %s answered its startup check on try %d (each try "
                    "timed out after remote_timeout_ms before); serving with it",
                    self._url,
                    tries,
                )
            return

    def _check_eviction(self, full: str) -> None:
        """A store that evicts nothing, with records that never expire, fills up and then
        refuses every write: kvtier would stop storing without a word. Refused at startup
        (`remote_full: refuse`) or warned about (`warn`), naming both settings and the fix."""
        stuck = [(m, p) for m, p in self._transport.memory_policies() if p == "noeviction" and m]
        if not stuck or self._ttl > 0:
            return
        maxmemory = min(m for m, _ in stuck)
        msg = (
            f"remote tier {self._url}: the server evicts nothing (maxmemory-policy noeviction, "
            f"maxmemory {maxmemory} bytes) and remote_ttl_s=0 sets no expiry, so once full it "
            "refuses every write and kvtier stores nothing more; set maxmemory-policy "
            "allkeys-lru on the server (CONFIG SET maxmemory-policy allkeys-lru), or "
            "volatile-lru with remote_ttl_s > 0, or remote_full: warn to serve anyway"
        )
        if full == "refuse":
            self.close()
            raise StartupError(msg)
        log.warning("kvtier: %s", msg)

    def _value_limit(self, reachable: bool, payload_bytes: int | None) -> int:
        """The server's `proto-max-bulk-len`; a chunk record over it stops startup by name."""
        limit = self._transport.max_value_bytes() if reachable else None
        if limit is None:
            limit = _DEFAULT_MAX_VALUE
            if reachable:
                log.info(
                    "kvtier: remote tier %s does not report proto-max-bulk-len (CONFIG "
                    "refused); assuming the default %d bytes",
                    self._url,
                    limit,
                )
        if payload_bytes is not None and record.HEADER_BYTES + payload_bytes > limit:
            self.close()
            raise StartupError(
                f"remote tier {self._url}: one chunk record is "
                f"{record.HEADER_BYTES + payload_bytes} bytes ({payload_bytes} payload + "
                f"{record.HEADER_BYTES} header), over the server's proto-max-bulk-len={limit}; "
                "lower chunk_size or raise proto-max-bulk-len on every server "
                "(CONFIG SET proto-max-bulk-len <bytes>)"
            )
        return limit

    def _verified(
        self,
        key: bytes,
        rkey: bytes,
        data: bytes | bytearray | memoryview,
        expected_length: int | None = None,
    ) -> memoryview | None:
        try:
            return memoryview(self._codec.open(data, key, expected_length))
        except record.RecordError as e:
            self._m.verify_failure(self.name, e.reason).inc()
            if e.reason in _ANOTHER_KEYS:
                # another chunk's record: a planted copy, or a reply to another request (a
                # connection out of step after a lost reply, which every later read would
                # repeat): the next calls go over new connections
                self._replace_connections()
            # another writer of the store may plant records at will: a flood of them may not
            # fill the log (the counter carries the rate)
            self._bad_records.warning(
                e.reason,
                "kvtier: remote record %s failed verification (%s); deleting it if the store "
                "still holds those bytes",
                rkey.decode("ascii"),
                e.reason,
            )
            # only the bytes found bad: a valid record rewritten since, or one whose reply
            # went to another request, stays. A bounded read of a longer value got only its
            # first bytes, whose SHA-1 is not the value's: that value is deleted only while the
            # store holds more than the longest record under the key (STRLEN in the same
            # script), which no writer of this namespace stores, so it is bad whatever the
            # bytes we did not read; a valid record written since is no longer and stays
            n = len(data)
            digest = hashlib.sha1(data, usedforsecurity=False).hexdigest().encode("ascii")
            longer = self._max_record
            if self._guard.call(
                rkey, lambda: self._transport.delete_if(rkey, digest, longer), write=True
            ):
                with self._lock:
                    self._resident = max(0, self._resident - n)
                    self._publish_locked()
            return None

    def _replace_connections(self) -> None:
        """`reconnect` the transport unless it was done within `RECONNECT_MIN_S`."""
        now = self._clock()
        with self._lock:
            if now - self._reconnected_at < RECONNECT_MIN_S:
                return
            self._reconnected_at = now
        self._transport.reconnect()

    def _read_limit(self) -> int | None:
        """Bytes a record read asks for: one past the longest record, so a longer value fills
        it and fails verification by length (the rest never crosses the wire); None (whole
        values) when `payload_bytes` is unknown."""
        return None if self._max_record is None else self._max_record + 1

    def _buffer(self, kind: str, size: int) -> memoryview:
        """This thread's reusable `kind` buffer, at least `size` bytes, viewed at `size`."""
        buf: bytearray | None = getattr(self._local, kind, None)
        if buf is None or len(buf) < size:
            buf = bytearray(size)
            setattr(self._local, kind, buf)
        return memoryview(buf)[:size]

    def _rkey(self, key: bytes) -> bytes:
        if len(key) != record.KEY_BYTES:
            raise ValueError(f"chunk key must be {record.KEY_BYTES} bytes, got {len(key)}")
        return self._prefix + key.hex().encode("ascii")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("RemoteTier is closed; build a new one")

    def _publish(self) -> None:
        with self._lock:
            self._publish_locked()

    def _publish_locked(self) -> None:
        self._m.residency(self.name).set(self._resident)


def _unretained(key: bytes) -> float | None:
    return None


def check_database(
    url: str, endpoint: remote_endpoint.RemoteEndpoint, config: KVTierConfig
) -> None:
    """A database index the server does not have stops startup by name (a client would
    otherwise fail every connect and the tier would only look unreachable)."""
    if endpoint.db == 0 or endpoint.cluster or endpoint.unix:
        return
    have = _server_databases(endpoint, config)
    if have is not None and endpoint.db >= have:
        raise StartupError(
            f"remote_url={mask_url(url)!r} selects database {endpoint.db}, but the server has "
            f"databases 0..{have - 1}; use a database index it has, e.g. redis://host:6379/0"
        )


def _server_databases(endpoint: remote_endpoint.RemoteEndpoint, config: KVTierConfig) -> int | None:
    """The server's `databases` setting, asked on database 0 (None when it will not say)."""
    import redis

    host, port = endpoint.seeds[0]
    username = config.remote_username if config.remote_username is not None else endpoint.username
    password = config.remote_password if config.remote_password is not None else endpoint.password
    client = redis.Redis(
        host=host,
        port=port,
        db=0,
        username=username,
        password=password,
        ssl=endpoint.tls,
        socket_timeout=config.remote_timeout_ms / 1000,
        socket_connect_timeout=config.remote_timeout_ms / 1000,
    )
    try:
        return int(client.config_get("databases")["databases"])
    except (redis.exceptions.RedisError, KeyError, ValueError):
        # an unreachable or TLS server says nothing here; the tier's own startup probe reports it
        return None
    finally:
        client.close()


def _check_arguments(
    namespace: bytes,
    ttl_s: int,
    timeout_ms: int,
    write_timeout_ms: int,
    timeout_gbps: float,
    payload_bytes: int | None,
    read_from: str,
    max_connections: int,
) -> None:
    """A RemoteTier argument out of range is a ValueError naming it and the fix."""
    if len(namespace) != record.NAMESPACE_BYTES:
        raise ValueError(f"namespace must be {record.NAMESPACE_BYTES} bytes, got {len(namespace)}")
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int) or ttl_s < 0:
        raise ValueError(f"ttl_s={ttl_s!r} must be an int >= 0 (0 = no expiry)")
    if not timeout_ms > 0:
        raise ValueError(f"timeout_ms={timeout_ms!r} must be > 0; use 100 (the default)")
    if not write_timeout_ms >= timeout_ms:
        raise ValueError(
            f"write_timeout_ms={write_timeout_ms!r} must be >= timeout_ms={timeout_ms!r}; "
            f"leave it unset for {_DEFAULT_WRITE_TIMEOUT_MS}"
        )
    if not timeout_gbps > 0:
        raise ValueError(f"timeout_gbps={timeout_gbps!r} must be > 0; use 0.1 (the default)")
    if payload_bytes is not None and payload_bytes <= 0:
        raise ValueError(f"payload_bytes={payload_bytes!r} must be > 0 (one chunk's bytes)")
    if read_from not in ("primary", "replica"):
        raise ValueError(f"read_from={read_from!r} is not 'primary' or 'replica'")
    if max_connections <= 0:
        raise ValueError(f"max_connections={max_connections!r} must be > 0; use 16")
