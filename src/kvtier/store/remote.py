"""Shared tier on Valkey/Redis: verified records under `kvtier:<namespace hex>:<key hex>`.

Every call runs under a short socket timeout and a circuit breaker, so a slow or dead store costs
hits, never requests: network errors and timeouts become misses (reads) or counted False (writes),
and after `breaker.failures` of them in a row calls are skipped without touching the network until
a probe finds the store again.

Writes get their own connections with a longer socket timeout (`write_timeout_ms`): Python bounds
a whole `sendall` by the socket timeout, so a 32 MiB record over a 1 Gbit/s link (~270 ms) would
never fit in the 100 ms that suits reads, whose timeout applies to each receive. Writes come from
the write-behind thread, never from the engine's step.

Redis cannot pin: a chunk counted by `lookup_prefix`/`lease` may be evicted by the server
(maxmemory policy, TTL) or deleted by another process before the load reads it. That load then
misses, the load fails, and the request recomputes the prefix.
"""

from __future__ import annotations

import enum
import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.maint_notifications import MaintNotificationsConfig
from redis.retry import Retry

from kvtier.errors import ConfigError, StartupError
from kvtier.metrics import Metrics
from kvtier.store import record
from kvtier.store.breaker import CircuitBreaker, Transition

if TYPE_CHECKING:
    from kvtier.config import KVTierConfig

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_DEFAULT_WRITE_TIMEOUT_MS = 1000
_MASK = "***"
_QUERY_PASSWORD_RE = re.compile(r"(?i)([?&]password=)[^&#]*")

# The store did not answer in time or the connection broke: feed the breaker, read as a miss.
# AuthenticationError is a ConnectionError in redis-py; after startup a credential change on the
# server is one more way for the store to be unusable, so it degrades the same way.
_NET_ERRORS: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.InvalidResponse,
    TimeoutError,
    OSError,
)
_TIMEOUTS: tuple[type[BaseException], ...] = (redis.exceptions.TimeoutError, TimeoutError)
# Refusals the server answered promptly (full, read-only replica, ACL): the store is alive
_REJECT_REASONS: tuple[tuple[type[redis.exceptions.ResponseError], str], ...] = (
    (redis.exceptions.OutOfMemoryError, "oom"),
    (redis.exceptions.ReadOnlyError, "read_only"),
    (redis.exceptions.NoPermissionError, "no_permission"),
)


def mask_url(url: str) -> str:
    """`url` with the password of its userinfo and any `?password=` query value replaced."""
    url = _QUERY_PASSWORD_RE.sub(lambda m: m.group(1) + _MASK, url)
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    # the userinfo ends at the last '@' before the query: searching past the first '/' too
    # keeps a password holding an unescaped '/' hidden (over-masking a path is harmless)
    cut = min((i for i in (rest.find("?"), rest.find("#")) if i != -1), default=len(rest))
    at = rest.rfind("@", 0, cut)
    if at == -1:
        return url
    user, colon, _secret = rest[:at].partition(":")
    # a lone userinfo is a user name to redis-py, but people write passwords there: hide it
    shown = f"{user}:{_MASK}" if colon else _MASK
    return f"{scheme}://{shown}{rest[at:]}"


class _Status(enum.Enum):
    OK = "ok"
    SKIPPED = "skipped"  # breaker open: the network was not touched
    FAILED = "failed"  # counted and fed to the breaker


class RemoteTier:
    """Chunk records in a Valkey/Redis server shared by every engine with the same namespace.

    Thread-safe (redis-py's pool hands each thread its own connection). Never raises for a slow,
    dead or refusing store after construction; construction raises `StartupError` only when the
    server answers but rejects the credentials. Reads time out after `timeout_ms`, writes after
    `write_timeout_ms` (default max(timeout_ms, 1000)). `clock` drives the breaker built when
    none is given (failures=5, probe_s=5.0, the config defaults).
    """

    name = "remote"

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
        breaker: CircuitBreaker | None = None,
        max_connections: int = 16,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        shown = mask_url(url)
        if len(namespace) != record.NAMESPACE_BYTES:
            raise ValueError(
                f"namespace must be {record.NAMESPACE_BYTES} bytes, got {len(namespace)}"
            )
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, int) or ttl_s < 0:
            raise ValueError(f"ttl_s={ttl_s!r} must be an int >= 0 (0 = no expiry)")
        if not timeout_ms > 0:
            raise ValueError(f"timeout_ms={timeout_ms!r} must be > 0; use 100 (the default)")
        if write_timeout_ms is None:
            write_timeout_ms = max(timeout_ms, _DEFAULT_WRITE_TIMEOUT_MS)
        if not write_timeout_ms >= timeout_ms:
            raise ValueError(
                f"write_timeout_ms={write_timeout_ms!r} must be >= timeout_ms={timeout_ms!r}; "
                f"leave it unset for {_DEFAULT_WRITE_TIMEOUT_MS}"
            )
        if max_connections <= 0:
            raise ValueError(f"max_connections={max_connections!r} must be > 0; use 16")
        self._url = shown
        self._ns = namespace
        self._prefix = b"kvtier:" + namespace.hex().encode("ascii") + b":"
        self._m = metrics
        self._ttl = ttl_s
        self._timeout_s = timeout_ms / 1000.0
        self._write_timeout_s = write_timeout_ms / 1000.0
        self._breaker = breaker if breaker is not None else CircuitBreaker(5, 5.0, clock)
        self._lock = threading.Lock()
        self._resident = 0
        self._closed = False
        self._rejections_logged: set[str] = set()
        self._redis = redis.Redis(
            connection_pool=self._pool(url, username, password, max_connections, self._timeout_s)
        )
        self._writer = redis.Redis(
            connection_pool=self._pool(
                url, username, password, max_connections, self._write_timeout_s
            )
        )
        self._m.breaker(self.name).set(1 if self._breaker.is_open else 0)
        self._publish()
        self._check_server()

    @classmethod
    def from_config(
        cls,
        config: KVTierConfig,
        namespace: bytes,
        metrics: Metrics,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> RemoteTier:
        """The remote tier `config` describes (`remote_*` and `breaker_*` fields)."""
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
            breaker=CircuitBreaker(config.breaker_failures, config.breaker_probe_s, clock),
            clock=clock,
        )

    # ---- Tier protocol -------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        """True if the server holds a value under `key` (EXISTS; no payload read)."""
        self._check_open()
        rkey = self._rkey(key)
        status, found = self._run(lambda: self._redis.exists(rkey), write=False)
        return status is _Status.OK and bool(found)

    def get(self, key: bytes) -> memoryview | None:
        """The verified payload of `key`, or None on a miss, a failure or an open breaker."""
        self._check_open()
        rkey = self._rkey(key)
        status, data = self._run(lambda: self._redis.get(rkey), write=False)
        if status is not _Status.OK or data is None:
            return None
        return self._verified(key, rkey, data)

    def put(self, key: bytes, payload: bytes | memoryview) -> bool:
        """SET the record (EX ttl_s when > 0); False, counted, when skipped or failed."""
        self._check_open()
        rkey = self._rkey(key)
        header = record.encode_header(self._ns, key, payload)

        def write() -> list[object]:
            value = b"".join((header, payload))
            pipe = self._writer.pipeline(transaction=False)
            # EXISTS rides along so a rewrite of a held chunk is not counted twice in residency
            pipe.exists(rkey)
            pipe.set(rkey, value, ex=self._ttl if self._ttl > 0 else None)
            return pipe.execute()

        status, replies = self._run(write, write=True)
        if status is _Status.SKIPPED:
            self._m.dropped_write(self.name, "breaker_open").inc()
            return False
        if status is not _Status.OK or replies is None:
            return False
        if not replies[0]:
            with self._lock:
                self._resident += len(header) + memoryview(payload).nbytes
                self._publish_locked()
        return True

    def lease(self, lease_id: str, keys: Sequence[bytes], counted: bool = True) -> int:
        """Redis cannot pin, so this only counts: the leading run of `keys` present now.

        A counted chunk may still vanish before the load (see the module docstring)."""
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
        """Drop every pooled connection; the tier is unusable afterwards."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for client in (self._redis, self._writer):
            client.close()
            client.connection_pool.disconnect()

    # ---- batched extras ------------------------------------------------------------------

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """`contains` for a batch, from one pipeline of EXISTS (all False when unreachable)."""
        self._check_open()
        if not keys:
            return []
        rkeys = [self._rkey(k) for k in keys]

        def exists_all() -> list[object]:
            pipe = self._redis.pipeline(transaction=False)
            for rkey in rkeys:
                pipe.exists(rkey)
            return pipe.execute()

        status, found = self._run(exists_all, write=False)
        if status is not _Status.OK or found is None:
            return [False] * len(keys)
        return [bool(hit) for hit in found]

    def lookup_prefix(self, keys: Sequence[bytes]) -> int:
        """Number of leading `keys` the server holds, from one pipeline of EXISTS."""
        n = 0
        for hit in self.contains_many(keys):
            if not hit:
                break
            n += 1
        return n

    def get_many(self, keys: Sequence[bytes]) -> list[memoryview | None]:
        """Verified payloads of `keys` (None per miss), read with one MGET round trip."""
        self._check_open()
        if not keys:
            return []
        rkeys = [self._rkey(k) for k in keys]
        status, values = self._run(lambda: self._redis.mget(rkeys), write=False)
        if status is not _Status.OK or values is None:
            return [None] * len(keys)
        out: list[memoryview | None] = []
        for key, rkey, data in zip(keys, rkeys, values, strict=True):
            out.append(None if data is None else self._verified(key, rkey, data))
        return out

    # ---- introspection -------------------------------------------------------------------

    @property
    def breaker(self) -> CircuitBreaker:
        """The breaker guarding this tier."""
        return self._breaker

    @property
    def url(self) -> str:
        """The server URL with any password masked (safe to log)."""
        return self._url

    def redis_key(self, key: bytes) -> bytes:
        """The server-side key of chunk `key` (`kvtier:<namespace hex>:<key hex>`)."""
        return self._rkey(key)

    def __repr__(self) -> str:
        return (
            f"RemoteTier(url={self._url!r}, namespace={self._ns.hex()}, "
            f"breaker={self._breaker.state.value})"
        )

    # ---- internals -----------------------------------------------------------------------

    def _pool(
        self,
        url: str,
        username: str | None,
        password: str | None,
        max_connections: int,
        socket_timeout_s: float,
    ) -> redis.BlockingConnectionPool:
        try:
            pool = redis.BlockingConnectionPool.from_url(
                url,
                max_connections=max_connections,
                # waiting for a free pooled connection is bounded like any other call
                timeout=self._timeout_s,
                socket_timeout=socket_timeout_s,
                # reaching the server is quick or not at all, for reads and writes alike
                socket_connect_timeout=self._timeout_s,
                # one attempt per call: retries would multiply the time spent on a dead store
                retry=Retry(NoBackoff(), 0),
                health_check_interval=0,
                # no extra handshake round trip per connection (a managed-cluster feature)
                maint_notifications_config=MaintNotificationsConfig(enabled=False),
            )
        except ValueError as e:
            # the parser's message may quote parts of the URL; name only the masked URL
            raise ConfigError(
                f"remote_url={self._url!r} is not a usable Redis URL ({type(e).__name__}); "
                "use redis://host:6379/0, rediss://host:6380/0 or unix:///path/to/redis.sock"
            ) from None
        # explicit credentials win over the URL's userinfo
        if username is not None:
            pool.connection_kwargs["username"] = username
        if password is not None:
            pool.connection_kwargs["password"] = password
        return pool

    def _check_server(self) -> None:
        """PING once: bad credentials stop startup; an unreachable store opens the breaker."""
        try:
            self._redis.ping()
        except (
            redis.exceptions.AuthenticationError,
            redis.exceptions.AuthorizationError,
            redis.exceptions.NoPermissionError,
        ) as e:
            self.close()
            raise StartupError(
                f"remote tier {self._url} refused the credentials ({type(e).__name__}: {e}); "
                "set remote_username/remote_password (or the URL's user:password) to an "
                "account the server accepts"
            ) from None
        except _NET_ERRORS as e:
            # degrade, never break: serve without the remote until a probe finds it
            self._report(self._breaker.trip(), e, at_startup=True)
            return
        self._report(self._breaker.success(), None)

    def _run(self, fn: Callable[[], _T], *, write: bool) -> tuple[_Status, _T | None]:
        """`fn()` behind the breaker; network failures are counted and fed to it."""
        if not self._breaker.allow():
            return _Status.SKIPPED, None
        try:
            value = fn()
        except _NET_ERRORS as e:
            reason = "timeout" if isinstance(e, _TIMEOUTS) else "connection"
            self._m.store_failure(self.name, reason if write else f"read_{reason}").inc()
            log.debug("kvtier: remote tier %s call failed: %s", self._url, _describe(e))
            self._report(self._breaker.failure(), e)
            return _Status.FAILED, None
        except redis.exceptions.ResponseError as e:
            self._rejected(e, write)
            # the server answered in time; that is what the breaker guards
            self._report(self._breaker.success(), None)
            return _Status.FAILED, None
        self._report(self._breaker.success(), None)
        return _Status.OK, value

    def _rejected(self, e: redis.exceptions.ResponseError, write: bool) -> None:
        reason = next((r for cls, r in _REJECT_REASONS if isinstance(e, cls)), "rejected")
        self._m.store_failure(self.name, reason if write else f"read_{reason}").inc()
        with self._lock:
            first = reason not in self._rejections_logged
            self._rejections_logged.add(reason)
        # once per reason: a full store refuses every write, and the counter carries the rate
        log.log(
            logging.WARNING if first else logging.DEBUG,
            "kvtier: remote tier %s refused a %s (%s); counted as store_failures{reason=%s}",
            self._url,
            "write" if write else "read",
            _describe(e),
            reason if write else f"read_{reason}",
        )

    def _report(
        self, transition: Transition | None, cause: BaseException | None, at_startup: bool = False
    ) -> None:
        if transition is None:
            return
        gauge = self._m.breaker(self.name)
        if transition is Transition.OPENED:
            gauge.set(1)
            why = (
                "is unreachable at startup"
                if at_startup
                else f"failed {self._breaker.failures} calls in a row"
            )
            log.warning(
                "kvtier: remote tier %s %s (%s); circuit breaker open: remote reads miss and "
                "writes are dropped, probing again every %.1fs",
                self._url,
                why,
                _describe(cause),
                self._breaker.probe_s,
            )
        elif transition is Transition.REOPENED:
            gauge.set(1)
            log.debug("kvtier: remote tier %s probe failed: %s", self._url, _describe(cause))
        else:
            gauge.set(0)
            log.info("kvtier: remote tier %s answers again; circuit breaker closed", self._url)

    def _verified(self, key: bytes, rkey: bytes, data: bytes) -> memoryview | None:
        try:
            return record.verify(data, self._ns, key)
        except record.RecordError as e:
            self._m.verify_failure(self.name, e.reason).inc()
            log.warning(
                "kvtier: remote record %s failed verification (%s); deleting it",
                rkey.decode("ascii"),
                e.reason,
            )
            # best effort: content-addressed chunks make a racing rewrite harmless (it is
            # simply written again later)
            status, deleted = self._run(lambda: self._redis.delete(rkey), write=True)
            if status is _Status.OK and deleted:
                with self._lock:
                    self._resident = max(0, self._resident - len(data))
                    self._publish_locked()
            return None

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


def _describe(e: BaseException | None) -> str:
    """`Type: message` of a redis-py error (its messages carry host and port, never secrets)."""
    if e is None:
        return "no error"
    return f"{type(e).__name__}: {e}"
