"""The worker role of KVTierConnector (one per vLLM worker, i.e. per TP/PP rank): the rank's
`OffloadWorker` (tiers, codec, lookup server) behind vLLM's worker hooks."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from prometheus_client import CollectorRegistry
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvtier.config import KVTierConfig
from kvtier.metrics import Metrics
from kvtier.offload import messages
from kvtier.offload.messages import OffloadMeta, WorkerReport
from kvtier.offload.worker import OffloadWorker
from kvtier.topology import resolve
from kvtier.vllm.metadata import KVTierConnectorMetadata
from kvtier.vllm.rundir import lookup_base_port, lookup_endpoint

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["WorkerSide"]


def _replica_rank(vllm_config: VllmConfig) -> int:
    """This worker's rank within its replica (pp-major, as vLLM and kvtier.topology number it)."""
    from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

    tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
    return get_pp_group().rank_in_group * tp_size + get_tensor_model_parallel_rank()


class WorkerSide:
    """Per-rank half: the rank's OffloadWorker behind vLLM's worker hooks."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        config: KVTierConfig,
        run_dir: Path,
        model_id: str,
        block_size: int,
    ) -> None:
        topo = resolve(vllm_config, rank=_replica_rank(vllm_config))
        self.rank = topo.rank
        self.block_size = block_size
        self.registry = CollectorRegistry()
        self.metrics = Metrics(rank=topo.rank, registry=self.registry)
        base_port = lookup_base_port(config, vllm_config, topo.dp_rank, topo.world)
        self.worker = OffloadWorker(
            config,
            rank=topo.rank,
            world=topo.world,
            model_id=model_id,
            metrics=self.metrics,
            lookup_endpoint=lookup_endpoint(config, topo.rank, run_dir, base_port),
        )
        self.meta = OffloadMeta()
        self.report = WorkerReport(rank=topo.rank)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Build the rank's layout, codec, tiers and lookup server over vLLM's KV tensors."""
        self.worker.register_kv_caches(kv_caches, self.block_size)

    def bind(self, meta: KVConnectorMetadata) -> None:
        """Decode this step's OffloadMeta."""
        if not isinstance(meta, KVTierConnectorMetadata):
            raise TypeError(
                f"connector metadata is {type(meta).__name__}, not KVTierConnectorMetadata; "
                "the scheduler and workers of one engine must all run KVTierConnector"
            )
        self.meta = messages.decode_meta(meta.data) if meta.data else OffloadMeta()

    def clear(self) -> None:
        """Forget this step's OffloadMeta."""
        self.meta = OffloadMeta()

    def get_finished(self) -> tuple[set[str], set[str]]:
        """Take the rank's report; (finished_sending, finished_recving) request ids."""
        self.report = self.worker.take_report()
        return set(self.report.finished_sending), set(self.report.finished_recving)

    def encoded_report(self) -> bytes:
        """The step's report (with a metrics snapshot when it changed), or b"" if empty."""
        return self.worker.encode_report(self.report)

    def shutdown(self) -> None:
        """Close the worker and remove its ipc socket file."""
        self.worker.close()
        endpoint = self.worker.lookup_endpoint or ""
        if endpoint.startswith("ipc://"):
            # the server is closed; its socket file would outlive it (zmq leaves it)
            Path(endpoint.removeprefix("ipc://")).unlink(missing_ok=True)
