"""Reading a server's Prometheus `/metrics`: vLLM's and kvtier's sample names, a parsed sample
set with totals, per-label sums and deltas, the counters of one window and the identities those
counters keep on a drained server.

The one reader `kvtier doctor` and `kvtier bench` share; it imports nothing of either.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

# Sample names (counters with `_total`), vLLM's as the native server exports them too.
PROMPT_TOKENS = "vllm:prompt_tokens_total"
HBM_QUERIES = "vllm:prefix_cache_queries_total"
HBM_HITS = "vllm:prefix_cache_hits_total"
EXT_QUERIES = "vllm:external_prefix_cache_queries_total"
EXT_HITS = "vllm:external_prefix_cache_hits_total"
RETRIEVED = "kvtier_retrieved_tokens_total"
READMITTED = "kvtier_readmitted_retrieved_tokens_total"
RESIDENCY = "kvtier_tier_residency_bytes"
WORLD_SIZE = "kvtier_world_size"
CACHE_CONFIG = "vllm:cache_config_info"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
STORED = "kvtier_stored_tokens_total"
FAILED_LOADS = "kvtier_load_failures_total"
LOADS = "kvtier_load_seconds_count"
SKIPPED_LOADS = "kvtier_skipped_loads_total"
STORE_FAILED = "kvtier_store_failures_total"
CAPACITY = "kvtier_tier_capacity_bytes"
SCOPE = "kvtier_lookup_scope"
STALLED = "kvtier_engine_stalled"
STALL_SECONDS = "kvtier_engine_stall_seconds"
LOAD_DECISION_TOKENS = "kvtier_load_decision_tokens_total"

# The `rank` label of the scheduler's own samples (workers carry their rank number).
SCHEDULER = "scheduler"

# The counters a periodic sample keeps (short key -> sample name).
SAMPLED = {
    "prompt_tokens": PROMPT_TOKENS,
    "hbm_queries": HBM_QUERIES,
    "hbm_hits": HBM_HITS,
    "ext_queries": EXT_QUERIES,
    "ext_hits": EXT_HITS,
    "retrieved": RETRIEVED,
    "readmitted": READMITTED,
    "policy_recomputed": LOAD_DECISION_TOKENS,
}
# a sampled counter split by a label is summed over the values named here only
SAMPLED_LABELS: dict[str, dict[str, str]] = {"policy_recomputed": {"decision": "recompute"}}


def sampled_totals(ms: MetricSet) -> dict[str, float]:
    """The `SAMPLED` counter totals `ms` exports, by short key."""
    return {k: ms.total(n, **SAMPLED_LABELS.get(k, {})) for k, n in SAMPLED.items() if ms.has(n)}

LabelKey = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class MetricSet:
    """Prometheus samples by (sample name, sorted labels); `_created` timestamps left out."""

    samples: Mapping[tuple[str, LabelKey], float] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> MetricSet:
        """Samples of a Prometheus text exposition."""
        out: dict[tuple[str, LabelKey], float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.endswith("_created"):
                    continue
                out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
        return cls(out)

    def total(self, name: str, **labels: str) -> float:
        """Sum of sample `name` over every label value not fixed by `labels` (0.0 if absent)."""
        return sum(
            v
            for (n, key), v in self.samples.items()
            if n == name and all(dict(key).get(k) == want for k, want in labels.items())
        )

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """Sample `name` summed per value of `label`."""
        out: dict[str, float] = {}
        for (n, key), v in self.samples.items():
            if n == name:
                value = dict(key).get(label)
                if value is not None:
                    out[value] = out.get(value, 0.0) + v
        return out

    def has(self, name: str) -> bool:
        """Whether any sample is named `name`."""
        return any(n == name for n, _ in self.samples)

    def engines(self) -> dict[str, MetricSet]:
        """The scrape split per `engine` label (vLLM's data-parallel engines on one /metrics,
        each with its own scheduler and ranks 0..world-1): each engine's samples, with the
        ones no engine labels shared by all. One entry ("") when at most one engine reports."""
        names = sorted({dict(key)["engine"] for _, key in self.samples if "engine" in dict(key)})
        if len(names) <= 1:
            return {"": self}
        out: dict[str, dict[tuple[str, LabelKey], float]] = {e: {} for e in names}
        for (n, key), v in self.samples.items():
            engine = dict(key).get("engine")
            for e in names if engine is None else (engine,):
                out[e][(n, key)] = v
        return {e: MetricSet(samples) for e, samples in out.items()}

    def delta(self, before: MetricSet) -> MetricSet:
        """`self - before`, sample by sample (a sample new in `self` counts from 0)."""
        return MetricSet({k: v - before.samples.get(k, 0.0) for k, v in self.samples.items()})

    def to_json(self) -> list[list[object]]:
        """Samples as `[name, {labels}, value]` triples (what `from_json` reads back)."""
        return [[n, dict(key), v] for (n, key), v in sorted(self.samples.items())]

    @classmethod
    def from_json(cls, doc: Sequence[Sequence[Any]]) -> MetricSet:
        """The set `to_json` wrote."""
        return cls(
            {(str(n), tuple(sorted(dict(labels).items()))): float(v) for n, labels, v in doc}
        )


@dataclass(frozen=True, slots=True)
class Counters:
    """The server counters of one window (deltas), in tokens."""

    prompt_tokens: float
    hbm_queries: float
    hbm_hits: float
    ext_queries: float
    ext_hits: float
    retrieved_by_rank: dict[str, float]
    has_external: bool
    # of the retrieved tokens, those loaded for admissions after a preemption: the hosts
    # count such admissions apart from their external hits (vLLM's PrefixCacheStats)
    readmitted_by_rank: dict[str, float] = field(default_factory=dict)
    # tier hits the load policy chose to recompute (`load_policy: cost`): found, not read
    policy_recomputed: float = 0.0

    @classmethod
    def of_samples(cls, first: Mapping[str, float], last: Mapping[str, float]) -> Counters:
        """Counters between two periodic samples' totals (`SAMPLED` keys); retrievals are
        summed over ranks under the key "all"."""

        def d(key: str) -> float:
            return float(last.get(key, 0.0)) - float(first.get(key, 0.0))

        return cls(
            prompt_tokens=d("prompt_tokens"),
            hbm_queries=d("hbm_queries"),
            hbm_hits=d("hbm_hits"),
            ext_queries=d("ext_queries"),
            ext_hits=d("ext_hits"),
            retrieved_by_rank={"all": d("retrieved")},
            has_external="ext_queries" in last or "ext_hits" in last,
            readmitted_by_rank={"all": d("readmitted")},
            policy_recomputed=d("policy_recomputed"),
        )

    @classmethod
    def of(cls, delta: MetricSet) -> Counters:
        """Pick the counters out of a window's delta; `rank="scheduler"` holds no retrievals."""
        ranks = {r: v for r, v in delta.by_label(RETRIEVED, "rank").items() if r != SCHEDULER}
        again = {r: v for r, v in delta.by_label(READMITTED, "rank").items() if r != SCHEDULER}
        return cls(
            prompt_tokens=delta.total(PROMPT_TOKENS),
            hbm_queries=delta.total(HBM_QUERIES),
            hbm_hits=delta.total(HBM_HITS),
            ext_queries=delta.total(EXT_QUERIES),
            ext_hits=delta.total(EXT_HITS),
            retrieved_by_rank=dict(sorted(ranks.items())),
            has_external=delta.has(EXT_QUERIES) or delta.has(EXT_HITS),
            readmitted_by_rank=dict(sorted(again.items())),
            policy_recomputed=delta.total(LOAD_DECISION_TOKENS, decision="recompute"),
        )

    @property
    def retrieved(self) -> float:
        """Tokens retrieved, summed over ranks."""
        return sum(self.retrieved_by_rank.values())

    @property
    def readmitted(self) -> float:
        """Of `retrieved`, the tokens loaded again for requests preempted after a load."""
        return sum(self.readmitted_by_rank.values())

    @property
    def hbm_hit_rate(self) -> float:
        """HBM prefix-cache hits over prompt tokens."""
        return _share(self.hbm_hits, self.prompt_tokens)

    @property
    def external_hit_rate(self) -> float:
        """Tier (external) hits over prompt tokens."""
        return _share(self.ext_hits, self.prompt_tokens)

    @property
    def hit_rate(self) -> float:
        """All hits over prompt tokens."""
        return _share(self.hbm_hits + self.ext_hits, self.prompt_tokens)

    def to_json(self) -> dict[str, object]:
        """Counts, rates and the retrieved tokens per rank."""
        out: dict[str, object] = asdict(self)
        out.update(
            retrieved=self.retrieved,
            readmitted=self.readmitted,
            hbm_hit_rate=self.hbm_hit_rate,
            external_hit_rate=self.external_hit_rate,
            hit_rate=self.hit_rate,
        )
        return out


# ----------------------------------------------------------------------------------------------
# identities
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Identity:
    """`lhs == rhs` (or `lhs <= rhs` for a bound) on one window, and whether it holds."""

    name: str
    expr: str
    lhs: float
    rhs: float
    op: str = "=="

    @property
    def holds(self) -> bool:
        """Exact for counts (they are integers carried as floats)."""
        if self.op == "<=":
            return self.lhs <= self.rhs + 1e-9
        return abs(self.lhs - self.rhs) <= 1e-9 * max(1.0, abs(self.rhs))

    def describe(self) -> str:
        """`expr: lhs == rhs holds|fails`."""
        verdict = "holds" if self.holds else "FAILS"
        return f"{self.expr}: {_num(self.lhs)} {self.op} {_num(self.rhs)} {verdict}"

    def to_json(self) -> dict[str, object]:
        """Fields plus `holds`."""
        return {
            "name": self.name,
            "expr": self.expr,
            "lhs": self.lhs,
            "op": self.op,
            "rhs": self.rhs,
            "holds": self.holds,
        }


def identities(
    c: Counters, tp: int, offload: bool, *, has_retrieved: bool = True
) -> list[Identity]:
    """The counter identities of a drained window: with offload, HBM misses are exactly what the
    connector was asked and the ranks' retrieved tokens, less those loaded again for preempted
    requests, are the external hits TP times over (only where the server exports kvtier's
    retrieved counter: `has_retrieved`); without, no
    external hit at all. Hits never exceed queries in either."""
    if tp < 1:
        raise ValueError(f"tp={tp} must be >= 1")
    out = [
        Identity(
            "hbm_hits_le_queries",
            "prefix_cache_hits <= prefix_cache_queries",
            c.hbm_hits,
            c.hbm_queries,
            "<=",
        ),
    ]
    if offload:
        out += [
            Identity(
                "hbm_misses_eq_external_queries",
                "prefix_cache_queries - prefix_cache_hits == external_prefix_cache_queries",
                c.hbm_queries - c.hbm_hits,
                c.ext_queries,
            ),
            *(
                [
                    Identity(
                        "retrieved_eq_external_hits",
                        f"sum_ranks (kvtier_retrieved_tokens - kvtier_readmitted_retrieved_tokens)"
                        f" / TP({tp}) == external_prefix_cache_hits",
                        (c.retrieved - c.readmitted) / tp,
                        c.ext_hits,
                    )
                ]
                if has_retrieved
                else []
            ),
            Identity(
                "external_hits_le_queries",
                "external_prefix_cache_hits <= external_prefix_cache_queries",
                c.ext_hits,
                c.ext_queries,
                "<=",
            ),
        ]
    else:
        out.append(
            Identity(
                "no_external_hits_off",
                "external_prefix_cache_hits == 0 (offload off)",
                c.ext_hits,
                0.0,
            )
        )
    return out


def world_size(ms: MetricSet) -> int | None:
    """Ranks of the server's engine (kvtier's `kvtier_world_size` gauge), if exported."""
    sizes = [v for (n, _), v in ms.samples.items() if n == WORLD_SIZE]
    return int(max(sizes)) if sizes else None


def cache_config(ms: MetricSet) -> dict[str, str]:
    """vLLM's `cache_config_info` labels (num_gpu_blocks, block_size, ...), if exported."""
    for (n, key), _v in ms.samples.items():
        if n == CACHE_CONFIG:
            return dict(key)
    return {}


def _share(part: float, whole: float) -> float:
    return part / whole if whole > 0 else 0.0


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.6g}"
