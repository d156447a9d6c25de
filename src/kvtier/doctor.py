"""`kvtier doctor URL`: read a server's /metrics (and its startup log) and say, check by check,
whether the offload tier is wired on every rank and is being read, with the numbers.

`diagnose()` is pure (metrics text in, checks out); `doctor_command` fetches, prints a table or
JSON and exits 1 on any FAIL (2 when the server cannot be read), so it can gate a deployment.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import httpx
import typer
from prometheus_client.parser import text_string_to_metric_families

from kvtier.config import format_size
from kvtier.scrape import (
    CAPACITY,
    EXT_HITS,
    EXT_QUERIES,
    FAILED_LOADS,
    HBM_HITS,
    HBM_QUERIES,
    KV_USAGE,
    LOADS,
    PROMPT_TOKENS,
    RETRIEVED,
    RUNNING,
    SCHEDULER,
    SCOPE,
    SKIPPED_LOADS,
    STALL_SECONDS,
    STALLED,
    STORE_FAILED,
    STORED,
    WAITING,
    WORLD_SIZE,
    Counters,
    MetricSet,
    identities,
)

__all__ = [
    "CHECK_NAMES",
    "Check",
    "DoctorError",
    "Status",
    "diagnose",
    "doctor_command",
    "fetch_metrics",
    "metrics_url",
    "parse_client_line",
    "render_json",
    "render_table",
]

# A target that missed at least this share of the scheduler's lookups is as good as gone: most
# lookups come back as misses because of it, so it fails the gate instead of warning.
LOOKUP_TIMEOUT_FAIL_SHARE = 0.5

# store-failure reasons after which a tier takes no write until space or rights come back
WRITE_REFUSED = ("enospc", "read_only", "no_permission")

_CLIENT_LINE = re.compile(r"kvtier: lookup client on ranks \[([0-9,\s]*)\] \(world=(\d+)\)")
_RETRIEVED_LINE = re.compile(r"kvtier\[rank (\d+)/\d+\]: Retrieved (\d+) of (\d+) required tokens")


class Status(StrEnum):
    """Outcome of one check; only FAIL makes the command exit non-zero."""

    PASS = "PASS"
    WARN = "WARN"
    FAIL = "FAIL"
    UNDETERMINED = "UNDETERMINED"


@dataclass(frozen=True)
class Check:
    """One check: its name, outcome, a sentence with the numbers, and the numbers themselves."""

    name: str
    status: Status
    detail: str
    numbers: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """Plain fields (status as its string)."""
        out = asdict(self)
        out["status"] = str(self.status)
        return out


PRESENT = "kvtier present"
PROGRESS = "engine progress"
SCOPE_CHECK = "lookup client on every rank"
WORKERS = "a worker on every rank"
RETRIEVING = "every rank retrieving"
EXTERNAL = "external queries and hits"
IDENTITIES = "identities"
VERIFY = "verify failures"
LEASES = "leases"
TIMEOUTS = "lookup timeouts"
DROPPED = "dropped writes"
LOAD_FAILURES = "load failures"
SAVE_FAILURES = "save failures"
STORE_FAILURES = "store failures"
SKIPPED = "skipped loads"
BREAKERS = "breakers"
POLICY = "failed loads recompute"
FAILS_REQUEST = "kvtier_load_failure_fails_request"

CHECK_NAMES = (
    PRESENT,
    PROGRESS,
    SCOPE_CHECK,
    WORKERS,
    RETRIEVING,
    EXTERNAL,
    IDENTITIES,
    VERIFY,
    LEASES,
    TIMEOUTS,
    DROPPED,
    LOAD_FAILURES,
    SAVE_FAILURES,
    STORE_FAILURES,
    SKIPPED,
    BREAKERS,
    POLICY,
)


class DoctorError(Exception):
    """The server or the log could not be read (unreachable, not HTTP 200); exit code 2."""


# ------------------------------------------------------------------------------ sample helpers


class _Samples:
    """Typed lookups over one scrape: worker ranks are the numeric `rank` labels; `declared`
    holds every family the text names, with or without samples."""

    def __init__(self, ms: MetricSet, declared: frozenset[str] = frozenset()) -> None:
        self.ms = ms
        self.declared = declared

    def has(self, name: str) -> bool:
        return self.ms.has(name)

    def exported(self, name: str) -> bool:
        """Whether the server exports `name` at all (a family with no sample yet counts: a
        counter by reason gets its first sample with its first event)."""
        return name in self.declared or self.ms.has(name)

    def total(self, name: str, **labels: str) -> float:
        return self.ms.total(name, **labels)

    def group(self, name: str, *labels: str, **fixed: str) -> dict[tuple[str, ...], float]:
        """Sample `name` summed per combination of `labels` (samples lacking one are skipped)."""
        out: dict[tuple[str, ...], float] = {}
        for (n, key), v in self.ms.samples.items():
            if n != name:
                continue
            d = dict(key)
            if any(d.get(k) != want for k, want in fixed.items()):
                continue
            if all(k in d for k in labels):
                combo = tuple(d[k] for k in labels)
                out[combo] = out.get(combo, 0.0) + v
        return out

    def per_rank(self, name: str, **fixed: str) -> dict[int, float]:
        """Sample `name` per worker rank (the scheduler's samples left out)."""
        return {int(r): v for (r,), v in self.group(name, "rank", **fixed).items() if r.isdigit()}

    def worker_ranks(self) -> set[int]:
        """Ranks that report any kvtier sample of their own."""
        out: set[int] = set()
        for n, key in self.ms.samples:
            rank = dict(key).get("rank")
            if n.startswith("kvtier_") and rank is not None and rank.isdigit():
                out.add(int(rank))
        return out

    def scheduler_value(self, name: str) -> float | None:
        for (n, key), v in self.ms.samples.items():
            if n == name and dict(key).get("rank") == SCHEDULER:
                return v
        return None


def _num(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


def _fmt(counts: Mapping[Any, float]) -> str:
    return ", ".join(f"{k}: {_num(v)}" for k, v in sorted(counts.items()) if v) or "none"


def _ranks(xs: Iterable[int]) -> list[int]:
    return sorted(xs)


# ------------------------------------------------------------------------------ the log


@dataclass(frozen=True)
class ClientLine:
    """`kvtier: lookup client on ranks [..] (world=N)` as logged at startup."""

    ranks: tuple[int, ...]
    world: int


def parse_client_line(log_text: str) -> ClientLine | None:
    """The last lookup-client line of a startup log (a restarted server appends a new one)."""
    found = _CLIENT_LINE.findall(log_text)
    if not found:
        return None
    ranks, world = found[-1]
    return ClientLine(tuple(int(r) for r in ranks.replace(",", " ").split()), int(world))


def _log_retrievals(log_text: str) -> dict[int, int]:
    """Per rank, the `Retrieved N of M` lines with N > 0 (the log's Retrieved histogram)."""
    out: dict[int, int] = {}
    for rank, got, _ in _RETRIEVED_LINE.findall(log_text):
        if int(got) > 0:
            out[int(rank)] = out.get(int(rank), 0) + 1
    return out


# ------------------------------------------------------------------------------ the checks


@dataclass(frozen=True)
class _Ctx:
    s: _Samples
    log_text: str | None
    tp: int | None
    world_metric: int | None  # what the scheduler exports
    world: int | None  # the world ranks are held to: --tp, else the exported one, else inferred
    worker_ranks: set[int]

    @property
    def span(self) -> list[int]:
        """Ranks to look at: the world's, and any rank reporting beyond it."""
        top = max([self.world or 0, *(r + 1 for r in self.worker_ranks)])
        return list(range(top))


def _is_tier_sample(name: str) -> bool:
    # the native server's engine gauges (kvtier_engine_*) are there with offload off too
    return name.startswith("kvtier_") and not name.startswith("kvtier_engine_")


def _present(s: _Samples) -> Check:
    names = {n for n, _ in s.ms.samples if _is_tier_sample(n)}
    if not names:
        return Check(
            PRESENT,
            Status.FAIL,
            "no kvtier_* metric in /metrics: offload is not on or this is not a kvtier server",
            {"kvtier_samples": 0},
        )
    kvtier = sum(1 for n, _ in s.ms.samples if _is_tier_sample(n))
    ranks = _ranks(s.worker_ranks())
    return Check(
        PRESENT,
        Status.PASS,
        f"{len(names)} kvtier_* series names, {kvtier} samples; worker ranks reporting: {ranks}",
        {"kvtier_samples": kvtier, "kvtier_names": len(names), "worker_ranks": ranks},
    )


def _scope(c: _Ctx) -> Check:
    s = c.s
    scope = {
        int(t): v for (t,), v in s.group(SCOPE, "target", rank=SCHEDULER).items() if t.isdigit()
    }
    covered = _ranks(t for t, v in scope.items() if v >= 1)
    numbers: dict[str, Any] = {
        "world": c.world_metric,
        "scope": covered,
        "tp": c.tp,
        "worker_ranks": _ranks(c.worker_ranks),
    }
    if c.world_metric is None or not scope:
        return Check(
            SCOPE_CHECK,
            Status.FAIL,
            f"no {WORLD_SIZE}/{SCOPE} for rank=scheduler in /metrics: the scheduler built no "
            "lookup client (a tier written and never read), or the server predates these metrics",
            numbers,
        )
    world = c.world_metric
    problems: list[str] = []
    missing = [r for r in range(world) if r not in covered]
    numbers["missing"] = missing
    if missing:
        problems.append(
            f"the lookup client asks ranks {covered} of world={world} and skips {missing}: "
            "hits are promised from a subset's answer"
        )
    outside = [r for r in covered if r >= world]
    if outside:
        problems.append(f"scope names ranks {outside} outside [0, {world})")
    if c.tp is not None and world != c.tp:
        problems.append(f"world={world} but --tp {c.tp}: the world size was mis-read")
    beyond = _ranks(r for r in c.worker_ranks if r >= world)
    if beyond:
        problems.append(
            f"ranks {beyond} run workers but world={world}: the world size was mis-read, so "
            "the lookup scope cannot cover them"
        )
    if c.log_text is not None:
        line = parse_client_line(c.log_text)
        if line is None:
            problems.append(
                "the log has no 'kvtier: lookup client on ranks [..] (world=N)' line: no lookup "
                "client was built (or this is not the server's startup log)"
            )
        else:
            numbers["log_ranks"] = list(line.ranks)
            numbers["log_world"] = line.world
            if sorted(line.ranks) != covered or line.world != world:
                problems.append(
                    f"the log says ranks {list(line.ranks)} (world={line.world}) but /metrics "
                    f"says ranks {covered} (world={world}): the log is not of this server's "
                    "latest start"
                )
            log_missing = [r for r in range(line.world) if r not in line.ranks]
            if log_missing and not missing:
                problems.append(f"the log's client skips ranks {log_missing}")
    if problems:
        return Check(SCOPE_CHECK, Status.FAIL, "; ".join(problems), numbers)
    tail = " (log agrees)" if c.log_text is not None else ""
    said = f"lookup client asks ranks {covered} of world={world}{tail}"
    return Check(SCOPE_CHECK, Status.PASS, said, numbers)


def _workers(c: _Ctx) -> Check:
    s = c.s
    capacity = s.per_rank(CAPACITY)
    prompt_tokens = s.total(PROMPT_TOKENS)
    numbers: dict[str, Any] = {
        "world": c.world,
        "capacity_bytes_by_rank": {str(r): _num(v) for r, v in sorted(capacity.items())},
        "prompt_tokens": _num(prompt_tokens),
    }
    if c.world is None:
        return Check(
            WORKERS, Status.UNDETERMINED,
            "world size unknown (no kvtier_world_size, no worker metrics); pass --tp", numbers,
        )  # fmt: skip
    expected = set(range(c.world))
    if not capacity:
        if prompt_tokens == 0:
            return Check(
                WORKERS,
                Status.UNDETERMINED,
                f"no rank has reported worker metrics yet (world={c.world}); ranks ship them "
                "with step outputs, so send one request and run doctor again",
                numbers,
            )
        return Check(
            WORKERS,
            Status.FAIL,
            f"no rank reports {CAPACITY} after {_num(prompt_tokens)} prompt tokens: "
            f"no worker is running kvtier on ranks {_ranks(expected)}",
            numbers,
        )
    missing = _ranks(expected - capacity.keys())
    extra = _ranks(capacity.keys() - expected)
    numbers.update(missing=missing, extra=extra)
    problems = []
    if missing:
        problems.append(f"ranks {missing} report no worker ({CAPACITY} missing)")
    if extra:
        problems.append(f"ranks {extra} report workers outside world={c.world}")
    if problems:
        return Check(WORKERS, Status.FAIL, "; ".join(problems), numbers)
    tiers = _ranks_tiers(s)
    return Check(
        WORKERS,
        Status.PASS,
        f"workers on ranks {_ranks(capacity)} of world={c.world}; tiers: {tiers}",
        numbers,
    )


def _ranks_tiers(s: _Samples) -> str:
    """Each tier's byte budget per rank (the largest rank's, should ranks differ)."""
    by_tier: dict[str, float] = {}
    for (_, tier), v in s.group(CAPACITY, "rank", "tier").items():
        by_tier[tier] = max(by_tier.get(tier, 0.0), v)
    return ", ".join(f"{t} {format_size(int(v))}/rank" for t, v in sorted(by_tier.items()))


def _retrieving(c: _Ctx) -> Check:
    s = c.s
    ranks = c.span
    got = s.per_rank(RETRIEVED)
    loads = s.per_rank(LOADS)
    tokens = {r: got.get(r, 0.0) for r in ranks}
    count = {r: loads.get(r, 0.0) for r in ranks}
    numbers: dict[str, Any] = {
        "retrieved_tokens_by_rank": {str(r): _num(v) for r, v in tokens.items()},
        "loads_by_rank": {str(r): _num(v) for r, v in count.items()},
    }
    if c.log_text is not None:
        numbers["log_retrieved_lines_by_rank"] = {
            str(r): n for r, n in sorted(_log_retrievals(c.log_text).items())
        }
    hist = ", ".join(f"rank {r}: {_num(count[r])} loads / {_num(tokens[r])} tokens" for r in tokens)
    if not tokens:
        return Check(RETRIEVING, Status.UNDETERMINED, "no rank known; pass --tp", numbers)
    zero = [r for r, v in tokens.items() if v == 0]
    if len(zero) == len(tokens):
        return Check(RETRIEVING, Status.UNDETERMINED, _all_zero(s, hist), numbers)
    if zero:
        busy = [r for r in tokens if r not in zero]
        return Check(
            RETRIEVING,
            Status.FAIL,
            f"ranks {zero} retrieved nothing while ranks {busy} did ({hist}): those ranks "
            "never read the tier (no worker, or every load failed there)",
            numbers,
        )
    if len(set(tokens.values())) > 1:
        return Check(
            RETRIEVING,
            Status.WARN,
            f"uneven ({hist}): every rank loads the same ops, so a difference means loads "
            "failed on some ranks (see load failures) or a rank's metrics are behind",
            numbers,
        )
    return Check(RETRIEVING, Status.PASS, f"even: {hist}", numbers)


def _all_zero(s: _Samples, hist: str) -> str:
    stored = s.total(STORED)
    queries = s.total(EXT_QUERIES)
    hits = s.total(EXT_HITS)
    hbm_hits = s.total(HBM_HITS)
    evictions = s.total("kvtier_evictions_total")
    causes = (
        "no rank has retrieved a token yet; three causes read the same here: "
        "(1) no reuse in the traffic yet (a prefix must repeat after it was stored); "
        f"(2) the reuse distance lies outside [HBM pool, tier): repeats were served by HBM "
        f"(prefix_cache_hits={_num(hbm_hits)}) or evicted from the tier "
        f"(evictions={_num(evictions)}); "
        f"(3) lookups never hit, the write-only tier: stored={_num(stored)} tokens (all ranks), "
        f"external queries={_num(queries)}, external hits={_num(hits)}"
    )
    if stored > 0 and queries > 0 and hits == 0:
        lean = "the numbers fit (3) unless the traffic so far repeated no prefix"
    elif stored == 0:
        lean = "nothing is stored yet, so (1): send traffic that repeats a prefix"
    else:
        lean = "the numbers do not single out one cause"
    return f"{causes}. {lean} ({hist})"


def _external(s: _Samples) -> Check:
    queries = s.total(EXT_QUERIES)
    hits = s.total(EXT_HITS)
    stored = s.total(STORED)
    numbers = {
        "external_queries": _num(queries),
        "external_hits": _num(hits),
        "stored_tokens": _num(stored),
    }
    if not (s.has(EXT_QUERIES) or s.has(EXT_HITS)):
        return Check(
            EXTERNAL,
            Status.UNDETERMINED,
            f"the server exports no {EXT_QUERIES} / {EXT_HITS} (on vLLM: serve with "
            "--enable-prompt-tokens-details)",
            numbers,
        )
    said = (
        f"external queries={_num(queries)}, hits={_num(hits)}, "
        f"stored={_num(stored)} tokens (all ranks)"
    )
    if not s.exported(STORED):
        return _absent(EXTERNAL, STORED)
    if hits > 0:
        return Check(EXTERNAL, Status.PASS, said, numbers)
    hbm_hits = s.total(HBM_HITS)
    hbm_skips = s.total(SKIPPED_LOADS, reason="hbm_satisfies")
    numbers.update(hbm_hits=_num(hbm_hits), skipped_hbm_satisfies=_num(hbm_skips))
    if queries > 0 and stored > 0 and (hbm_hits > 0 or hbm_skips > 0):
        return Check(
            EXTERNAL,
            Status.WARN,
            f"repeats fit in HBM: {said}, but the prefix cache answered the repeats "
            f"(prefix_cache_hits={_num(hbm_hits)}; tier hits skipped because HBM already held "
            f"them: {_num(hbm_skips)}), so the tier was never needed yet; it pays once repeats "
            "outgrow the HBM pool",
            numbers,
        )
    if queries > 0 and stored > 0:
        return Check(
            EXTERNAL,
            Status.FAIL,
            f"tier written and never read: {said}; check the lookup scope, or, if the traffic "
            "so far repeated no prefix, rerun after traffic that does",
            numbers,
        )
    if queries == 0:
        why = "no HBM miss has reached the connector yet"
    else:
        why = "nothing is stored in the tier yet (prompts shorter than a chunk, or saves failing)"
    return Check(EXTERNAL, Status.UNDETERMINED, f"{said}: {why}", numbers)


def _identities(c: _Ctx) -> Check:
    s = c.s
    names = (HBM_QUERIES, HBM_HITS, EXT_QUERIES, EXT_HITS, RUNNING, WAITING)
    absent = [n for n in names if not s.has(n)]
    if absent:
        return Check(
            IDENTITIES, Status.UNDETERMINED, f"the server exports no {', '.join(absent)}", {}
        )
    running, waiting = s.total(RUNNING), s.total(WAITING)
    numbers: dict[str, Any] = {"running": _num(running), "waiting": _num(waiting)}
    if running + waiting > 0:
        return Check(
            IDENTITIES,
            Status.WARN,
            f"not drained ({_num(running)} running, {_num(waiting)} waiting): counters are "
            "taken at different moments of a request, so the identities only close on an idle "
            "server; run doctor again when it is",
            numbers,
        )
    tp = c.world
    if tp is None:
        return Check(IDENTITIES, Status.UNDETERMINED, "TP unknown; pass --tp", numbers)
    ids = identities(Counters.of(c.s.ms), tp, offload=True)
    numbers["tp"] = tp
    numbers["identities"] = [i.to_json() for i in ids]
    failed = [i for i in ids if not i.holds]
    said = "; ".join(i.describe() for i in (failed or ids))
    return Check(IDENTITIES, Status.FAIL if failed else Status.PASS, said, numbers)


def _absent(name: str, family: str) -> Check:
    return Check(
        name,
        Status.UNDETERMINED,
        f"the server exports no {family}, so its count is unknown, not zero (a kvtier older "
        "than this doctor, or a host that exports counters only after their first increment)",
        {},
    )


def _counted(
    name: str,
    s: _Samples,
    family: str,
    labels: tuple[str, ...],
    bad: Status,
    what: str,
    why: str,
) -> Check:
    """A counter that must stay at zero: `bad` with its counts by `labels` (and per rank)."""
    if not s.exported(family):
        return _absent(name, family)
    by = {"/".join(k): v for k, v in s.group(family, *labels).items() if v}
    by_rank = {str(r): _num(v) for r, v in s.per_rank(family).items() if v}
    sched = s.group(family, *labels, rank=SCHEDULER)
    numbers = {
        "total": _num(sum(by.values())),
        "by": {k: _num(v) for k, v in sorted(by.items())},
        "by_rank": by_rank,
        "scheduler": {"/".join(k): _num(v) for k, v in sorted(sched.items()) if v},
    }
    if not by:
        return Check(name, Status.PASS, f"no {what}", numbers)
    key = "/".join(labels)
    return Check(
        name,
        bad,
        f"{_num(sum(by.values()))} {what} by {key}: {_fmt(by)} (per rank: {_fmt(by_rank)}); {why}",
        numbers,
    )


def _load_failures(s: _Samples) -> Check:
    if not s.exported(FAILED_LOADS):
        return _absent(LOAD_FAILURES, FAILED_LOADS)
    ops = {r: v for (r,), v in s.group(FAILED_LOADS, "reason", rank=SCHEDULER).items() if v}
    ranks = {
        f"{r}/{why}": v
        for (r, why), v in s.group(FAILED_LOADS, "rank", "reason").items()
        if v and r != SCHEDULER
    }
    numbers = {
        "ops_by_reason": {r: _num(v) for r, v in sorted(ops.items())},
        "by_rank_reason": {k: _num(v) for k, v in sorted(ranks.items())},
    }
    if not ops and not ranks:
        return Check(LOAD_FAILURES, Status.PASS, "no load failed", numbers)
    return Check(
        LOAD_FAILURES,
        Status.WARN,
        f"{_num(sum(ops.values()))} loads failed, by reason: {_fmt(ops)} (rank/reason: "
        f"{_fmt(ranks)}); each was recomputed, costing its hit",
        numbers,
    )


def _leases(s: _Samples) -> Check:
    if not s.exported("kvtier_lease_expiries_total"):
        return _absent(LEASES, "kvtier_lease_expiries_total")
    exp = s.per_rank("kvtier_lease_expiries_total")
    dbl = s.per_rank("kvtier_lease_double_releases_total")
    numbers = {
        "expiries": _num(sum(exp.values())),
        "double_releases": _num(sum(dbl.values())),
        "expiries_by_rank": {str(r): _num(v) for r, v in sorted(exp.items()) if v},
        "double_releases_by_rank": {str(r): _num(v) for r, v in sorted(dbl.items()) if v},
    }
    if not any(exp.values()) and not any(dbl.values()):
        return Check(LEASES, Status.PASS, "no lease expired and none was released twice", numbers)
    return Check(
        LEASES,
        Status.WARN,
        f"lease expiries {_num(sum(exp.values()))} (per rank: {_fmt(exp)}), double releases "
        f"{_num(sum(dbl.values()))} (per rank: {_fmt(dbl)}): a release path was missed "
        "(expiries) or ran twice (double releases); chunks were held until the deadline",
        numbers,
    )


def _timeouts(s: _Samples) -> Check:
    if not s.exported("kvtier_lookup_timeouts_total"):
        return _absent(TIMEOUTS, "kvtier_lookup_timeouts_total")
    per_target = {
        t: v
        for (t,), v in s.group("kvtier_lookup_timeouts_total", "target", rank=SCHEDULER).items()
        if v
    }
    lookups = s.scheduler_value("kvtier_lookups_total") or 0.0
    numbers = {
        "lookups": _num(lookups),
        "timeouts_by_target": {t: _num(v) for t, v in sorted(per_target.items())},
    }
    if not per_target:
        return Check(TIMEOUTS, Status.PASS, f"no timeout in {_num(lookups)} lookups", numbers)
    gone = sorted(
        t for t, v in per_target.items() if lookups > 0 and v >= LOOKUP_TIMEOUT_FAIL_SHARE * lookups
    )
    said = f"timeouts per target rank: {_fmt(per_target)} in {_num(lookups)} lookups"
    if gone:
        return Check(
            TIMEOUTS,
            Status.FAIL,
            f"{said}: ranks {gone} missed at least {LOOKUP_TIMEOUT_FAIL_SHARE:.0%} of lookups, "
            "so their lookup servers are down or stuck and most hits are lost",
            numbers,
        )
    return Check(
        TIMEOUTS, Status.WARN, f"{said}: each one cost a hit (raise lookup_timeout_ms?)", numbers
    )


def _skipped(s: _Samples) -> Check:
    by = {r: v for (r,), v in s.group("kvtier_skipped_loads_total", "reason").items() if v}
    numbers = {"by_reason": {r: _num(v) for r, v in sorted(by.items())}}
    said = f"tier hits not loaded, by reason: {_fmt(by)}" if by else "no tier hit was skipped"
    return Check(SKIPPED, Status.PASS, f"{said} (informational)", numbers)


def _store_failures(s: _Samples) -> Check:
    """Tier writes that failed; a tier refusing every write and evicting nothing is frozen."""
    if not s.exported(STORE_FAILED):
        return _absent(STORE_FAILURES, STORE_FAILED)
    by = {f"{t}/{r}": v for (t, r), v in s.group(STORE_FAILED, "tier", "reason").items() if v}
    evicted = {t: v for (t,), v in s.group("kvtier_evictions_total", "tier").items()}
    frozen = sorted(
        {k.split("/")[0] for k in by if k.split("/")[1] in WRITE_REFUSED}
        - {t for t, v in evicted.items() if v > 0}
    )
    numbers = {
        "by_tier_reason": {k: _num(v) for k, v in sorted(by.items())},
        "by_rank": {str(r): _num(v) for r, v in s.per_rank(STORE_FAILED).items() if v},
        "evictions_by_tier": {t: _num(v) for t, v in sorted(evicted.items())},
        "frozen_tiers": frozen,
    }
    if not by:
        return Check(STORE_FAILURES, Status.PASS, "no tier write failed", numbers)
    said = f"{_num(sum(by.values()))} tier writes failed, by tier/reason: {_fmt(by)}"
    if frozen:
        return Check(
            STORE_FAILURES,
            Status.FAIL,
            f"{said}; the {', '.join(frozen)} tier refuses writes ({', '.join(WRITE_REFUSED)}) "
            "and evicted nothing: it is frozen, every new chunk is lost to it (free space or "
            "fix its permissions, or lower its budget)",
            numbers,
        )
    return Check(
        STORE_FAILURES,
        Status.WARN,
        f"{said}; those chunks are missing from that tier (a full or unreachable store)",
        numbers,
    )


def _progress(s: _Samples) -> Check:
    """The engine's own stall signal; without it, the wedge signature of one scrape."""
    running, waiting, usage = s.total(RUNNING), s.total(WAITING), s.total(KV_USAGE)
    numbers: dict[str, Any] = {
        "running": _num(running), "waiting": _num(waiting), "kv_cache_usage": _num(usage),
    }  # fmt: skip
    if s.exported(STALLED):
        stalled_s = s.total(STALL_SECONDS)
        numbers.update(stalled=_num(s.total(STALLED)), stall_seconds=_num(stalled_s))
        if s.total(STALLED) >= 1:
            return Check(
                PROGRESS,
                Status.FAIL,
                f"wedged: requests are queued ({_num(waiting)} waiting, {_num(running)} "
                f"running) and no engine step made progress for {stalled_s:.0f} s "
                f"(kv_cache_usage {usage:.2f}); /health answers 503 for the same reason",
                numbers,
            )
        return Check(PROGRESS, Status.PASS, "engine steps keep making progress", numbers)
    if s.has(RUNNING) and s.has(WAITING) and running == 0 and waiting > 0 and usage >= 0.99:
        return Check(
            PROGRESS,
            Status.WARN,
            f"the wedge signature: nothing running, {_num(waiting)} waiting, KV cache "
            f"{usage:.0%} used; the server exports no {STALLED}, so scrape again: if it "
            "holds, the engine is stuck",
            numbers,
        )
    return Check(
        PROGRESS,
        Status.UNDETERMINED,
        f"the server exports no {STALLED} (vLLM, or an older kvtier server); "
        f"{_num(running)} running, {_num(waiting)} waiting",
        numbers,
    )


def _breakers(s: _Samples) -> Check:
    state = s.group("kvtier_breaker_open", "rank", "tier")
    open_ = sorted(f"rank {r} {t}" for (r, t), v in state.items() if v >= 1)
    numbers = {"open": open_, "breakers": len(state)}
    if open_:
        return Check(
            BREAKERS,
            Status.FAIL,
            f"circuit breaker open: {', '.join(open_)}; that tier is skipped until a probe "
            "succeeds (check the remote store)",
            numbers,
        )
    return Check(BREAKERS, Status.PASS, f"no breaker open ({len(state)} watched)", numbers)


def _policy(s: _Samples) -> Check:
    if not s.exported(FAILS_REQUEST):
        return _absent(POLICY, FAILS_REQUEST)
    fails = s.scheduler_value(FAILS_REQUEST)
    if fails:
        return Check(
            POLICY,
            Status.FAIL,
            "a failed tier load fails its request: kvtier runs inside a MultiConnector whose "
            'kv_load_failure_policy is not recompute; set "kv_load_failure_policy": '
            '"recompute" on the MultiConnector (the top-level --kv-transfer-config)',
            {"fails_request": fails},
        )
    return Check(POLICY, Status.PASS, "a failed tier load is recomputed", {"fails_request": 0})


def diagnose(metrics_text: str, log_text: str | None, tp: int | None) -> list[Check]:
    """Every check on one /metrics scrape (and the startup log, when given).

    `tp` is the tensor-parallel size the deployment intends; None takes the server's world.
    Raises ValueError for a `tp` below 1 or text that is not Prometheus exposition.
    """
    if tp is not None and tp < 1:
        raise ValueError(f"--tp {tp} must be >= 1 (the engine's tensor-parallel size)")
    try:
        ms = MetricSet.parse(metrics_text)
    except ValueError as exc:
        raise ValueError(f"the /metrics body is not Prometheus text ({exc})") from None
    s = _Samples(ms, _declared(metrics_text))
    present = _present(s)
    if present.status is Status.FAIL:
        return [present]
    world_value = s.scheduler_value(WORLD_SIZE)
    world_metric = int(world_value) if world_value is not None else None
    workers = s.worker_ranks()
    world = tp if tp is not None else world_metric
    if world is None and workers:
        world = max(workers) + 1
    c = _Ctx(s, log_text, tp, world_metric, world, workers)
    return [
        present,
        _progress(s),
        _scope(c),
        _workers(c),
        _retrieving(c),
        _external(s),
        _identities(c),
        _counted(
            VERIFY, s, "kvtier_verify_failures_total", ("tier", "reason"), Status.FAIL,
            "records failed verification",
            "the tier holds corrupted bytes (each was dropped and recomputed, never used)",
        ),
        _leases(s),
        _timeouts(s),
        _counted(
            DROPPED, s, "kvtier_dropped_writes_total", ("tier", "reason"), Status.WARN,
            "write-behind chunks dropped",
            "lower tiers miss those chunks (queue full, or the tier refused them)",
        ),
        _load_failures(s),
        _counted(
            SAVE_FAILURES, s, "kvtier_save_failures_total", ("reason",), Status.WARN,
            "save failures", "those chunks are saved again later, or missing from the tier",
        ),
        _store_failures(s),
        _skipped(s),
        _breakers(s),
        _policy(s),
    ]  # fmt: skip


def _declared(text: str) -> frozenset[str]:
    """Every family name the exposition declares (counters under both spellings)."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        if family.type == "counter":
            names.add(f"{family.name}_total")
    return frozenset(names)


# ------------------------------------------------------------------------------ fetching


def metrics_url(url: str) -> str:
    """`URL/metrics` (a URL already ending in /metrics is kept; a bare host:port gets http://)."""
    url = url.strip()
    if not url:
        raise DoctorError("the URL is empty; pass the server's base URL, e.g. http://host:8000")
    if "://" not in url:
        url = f"http://{url}"
    url = url.rstrip("/")
    return url if url.endswith("/metrics") else f"{url}/metrics"


def fetch_metrics(url: str, timeout_s: float = 10.0) -> str:
    """The text of `URL/metrics`; DoctorError names the URL and the cause when it cannot."""
    target = metrics_url(url)
    try:
        r = httpx.get(target, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise DoctorError(
            f"cannot reach {target} ({type(exc).__name__}: {exc}); is the server up, and is "
            "the URL its host and port?"
        ) from None
    if r.status_code != 200:
        raise DoctorError(
            f"{target} answered HTTP {r.status_code}: {r.text[:200]!r}; point doctor at the "
            "server's base URL"
        )
    return r.text


# ------------------------------------------------------------------------------ output


_STYLE = {
    Status.PASS: "green",
    Status.WARN: "yellow",
    Status.FAIL: "bold red",
    Status.UNDETERMINED: "cyan",
}


def render_table(checks: list[Check], url: str) -> None:
    """Print the checks as a rich table, then a one-line verdict."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvtier doctor: {url}", show_lines=True)
    table.add_column("check", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("detail")
    for ch in checks:
        table.add_row(ch.name, f"[{_STYLE[ch.status]}]{ch.status}[/]", ch.detail)
    con = Console()
    con.print(table)
    failed = [ch.name for ch in checks if ch.status is Status.FAIL]
    con.print(f"[bold red]FAIL[/]: {', '.join(failed)}" if failed else "[green]no check failed[/]")


def render_json(checks: list[Check], url: str) -> str:
    """The checks as one JSON document: url, ok (no FAIL) and the checks in order."""
    doc = {
        "url": url,
        "ok": not any(ch.status is Status.FAIL for ch in checks),
        "checks": [ch.to_json() for ch in checks],
    }
    return json.dumps(doc, indent=2)


def doctor_command(
    url: str = typer.Argument(..., help="Base URL of the server (its /metrics is read)."),
    log: Path | None = typer.Option(
        None, "--log", help="The server's startup log, to check its lookup-client line."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    tp: int | None = typer.Option(
        None, "--tp", help="Tensor-parallel size the deployment intends (checked against world)."
    ),
    timeout: float = typer.Option(10.0, "--timeout", help="Seconds to wait for /metrics."),
) -> None:
    """Check a running kvtier server: PASS/FAIL/WARN per check; exit 1 on any FAIL, 2 if unread."""
    try:
        log_text = None
        if log is not None:
            try:
                log_text = log.read_text(errors="replace")
            except OSError as exc:
                raise DoctorError(
                    f"cannot read --log {log} ({exc.strerror}); pass a file"
                ) from None
        text = fetch_metrics(url, timeout_s=timeout)
        checks = diagnose(text, log_text, tp)
    except (DoctorError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from None
    shown = metrics_url(url)
    if json_out:
        typer.echo(render_json(checks, shown))
    else:
        render_table(checks, shown)
    raise typer.Exit(code=1 if any(ch.status is Status.FAIL for ch in checks) else 0)
