"""Builds a rank's TierStack from the config: every registered tier kind its config asks for,
memory first (store/registry.py)."""

from __future__ import annotations

from kvtier.config import KVTierConfig
from kvtier.metrics import Metrics
from kvtier.store import registry
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
    state_parts: int = 0,
    engine: str = "",
) -> TierStack:
    """The tiers of one rank; a tier that cannot be built stops startup with the cause (the
    tiers built before it are closed).

    A replicated layout (every TP rank holds the same bytes) passes `lower_namespace`, one for
    all ranks, so the tiers below memory hold one copy; only rank 0 `writes_lower` (the others
    read its records: a follower disk tier, the shared remote). `engine` names the engine
    replica (its lookup run dir): a follower finds its owner's own_dir directory by it."""
    ctx = registry.TierContext(
        config,
        namespace,
        namespace if lower_namespace is None else lower_namespace,
        slot_bytes,
        metrics,
        writes_lower,
        engine,
    )
    built = []
    try:
        for kind in registry.kinds():
            section = kind.section(config)
            if section is not None:
                built.append(kind.build(ctx, section))
    except BaseException:
        for tier in built:
            tier.close()
        raise
    memory, *lower = built
    if not isinstance(memory, MemoryTier):
        raise TypeError(f"the top tier must be the host-memory tier, got {memory.name!r}")
    return TierStack(
        memory,
        lower,
        metrics,
        queue_depth=config.write_queue_depth,
        writes_lower=writes_lower,
        retention_limit=retention_limit(config, slot_bytes),
        state_parts=state_parts,
        retention_share=config.retention_budget,
        write_wait_s=config.write_wait_ms / 1000,
    )


def retention_limit(config: KVTierConfig, slot_bytes: int) -> int:
    """Chunks a rank lets clients retain: the budget's share of its largest private tier."""
    chunks = max(config.memory_bytes, config.disk_bytes) // max(slot_bytes, 1)
    return int(config.retention_budget * chunks)
