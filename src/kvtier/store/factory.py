"""Builds a rank's TierStack from the config: memory always, then disk and remote if configured."""

from __future__ import annotations

from kvtier import remote_endpoint
from kvtier.config import KVTierConfig, format_size, mask_url
from kvtier.errors import StartupError
from kvtier.metrics import Metrics
from kvtier.store.base import Tier
from kvtier.store.memory import MemoryTier
from kvtier.store.stack import TierStack


def build_stack(
    config: KVTierConfig,
    namespace: bytes,
    slot_bytes: int,
    metrics: Metrics,
    *,
    lower_namespace: bytes | None = None,
    writes_lower: bool = True,
) -> TierStack:
    """The tiers of one rank; a tier that cannot be built stops startup with the cause.

    A replicated layout (every TP rank holds the same bytes) passes `lower_namespace`, one for
    all ranks, so the disk and remote tiers hold one copy; only rank 0 `writes_lower` (the
    others read its records: a follower disk tier, the shared remote)."""
    shared = namespace if lower_namespace is None else lower_namespace
    if config.memory_bytes < slot_bytes:
        raise StartupError(
            f"memory_bytes={config.memory_bytes} cannot hold one chunk of {slot_bytes} bytes "
            f"(chunk_size={config.chunk_size} x layout bytes per token); raise memory_bytes to "
            f"at least {slot_bytes} or lower chunk_size"
        )
    memory = MemoryTier(
        slot_bytes,
        config.memory_bytes,
        namespace,
        metrics,
        lease_ttl_s=config.lease_ttl_s,
        max_leases=config.max_leases,
        verify_reads=config.verify_memory_reads,
    )
    lower: list[Tier] = []
    if config.disk_bytes > 0:
        from kvtier.store.disk import DiskTier
        from kvtier.store.record import HEADER_BYTES
        from kvtier.store.secret import codec_for

        record_bytes = slot_bytes + HEADER_BYTES
        if config.disk_bytes < record_bytes:
            raise StartupError(
                f"disk_bytes={config.disk_bytes} ({format_size(config.disk_bytes)}) cannot hold "
                f"one chunk record of {record_bytes} bytes ({slot_bytes} of KV for "
                f"chunk_size={config.chunk_size} plus a {HEADER_BYTES}-byte header); raise "
                f"disk_bytes to at least {record_bytes}, or set disk_bytes=0 for no disk tier"
            )

        try:
            lower.append(
                DiskTier(
                    config.disk_dir,
                    config.disk_bytes,
                    shared,
                    metrics,
                    lease_ttl_s=config.lease_ttl_s,
                    max_leases=config.max_leases,
                    follower=not writes_lower,
                    gc_days=config.disk_gc_days,
                    conflict=config.disk_conflict,
                    codec=codec_for(config, shared),
                )
            )
        except OSError as e:
            raise StartupError(
                f"disk tier at disk_dir={config.disk_dir!r} could not be opened: {e}; "
                "point disk_dir at a writable directory or set disk_bytes=0"
            ) from e
    if config.remote_url:
        from kvtier.store.remote import RemoteTier

        _check_database(config)
        lower.append(RemoteTier.from_config(config, shared, metrics, payload_bytes=slot_bytes))
    return TierStack(
        memory,
        lower,
        metrics,
        queue_depth=config.write_queue_depth,
        writes_lower=writes_lower,
        retention_limit=retention_limit(config, slot_bytes),
    )


def retention_limit(config: KVTierConfig, slot_bytes: int) -> int:
    """Chunks a rank lets clients retain: the budget's share of its largest private tier."""
    chunks = max(config.memory_bytes, config.disk_bytes) // max(slot_bytes, 1)
    return int(config.retention_budget * chunks)


def _check_database(config: KVTierConfig) -> None:
    """A database index the server does not have stops startup by name (a client would
    otherwise fail every connect and the tier would only look unreachable)."""
    url = config.remote_url or ""
    ep = remote_endpoint.parse(url)
    if ep.db == 0 or ep.cluster or ep.unix:
        return
    have = _server_databases(url, config)
    if have is not None and ep.db >= have:
        raise StartupError(
            f"remote_url={mask_url(url)!r} selects database {ep.db}, but the server has "
            f"databases 0..{have - 1}; use a database index it has, e.g. redis://host:6379/0"
        )


def _server_databases(url: str, config: KVTierConfig) -> int | None:
    """The server's `databases` setting, asked on database 0 (None when it will not say)."""
    import redis
    from redis.connection import parse_url

    kwargs = {**parse_url(url), "db": 0, "socket_timeout": config.remote_timeout_ms / 1000}
    if config.remote_username is not None:
        kwargs["username"] = config.remote_username
    if config.remote_password is not None:
        kwargs["password"] = config.remote_password
    client = redis.Redis(connection_pool=redis.ConnectionPool(**kwargs))
    try:
        return int(client.config_get("databases")["databases"])
    except (redis.exceptions.RedisError, KeyError, ValueError):
        # an unreachable or TLS server says nothing here; the tier's own startup probe reports it
        return None
    finally:
        client.close()
