"""The tier kinds: one record each (name, config section, factory, how hosts report it), the only
table of tier names. The stack's order, the lookup's "deepest tier", the hosts' cache-hit
sources, the KV events' medium and the cost model's read-speed seeds are all read from here.

Adding a kind is its module (a class following `store.base.Tier`) and one `register` call;
docs/architecture.md walks through it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from kvtier.config import KVTierConfig, format_size
from kvtier.errors import StartupError
from kvtier.metrics import Metrics
from kvtier.remote_endpoint import RemoteEndpoint
from kvtier.store.base import Tier

# a hit's source in vLLM's `CacheHitSource` vocabulary (the native engine reports the same)
HOST = "host"
DISK = "disk"
EXTERNAL = "external_unspecified"
# a record's medium in vLLM's KV-event vocabulary (`MEDIUM_CPU`, `MEDIUM_STORAGE`)
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"


@dataclass(frozen=True, slots=True)
class TierContext:
    """What a factory gets besides its section: the rank's identity in the tiers."""

    config: KVTierConfig
    namespace: bytes  # this rank's records
    shared_namespace: bytes  # the records every rank of a replicated layout shares
    slot_bytes: int  # one chunk's payload
    metrics: Metrics
    writes_lower: bool  # False: a follower rank, which reads what rank 0 writes below memory
    engine: str = ""  # the engine replica the rank belongs to (its lookup run dir), or ""


@dataclass(frozen=True, slots=True)
class TierKind:
    """One kind of tier. `name` is also its metrics label (`tier="..."`) and what lookups
    answer; `depth` orders the stack from the accelerator outwards (memory is 0)."""

    name: str
    depth: int
    # the kind's typed settings read from the config, None when the config asks for no such tier
    section: Callable[[KVTierConfig], Any | None]
    build: Callable[[TierContext, Any], Tier]
    # seed of the cost model's read speed for this tier, in GB/s
    read_gbps: Callable[[KVTierConfig], float]
    hit_source: str = EXTERNAL
    medium: str = MEDIUM_STORAGE
    # records other hosts read too (KV events say REMOTE)
    shared: bool = False

    @property
    def locality(self) -> str:
        """KV events' locality of this kind's records."""
        return "REMOTE" if self.shared else "LOCAL"


_lock = threading.Lock()
_kinds: dict[str, TierKind] = {}


def register(kind: TierKind) -> None:
    """Add a tier kind; a name or depth already taken is refused by name."""
    with _lock:
        clash = [k.name for k in _kinds.values() if k.name == kind.name or k.depth == kind.depth]
        if clash:
            raise ValueError(
                f"tier kind {kind.name!r} (depth {kind.depth}) clashes with registered kind "
                f"{clash[0]!r}; pick another name and depth"
            )
        _kinds[kind.name] = kind


def unregister(name: str) -> None:
    """Remove a tier kind (tests that register their own)."""
    with _lock:
        _kinds.pop(name, None)


@contextlib.contextmanager
def registered(kind: TierKind) -> Iterator[TierKind]:
    """`kind` registered for the block's duration."""
    register(kind)
    try:
        yield kind
    finally:
        unregister(kind.name)


def kinds() -> list[TierKind]:
    """Every registered kind, from the accelerator outwards."""
    with _lock:
        return sorted(_kinds.values(), key=lambda k: k.depth)


def order() -> tuple[str, ...]:
    """Tier names from the accelerator outwards (a lookup's "deepest tier" is the last)."""
    return tuple(k.name for k in kinds())


def kind(name: str) -> TierKind | None:
    """The kind named `name`, or None."""
    with _lock:
        return _kinds.get(name)


def hit_source(tier: str) -> str:
    """Where a hit served by `tier` came from, in vLLM's `CacheHitSource` values."""
    k = kind(tier)
    return k.hit_source if k is not None else EXTERNAL


def read_seeds(config: KVTierConfig) -> dict[str, float]:
    """Each kind's seeded read speed in GB/s (the cost model starts from these)."""
    return {k.name: k.read_gbps(config) for k in kinds()}


# ---- the built-in kinds --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MemorySection:
    """The host-memory tier's settings (`memory_*`, `verify_memory_reads`, leases)."""

    bytes: int
    verify_reads: bool
    lease_ttl_s: float
    max_leases: int


@dataclass(frozen=True, slots=True)
class DiskSection:
    """The disk tier's settings (`disk_*`)."""

    dir: str
    bytes: int
    gc_days: float
    conflict: str
    lease_ttl_s: float
    max_leases: int


@dataclass(frozen=True, slots=True)
class RemoteSection:
    """The shared store's settings (`remote_*`), its URL parsed once by the config."""

    url: str
    endpoint: RemoteEndpoint


def _memory_section(config: KVTierConfig) -> MemorySection:
    return MemorySection(
        config.memory_bytes, config.verify_memory_reads, config.lease_ttl_s, config.max_leases
    )


def _build_memory(ctx: TierContext, s: MemorySection) -> Tier:
    from kvtier.store.memory import MemoryTier

    if s.bytes < ctx.slot_bytes:
        raise StartupError(
            f"memory_bytes={s.bytes} cannot hold one chunk of {ctx.slot_bytes} bytes "
            f"(chunk_size={ctx.config.chunk_size} x layout bytes per token); raise memory_bytes "
            f"to at least {ctx.slot_bytes} or lower chunk_size"
        )
    return MemoryTier(
        ctx.slot_bytes,
        s.bytes,
        ctx.namespace,
        ctx.metrics,
        lease_ttl_s=s.lease_ttl_s,
        max_leases=s.max_leases,
        verify_reads=s.verify_reads,
    )


def _disk_section(config: KVTierConfig) -> DiskSection | None:
    if config.disk_bytes <= 0 or config.disk_dir is None:
        return None
    return DiskSection(
        config.disk_dir,
        config.disk_bytes,
        config.disk_gc_days,
        config.disk_conflict,
        config.lease_ttl_s,
        config.max_leases,
    )


def _build_disk(ctx: TierContext, s: DiskSection) -> Tier:
    from kvtier.store.disk import DiskTier
    from kvtier.store.record import HEADER_BYTES
    from kvtier.store.secret import codec_for

    record_bytes = ctx.slot_bytes + HEADER_BYTES
    if s.bytes < record_bytes:
        raise StartupError(
            f"disk_bytes={s.bytes} ({format_size(s.bytes)}) cannot hold one chunk record of "
            f"{record_bytes} bytes ({ctx.slot_bytes} of KV for chunk_size="
            f"{ctx.config.chunk_size} plus a {HEADER_BYTES}-byte header); raise disk_bytes to "
            f"at least {record_bytes}, or set disk_bytes=0 for no disk tier"
        )
    try:
        return DiskTier(
            s.dir,
            s.bytes,
            ctx.shared_namespace,
            ctx.metrics,
            lease_ttl_s=s.lease_ttl_s,
            max_leases=s.max_leases,
            follower=not ctx.writes_lower,
            gc_days=s.gc_days,
            conflict=s.conflict,
            codec=codec_for(ctx.config, ctx.shared_namespace),
            engine=ctx.engine,
        )
    except OSError as e:
        raise StartupError(
            f"disk tier at disk_dir={s.dir!r} could not be opened: {e}; "
            "point disk_dir at a writable directory or set disk_bytes=0"
        ) from e


def _remote_section(config: KVTierConfig) -> RemoteSection | None:
    endpoint = config.store_endpoint
    if config.remote_url is None or endpoint is None:
        return None
    return RemoteSection(config.remote_url, endpoint)


def _build_remote(ctx: TierContext, s: RemoteSection) -> Tier:
    from kvtier.store.remote import RemoteTier, check_database

    check_database(s.url, s.endpoint, ctx.config)
    return RemoteTier.from_config(
        ctx.config, ctx.shared_namespace, ctx.metrics, payload_bytes=ctx.slot_bytes
    )


for _kind in (
    TierKind(
        "memory", 0, _memory_section, _build_memory, lambda c: c.memory_read_gbps,
        hit_source=HOST, medium=MEDIUM_CPU,
    ),
    TierKind(
        "disk", 10, _disk_section, _build_disk, lambda c: c.disk_read_gbps, hit_source=DISK
    ),
    TierKind(
        "remote", 20, _remote_section, _build_remote, lambda c: c.remote_read_gbps, shared=True
    ),
):  # fmt: skip
    register(_kind)
