"""`kvtier bench tier` remote rows: RemoteTier put / read GB/s for 1, 4 and 32 MiB chunks on one
server (`--remote-url`) and on a cluster (`--remote-cluster-url`), each next to the raw client
library moving the same bytes. The user runs the store; the bench deletes the keys it wrote.

The raw reference is valkey-glide, the client the tier uses and the fastest reader installed
here: `set` of the whole record, `get` into a reused buffer. redis-py's numbers for the same
bytes ride along in each row's detail (`redis_py_gbps`), so the client choice stays measured.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import redis
import torch
from glide_sync import (
    GlideClient,
    GlideClientConfiguration,
    GlideClusterClient,
    GlideClusterClientConfiguration,
    GlideError,
    NodeAddress,
    ServerCredentials,
)
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from kvtier import remote_endpoint
from kvtier.bench.table import Report, Target
from kvtier.bench.tier_common import (
    STORE_RATIO_TARGET,
    Keys,
    Progress,
    gbps_row,
    interleave,
)
from kvtier.config import mask_url
from kvtier.errors import StartupError
from kvtier.keys import digest16
from kvtier.metrics import Metrics
from kvtier.store import record
from kvtier.store.remote import RemoteTier

SIZES_MIB = (1, 4, 32)
REMOTE_RATIO_TARGET = STORE_RATIO_TARGET
# keys each method cycles through: the server holds a few records per method, not one per rep
_KEYS_PER_METHOD = 3
_TIMEOUT_MS = 5000  # a loaded 2-core box must not turn a slow rep into a failure
_MIB = 1 << 20

log = logging.getLogger("kvtier")


def check_reachable(url: str, flag: str) -> None:
    """PING the store at `url` (given as `flag`) once, so that a wrong URL stops the bench
    before anything is measured; StartupError naming the flag and the masked URL."""
    try:
        # RedisCluster maps the cluster when built: an unreachable seed raises right here;
        # one attempt, no back-off: a refused connection is an answer
        client = _redis_py(url, retry=Retry(NoBackoff(), 0))
    except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException) as e:
        raise _unreachable(url, flag, e) from None
    try:
        client.ping()
    except redis.exceptions.RedisError as e:
        raise _unreachable(url, flag, e) from None
    finally:
        client.close()


def _unreachable(url: str, flag: str, e: Exception) -> StartupError:
    return StartupError(
        f"{flag} {mask_url(url)!r}: the store did not answer PING ({type(e).__name__}: {e}); "
        "start it or fix the URL"
    )


def bench_remote(
    report: Report, quick: bool, say: Progress, server_url: str | None, cluster_url: str | None
) -> None:
    """Add the remote rows of each store given: one server, then a cluster."""
    setups = [("server", "one server", server_url)] if server_url else []
    if cluster_url:
        setups.append(("cluster", f"{_shards(cluster_url)}-shard cluster", cluster_url))
    if not setups:
        return
    where = "; ".join(f"{tag} {mask_url(url)}" for tag, _, url in setups)
    note = report.note(
        f"the stores given ({where}), the bench's own keys deleted after; tier put = "
        "RemoteTier.put (checksum, header + payload laid into a reused buffer, one SET); tier "
        "get = RemoteTier.read_into (GET into a reused buffer, verified there, copied into the "
        "destination tensor); raw = valkey-glide set of the same record bytes / get into a "
        "reused buffer, interleaved rep by rep; detail.redis_py_gbps = redis-py (pure-Python "
        "parser; RedisCluster on the cluster) moving the same bytes in the same run"
    )
    reps = (2, 3) if quick else (8, 30)  # (32 MiB, smaller) repetitions after one warm-up
    for tag, label, url in setups:
        for mib in SIZES_MIB:
            n = reps[0] if mib >= 32 else reps[1]
            say(f"remote tier ({label}): put + get of {mib} MiB chunks, {n} rounds")
            puts, gets = _measure(url, mib * _MIB, n, tag)
            for op, samples in (("put", puts), ("get", gets)):
                row = gbps_row(
                    report,
                    f"remote.{tag}.{op}.{mib}mib",
                    f"remote {op}, {label}, {mib} MiB {note}",
                    mib * _MIB,
                    samples["tier"],
                    samples["raw"],
                    Target("ratio", ">=", REMOTE_RATIO_TARGET),
                )
                note = ""
                rpy_s = float(np.median(samples["redis_py"]))
                row.detail["redis_py_gbps"] = mib * _MIB / rpy_s / 1e9


def _shards(url: str) -> int:
    """How many primaries serve the cluster at `url`."""
    client = _redis_py(url)
    try:
        if not isinstance(client, RedisCluster):
            raise TypeError(f"{mask_url(url)!r} names one server, not a cluster")
        return len(client.get_primaries())
    finally:
        client.close()


def _measure(url: str, size: int, reps: int, tag: str) -> tuple[dict[str, list[float]], ...]:
    """Seconds per rep of (puts, gets) for the tier, raw glide and raw redis-py."""
    metrics = Metrics(0)
    ns = digest16("kvtier.bench.tier.remote", (tag, size))
    codec = record.RecordCodec(ns, record.RecordKeys.derive(secrets.token_bytes(32)))
    tier = RemoteTier(
        url, ns, metrics, payload_bytes=size, timeout_ms=_TIMEOUT_MS, write_timeout_ms=_TIMEOUT_MS,
        codec=codec,
    )  # fmt: skip
    glide = _glide(url)
    rpy = _redis_py(url)
    payload = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    value = codec.encode(bytes(16), memoryview(payload))  # the same bytes the tier sends
    dst = torch.zeros(size, dtype=torch.uint8)
    buf = memoryview(bytearray(len(value)))
    keys = {m: _cycle(f"{tag}.{m}.{size}") for m in ("tier", "raw", "redis_py")}
    tier_keys: list[bytes] = []
    try:

        def tier_put() -> float:
            key = next(keys["tier"])
            t = time.perf_counter()
            ok = tier.put(key, memoryview(payload))
            dt = time.perf_counter() - t
            if not ok:
                raise RuntimeError(f"remote tier refused a {size}-byte put; see its log")
            tier_keys.append(key)
            return dt

        def raw_put(client: Any, name: str) -> Callable[[], float]:
            def put() -> float:
                key = next(keys[name])
                t = time.perf_counter()
                client.set(key, value)
                return time.perf_counter() - t

            return put

        puts = interleave(
            {"tier": tier_put, "raw": raw_put(glide, "raw"), "redis_py": raw_put(rpy, "redis_py")},
            1,
            reps + 1,
        )
        stored = {m: [next(keys[m]) for _ in range(_KEYS_PER_METHOD)] for m in ("raw", "redis_py")}
        turn = iter(range(1 << 30))

        def tier_get() -> float:
            key = tier_keys[-1 - next(turn) % _KEYS_PER_METHOD]
            t = time.perf_counter()
            ok = tier.read_into(key, dst)
            dt = time.perf_counter() - t
            if not ok:
                raise RuntimeError("remote tier missed a chunk it stored; see its log")
            return dt

        def glide_get() -> float:
            key = stored["raw"][next(turn) % _KEYS_PER_METHOD]
            t = time.perf_counter()
            got = glide.get(key, buffer=buf)
            dt = time.perf_counter() - t
            if got is None:
                raise RuntimeError("glide missed a value it stored")
            return dt

        def rpy_get() -> float:
            key = stored["redis_py"][next(turn) % _KEYS_PER_METHOD]
            t = time.perf_counter()
            got = rpy.get(key)
            dt = time.perf_counter() - t
            if got is None:
                raise RuntimeError("redis-py missed a value it stored")
            return dt

        gets = interleave({"tier": tier_get, "raw": glide_get, "redis_py": rpy_get}, 1, reps + 1)
        # a bench of wrong bytes would prove nothing
        if not (tier.read_into(tier_keys[-1], dst) and np.array_equal(dst.numpy(), payload)):
            raise RuntimeError("remote tier read back other bytes than were stored")
    finally:
        try:
            _delete_written(tier, set(tier_keys), glide, rpy, tag, size)
        finally:
            tier.close()
            glide.close()
            rpy.close()
    return puts, gets


def _delete_written(
    tier: RemoteTier,
    tier_keys: set[bytes],
    glide: GlideClient | GlideClusterClient,
    rpy: redis.Redis | RedisCluster,
    tag: str,
    size: int,
) -> None:
    """Delete every record the bench may have written: it is the user's store."""
    for key in tier_keys:
        tier.delete(key)  # counted by the tier's breaker on failure, never raised
    raw = _ring(f"{tag}.raw.{size}")
    rpy_keys = _ring(f"{tag}.redis_py.{size}")
    try:
        glide.delete(raw)  # type: ignore[arg-type]
        rpy.delete(*rpy_keys)
    except (GlideError, redis.exceptions.RedisError) as e:
        # a bench that failed because the store went away must report that, not this
        log.warning("kvtier bench: could not delete the raw baselines' keys: %s", e)


def _ring(tag: str) -> list[bytes]:
    """The `_KEYS_PER_METHOD` keys a method under `tag` cycles through."""
    keys = Keys(tag)
    return [keys.next() for _ in range(_KEYS_PER_METHOD)]


def _cycle(tag: str) -> Iterator[bytes]:
    ring = _ring(tag)
    i = 0
    while True:
        yield ring[i % len(ring)]
        i += 1


def _glide(url: str) -> GlideClient | GlideClusterClient:
    """valkey-glide on `url` as the tier connects: TLS, credentials and database from it."""
    endpoint = remote_endpoint.parse(url)
    nodes = [NodeAddress(h, p) for h, p in endpoint.seeds]
    creds = None
    if endpoint.password is not None or endpoint.username is not None:
        creds = ServerCredentials(password=endpoint.password, username=endpoint.username)
    if endpoint.cluster:
        return GlideClusterClient.create(
            GlideClusterClientConfiguration(
                nodes, use_tls=endpoint.tls, credentials=creds, request_timeout=_TIMEOUT_MS
            )
        )
    return GlideClient.create(
        GlideClientConfiguration(
            nodes, use_tls=endpoint.tls, credentials=creds, request_timeout=_TIMEOUT_MS,
            database_id=endpoint.db,
        )
    )  # fmt: skip


def _redis_py(url: str, **options: Any) -> redis.Redis | RedisCluster:
    """redis-py on `url`, TLS, credentials and database from it; `options` to the client."""
    endpoint = remote_endpoint.parse(url)
    auth: dict[str, Any] = {
        "username": endpoint.username,
        "password": endpoint.password,
        "ssl": endpoint.tls,
        "socket_timeout": _TIMEOUT_MS / 1e3,
        **options,
    }
    if endpoint.cluster:
        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in endpoint.seeds], **auth)
    host, port = endpoint.seeds[0]
    return redis.Redis(host=host, port=port, db=endpoint.db, **auth)
