"""The native engine's adapter to the offload core: both connector halves over kvtier.

The engine builds the scheduler half in its own process and one worker half in every TP rank
(`connector_spec()` gives the spec). The worker half owns the rank's `OffloadWorker` (tiers,
codec, lookup server); the scheduler half owns the `OffloadScheduler` and the all-rank
`LookupClient`, and runs the startup self-test once every rank is up.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from kvtier.config import KVTierConfig
from kvtier.identity import model_identity
from kvtier.lookup import LookupClient, endpoint_for, make_run_dir
from kvtier.metrics import MergedCollector, Metrics
from kvtier.native.connector import (
    UNSPECIFIED_SOURCE,
    ConnectorContext,
    ConnectorOutput,
    ConnectorRequest,
    ConnectorRole,
    ConnectorSpec,
)
from kvtier.native.scheduler import SchedulerOutput
from kvtier.offload import messages
from kvtier.offload.messages import OffloadMeta
from kvtier.offload.pages import KVCacheDescription
from kvtier.offload.protocols import StepRequest
from kvtier.offload.scheduler import OffloadScheduler
from kvtier.offload.selftest import check_lookup
from kvtier.offload.worker import OffloadWorker
from kvtier.topology import Topology, resolve, validate_lookup_scope

log = logging.getLogger("kvtier")

# kvtier's tier names -> vLLM's CacheHitSource values; a shared store has no vLLM name of its own
_SOURCE_OF_TIER = {"memory": "host", "disk": "disk", "remote": UNSPECIFIED_SOURCE}


def connector_spec(
    config: KVTierConfig, model_dir: str | Path, run_dir: str | Path | None = None
) -> ConnectorSpec:
    """The spec the native Engine takes to run kvtier; the run dir holds the lookup sockets."""
    if run_dir is None:
        run = make_run_dir()
    else:
        run = Path(run_dir)
        run.mkdir(mode=0o700, parents=True, exist_ok=True)
    return ConnectorSpec(
        "kvtier.native.offload:build",
        {
            "config": config.to_dict(secrets=True),
            "run_dir": str(run),
            "model_id": model_identity(model_dir, config.model_revision),
        },
    )


def build(role: ConnectorRole, context: ConnectorContext, **args: Any) -> Any:
    """Connector factory named by `connector_spec`."""
    config = KVTierConfig.from_dict(args["config"])
    topo = resolve({"tensor_parallel_size": context.tp_size}, rank=max(context.tp_rank, 0))
    if role is ConnectorRole.SCHEDULER:
        return SchedulerHalf(context, config, topo, args["run_dir"], args["model_id"])
    return WorkerHalf(context, config, topo, args["run_dir"], args["model_id"])


def _bytes_per_token(context: ConnectorContext) -> int:
    """K and V of every layer for one token on one rank."""
    itemsize = torch.empty(0, dtype=getattr(torch, context.dtype)).element_size()
    return 2 * context.num_layers * context.num_kv_heads_per_rank * context.head_dim * itemsize


def _endpoint(config: KVTierConfig, rank: int, run_dir: str) -> str:
    return endpoint_for(
        rank,
        transport=config.lookup_transport,
        run_dir=run_dir,
        host=config.lookup_bind_host,
        base_port=config.lookup_base_port,
        allow_remote_bind=config.allow_remote_bind,
    )


class SchedulerHalf:
    """Engine-process half: lookups, load/save decisions, terminals, merged metrics."""

    def __init__(
        self,
        context: ConnectorContext,
        config: KVTierConfig,
        topo: Topology,
        run_dir: str,
        model_id: str,
    ) -> None:
        self.config = config
        if context.max_model_len:
            config.check_max_model_len(context.max_model_len)
        self.registry = CollectorRegistry()
        self.metrics = Metrics(rank="scheduler", registry=self.registry)
        self.collector = MergedCollector(self.registry)
        scope = validate_lookup_scope(config.lookup_scope, topo)
        endpoints = {r: _endpoint(config, r, run_dir) for r in scope}
        self.metrics.set_lookup_scope(scope, topo.world)
        # the native engine always recomputes from a failed load's first bad block
        self.metrics.set_load_failure_policy(False)
        self.client = LookupClient(
            endpoints,
            self.metrics,
            chunk_size=config.chunk_size,
            timeout_ms=config.lookup_timeout_ms,
            world=topo.world,
        )
        try:
            self.client.wait_ready(timeout_s=30.0)
            if config.self_test:
                check_lookup(self.client, scope)
            self.core = OffloadScheduler(
                config,
                self.client,
                model_id=model_id,
                block_size=context.block_size,
                world=topo.world,
                metrics=self.metrics,
                bytes_per_token=_bytes_per_token(context),
            )
        except BaseException:
            self.client.close()
            raise
        self.scope = scope
        self._step_t0: float | None = None
        self._step_prefill = 0
        log.info("%s", config.describe())

    # ---- vLLM-named hooks ---------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        n = self.core.get_num_new_matched_tokens(request, num_computed_tokens)
        if n is None:
            return None, False  # not known yet: the engine asks again next step
        # a load predicted to take a small share of a step runs inside the forward (False)
        return (n, self.core.load_is_async(request.request_id)) if n > 0 else (0, False)

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        self.core.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadMeta:
        scheduled = [StepRequest(s.seq, s.computed_after_step) for s in scheduler_output.scheduled]
        preempted = scheduler_output.preempted_req_ids
        self._step_prefill = sum(
            min(s.computed_after_step, len(s.seq.prompt_token_ids)) - s.seq.num_computed_tokens
            for s in scheduler_output.scheduled
            if s.seq.num_computed_tokens < len(s.seq.prompt_token_ids)
        )
        self._step_t0 = time.perf_counter()
        return self.core.build_meta(scheduled, preempted)

    def encode_meta(self, meta: object) -> bytes:
        assert isinstance(meta, OffloadMeta)
        return b"" if meta.is_empty() else messages.encode(meta)

    def update_connector_output(self, output: ConnectorOutput) -> None:
        if self._step_t0 is not None and self._step_prefill > 0:
            self.core.observe_prefill(self._step_prefill, time.perf_counter() - self._step_t0)
        self._step_t0 = None
        reports = []
        for rank, data in enumerate(output.worker_meta):
            if not data:
                continue
            meta = messages.decode_report(data)
            if meta.metrics:
                self.collector.update(f"rank{rank}", meta.metrics)
            reports.append(meta)
        self.core.process_reports(reports)

    def get_external_cache_hit_sources(
        self, request: ConnectorRequest, num_external_tokens: int
    ) -> dict[str, int]:
        """The load's tokens under the tier its lookup found the run in (vLLM's CacheHitSource
        names)."""
        tier = self.core.hit_tier(request.request_id)
        return {_SOURCE_OF_TIER.get(tier, UNSPECIFIED_SOURCE): num_external_tokens}

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> bool:
        return self.core.request_finished(request)

    def request_preempted(self, request: ConnectorRequest) -> None:
        self.core.request_preempted(request)

    def shutdown(self) -> None:
        self.client.close()


class WorkerHalf:
    """Per-rank half: the rank's OffloadWorker behind the hook contract."""

    def __init__(
        self,
        context: ConnectorContext,
        config: KVTierConfig,
        topo: Topology,
        run_dir: str,
        model_id: str,
    ) -> None:
        self.rank = topo.rank
        self.context = context
        self.registry = CollectorRegistry()
        self.metrics = Metrics(rank=topo.rank, registry=self.registry)
        self.worker = OffloadWorker(
            config,
            rank=topo.rank,
            world=topo.world,
            model_id=model_id,
            metrics=self.metrics,
            lookup_endpoint=_endpoint(config, topo.rank, run_dir),
            # every TP rank of the native engine runs on this host
            ranks_on_host=topo.world,
        )
        self._meta = OffloadMeta()
        self._report = messages.WorkerReport(rank=topo.rank)

    def register_kv_caches(self, kv_caches: dict[str, Any], block_size: int) -> None:
        self.worker.register_kv_caches(
            KVCacheDescription(
                tensors=kv_caches,
                num_blocks=self.context.num_blocks,
                block_size=block_size,
                layout=f"native[{self.context.kv_layout}]",
            )
        )

    def decode_meta(self, data: bytes) -> OffloadMeta:
        return messages.decode_meta(data) if data else OffloadMeta()

    def bind_connector_metadata(self, meta: object) -> None:
        assert isinstance(meta, OffloadMeta)
        self._meta = meta
        self.worker.begin_step()

    def handle_preemptions(self, preempted_req_ids: set[str]) -> None:
        # a loading request is parked, never running, so only saves can touch these blocks
        self.worker.handle_preemptions(preempted_req_ids)

    def start_load_kv(self) -> None:
        self.worker.start_load_kv(self._meta)

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        self._report = self.worker.take_report()
        return set(self._report.finished_sending), set(self._report.finished_recving)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set(self._report.invalid_block_ids)

    def build_worker_meta(self) -> bytes:
        return self.worker.encode_report(self._report)

    def clear_connector_metadata(self) -> None:
        self._meta = OffloadMeta()

    def shutdown(self) -> None:
        self.worker.close()
