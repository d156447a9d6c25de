"""The worker role of KVTierConnector (one per vLLM worker, i.e. per TP/PP rank): the rank's
`OffloadWorker` (tiers, codec, lookup server) behind vLLM's worker hooks."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.platforms import current_platform

from kvtier.config import KVTierConfig
from kvtier.offload import messages
from kvtier.offload.groups import GroupSpec
from kvtier.offload.messages import OffloadMeta, WorkerReport
from kvtier.offload.pages import KVCacheDescription
from kvtier.offload.wiring import build_worker, decode_step_meta
from kvtier.topology import resolve
from kvtier.vllm.cpu_binding import compute_cpus
from kvtier.vllm.events import kv_events_enabled
from kvtier.vllm.metadata import KVTierConnectorMetadata
from kvtier.vllm.rundir import offload_spec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["WorkerSide"]


# every layout vLLM 0.32 may resolve whose pages kvtier moves whole (LHBNC is refused)
LAYOUT_FIX = (
    "set VLLM_KV_CACHE_LAYOUT to LBHNC, LBNHC, BLHNC or BLNHC (block pages contiguous), or "
    "let kvtier request its preferred_kv_layout"
)


def ranks_on_host(vllm_config: VllmConfig) -> int:
    """Workers of every replica that run on this host (they share its RAM)."""
    pc = vllm_config.parallel_config
    local = int(getattr(pc, "local_world_size", pc.world_size))
    return local * max(1, int(getattr(pc, "data_parallel_size_local", 1) or 1))


def kv_description(
    kv_caches: dict[str, torch.Tensor],
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig | None,
    block_size: int,
    groups: tuple[GroupSpec, ...] | None = None,
) -> KVCacheDescription:
    """What vLLM resolved, as kvtier's page description: per-layer `[B, H, N, C]` views (kernel
    blocks on dim 0 when the kernel block is smaller), the manager block count, the layout, and
    a hybrid model's KV cache groups (their layers alias one block pool)."""
    layout = getattr(kv_cache_config, "kv_cache_layout", None) or getattr(
        vllm_config.cache_config, "kv_cache_layout", None
    )
    if kv_cache_config is not None:
        num_blocks = int(kv_cache_config.num_blocks)
    else:
        num_blocks = int(next(iter(kv_caches.values())).shape[0])
    tensors = flat_tensors(kv_caches)
    return KVCacheDescription(
        tensors=tensors,
        num_blocks=num_blocks,
        block_size=block_size,
        layout=str(layout or "unresolved"),
        layout_fix=LAYOUT_FIX,
        replicated=replicated_across_tp(kv_cache_config, vllm_config),
        page_format=kernel_page_format(vllm_config, kv_caches),
        groups=with_tensor_names(groups, tensors) if groups else (),
    )


def flat_tensors(kv_caches: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """vLLM's caches by name; a state layer handed as a list of state tensors (conv, ssm, ...:
    vLLM's GPU runner) as one entry each, `<layer>#<i>` (vLLM's CPU runner hands one byte view
    of the layer's whole state page instead)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in kv_caches.items():
        if isinstance(t, list | tuple):
            out.update((f"{name}#{i}", x) for i, x in enumerate(t))
        else:
            out[name] = t
    return out


def with_tensor_names(
    groups: tuple[GroupSpec, ...], tensors: Mapping[str, torch.Tensor]
) -> tuple[GroupSpec, ...]:
    """The groups with each layer named as its tensors are registered (`flat_tensors`)."""
    out = []
    for g in groups:
        names = tuple(
            n
            for layer in g.layers
            for n in ([layer] if layer in tensors else _parts_of(layer, tensors))
        )
        out.append(dataclasses.replace(g, layers=names))
    return tuple(out)


def _parts_of(layer: str, tensors: Mapping[str, torch.Tensor]) -> list[str]:
    parts = [n for n in tensors if n.startswith(layer + "#")]
    return sorted(parts, key=lambda n: int(n.rpartition("#")[2])) or [layer]


def kernel_page_format(vllm_config: VllmConfig, kv_caches: dict[str, torch.Tensor]) -> str:
    """The attention backends writing these pages, with the ISA where the kernel picks the
    in-page order by CPU (vLLM's CPU backend: `amx` or `vec`), e.g. `CPU_ATTN:amx`. vLLM sets
    a layer's `isa` when it builds the attention backend, before it registers the caches."""
    context = vllm_config.compilation_config.static_forward_context
    formats = set()
    for name in kv_caches:
        layer = context.get(name.partition("#")[0])
        backend = getattr(layer, "attn_backend", None)
        if backend is None:
            continue
        fmt = str(backend.get_name())
        isa = getattr(layer, "isa", None)
        formats.add(f"{fmt}:{isa}" if isa else fmt)
    return "+".join(sorted(formats))


def replicated_across_tp(kv_cache_config: KVCacheConfig | None, vllm_config: VllmConfig) -> bool:
    """Whether every TP rank holds the same KV bytes: each spec splits into one TP shard only
    (`max_tp_shards == 1`: MLA latents, the DSA indexer) and there is more than one rank."""
    if int(vllm_config.parallel_config.tensor_parallel_size) <= 1 or kv_cache_config is None:
        return False
    specs = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        specs.extend(getattr(spec, "kv_cache_specs", {}).values() or [spec])
    return bool(specs) and all(getattr(s, "max_tp_shards", None) == 1 for s in specs)


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
        kv_cache_config: KVCacheConfig | None = None,
        groups: tuple[GroupSpec, ...] | None = None,
    ) -> None:
        topo = resolve(vllm_config, rank=_replica_rank(vllm_config))
        self.groups = groups
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.rank = topo.rank
        self.block_size = block_size
        local_ranks = ranks_on_host(vllm_config)
        self.worker = build_worker(
            offload_spec(config, vllm_config, topo, run_dir, model_id),
            ranks_on_host=local_ranks,
            compute_cpus=compute_cpus(
                os.environ, is_cpu=current_platform.is_cpu(), ranks_on_host=local_ranks
            ),
            # rank 0 reports what its tiers hold for KV events (TP ranks mirror each other)
            report_changes=topo.rank == 0 and kv_events_enabled(vllm_config),
        )
        self.metrics = self.worker.metrics
        self.meta = OffloadMeta()
        self.report = WorkerReport(rank=topo.rank)
        # a hybrid model's loads in flight (op id -> request id): vLLM takes a failed one back
        # by request (failed_recving), never by block id (ids are per group)
        self._loads: dict[str, str] = {}
        self.failed_recving: set[str] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Build the rank's pages, codec, tiers and lookup server over vLLM's KV views."""
        desc = kv_description(
            kv_caches, self.vllm_config, self.kv_cache_config, self.block_size, self.groups
        )
        self.worker.register_kv_caches(desc)

    def handle_preemptions(self, meta: KVConnectorMetadata) -> None:
        """Cancel the in-flight saves of requests whose blocks vLLM takes back this step
        (called with the step's metadata before it is bound)."""
        if isinstance(meta, KVTierConnectorMetadata) and meta.data:
            decoded = messages.decode_meta(meta.data)
            if decoded.preempted or decoded.cancel_saves:
                self.worker.handle_preemptions(decoded.preempted, decoded.cancel_saves)

    def bind(self, meta: KVConnectorMetadata) -> None:
        """Decode this step's OffloadMeta."""
        if not isinstance(meta, KVTierConnectorMetadata):
            raise TypeError(
                f"connector metadata is {type(meta).__name__}, not KVTierConnectorMetadata; "
                "the scheduler and workers of one engine must all run KVTierConnector"
            )
        self.meta = decode_step_meta(meta.data)
        if self.groups:
            self._loads.update((op.op_id, op.req_id) for op in self.meta.loads)
        self.worker.begin_step()

    def clear(self) -> None:
        """Forget this step's OffloadMeta."""
        self.meta = OffloadMeta()

    def get_finished(self) -> tuple[set[str], set[str]]:
        """Take the rank's report; (finished_sending, finished_recving) request ids."""
        self.report = self.worker.take_report()
        self.failed_recving = set()
        if self.groups:
            for result in self.report.results:
                req_id = self._loads.pop(result.op_id, None)
                if req_id is not None and not result.ok:
                    self.failed_recving.add(req_id)
        return set(self.report.finished_sending), set(self.report.finished_recving)

    def load_error_blocks(self) -> set[int]:
        """Blocks of this step's failed loads for vLLM to recompute; none for a hybrid model,
        whose failed loads go back whole by request (`failed_recving`)."""
        return set() if self.groups else set(self.report.invalid_block_ids)

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
