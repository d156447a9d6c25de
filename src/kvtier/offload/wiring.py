"""One wiring for both hosts: the spec both connector halves of an engine are built from (as
vLLM's offloading connector hands one spec to both halves), the scheduler half's objects built
from it (metrics, the all-rank lookup client, the startup lookup self-test, the
`OffloadScheduler`) and each step's report handling, and a rank's `OffloadWorker`.

A host adapter computes the spec from its own configuration (where the lookup sockets live, the
topology, the model's identity) and keeps only the translation of its own types.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry

from kvtier.config import KVTierConfig
from kvtier.lookup import LookupClient, endpoint_for
from kvtier.metrics import MergedCollector, Metrics
from kvtier.offload import messages
from kvtier.offload.gil import apply_switch_interval
from kvtier.offload.groups import ChunkGroups
from kvtier.offload.messages import OffloadMeta, WorkerReport
from kvtier.offload.protocols import StepRequest
from kvtier.offload.scheduler import OffloadScheduler
from kvtier.offload.selftest import check_lookup
from kvtier.offload.worker import OffloadWorker
from kvtier.store import registry
from kvtier.topology import Topology, validate_lookup_scope

READY_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class OffloadSpec:
    """What both halves of one engine share: the config, the model's identity, the topology
    and the lookup endpoint of every rank of the engine replica (derived endpoints carry the
    run dir holding the replica's lookup key: `kvtier.lookup.LookupEndpoint`)."""

    config: KVTierConfig
    model_id: str
    topo: Topology
    endpoints: Mapping[int, str]

    def __post_init__(self) -> None:
        missing = sorted(set(range(self.topo.world)) - set(self.endpoints))
        if missing:
            raise ValueError(f"OffloadSpec has no lookup endpoint for ranks {missing}")

    @classmethod
    def derive(
        cls,
        config: KVTierConfig,
        model_id: str,
        topo: Topology,
        *,
        run_dir: str | Path,
        base_port: int | None,
    ) -> OffloadSpec:
        """The spec with every rank's lookup endpoint: an ipc socket in `run_dir`, or tcp on
        `base_port + rank`, as `config.lookup_transport` says (every half derives the same).
        Over either transport the replica's lookup key lives in `run_dir`: the first server or
        client built from these endpoints creates it, the others read it."""
        endpoints = {
            rank: endpoint_for(
                rank,
                transport=config.lookup_transport,
                run_dir=run_dir,
                host=config.lookup_bind_host,
                base_port=base_port,
                allow_remote_bind=config.allow_remote_bind,
            )
            for rank in range(topo.world)
        }
        return cls(config, model_id, topo, endpoints)


class SchedulerWiring:
    """The scheduler half's objects: its metrics (merged with every rank's snapshots), the
    lookup client over the lookup scope, checked ready (and looked up once with
    `config.self_test`), and the `OffloadScheduler`; a failure closes the client and raises."""

    def __init__(
        self,
        spec: OffloadSpec,
        *,
        block_size: int,
        bytes_per_token: int | None,
        loads: bool = True,
        saves: bool = True,
        ready_timeout_s: float = READY_TIMEOUT_S,
        groups: ChunkGroups | None = None,
    ) -> None:
        config, topo = spec.config, spec.topo
        apply_switch_interval(config, "scheduler")
        self.registry = CollectorRegistry()
        self.metrics = Metrics(rank="scheduler", registry=self.registry)
        self.collector = MergedCollector(self.registry)
        self.scope = validate_lookup_scope(config.lookup_scope, topo)
        self.metrics.set_lookup_scope(self.scope, topo.world)
        self.client = LookupClient(
            {r: spec.endpoints[r] for r in self.scope},
            self.metrics,
            chunk_size=config.chunk_size,
            timeout_ms=config.lookup_timeout_ms,
            world=topo.world,
            tier_order=registry.order(),
        )
        try:
            # every worker registered its caches (and started its lookup server) before the host
            # builds the scheduler half, so a silent rank here is a startup error, not a race
            self.client.wait_ready(timeout_s=ready_timeout_s)
            if config.self_test:
                check_lookup(self.client, self.scope)
            self.core = OffloadScheduler(
                config,
                self.client,
                model_id=spec.model_id,
                block_size=block_size,
                world=topo.world,
                metrics=self.metrics,
                bytes_per_token=bytes_per_token,
                loads=loads,
                saves=saves,
                groups=groups,
            )
        except BaseException:
            self.client.close()
            raise
        self._step_t0: float | None = None
        self._step_prefill = 0

    def build_meta(
        self, scheduled: Sequence[StepRequest], preempted: Iterable[str], prefill_tokens: int
    ) -> OffloadMeta:
        """The core's meta for this step; starts the clock that times the step's
        `prefill_tokens` (prompt tokens it computes) for the load gate."""
        meta = self.core.build_meta(scheduled, preempted)
        self._step_prefill = prefill_tokens
        self._step_t0 = time.perf_counter()
        return meta

    def step_reports(self, reports: Iterable[bytes]) -> list[WorkerReport]:
        """After the step: its prefill rate into the gate, each rank's report decoded, its
        metrics snapshot merged and its results fed to the quorum; the decoded reports."""
        if self._step_t0 is not None and self._step_prefill > 0:
            self.core.observe_prefill(self._step_prefill, time.perf_counter() - self._step_t0)
        self._step_t0 = None
        decoded: list[WorkerReport] = []
        for data in reports:
            if not data:
                continue
            # a report that cannot be read loses its rank's results of one step (their ops end
            # by their deadlines), never the engine
            report = self.core.guard.run(
                "update_connector_output", None, lambda data=data: self._decode(data), lambda: None
            )
            if report is not None:
                decoded.append(report)
        self.core.process_reports(decoded)
        return decoded

    def _decode(self, data: bytes) -> WorkerReport:
        report = messages.decode_report(data)
        if report.metrics:
            self.collector.update(f"rank{report.rank}", report.metrics)
        return report

    def close(self) -> None:
        """Close the lookup client."""
        self.client.close()


def build_worker(
    spec: OffloadSpec,
    *,
    ranks_on_host: int,
    report_changes: bool = False,
    compute_cpus: frozenset[int] | None = None,
) -> OffloadWorker:
    """The rank's `OffloadWorker` (its tiers, codec and lookup server come with the KV caches),
    counting on metrics of its own; `ranks_on_host` sizes the host-RAM check, `compute_cpus`
    are the cores the host bound its compute threads to (kept free of copy lanes)."""
    rank = spec.topo.rank
    # the GIL switch interval is the worker's to set when the KV caches register
    return OffloadWorker(
        spec.config,
        rank=rank,
        world=spec.topo.world,
        model_id=spec.model_id,
        metrics=Metrics(rank=rank, registry=CollectorRegistry()),
        lookup_endpoint=spec.endpoints[rank],
        ranks_on_host=ranks_on_host,
        report_changes=report_changes,
        compute_cpus=compute_cpus,
        tp_size=spec.topo.tp_size,
    )


def encode_step_meta(meta: OffloadMeta) -> bytes:
    """The step's meta as the bytes every rank decodes (b"" when there is nothing to do)."""
    return b"" if meta.is_empty() else messages.encode(meta)


def decode_step_meta(data: bytes) -> OffloadMeta:
    """A rank's view of the step's meta bytes (empty bytes: nothing to do)."""
    return messages.decode_meta(data) if data else OffloadMeta()
