"""The remote tier's transport to a server on a local socket (`unix://`), over redis-py.

valkey-glide speaks TCP only; a same-host server on a socket goes through redis-py's pools, one
for reads and presence, one for writes, each with its own socket timeout.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.maint_notifications import MaintNotificationsConfig
from redis.retry import Retry

from kvtier.remote_endpoint import RemoteEndpoint
from kvtier.store.remote_transport import (
    DELETE_IF_SCRIPT,
    CredentialsRefused,
    StoreError,
    Timeouts,
)

# The store did not answer in time or the connection broke. AuthenticationError is a
# ConnectionError in redis-py: after startup a credential change is one more outage.
_NET_ERRORS: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.InvalidResponse,
    TimeoutError,
    OSError,
)
_T = TypeVar("_T")
_TIMEOUTS: tuple[type[BaseException], ...] = (redis.exceptions.TimeoutError, TimeoutError)
_REJECT_REASONS: tuple[tuple[type[redis.exceptions.ResponseError], str], ...] = (
    (redis.exceptions.OutOfMemoryError, "oom"),
    (redis.exceptions.ReadOnlyError, "read_only"),
    (redis.exceptions.NoPermissionError, "no_permission"),
)
_AUTH_ERRORS: tuple[type[BaseException], ...] = (
    redis.exceptions.AuthenticationError,
    redis.exceptions.AuthorizationError,
    redis.exceptions.NoPermissionError,
)


class _Batch(threading.local):
    # this thread's deadline for every reply of the pipeline it runs now (None: each reply
    # gets the read timeout of its own)
    deadline: float | None = None


_BATCH = _Batch()


class SocketTransport:
    """A Valkey/Redis server on a unix socket; one shard, named by the socket path."""

    timeout_stderr = ""  # redis-py prints nothing of its own

    def __init__(
        self,
        endpoint: RemoteEndpoint,
        timeouts: Timeouts,
        *,
        username: str | None,
        password: str | None,
        max_connections: int = 16,
    ) -> None:
        # named by its path alone: a shard name reaches logs and errors, the URL's userinfo
        # and query may hold a password
        self._shard = f"unix:{endpoint.socket_path}"
        self._closed = False
        self._timeouts = timeouts
        self._redis = redis.Redis(
            connection_pool=_pool(endpoint, username, password, max_connections, timeouts, False)
        )
        self._writer = redis.Redis(
            connection_pool=_pool(endpoint, username, password, max_connections, timeouts, True)
        )

    @property
    def epoch(self) -> int:
        return 0

    def shard_of(self, rkey: bytes) -> str:
        return self._shard

    def shards(self) -> list[str]:
        return [self._shard]

    def refresh(self) -> None:
        """One server: nothing to re-read."""

    def check(self) -> None:
        try:
            self._redis.ping()
        except _AUTH_ERRORS as e:
            raise CredentialsRefused(f"{type(e).__name__}: {e}") from None
        except (*_NET_ERRORS, redis.exceptions.ResponseError) as e:
            raise self._error(e) from None

    def max_value_bytes(self) -> int | None:
        try:
            reply = self._redis.config_get("proto-max-bulk-len")
        except (*_NET_ERRORS, redis.exceptions.ResponseError):
            return None
        value = reply.get("proto-max-bulk-len") if isinstance(reply, dict) else None
        return None if value is None else int(value)

    def memory_policies(self) -> list[tuple[int, str]]:
        try:
            info = self._redis.info("memory")
        except (*_NET_ERRORS, redis.exceptions.ResponseError):
            return []
        try:
            return [(int(info["maxmemory"]), str(info["maxmemory_policy"]))]
        except (KeyError, ValueError):
            return []

    def exists(self, rkeys: Sequence[bytes]) -> list[bool | StoreError]:
        def call() -> list[object]:
            pipe = self._redis.pipeline(transaction=False)
            for rkey in rkeys:
                pipe.exists(rkey)
            return pipe.execute()

        replies = self._batch(call, len(rkeys))
        return [r if isinstance(r, StoreError) else bool(r) for r in replies]

    def get(self, rkey: bytes, limit: int | None = None) -> bytes | None:
        if limit is None:
            data = self._call(lambda: self._redis.get(rkey))
            return None if data is None else bytes(data)
        # GETRANGE: at most `limit` bytes, whatever the store holds under the key; a missing
        # key reads as an empty range: a miss
        data = self._call(lambda: self._redis.getrange(rkey, 0, limit - 1))
        return bytes(data) or None

    def get_into(self, rkey: bytes, buf: memoryview) -> int | None:
        # at most the buffer's bytes, whatever the store holds under the key
        data = self._call(lambda: self._redis.getrange(rkey, 0, buf.nbytes - 1))
        if not data:
            return None  # a missing key reads as an empty range (an empty record is none)
        buf[: len(data)] = data
        return len(data)

    def get_many(
        self, rkeys: Sequence[bytes], limit: int | None = None
    ) -> list[bytes | None | StoreError]:
        if limit is None:
            return self._batch(lambda: self._redis.mget(rkeys), len(rkeys))  # type: ignore[return-value]

        def call() -> list[object]:
            # one pipeline of GETRANGE (one round trip): at most `limit` bytes of each value
            pipe = self._redis.pipeline(transaction=False)
            for rkey in rkeys:
                pipe.getrange(rkey, 0, limit - 1)
            # every reply under one deadline, the read timeout, as MGET's single reply had
            _BATCH.deadline = time.monotonic() + self._timeouts.read_s
            try:
                return pipe.execute(raise_on_error=False)
            finally:
                _BATCH.deadline = None

        out: list[bytes | None | StoreError] = []
        for reply in self._batch(call, len(rkeys)):
            if isinstance(reply, redis.exceptions.ResponseError):
                out.append(self._error(reply))  # refused for this key alone (e.g. WRONGTYPE)
            else:
                # a missing key reads as an empty range: a miss
                out.append(reply or None)  # type: ignore[arg-type]
        return out

    def put(self, rkey: bytes, value: memoryview, ttl_s: int) -> bool:
        def call() -> list[object]:
            pipe = self._writer.pipeline(transaction=False)
            pipe.exists(rkey)
            pipe.set(rkey, value, ex=ttl_s if ttl_s > 0 else None)
            return pipe.execute()

        replies = self._call(call)
        return bool(replies[0])

    def expire(self, rkey: bytes, ttl_s: int) -> bool:
        return bool(self._call(lambda: self._writer.expire(rkey, ttl_s)))

    def delete(self, rkey: bytes) -> bool:
        return bool(self._call(lambda: self._writer.delete(rkey)))

    def delete_if(self, rkey: bytes, sha1_hex: bytes, longer_than: int | None = None) -> bool:
        args = (sha1_hex,) if longer_than is None else (sha1_hex, longer_than)
        return bool(self._call(lambda: self._writer.eval(DELETE_IF_SCRIPT, 1, rkey, *args)))

    def reconnect(self) -> None:
        # redis-py drops a connection whose call failed itself; the idle pooled ones go too
        # (those in use are left to their calls: closing them under a read breaks it)
        for client in (self._redis, self._writer):
            client.connection_pool.disconnect(inuse_connections=False)

    def close(self) -> None:
        self._closed = True
        for client in (self._redis, self._writer):
            client.close()
            client.connection_pool.disconnect()

    def _call(self, fn: Callable[[], _T]) -> _T:
        try:
            return fn()
        except (*_NET_ERRORS, redis.exceptions.ResponseError) as e:
            raise self._error(e) from None
        except (ValueError, AttributeError) as e:
            # close() disconnects sockets other threads are reading: redis-py then raises
            # these, which are a closed store's misses, not errors of kvtier's
            if not self._closed:
                raise
            raise StoreError("connection", True, self._shard, f"closed ({e})") from None

    def _batch(self, fn: Callable[[], Sequence[object]], n: int) -> list[object]:
        try:
            return list(self._call(fn))
        except StoreError as error:
            return [error] * n

    def _error(self, e: BaseException) -> StoreError:
        if isinstance(e, redis.exceptions.ResponseError):
            reason = next((r for cls, r in _REJECT_REASONS if isinstance(e, cls)), "rejected")
            return StoreError(reason, False, self._shard, f"{type(e).__name__}: {e}")
        reason = "timeout" if isinstance(e, _TIMEOUTS) else "connection"
        return StoreError(reason, True, self._shard, f"{type(e).__name__}: {e}")


class _DeadlineSocket:
    """A connection's socket whose reads of one reply share one deadline. redis-py bounds each
    `recv` by the socket timeout, so a store that drips its reply a few bytes at a time could
    hold a read for as long as it likes; here the whole reply gets the read timeout."""

    def __init__(self, sock: socket.socket, timeout_s: float | None) -> None:
        self._sock = sock
        self._timeout_s = timeout_s
        self.deadline: float | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)

    def _bound(self) -> None:
        if self.deadline is None:
            return
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the reply took longer than the read timeout")
        self._sock.settimeout(left if self._timeout_s is None else min(left, self._timeout_s))

    def recv(self, *args: Any) -> bytes:
        self._bound()
        return self._sock.recv(*args)

    def recv_into(self, *args: Any) -> int:
        self._bound()
        return self._sock.recv_into(*args)

    def settimeout(self, value: float | None) -> None:
        self._timeout_s = value  # redis-py's own per-read timeouts, still capped by the deadline
        self._sock.settimeout(value)


class _Connection(redis.UnixDomainSocketConnection):
    """redis-py's unix-socket connection, one deadline per reply (`_DeadlineSocket`)."""

    def _connect(self) -> Any:
        return _DeadlineSocket(super()._connect(), self.socket_timeout)

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        sock = self._sock
        if not isinstance(sock, _DeadlineSocket) or self.socket_timeout is None:
            return super().read_response(*args, **kwargs)
        batch = _BATCH.deadline
        sock.deadline = time.monotonic() + self.socket_timeout if batch is None else batch
        try:
            return super().read_response(*args, **kwargs)
        finally:
            sock.deadline = None
            if self._sock is sock:  # still connected: writes get their own timeout back
                sock.settimeout(self.socket_timeout)


def _pool(
    ep: RemoteEndpoint,
    username: str | None,
    password: str | None,
    max_connections: int,
    timeouts: Timeouts,
    write: bool,
) -> redis.BlockingConnectionPool:
    # redis-py is handed the socket and database only: kvtier parsed the URL already, and
    # redis-py's own parse breaks on passwords holding '[', '#' or '?'
    username = username if username is not None else ep.username
    password = password if password is not None else ep.password
    pool = redis.BlockingConnectionPool(
        connection_class=_Connection,
        path=ep.socket_path,
        db=ep.db,
        max_connections=max_connections,
        # waiting for a free pooled connection is bounded like any other call
        timeout=timeouts.presence_s,
        # Python bounds a whole sendall by the socket timeout, so writes get the write timeout
        socket_timeout=timeouts.write_s if write else timeouts.read_s,
        socket_connect_timeout=timeouts.presence_s,
        # one attempt per call: retries would multiply the time spent on a dead store
        retry=Retry(NoBackoff(), 0),
        health_check_interval=0,
        # no extra handshake round trip per connection (a managed-cluster feature)
        maint_notifications_config=MaintNotificationsConfig(enabled=False),
    )
    # explicit credentials win over the URL's userinfo
    if username is not None:
        pool.connection_kwargs["username"] = username
    if password is not None:
        pool.connection_kwargs["password"] = password
    return pool
