"""The native engine's adapter to the offload core: both connector halves over kvtier.

The engine builds the scheduler half in its own process and one worker half in every TP rank
(`connector_spec()` gives the spec). The worker half owns the rank's `OffloadWorker` (tiers,
codec, lookup server); the scheduler half owns the `OffloadScheduler` and the all-rank
`LookupClient`, and runs the startup self-test once every rank is up.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from kvtier.config import KVTierConfig
from kvtier.identity import model_identity
from kvtier.lookup import make_run_dir
from kvtier.native.connector import (
    ConnectorContext,
    ConnectorOutput,
    ConnectorRequest,
    ConnectorRole,
    ConnectorSpec,
)
from kvtier.native.sched_output import SchedulerOutput
from kvtier.offload import messages
from kvtier.offload.messages import OffloadMeta
from kvtier.offload.pages import KVCacheDescription
from kvtier.offload.protocols import StepRequest
from kvtier.offload.retention_api import run_admin
from kvtier.offload.wiring import (
    OffloadSpec,
    SchedulerWiring,
    build_worker,
    decode_step_meta,
    encode_step_meta,
)
from kvtier.store import registry
from kvtier.topology import resolve

log = logging.getLogger("kvtier")



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
    spec = OffloadSpec.derive(
        config, args["model_id"], topo, run_dir=args["run_dir"], base_port=config.lookup_base_port
    )
    if role is ConnectorRole.SCHEDULER:
        return SchedulerHalf(context, spec)
    return WorkerHalf(context, spec)


def _bytes_per_token(context: ConnectorContext) -> int:
    """K and V of every layer for one token on one rank."""
    itemsize = torch.empty(0, dtype=getattr(torch, context.dtype)).element_size()
    return 2 * context.num_layers * context.num_kv_heads_per_rank * context.head_dim * itemsize


class SchedulerHalf:
    """Engine-process half: lookups, load/save decisions, terminals, merged metrics."""

    def __init__(self, context: ConnectorContext, spec: OffloadSpec) -> None:
        self.config = spec.config
        if context.max_model_len:
            spec.config.check_max_model_len(context.max_model_len)
        self.wiring = SchedulerWiring(
            spec, block_size=context.block_size, bytes_per_token=_bytes_per_token(context)
        )
        self.metrics = self.wiring.metrics
        self.collector = self.wiring.collector
        self.client = self.wiring.client
        self.core = self.wiring.core
        self.scope = self.wiring.scope
        # the native engine always recomputes from a failed load's first bad block
        self.metrics.set_load_failure_policy(False)
        log.info("%s", spec.config.describe())

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
        prefill = sum(
            min(s.computed_after_step, len(s.seq.prompt_token_ids)) - s.seq.num_computed_tokens
            for s in scheduler_output.scheduled
            if s.seq.num_computed_tokens < len(s.seq.prompt_token_ids)
        )
        return self.wiring.build_meta(scheduled, preempted, prefill)

    def encode_meta(self, meta: object) -> bytes:
        assert isinstance(meta, OffloadMeta)
        return encode_step_meta(meta)

    def update_connector_output(self, output: ConnectorOutput) -> None:
        self.wiring.step_reports(output.worker_meta)

    def get_external_cache_hit_sources(
        self, request: ConnectorRequest, num_external_tokens: int
    ) -> dict[str, int]:
        """The load's tokens under the tier its lookup found the run in (vLLM's CacheHitSource
        names)."""
        tier = self.core.hit_tier(request.request_id)
        return {registry.hit_source(tier): num_external_tokens}

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> bool:
        return self.core.request_finished(request)

    def request_preempted(self, request: ConnectorRequest) -> None:
        # the core runs every other scheduler hook under its guard, not this one: an exception
        # here (a lease release, or a load the core still counts open because its rank's report
        # was lost) would end the engine loop. It costs the request its tier instead: no
        # lookup, load or save again (its saves in flight are cancelled by the ranks, which
        # get the preempted id in this step's meta)
        rid = request.request_id
        self.core.guard.run(
            "request_preempted",
            rid,
            lambda: self.core.request_preempted(request),
            lambda: self.core.quarantine(rid),
        )

    def retention_decision(self, req_id: str) -> dict[str, object] | None:
        """What the request's retention hint was granted (the response's usage extension)."""
        decision = self.core.planner.retention_decision(req_id)
        return None if decision is None else decision.as_dict()

    def retention_admin(self, op: str, **target: Any) -> dict[str, Any]:
        """Retain, release, prefetch or forget a prompt, a conversation or a tenant's
        conversations, or report retention stats (`offload.retention_api`)."""
        return run_admin(self.core.planner, op, **target)

    def shutdown(self) -> None:
        self.wiring.close()


class WorkerHalf:
    """Per-rank half: the rank's OffloadWorker behind the hook contract."""

    def __init__(self, context: ConnectorContext, spec: OffloadSpec) -> None:
        self.rank = spec.topo.rank
        self.context = context
        # every TP rank of the native engine runs on this host
        self.worker = build_worker(spec, ranks_on_host=spec.topo.world)
        self.metrics = self.worker.metrics
        self._meta = OffloadMeta()
        self._report = messages.WorkerReport(rank=self.rank)

    def register_kv_caches(self, kv_caches: dict[str, Any], block_size: int) -> None:
        self.worker.register_kv_caches(
            KVCacheDescription(
                tensors=kv_caches,
                num_blocks=self.context.num_blocks,
                block_size=block_size,
                layout=f"native[{self.context.kv_layout}]",
            )
        )
        # the engine's forward calls wait_for_layer_load before every layer, in this order
        self.worker.enable_layer_waves(list(kv_caches))

    def decode_meta(self, data: bytes) -> OffloadMeta:
        return decode_step_meta(data)

    def bind_connector_metadata(self, meta: object) -> None:
        assert isinstance(meta, OffloadMeta)
        self._meta = meta
        self.worker.begin_step()

    def handle_preemptions(self, preempted_req_ids: set[str]) -> None:
        # a loading request is parked, never running, so only saves can touch these blocks
        self.worker.handle_preemptions(preempted_req_ids)

    def start_load_kv(self) -> None:
        self.worker.start_load_kv(self._meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(layer_name)

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
