"""The two messages kvtier sends through vLLM's connector channels.

Both carry kvtier's own msgpack bytes (`kvtier.offload.messages`), so the wire format is the
core's, whatever vLLM uses to move its scheduler output and worker outputs between processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

__all__ = ["KVTierConnectorMetadata", "KVTierWorkerMetadata"]


@dataclass
class KVTierConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step: an encoded `OffloadMeta` (b"" = nothing to do)."""

    data: bytes = b""


@dataclass
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler, once per step: each rank's encoded `WorkerReport`."""

    reports: list[bytes] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVTierWorkerMetadata:
        """vLLM folds every rank's metadata into one; kvtier keeps each rank's report whole."""
        if not isinstance(other, KVTierWorkerMetadata):
            raise TypeError(
                f"cannot aggregate {type(other).__name__} into KVTierWorkerMetadata; every "
                "worker of one engine must run KVTierConnector"
            )
        return KVTierWorkerMetadata(self.reports + other.reports)
