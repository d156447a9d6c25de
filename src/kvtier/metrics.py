"""Prometheus families for kvtier (`kvtier_` prefix), labelled by rank and, where it applies, tier.

One `Metrics` object per rank binds the rank label; several may share one registry (a bench that
runs four rank servers in one process). Families are created once per registry.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

_LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
# per-step costs: a hook's share of a step lies between ten microseconds and the step itself
_STEP_BUCKETS = (
    0.00001,
    0.000025,
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)
# engine steps a request waited parked per load (0 = loaded inside the forward of its step)
_STEP_COUNT_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
# measured over predicted: 2x either way is where a prediction counts as missed
_RATIO_BUCKETS = (0.125, 0.25, 0.5, 0.8, 1.0, 1.25, 2.0, 4.0, 8.0, 16.0)


@dataclass(frozen=True)
class _Families:
    lookups: Counter
    cold_lookups: Counter
    lookup_hit_tokens: Counter
    lookup_timeouts: Counter
    retrieved_tokens: Counter
    retrieved_bytes: Counter
    readmitted_retrieved_tokens: Counter
    prefetched_chunks: Counter
    stored_tokens: Counter
    stored_bytes: Counter
    state_parts_stored: Counter
    state_parts_loaded: Counter
    load_failures: Counter
    save_failures: Counter
    skipped_loads: Counter
    lease_releases: Counter
    lease_expiries: Counter
    lease_double_releases: Counter
    verify_failures: Counter
    tier_hits: Counter
    tier_residency_bytes: Gauge
    tier_capacity_bytes: Gauge
    evictions: Counter
    store_failures: Counter
    tier_full: Counter
    dropped_writes: Counter
    slot_waits: Counter
    rejected_frames: Counter
    dropped_tier_changes: Counter
    breaker_open: Gauge
    writes_refused_seconds: Gauge
    queue_depth: Gauge
    lookup_scope: Gauge
    world_size: Gauge
    state_groups: Gauge
    load_failure_fails_request: Gauge
    lookup_seconds: Histogram
    load_seconds: Histogram
    save_seconds: Histogram
    scheduler_lookup_seconds: Histogram
    hook_seconds: Histogram
    hook_cpu_seconds: Counter
    lane_cpu_seconds: Counter
    transfer_chunks: Counter
    step_seconds: Histogram
    load_parked_steps: Histogram
    sync_loads: Counter
    hook_errors: Counter
    admission: Counter
    admission_returns: Counter
    admission_pressure: Gauge
    admission_rejected_roomy: Counter
    retention: Counter
    retained_chunks: Gauge
    retention_displaced: Counter
    load_decisions: Counter
    load_decision_tokens: Counter
    load_predicted_seconds: Histogram
    load_prediction_ratio: Histogram
    load_mispredictions: Counter
    load_misprediction_share: Gauge
    load_speed_shifts: Counter


def _build(reg: CollectorRegistry) -> _Families:
    make = _Makers(reg)
    return _Families(
        **_store_families(make.c, make.g, make.h),
        **_timing_families(make.c, make.g, make.h),
        **_policy_families(make.c, make.g, make.h),
    )


class _Makers:
    """A family of each kind, named `kvtier_<name>` with a `rank` label first, in `reg`."""

    def __init__(self, reg: CollectorRegistry) -> None:
        self.reg = reg

    def c(self, name: str, doc: str, *labels: str) -> Counter:
        return Counter(f"kvtier_{name}", doc, ("rank", *labels), registry=self.reg)

    def g(self, name: str, doc: str, *labels: str) -> Gauge:
        return Gauge(f"kvtier_{name}", doc, ("rank", *labels), registry=self.reg)

    def h(
        self,
        name: str,
        doc: str,
        *labels: str,
        buckets: tuple[float, ...] = _LATENCY_BUCKETS,
    ) -> Histogram:
        return Histogram(
            f"kvtier_{name}", doc, ("rank", *labels), registry=self.reg, buckets=buckets
        )


def _store_families(
    c: Callable[..., Counter], g: Callable[..., Gauge], h: Callable[..., Histogram]
) -> dict[str, Any]:
    """Counters and gauges of lookups, loads, saves and the tiers."""
    return dict(
        lookups=c("lookups", "Lookups answered (server) or sent (client)."),
        cold_lookups=c(
            "cold_lookups",
            "Lookups the scheduler answered 0 without asking the ranks: the prompt's first chunk "
            "was never saved by this engine (memory-only tiers).",
        ),
        lookup_hit_tokens=c("lookup_hit_tokens", "Tokens found in the tier by lookups."),
        lookup_timeouts=c("lookup_timeouts", "Rank lookups that missed the deadline.", "target"),
        retrieved_tokens=c("retrieved_tokens", "Tokens loaded from the tier into KV blocks."),
        retrieved_bytes=c("retrieved_bytes", "Bytes loaded from the tier into KV blocks."),
        prefetched_chunks=c(
            "prefetched_chunks",
            "Chunks a prefetch brought from disk or the shared store into host memory.",
        ),
        readmitted_retrieved_tokens=c(
            "readmitted_retrieved_tokens",
            "Of the retrieved tokens, those of requests admitted again after a preemption "
            "(vLLM counts those admissions apart from its external prefix-cache hits).",
        ),
        stored_tokens=c("stored_tokens", "Tokens saved into the tier."),
        stored_bytes=c("stored_bytes", "Bytes saved into the tier."),
        state_parts_stored=c(
            "state_parts_stored",
            "Parts of boundary-state records (a hybrid model's Mamba / linear-attention states) "
            "saved into the tier.",
        ),
        state_parts_loaded=c(
            "state_parts_loaded",
            "Parts of boundary-state records read back into a hybrid model's state blocks.",
        ),
        load_failures=c("load_failures", "Loads that failed, by reason.", "reason"),
        save_failures=c("save_failures", "Saves that failed, by reason.", "reason"),
        skipped_loads=c("skipped_loads", "Tier hits not loaded, by reason.", "reason"),
        lease_releases=c("lease_releases", "Leases released."),
        lease_expiries=c("lease_expiries", "Leases that expired before release."),
        lease_double_releases=c(
            "lease_double_releases", "Releases of a lease not held (counted no-ops)."
        ),
        verify_failures=c("verify_failures", "Records that failed verification.", "tier", "reason"),
        tier_hits=c("tier_hits", "Chunks served by each tier.", "tier"),
        tier_residency_bytes=g("tier_residency_bytes", "Bytes resident per tier.", "tier"),
        tier_capacity_bytes=g("tier_capacity_bytes", "Byte budget per tier.", "tier"),
        evictions=c("evictions", "Chunks evicted per tier.", "tier"),
        store_failures=c("store_failures", "Tier writes that failed, by reason.", "tier", "reason"),
        tier_full=c(
            "tier_full",
            "Writes that found the tier's filesystem full; the tier lowered its budget, "
            "evicted and retried.",
            "tier",
        ),
        dropped_writes=c(
            "dropped_writes", "Write-behind chunks dropped, by reason.", "tier", "reason"
        ),
        slot_waits=c(
            "slot_waits",
            "Saves that found every memory slot pinned while chunks were still being written "
            "below, and waited for the write-behind: outcome slot (got one) or none "
            "(write_wait_ms passed, or no write was left to unpin one).",
            "outcome",
        ),
        rejected_frames=c("rejected_frames", "Malformed or oversized frames rejected.", "reason"),
        dropped_tier_changes=c(
            "dropped_tier_changes",
            "Tier stores/evictions not reported as KV events (the rank's bounded buffer was full).",
        ),
        breaker_open=g("breaker_open", "1 while a tier's circuit breaker is open.", "tier"),
        writes_refused_seconds=g(
            "tier_writes_refused_seconds",
            "How long a tier has refused every write (a full store at maxmemory-policy "
            "noeviction, a read-only replica, missing permissions), as of its last refusal; "
            "0 once a write is accepted.",
            "tier",
        ),
        queue_depth=g("queue_depth", "Items waiting per queue.", "queue"),
        lookup_scope=g(
            "lookup_scope", "1 for each rank the scheduler's lookup client asks.", "target"
        ),
        world_size=g("world_size", "Ranks of this engine replica (TP x PP)."),
        state_groups=g(
            "state_groups",
            "KV cache groups whose state at a chunk boundary is a record of its own (Mamba, "
            "gated delta net); 0 for a model with attention groups only.",
        ),
        load_failure_fails_request=g(
            "load_failure_fails_request",
            "1 when the host fails a request whose tier load failed instead of recomputing it "
            "(vLLM: a MultiConnector parent without kv_load_failure_policy=recompute).",
        ),
    )


def _timing_families(
    c: Callable[..., Counter], g: Callable[..., Gauge], h: Callable[..., Histogram]
) -> dict[str, Any]:
    """Latencies, step timings and the load gate's families."""
    return dict(
        lookup_seconds=h("lookup_seconds", "Lookup latency."),
        load_seconds=h("load_seconds", "Load latency."),
        save_seconds=h("save_seconds", "Save latency."),
        scheduler_lookup_seconds=h(
            "scheduler_lookup_seconds",
            "Time the engine's scheduler loop waited on lookups, per call (lookups in flight "
            "are polled again next step instead of blocking it).",
        ),
        hook_seconds=h(
            "hook_seconds",
            "Time spent in one kvtier hook (lookup, meta, reports, stats, load, save, report), "
            "summed per engine step in which it ran.",
            "hook",
            buckets=_STEP_BUCKETS,
        ),
        hook_cpu_seconds=c(
            "hook_cpu_seconds",
            "CPU time of the thread running a kvtier hook, summed over its calls; the hook's "
            "wall time (kvtier_hook_seconds) less this is time it waited for the GIL or a core.",
            "hook",
        ),
        lane_cpu_seconds=c(
            "lane_cpu_seconds",
            "CPU time a rank's copy lane (load, save) spent running transfer jobs.",
            "lane",
        ),
        transfer_chunks=c(
            "transfer_chunks",
            "Chunks a rank moved between its KV cache and host memory, by direction (save, "
            "load) and path: dma = 2-D copies on the copy engine, no kernel; kernel = a gather "
            "or scatter kernel and a staging buffer (fragmented block ids); host = the KV cache "
            "is host memory.",
            "lane",
            "path",
        ),
        step_seconds=h(
            "step_seconds",
            "One engine step on this rank, from the step's metadata to its report (the "
            "forward and every kvtier hook inside it).",
            buckets=_STEP_BUCKETS,
        ),
        load_parked_steps=h(
            "load_parked_steps",
            "Engine steps a request waited parked per load (0 = loaded inside its step's forward).",
            buckets=_STEP_COUNT_BUCKETS,
        ),
        sync_loads=c("sync_loads", "Loads finished inside the forward of their step."),
        hook_errors=c(
            "hook_errors",
            "Exceptions raised inside a kvtier hook, by hook: each cost its request a tier hit "
            "(or its rank the tier), never the engine.",
            "hook",
        ),
        admission=c(
            "admission",
            "Chunks the scheduler's admission policy decided (those past the tier's hit), by "
            "decision: admitted, rejected (never written), forced (a save the host needs).",
            "decision",
        ),
        admission_returns=c(
            "admission_returns",
            "Decided chunks that came back in a later prompt needing the tier, by the decision "
            "made for them; rejected ones are hits the policy gave up.",
            "decision",
        ),
        admission_rejected_roomy=c(
            "admission_rejected_with_room",
            "Chunks the admission policy rejected while the tiers had room for them, that came "
            "back needing the tier: hits lost to a rejection nothing required (a defect: kvtier "
            "doctor fails on it).",
        ),
        admission_pressure=g(
            "admission_pressure",
            "Share of the admitted chunks that came back needing the tier and were gone from it "
            "(0: the tier keeps what returns).",
        ),
    )


def _policy_families(
    c: Callable[..., Counter], g: Callable[..., Gauge], h: Callable[..., Histogram]
) -> dict[str, Any]:
    """Retention, admission and the cost model's families."""
    return dict(
        retention=c(
            "retention",
            "Clients' retention hints by what the budget granted: retained, clipped (the "
            "leading chunks or a shorter TTL), rejected.",
            "status",
        ),
        retention_displaced=c(
            "retention_displaced_chunks",
            "Retained chunks whose room a hint due back sooner took (retention_full: soonest).",
        ),
        retained_chunks=g(
            "retained_chunks",
            "Chunks clients' hints retain now (the scheduler's ledger, within retention_budget).",
        ),
        load_decisions=c(
            "load_decisions",
            "Runs of tier hits by what the load policy decided: load, recompute (predicted "
            "slower than the prefill it replaces), probe (a turned-away tier read to keep its "
            "measured speed current).",
            "decision",
            "tier",
        ),
        load_decision_tokens=c(
            "load_decision_tokens",
            "Tokens of tier hits by what the load policy decided (see load_decisions).",
            "decision",
            "tier",
        ),
        load_predicted_seconds=h(
            "load_predicted_seconds", "The cost model's predicted time of each load it chose."
        ),
        load_prediction_ratio=h(
            "load_prediction_ratio",
            "Each finished load's measured over predicted time (1 = exact).",
            buckets=_RATIO_BUCKETS,
        ),
        load_mispredictions=c(
            "load_mispredictions",
            "Loads whose measured time was off the prediction by more than 2x.",
        ),
        load_misprediction_share=g(
            "load_misprediction_share",
            "Recent share of loads off their prediction by more than 2x (kvtier doctor warns "
            "above 0.5).",
        ),
        load_speed_shifts=c(
            "load_speed_shifts",
            "Times a tier's read model dropped most of its past because two reads in a row "
            "were over 1.5x off its prediction on the same side (the tier's speed changed).",
            "tier",
        ),
    )


_families: weakref.WeakKeyDictionary[CollectorRegistry, _Families] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def families(registry: CollectorRegistry) -> _Families:
    """The kvtier families registered in `registry`, created on first use."""
    with _lock:
        fam = _families.get(registry)
        if fam is None:
            fam = _families[registry] = _build(registry)
        return fam


def counter_labels() -> dict[str, tuple[str, ...]]:
    """Every kvtier counter's sample name (`..._total`) and label names, for hosts that must
    export the families before their first increment."""
    fams = _build(CollectorRegistry())
    return {
        f"{c._name}_total": tuple(c._labelnames)  # prometheus_client keeps both on the family
        for c in vars(fams).values()
        if isinstance(c, Counter)
    }


def gauge_labels() -> dict[str, tuple[str, ...]]:
    """Every kvtier gauge's name and label names (declared by hosts before their first set)."""
    fams = _build(CollectorRegistry())
    return {g._name: tuple(g._labelnames) for g in vars(fams).values() if isinstance(g, Gauge)}


class Metrics:
    """The kvtier metrics of one rank. Attributes are rank-bound children; methods add labels."""

    def __init__(self, rank: int | str = 0, registry: CollectorRegistry | None = None) -> None:
        self.rank = rank
        self.registry = registry if registry is not None else CollectorRegistry()
        self.f = families(self.registry)
        # (family, label values) -> child: prometheus_client's `labels()` validates and locks
        # on every call, several microseconds each time a copy lane counts a chunk
        self._children: dict[tuple[object, tuple[str, ...]], Any] = {}
        r = str(rank)
        f = self.f
        self.lookups = f.lookups.labels(r)
        self.cold_lookups = f.cold_lookups.labels(r)
        self.lookup_hit_tokens = f.lookup_hit_tokens.labels(r)
        self.retrieved_tokens = f.retrieved_tokens.labels(r)
        self.retrieved_bytes = f.retrieved_bytes.labels(r)
        self.readmitted_retrieved_tokens = f.readmitted_retrieved_tokens.labels(r)
        self.prefetched_chunks = f.prefetched_chunks.labels(r)
        self.admission_pressure = f.admission_pressure.labels(r)
        self.admission_rejected_roomy = f.admission_rejected_roomy.labels(r)
        self.retained_chunks = f.retained_chunks.labels(r)
        self.retention_displaced = f.retention_displaced.labels(r)
        self.stored_tokens = f.stored_tokens.labels(r)
        self.stored_bytes = f.stored_bytes.labels(r)
        self.state_parts_stored = f.state_parts_stored.labels(r)
        self.state_parts_loaded = f.state_parts_loaded.labels(r)
        self.lease_releases = f.lease_releases.labels(r)
        self.lease_expiries = f.lease_expiries.labels(r)
        self.lease_double_releases = f.lease_double_releases.labels(r)
        self.lookup_seconds = f.lookup_seconds.labels(r)
        self.scheduler_lookup_seconds = f.scheduler_lookup_seconds.labels(r)
        self.load_seconds = f.load_seconds.labels(r)
        self.save_seconds = f.save_seconds.labels(r)
        self.dropped_tier_changes = f.dropped_tier_changes.labels(r)
        self.step_seconds = f.step_seconds.labels(r)
        self.load_parked_steps = f.load_parked_steps.labels(r)
        self.sync_loads = f.sync_loads.labels(r)
        self.load_predicted_seconds = f.load_predicted_seconds.labels(r)
        self.load_prediction_ratio = f.load_prediction_ratio.labels(r)
        self.load_mispredictions = f.load_mispredictions.labels(r)
        self.load_misprediction_share = f.load_misprediction_share.labels(r)

    def _child(self, family: Any, *values: str) -> Any:
        """`family`'s child for this rank and `values`, made once."""
        key = (family, values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = family.labels(str(self.rank), *values)
        return child

    def hook(self, name: str) -> Histogram:
        return self._child(self.f.hook_seconds, name)

    def hook_cpu(self, name: str) -> Counter:
        return self._child(self.f.hook_cpu_seconds, name)

    def hook_error(self, hook: str) -> Counter:
        return self._child(self.f.hook_errors, hook)

    def lane_cpu(self, lane: str) -> Counter:
        return self._child(self.f.lane_cpu_seconds, lane)

    def transfer_chunk(self, lane: str, path: str) -> Counter:
        return self._child(self.f.transfer_chunks, lane, path)

    def lookup_timeout(self, target: int) -> Counter:
        return self._child(self.f.lookup_timeouts, str(target))

    def load_failure(self, reason: str) -> Counter:
        return self._child(self.f.load_failures, reason)

    def save_failure(self, reason: str) -> Counter:
        return self._child(self.f.save_failures, reason)

    def admission(self, decision: str) -> Counter:
        return self._child(self.f.admission, decision)

    def retention(self, status: str) -> Counter:
        return self._child(self.f.retention, status)

    def admission_return(self, decision: str) -> Counter:
        return self._child(self.f.admission_returns, decision)

    def load_decision(self, decision: str, tier: str) -> Counter:
        return self._child(self.f.load_decisions, decision, tier)

    def load_decision_tokens(self, decision: str, tier: str) -> Counter:
        return self._child(self.f.load_decision_tokens, decision, tier)

    def load_speed_shift(self, tier: str) -> Counter:
        return self._child(self.f.load_speed_shifts, tier)

    def skipped_load(self, reason: str) -> Counter:
        return self._child(self.f.skipped_loads, reason)

    def verify_failure(self, tier: str, reason: str) -> Counter:
        return self._child(self.f.verify_failures, tier, reason)

    def tier_hit(self, tier: str) -> Counter:
        return self._child(self.f.tier_hits, tier)

    def residency(self, tier: str) -> Gauge:
        return self._child(self.f.tier_residency_bytes, tier)

    def capacity(self, tier: str) -> Gauge:
        return self._child(self.f.tier_capacity_bytes, tier)

    def eviction(self, tier: str) -> Counter:
        return self._child(self.f.evictions, tier)

    def store_failure(self, tier: str, reason: str) -> Counter:
        return self._child(self.f.store_failures, tier, reason)

    def tier_full(self, tier: str) -> Counter:
        return self._child(self.f.tier_full, tier)

    def dropped_write(self, tier: str, reason: str) -> Counter:
        return self._child(self.f.dropped_writes, tier, reason)

    def slot_wait(self, outcome: str) -> Counter:
        return self._child(self.f.slot_waits, outcome)

    def rejected_frame(self, reason: str) -> Counter:
        return self._child(self.f.rejected_frames, reason)

    def breaker(self, tier: str) -> Gauge:
        return self._child(self.f.breaker_open, tier)

    def writes_refused(self, tier: str) -> Gauge:
        return self._child(self.f.writes_refused_seconds, tier)

    def queue(self, name: str) -> Gauge:
        return self._child(self.f.queue_depth, name)

    def set_load_failure_policy(self, fails_request: bool) -> None:
        """Export whether a failed tier load fails its request on this host (doctor FAILs it)."""
        self.f.load_failure_fails_request.labels(str(self.rank)).set(1 if fails_request else 0)

    def set_state_groups(self, n: int) -> None:
        """Export how many state groups the model has (doctor holds them against the states
        the tier stored)."""
        self.f.state_groups.labels(str(self.rank)).set(n)

    def set_lookup_scope(self, ranks: Sequence[int], world: int) -> None:
        """Export which ranks the lookup client covers, so a cut scope is visible in /metrics."""
        self.f.world_size.labels(str(self.rank)).set(world)
        for r in range(world):
            self.f.lookup_scope.labels(str(self.rank), str(r)).set(1 if r in ranks else 0)

    def value(self, name: str, **labels: str) -> float:
        """Current value of `kvtier_<name>` for this rank (0.0 when never touched); for tests."""
        got = self.registry.get_sample_value(f"kvtier_{name}", {"rank": str(self.rank), **labels})
        return 0.0 if got is None else got

    def total(self, name: str, **labels: str) -> float:
        """Sum of `kvtier_<name>` for this rank over every value of the labels not given."""
        total = 0.0
        for metric in self.registry.collect():
            for s in metric.samples:
                if s.name != f"kvtier_{name}" or s.labels.get("rank") != str(self.rank):
                    continue
                if all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
        return total


class SampleSnapshot(msgspec.Struct, frozen=True, array_like=True):
    """One sample of a family."""

    name: str
    labels: dict[str, str]
    value: float


class FamilySnapshot(msgspec.Struct, frozen=True, array_like=True):
    """One metric family as collected in another process."""

    name: str
    type: str
    documentation: str
    samples: list[SampleSnapshot]


_snap_encoder = msgspec.msgpack.Encoder()
_snap_decoder = msgspec.msgpack.Decoder(list[FamilySnapshot])


def snapshot(registry: CollectorRegistry) -> bytes:
    """kvtier's families of `registry` (a rank's registry holds nothing else) as msgpack bytes,
    to ship to the process that serves /metrics; `_created` timestamps are left out."""
    return _snap_encoder.encode([_family_snapshot(f) for f in vars(families(registry)).values()])


# A rank ships a snapshot with its report once a second, and whenever it turns idle with news,
# which under steady load is every few steps; prometheus_client's collect() formats every
# histogram bucket's `le` label anew each time (a millisecond a snapshot on the dev VM, most of
# the rank's report hook), so the samples are read from the families' values directly, with
# the bucket labels formatted once. `test_the_fast_snapshot_equals_prometheus_collect` holds it
# to collect()'s output.
_LE: dict[tuple[float, ...], tuple[str, ...]] = {}


def _family_snapshot(family: Counter | Gauge | Histogram) -> FamilySnapshot:
    name, labelnames = family._name, family._labelnames
    with family._lock:
        children = list(family._metrics.items())
    samples: list[SampleSnapshot] = []
    if isinstance(family, Histogram):
        kind = "histogram"
        for values, child in children:
            labels = dict(zip(labelnames, values, strict=True))
            bounds = tuple(child._upper_bounds)
            les = _LE.get(bounds)
            if les is None:
                les = _LE[bounds] = tuple(floatToGoString(b) for b in bounds)
            acc = 0.0
            for le, bucket in zip(les, child._buckets, strict=True):
                acc += bucket.get()
                samples.append(SampleSnapshot(f"{name}_bucket", {**labels, "le": le}, acc))
            samples.append(SampleSnapshot(f"{name}_count", labels, acc))
            samples.append(SampleSnapshot(f"{name}_sum", labels, child._sum.get()))
    else:
        kind = "counter" if isinstance(family, Counter) else "gauge"
        sample = f"{name}_total" if kind == "counter" else name
        for values, child in children:
            labels = dict(zip(labelnames, values, strict=True))
            samples.append(SampleSnapshot(sample, labels, float(child._value.get())))
    return FamilySnapshot(name, kind, family._documentation, samples)


class MergedCollector(Collector):
    """Serves kvtier's families of local registries plus the latest snapshot of each remote
    process, merged by family name (ranks differ by their `rank` label, so samples never
    collide); `_created` timestamps are left out."""

    def __init__(self, *registries: CollectorRegistry) -> None:
        self._registries = registries
        self._remote: dict[str, list[FamilySnapshot]] = {}
        self._lock = threading.Lock()

    def update(self, source: str, data: bytes) -> None:
        """Replace the snapshot from `source` (e.g. "rank1")."""
        fams = _snap_decoder.decode(data)
        with self._lock:
            self._remote[source] = fams

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        # the scheduler walks this once a second while requests are live: the same direct read
        # of the families as a rank's snapshot
        local = [
            _family_snapshot(f) for reg in self._registries for f in vars(families(reg)).values()
        ]
        with self._lock:
            remote = [f for fams in self._remote.values() for f in fams]
        for f in (*local, *remote):
            metric = merged.setdefault(f.name, Metric(f.name, f.documentation, f.type))
            metric.samples.extend(Sample(s.name, s.labels, s.value) for s in f.samples)
        yield from merged.values()
