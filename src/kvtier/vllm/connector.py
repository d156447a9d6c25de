"""`KVTierConnector`: kvtier behind vLLM's prefix cache, as a vLLM v1 KV connector (both roles).

Load it with
`--kv-transfer-config '{"kv_connector": "KVTierConnector", "kv_connector_module_path":
"kvtier.vllm", "kv_role": "kv_both", "kv_connector_extra_config": {...}}'`; the extra config is
a `KVTierConfig` (over `KVTIER_*` variables and the `KVTIER_CONFIG` YAML file).

The scheduler role runs in vLLM's EngineCore and owns the `OffloadScheduler` plus the all-rank
`LookupClient`; each worker role owns its rank's `OffloadWorker` (tiers, codec, lookup server).
This module only adapts vLLM's types (`Request`, `KVCacheBlocks`, `SchedulerOutput`,
`KVConnectorOutput`, registered KV caches) to the core, the way `kvtier.native.offload` does
for the native engine. vLLM itself is not patched.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.identity import model_identity
from kvtier.offload.groups import STATE, GroupSpec
from kvtier.offload.scheduler import OffloadScheduler
from kvtier.offload.worker import OffloadWorker
from kvtier.vllm.groups import group_specs
from kvtier.vllm.metadata import KVTierConnectorMetadata, KVTierWorkerMetadata
from kvtier.vllm.rundir import remove_if_empty, run_dir_for, sweep_stale
from kvtier.vllm.scheduler_side import SchedulerSide
from kvtier.vllm.stats import KVTierPromMetrics, KVTierStats
from kvtier.vllm.worker_side import WorkerSide

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KVTierConnector"]

log = logging.getLogger("kvtier")

_RECOMPUTE = "recompute"


# ---- helpers ------------------------------------------------------------------------------------


def register_by_name(name: str, module: str, class_name: str) -> None:
    """Make an out-of-tree connector known to vLLM by name: a MultiConnector's stats path
    looks its children up by name only, and fails on one it does not know."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if name not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(name, module, class_name)


def _ensure_logging() -> None:
    """vLLM configures only its own "vllm" logger; give "kvtier" an INFO handler on stderr in
    every process vLLM spawns, unless the application already configured logging."""
    lg = logging.getLogger("kvtier")
    if lg.level == logging.NOTSET:
        lg.setLevel(logging.INFO)
    if not lg.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(
            logging.Formatter("%(levelname)s %(asctime)s [%(process)d] %(message)s")
        )
        lg.addHandler(handler)


def model_id_for(vllm_config: VllmConfig, config: KVTierConfig) -> str:
    """The namespace's model identity (`kvtier.identity`) of the weights vLLM serves: its
    local directory, or the Hugging Face cache snapshot a hub id resolved to, with vLLM's
    settings that change the KV without changing the files."""
    mc = vllm_config.model_config
    path = Path(mc.model)
    if not path.is_dir():
        path = _hub_snapshot(str(mc.model), mc.revision)
    return model_identity(path, config.model_revision, runtime_settings(vllm_config))


# vLLM 0.32 settings outside the weight files that change what the KV cache holds (KV scales
# come with the quantization config and the checkpoint, which the identity covers)
_KV_MODEL_SETTINGS = ("hf_overrides", "model_class_overrides", "quantization")
_KV_CACHE_SETTINGS = (
    "cache_dtype",
    "kv_cache_dtype_skip_layers",
    "mamba_cache_dtype",
    "mamba_ssm_cache_dtype",
)


def runtime_settings(vllm_config: VllmConfig) -> list[str]:
    """`name=value` of every vLLM setting outside the weight files that changes what the KV
    cache holds (`--hf-overrides` for rope scaling or head counts, the KV cache dtype and the
    layers it skips, state dtypes, class overrides, quantization): engines that differ in one
    never share a namespace."""
    out = []
    for section, names in (("model_config", _KV_MODEL_SETTINGS),
                           ("cache_config", _KV_CACHE_SETTINGS)):  # fmt: skip
        cfg = getattr(vllm_config, section, None)
        for name in names:
            value = getattr(cfg, name, None)
            if callable(value):
                value = f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', '?')}"
            out.append(f"{name}={json.dumps(value or None, sort_keys=True, default=repr)}")
    return out


def _hub_snapshot(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    if not isinstance(found, str):
        raise ConfigError(
            f"model {repo_id!r} (revision {revision or 'main'!r}) is neither a local directory "
            "nor in the Hugging Face cache, so kvtier cannot tell which weights it serves; "
            "download it first or pass its local directory"
        )
    return Path(found).parent


def _fitted_chunk(
    config: KVTierConfig,
    vllm_config: VllmConfig,
    groups: tuple[GroupSpec, ...] | None,
    chosen: bool = False,
) -> KVTierConfig:
    """The config with its default chunk fitted to vLLM's block (`fitted_to_block`; a chunk
    size the user `chosen` is kept), said once."""
    block = int(vllm_config.cache_config.block_size)
    states = any(g.kind == STATE for g in groups or ())
    fitted = config.fitted_to_block(block, states=states, chosen=chosen)
    if fitted is not config:
        why = (
            "a model with state layers keeps a state per block boundary, and kvtier stores one "
            "per chunk boundary"
            if states
            else f"vLLM's KV block size {block} does not divide the default chunk of "
            f"{config.chunk_size} tokens"
        )
        log.info(
            "kvtier: chunk_size=%d: %s (set chunk_size to a multiple of %d to choose another)",
            fitted.chunk_size, why, block,
        )  # fmt: skip
    return fitted


def _block_size(vllm_config: VllmConfig, config: KVTierConfig) -> int:
    block_size = int(vllm_config.cache_config.block_size)
    if config.chunk_size % block_size:
        fit = max(block_size, -(-config.chunk_size // block_size) * block_size)
        raise ConfigError(
            f"kvtier chunk_size={config.chunk_size} is not a multiple of vLLM's KV block size "
            f"{block_size}: set kv_connector_extra_config.chunk_size to a multiple of "
            f"{block_size} (e.g. {fit}), or change vLLM's --block-size to a divisor of "
            f"{config.chunk_size}"
        )
    return block_size


def _multiconnector_parent(vllm_config: VllmConfig) -> Any:
    """The KVTransferConfig of the MultiConnector building this connector, or None.

    vLLM hands a child a copy of the engine config holding only the child's own entry; the
    parent's entry is visible to the MultiConnector being constructed (a caller frame) and, in a
    worker, as the current config. vLLM's scheduler reads the parent's load-failure policy."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    frame = sys._getframe(1)
    for _ in range(16):
        if frame is None:
            break
        if isinstance(frame.f_locals.get("self"), MultiConnector):
            ktc = getattr(frame.f_locals.get("vllm_config"), "kv_transfer_config", None)
            if ktc is not None:
                return ktc
        frame = frame.f_back
    from vllm.config import get_current_vllm_config_or_none

    current = get_current_vllm_config_or_none()
    ktc = getattr(current, "kv_transfer_config", None)
    if ktc is not None and current is not vllm_config and ktc.kv_connector == "MultiConnector":
        return ktc
    return None


def _settle_load_failure_policy(ktc: Any, parent: Any) -> bool:
    """Make a failed tier load cost a recompute, never the request (invariant 9), or say
    exactly why it cannot: True when vLLM will fail requests on a failed tier load."""
    fix = f'"kv_load_failure_policy": "{_RECOMPUTE}"'
    if parent is not None:
        if parent.kv_load_failure_policy == _RECOMPUTE:
            log.info("kvtier: inside a MultiConnector whose kv_load_failure_policy is recompute")
            return False
        log.error(
            "kvtier: KVTierConnector runs inside a MultiConnector whose kv_load_failure_policy="
            "%r: vLLM reads the MultiConnector's policy, so a failed tier load FAILS its request. "
            "Set %s at the top level of the MultiConnector's --kv-transfer-config (next to "
            '"kv_connector": "MultiConnector"); a child connector cannot change it',
            parent.kv_load_failure_policy,
            fix,
        )
        return True
    if ktc.kv_load_failure_policy != _RECOMPUTE:
        # vLLM reads the policy right after building the scheduler-side connector
        log.warning(
            "kvtier: kv_load_failure_policy=%r changed to %r: a failed tier load is recomputed "
            "instead of failing the request (set %s in --kv-transfer-config to silence this)",
            ktc.kv_load_failure_policy,
            _RECOMPUTE,
            fix,
        )
        ktc.kv_load_failure_policy = _RECOMPUTE
    return False


# ---- the connector ----------------------------------------------------------------------------


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM v1 KV connector over kvtier's offload core; vLLM builds one per role and rank.

    It supports vLLM's hybrid memory allocator (`SupportsHMA`): full-attention and
    sliding-window groups are stored per chunk (`kvtier.vllm.groups`); any other group kind is
    refused at startup by name."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _ensure_logging()
        ktc = self._kv_transfer_config
        config = KVTierConfig.load(ktc.kv_connector_extra_config or {})
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if not config.enabled:
            self.config = config
            log.info("kvtier: offload off (enabled=false); KVTierConnector does nothing")
            return
        # a hybrid model's groups (None: one group, stored as before); what kvtier cannot
        # store yet stops startup here, by group, spec class, layers and reason
        self.groups = group_specs(kv_cache_config)
        chosen = "chunk_size" in KVTierConfig.given(ktc.kv_connector_extra_config or {})
        self.config = _fitted_chunk(config, vllm_config, self.groups, chosen)
        self.block_size = _block_size(vllm_config, self.config)
        dp_rank = int(vllm_config.parallel_config.data_parallel_rank or 0)
        self.run_dir = run_dir_for(str(ktc.engine_id), dp_rank, self.config.lookup_dir)
        self.config.check_max_model_len(int(vllm_config.model_config.max_model_len))
        model_id = model_id_for(vllm_config, self.config)
        if role == KVConnectorRole.SCHEDULER:
            # one sweep per engine start (the scheduler, not every rank): dead engines' sockets
            stale = sweep_stale(self.config.lookup_dir, keep=self.run_dir)
            if stale:
                log.info("kvtier: removed %d run dirs of engines that are gone", len(stale))
            fails_request = _settle_load_failure_policy(ktc, _multiconnector_parent(vllm_config))
            self._scheduler = SchedulerSide(
                vllm_config,
                self.config,
                self.run_dir,
                model_id,
                self.block_size,
                kv_cache_config,
                groups=self.groups,
            )
            self._scheduler.metrics.set_load_failure_policy(fails_request)
        else:
            self._worker = WorkerSide(
                vllm_config,
                self.config,
                self.run_dir,
                model_id,
                self.block_size,
                kv_cache_config,
                groups=self.groups,
            )

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """The cross-layer layout (one contiguous page per block for all layers: one copy per
        block), unless the config's preferred_kv_layout says otherwise; none on CPU, whose
        attention reads LBHNC only."""
        from vllm.platforms import current_platform

        ktc = vllm_config.kv_transfer_config
        config = KVTierConfig.load((ktc.kv_connector_extra_config if ktc else None) or {})
        if current_platform.is_cpu() or not config.preferred_kv_layout:
            return None
        return config.preferred_kv_layout

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a save dropped by preemption is only a future miss."""
        return False

    # ---- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Hand the rank's KV tensors to its OffloadWorker (copied whole and opaque per block)."""
        if self._worker is not None:
            self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Decode this step's OffloadMeta."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.bind(connector_metadata)

    def clear_connector_metadata(self) -> None:
        """Forget this step's OffloadMeta."""
        super().clear_connector_metadata()
        if self._worker is not None:
            self._worker.clear()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Cancel in-flight saves of the step's preempted requests before their blocks are
        reused (saves run off the forward path)."""
        if self._worker is not None:
            self._worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Finish this step's synchronous loads (vLLM calls this before the forward when the
        step has any) and queue its asynchronous ones on the rank's load lane."""
        if self._worker is not None:
            self._worker.worker.start_load_kv(self._worker.meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: synchronous loads are complete when start_load_kv returns, and
        asynchronous ones target parked requests, never this forward's."""
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Nothing per layer: whole blocks of every layer are packed in `wait_for_save`."""
        return

    def wait_for_save(self) -> None:
        """Queue this step's finished chunks for the save lane; returns without waiting for
        their copies (they report through get_finished / the worker metadata)."""
        if self._worker is not None:
            self._worker.worker.wait_for_save(self._worker.meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(delayed frees now safe, loads finished ok or failed) on this rank."""
        if self._worker is None:
            return None, None
        return self._worker.get_finished()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """`get_finished`, plus the requests whose load failed on this rank when the model is
        hybrid (vLLM recomputes them whole: its block ids are per group)."""
        sending, recving = self.get_finished(finished_req_ids)
        failed = set() if self._worker is None else set(self._worker.failed_recving)
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()),
            failed_recving=failed,
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of failed loads, reported with their request's finished_recving (none for a
        hybrid model: `get_transfer_results` names its failed requests instead)."""
        if self._worker is None:
            return set()
        return self._worker.load_error_blocks()

    def build_connector_worker_meta(self) -> KVTierWorkerMetadata | None:
        """This rank's op results (and a metrics snapshot) for the scheduler's quorum."""
        if self._worker is None:
            return None
        data = self._worker.encoded_report()
        return KVTierWorkerMetadata([data]) if data else None

    def shutdown(self) -> None:
        """Close the rank's worker, or the scheduler's lookup client."""
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None
        if self._scheduler is not None:
            self._scheduler.shutdown()
            self._scheduler = None
        if self.config.enabled:
            remove_if_empty(self.run_dir)

    # ---- scheduler side -------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """(tokens beyond vLLM's local hit that the tier loads, load_async); 0 = none."""
        if self._scheduler is None:
            return 0, False
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        """The tokens by the tier the lookup found them in (host, disk, external_unspecified)."""
        if self._scheduler is None:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return self._scheduler.get_external_cache_hit_sources(request, num_external_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Record the blocks vLLM allocated for a promised load (or withdraw it)."""
        if self._scheduler is not None:
            self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's loads, saves and delayed frees for every worker."""
        if self._scheduler is None:
            return KVTierConnectorMetadata()
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Feed every rank's report to the core's quorum."""
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """True while the request's saves await their terminal (freed via finished_sending)."""
        if self._scheduler is None:
            return False, None
        delay = self._scheduler.request_finished(request)
        return delay, self._scheduler.retention_params(request.request_id)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """HMA's request end (every group's blocks): True while the request's saves await
        their terminal; vLLM then holds every group's blocks until finished_sending."""
        if self._scheduler is None:
            return False, None
        delay = self._scheduler.request_finished(request)
        return delay, self._scheduler.retention_params(request.request_id)

    # ---- metrics on vLLM's /metrics ---------------------------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Scheduler role: what changed in every rank's kvtier metrics since the last step."""
        if self._scheduler is None:
            return None
        return self._scheduler.take_stats()

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        """vLLM's frontend rebuilds the stats it received (for its periodic log line)."""
        return KVTierStats(data=data if data is not None else {"c": {}, "g": {}})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        """`kvtier_*` families on vLLM's /metrics, fed from the scheduler's stats."""
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def reset_cache(self) -> bool:
        """vLLM's cache reset (pause, sleep, weight update): a new namespace epoch makes every
        chunk stored before unreachable; the tiers free their space by eviction."""
        if self._scheduler is not None:
            self._scheduler.reset()
        return True

    def take_events(self) -> Iterable[KVCacheEvent]:
        """What kvtier's tiers stored and dropped, as vLLM KV-cache events (CPU / STORAGE)."""
        return [] if self._scheduler is None else self._scheduler.take_events()

    @property
    def offload_scheduler(self) -> OffloadScheduler | None:
        """The core scheduler (scheduler role only), for diagnostics and tests."""
        return None if self._scheduler is None else self._scheduler.core

    @property
    def offload_worker(self) -> OffloadWorker | None:
        """This rank's OffloadWorker (worker role only), for diagnostics and tests."""
        return None if self._worker is None else self._worker.worker


register_by_name("KVTierConnector", "kvtier.vllm.connector", "KVTierConnector")
