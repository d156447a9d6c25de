"""The checks of what must stay at zero, closed or moving: verify, save, store and load
failures, dropped writes, leases, lookup timeouts, skipped loads, breakers, the load-failure
policy and the engine's progress."""

from __future__ import annotations

import math
from typing import Any

from kvtier.doctor.result import (
    ADMISSION,
    BREAKERS,
    LEASES,
    LOAD_COST,
    LOAD_FAILURES,
    POLICY,
    PROGRESS,
    RETENTION,
    SKIPPED,
    STATES,
    STORE_FAILURES,
    TIMEOUTS,
    Check,
    Status,
)
from kvtier.doctor.samples import Samples, fmt, num
from kvtier.scrape import (
    FAILED_LOADS,
    KV_USAGE,
    RUNNING,
    SCHEDULER,
    STALL_SECONDS,
    STALLED,
    STORE_FAILED,
    WAITING,
)

# A target that missed at least this share of the scheduler's lookups is as good as gone: most
# lookups come back as misses because of it, so it fails the gate instead of warning.
LOOKUP_TIMEOUT_FAIL_SHARE = 0.5
# a target fails only from this many timeouts: one timeout in a young server's first two
# lookups is half of them, and says nothing of a server that is down
LOOKUP_TIMEOUT_FAIL_MIN = 4
# store-failure reasons after which a tier takes no write until space or rights come back
WRITE_REFUSED = ("enospc", "read_only", "no_permission")
WRITES_REFUSED = "kvtier_tier_writes_refused_seconds"
SLOT_WAITS = "kvtier_slot_waits_total"
FAILS_REQUEST = "kvtier_load_failure_fails_request"
ADMITTED_TOTAL = "kvtier_admission_total"
RETURNS_TOTAL = "kvtier_admission_returns_total"
PRESSURE = "kvtier_admission_pressure"
ROOMY_REJECTS = "kvtier_admission_rejected_with_room_total"
RETENTION_TOTAL = "kvtier_retention_total"
RETAINED = "kvtier_retained_chunks"
# hints refused or clipped beyond this share (of at least this many) mean a budget too small
RETENTION_SHORT_SHARE = 0.2
RETENTION_SHORT_MIN = 20
# rejected chunks that came back, as a share of all that came back, that a tier without
# pressure should not see (it had room for them)
REGRET_WARN_SHARE = 0.05
REGRET_WARN_MIN = 64
# pressure below this: the tier kept what came back
LOW_PRESSURE = 0.1
DECISIONS = "kvtier_load_decisions_total"
PREDICTED = "kvtier_load_prediction_ratio_count"
MISPREDICTED_SHARE = "kvtier_load_misprediction_share"
# the cost model's recent loads off by over 2x beyond this share, once it has seen enough
MISPREDICTED_WARN_SHARE = 0.5
MISPREDICTED_WARN_MIN = 32
STATE_GROUPS = "kvtier_state_groups"
STORED_TOKENS = "kvtier_stored_tokens_total"
STATES_STORED = "kvtier_state_parts_stored_total"
STATES_LOADED = "kvtier_state_parts_loaded_total"


def absent(name: str, family: str) -> Check:
    """UNDETERMINED: the server does not export `family`, so its count is unknown."""
    return Check(
        name,
        Status.UNDETERMINED,
        f"the server exports no {family}, so its count is unknown, not zero (a kvtier older "
        "than this doctor, or a host that exports counters only after their first increment)",
        {},
    )


def counted(
    name: str,
    s: Samples,
    family: str,
    labels: tuple[str, ...],
    bad: Status,
    what: str,
    why: str,
) -> Check:
    """A counter that must stay at zero: `bad` with its counts by `labels` (and per rank)."""
    if not s.exported(family):
        return absent(name, family)
    by = {"/".join(k): v for k, v in s.group(family, *labels).items() if v}
    by_rank = {str(r): num(v) for r, v in s.per_rank(family).items() if v}
    sched = s.group(family, *labels, rank=SCHEDULER)
    numbers = {
        "total": num(sum(by.values())),
        "by": {k: num(v) for k, v in sorted(by.items())},
        "by_rank": by_rank,
        "scheduler": {"/".join(k): num(v) for k, v in sorted(sched.items()) if v},
    }
    if not by:
        return Check(name, Status.PASS, f"no {what}", numbers)
    key = "/".join(labels)
    return Check(
        name,
        bad,
        f"{num(sum(by.values()))} {what} by {key}: {fmt(by)} (per rank: {fmt(by_rank)}); {why}",
        numbers,
    )


def load_failures(s: Samples) -> Check:
    """Loads that failed (each recomputed), by reason and by rank."""
    if not s.exported(FAILED_LOADS):
        return absent(LOAD_FAILURES, FAILED_LOADS)
    ops = {r: v for (r,), v in s.group(FAILED_LOADS, "reason", rank=SCHEDULER).items() if v}
    ranks = {
        f"{r}/{why}": v
        for (r, why), v in s.group(FAILED_LOADS, "rank", "reason").items()
        if v and r != SCHEDULER
    }
    numbers = {
        "ops_by_reason": {r: num(v) for r, v in sorted(ops.items())},
        "by_rank_reason": {k: num(v) for k, v in sorted(ranks.items())},
    }
    if not ops and not ranks:
        return Check(LOAD_FAILURES, Status.PASS, "no load failed", numbers)
    return Check(
        LOAD_FAILURES,
        Status.WARN,
        f"{num(sum(ops.values()))} loads failed, by reason: {fmt(ops)} (rank/reason: "
        f"{fmt(ranks)}); each was recomputed, costing its hit",
        numbers,
    )


def leases(s: Samples) -> Check:
    """Leases that expired or were released twice: a release path missed or doubled."""
    if not s.exported("kvtier_lease_expiries_total"):
        return absent(LEASES, "kvtier_lease_expiries_total")
    exp = s.per_rank("kvtier_lease_expiries_total")
    dbl = s.per_rank("kvtier_lease_double_releases_total")
    numbers = {
        "expiries": num(sum(exp.values())),
        "double_releases": num(sum(dbl.values())),
        "expiries_by_rank": {str(r): num(v) for r, v in sorted(exp.items()) if v},
        "double_releases_by_rank": {str(r): num(v) for r, v in sorted(dbl.items()) if v},
    }
    if not any(exp.values()) and not any(dbl.values()):
        return Check(LEASES, Status.PASS, "no lease expired and none was released twice", numbers)
    return Check(
        LEASES,
        Status.WARN,
        f"lease expiries {num(sum(exp.values()))} (per rank: {fmt(exp)}), double releases "
        f"{num(sum(dbl.values()))} (per rank: {fmt(dbl)}): a release path was missed "
        "(expiries) or ran twice (double releases); chunks were held until the deadline",
        numbers,
    )


def timeouts(s: Samples) -> Check:
    """Lookup timeouts per target rank; a rank missing most lookups fails."""
    if not s.exported("kvtier_lookup_timeouts_total"):
        return absent(TIMEOUTS, "kvtier_lookup_timeouts_total")
    per_target = {
        t: v
        for (t,), v in s.group("kvtier_lookup_timeouts_total", "target", rank=SCHEDULER).items()
        if v
    }
    lookups = s.scheduler_value("kvtier_lookups_total") or 0.0
    numbers = {
        "lookups": num(lookups),
        "timeouts_by_target": {t: num(v) for t, v in sorted(per_target.items())},
    }
    if not per_target:
        return Check(TIMEOUTS, Status.PASS, f"no timeout in {num(lookups)} lookups", numbers)
    gone = sorted(
        int(t) if t.isdigit() else t
        for t, v in per_target.items()
        if v >= LOOKUP_TIMEOUT_FAIL_MIN and v >= LOOKUP_TIMEOUT_FAIL_SHARE * lookups
    )
    said = f"timeouts per target rank: {fmt(per_target)} in {num(lookups)} lookups"
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


def skipped(s: Samples) -> Check:
    """Tier hits the scheduler chose not to load, by reason (informational)."""
    by = {r: v for (r,), v in s.group("kvtier_skipped_loads_total", "reason").items() if v}
    numbers = {"by_reason": {r: num(v) for r, v in sorted(by.items())}}
    said = f"tier hits not loaded, by reason: {fmt(by)}" if by else "no tier hit was skipped"
    return Check(SKIPPED, Status.PASS, f"{said} (informational)", numbers)


def store_failures(s: Samples) -> Check:
    """Tier writes that failed; a tier refusing every write and evicting nothing is frozen."""
    if not s.exported(STORE_FAILED):
        return absent(STORE_FAILURES, STORE_FAILED)
    by = {f"{t}/{r}": v for (t, r), v in s.group(STORE_FAILED, "tier", "reason").items() if v}
    evicted = {t: v for (t,), v in s.group("kvtier_evictions_total", "tier").items()}
    # per rank: each rank's tier has its own budget, so another rank's evictions make no room
    refused = s.group(STORE_FAILED, "rank", "tier", "reason")
    evicting = s.group("kvtier_evictions_total", "rank", "tier")
    frozen = sorted(
        {f"rank {r} {t}" for (r, t, why), v in refused.items() if v and why in WRITE_REFUSED}
        - {f"rank {r} {t}" for (r, t), v in evicting.items() if v > 0}
    )
    # how long each tier has refused every write, as of its last refusal (0: it accepts)
    refusing: dict[str, float] = {}
    for (tier, _rank), v in s.group(WRITES_REFUSED, "tier", "rank").items():
        if v > 0:
            refusing[tier] = max(refusing.get(tier, 0.0), v)  # the longest rank's, not a sum
    numbers = {
        "by_tier_reason": {k: num(v) for k, v in sorted(by.items())},
        "by_rank": {str(r): num(v) for r, v in s.per_rank(STORE_FAILED).items() if v},
        "evictions_by_tier": {t: num(v) for t, v in sorted(evicted.items())},
        "frozen_tiers": frozen,
        "writes_refused_seconds": {t: num(v) for t, v in sorted(refusing.items())},
    }
    if not by:
        return Check(STORE_FAILURES, Status.PASS, "no tier write failed", numbers)
    said = f"{num(sum(by.values()))} tier writes failed, by tier/reason: {fmt(by)}"
    if refusing:
        shown = ", ".join(f"{t} tier writes refused for {v:.0f} s" for t, v in refusing.items())
        return Check(
            STORE_FAILURES,
            Status.FAIL,
            f"{shown} ({said}): nothing new is stored there (a full store at maxmemory-policy "
            "noeviction: set allkeys-lru, or volatile-lru with remote_ttl_s; a read-only "
            "replica; missing permissions)",
            numbers,
        )
    if frozen:
        return Check(
            STORE_FAILURES,
            Status.FAIL,
            f"{said}; the {', '.join(frozen)} tier refuses writes ({', '.join(WRITE_REFUSED)}) "
            "and evicted nothing there: it is frozen, every new chunk is lost to it (free "
            "space or fix its permissions, or lower its budget)",
            numbers,
        )
    waits = {o: v for (o,), v in s.group(SLOT_WAITS, "outcome").items() if v}
    numbers["slot_waits"] = {o: num(v) for o, v in sorted(waits.items())}
    if by.get("memory/all_pinned") and waits.get("none"):
        return Check(
            STORE_FAILURES,
            Status.WARN,
            f"{said}; every memory slot held a chunk the write-behind had not yet copied below, "
            f"and {num(waits['none'])} saves waited write_wait_ms in vain: the disk or store "
            "writes slower than the saves arrive (raise memory_bytes, or write_wait_ms, or "
            "give the lower tier more bandwidth)",
            numbers,
        )
    return Check(
        STORE_FAILURES,
        Status.WARN,
        f"{said}; those chunks are missing from that tier (a full or unreachable store)",
        numbers,
    )


def progress(s: Samples) -> Check:
    """The engine's own stall signal; without it, the wedge signature of one scrape."""
    running, waiting, usage = s.total(RUNNING), s.total(WAITING), s.total(KV_USAGE)
    numbers: dict[str, Any] = {
        "running": num(running), "waiting": num(waiting), "kv_cache_usage": num(usage),
    }  # fmt: skip
    if s.exported(STALLED):
        stalled_s = s.total(STALL_SECONDS)
        numbers.update(stalled=num(s.total(STALLED)), stall_seconds=num(stalled_s))
        if not math.isfinite(s.total(STALLED)):
            return Check(
                PROGRESS,
                Status.UNDETERMINED,
                f"{STALLED} reads {s.total(STALLED)}, not a count of stalled engines: the "
                "exporter is broken; check /health instead",
                numbers,
            )
        if s.total(STALLED) >= 1:
            return Check(
                PROGRESS,
                Status.FAIL,
                f"wedged: requests are queued ({num(waiting)} waiting, {num(running)} "
                f"running) and no engine step made progress for {stalled_s:.0f} s "
                f"(kv_cache_usage {usage:.2f}); /health answers 503 for the same reason",
                numbers,
            )
        return Check(PROGRESS, Status.PASS, "engine steps keep making progress", numbers)
    if s.has(RUNNING) and s.has(WAITING) and running == 0 and waiting > 0 and usage >= 0.99:
        return Check(
            PROGRESS,
            Status.WARN,
            f"the wedge signature: nothing running, {num(waiting)} waiting, KV cache "
            f"{usage:.0%} used; the server exports no {STALLED}, so scrape again: if it "
            "holds, the engine is stuck",
            numbers,
        )
    return Check(
        PROGRESS,
        Status.UNDETERMINED,
        f"the server exports no {STALLED} (vLLM, or an older kvtier server); "
        f"{num(running)} running, {num(waiting)} waiting",
        numbers,
    )


def breakers(s: Samples) -> Check:
    """Every circuit breaker closed."""
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


def policy(s: Samples) -> Check:
    """A failed tier load is recomputed, not failed (inside a MultiConnector too)."""
    if not s.exported(FAILS_REQUEST):
        return absent(POLICY, FAILS_REQUEST)
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


def admission(s: Samples) -> Check:
    """What the admission policy kept out of the tiers, and whether it cost hits the tier had
    room for (rejected chunks coming back while the tier lost none of the admitted ones)."""
    if not s.exported(ADMITTED_TOTAL):
        return absent(ADMISSION, ADMITTED_TOTAL)
    decided = {d: v for (d,), v in s.group(ADMITTED_TOTAL, "decision").items() if v}
    back = {d: v for (d,), v in s.group(RETURNS_TOTAL, "decision").items() if v}
    pressure = s.scheduler_value(PRESSURE) or 0.0
    numbers: dict[str, Any] = {
        "decided": {d: num(v) for d, v in sorted(decided.items())},
        "returns": {d: num(v) for d, v in sorted(back.items())},
        "pressure": pressure,
    }
    regret = back.get("rejected", 0.0)
    came_back = sum(back.values())
    said = (
        f"chunks decided: {fmt(decided)}; came back: {fmt(back) if back else 'none yet'}; "
        f"pressure {pressure:.2f}"
    )
    roomy = s.scheduler_value(ROOMY_REJECTS) or 0.0
    numbers["rejected_with_room"] = num(roomy)
    if roomy > 0:
        return Check(
            ADMISSION,
            Status.FAIL,
            f"{said}: {num(roomy)} chunks were rejected while the tiers had room for them and "
            "came back needing the tier: hits lost to a rejection nothing required (a defect of "
            "the admission policy; admission=all writes everything meanwhile)",
            numbers,
        )
    if (
        pressure < LOW_PRESSURE
        and regret >= REGRET_WARN_MIN
        and regret > REGRET_WARN_SHARE * came_back
    ):
        return Check(
            ADMISSION,
            Status.WARN,
            f"{said}: {num(regret)} rejected chunks came back although the tier kept the "
            "admitted ones that did (it had room): those were hits given up; admission=all "
            "writes everything",
            numbers,
        )
    return Check(ADMISSION, Status.PASS, said if decided else "no chunk decided yet", numbers)


def retention(s: Samples) -> Check:
    """What clients' retention hints were granted: a budget that clips or rejects many of them
    serves the hinting clients less than they asked (retention_budget)."""
    if not s.exported(RETENTION_TOTAL):
        return absent(RETENTION, RETENTION_TOTAL)
    by = {st: v for (st,), v in s.group(RETENTION_TOTAL, "status").items() if v}
    held = s.scheduler_value(RETAINED) or 0.0
    numbers: dict[str, Any] = {"hints": {k: num(v) for k, v in sorted(by.items())},
                               "retained_chunks": num(held)}  # fmt: skip
    total = sum(by.values())
    if not total:
        return Check(RETENTION, Status.PASS, "no retention hint received", numbers)
    short = by.get("clipped", 0.0) + by.get("rejected", 0.0)
    said = f"hints: {fmt(by)}; {num(held)} chunks retained now"
    if total >= RETENTION_SHORT_MIN and short > RETENTION_SHORT_SHARE * total:
        return Check(
            RETENTION,
            Status.WARN,
            f"{said}: {num(short)} of {num(total)} hints were clipped or rejected by the budget; "
            "raise retention_budget (or the tiers) if those clients should be served",
            numbers,
        )
    return Check(RETENTION, Status.PASS, said, numbers)


def load_cost(s: Samples) -> Check:
    """What the load policy decided per tier, and whether its predictions hold: a model whose
    recent loads miss by over 2x decides on guesses (a tier's speed changed faster than it
    learns, or the reads are erratic)."""
    if not s.exported(DECISIONS):
        return absent(LOAD_COST, DECISIONS)
    by = {f"{t}/{d}": v for (d, t), v in s.group(DECISIONS, "decision", "tier").items() if v}
    loads = s.scheduler_value(PREDICTED) or 0.0
    share = s.scheduler_value(MISPREDICTED_SHARE) or 0.0
    numbers: dict[str, Any] = {
        "decisions": {k: num(v) for k, v in sorted(by.items())},
        "predicted_loads": num(loads),
        "mispredicted_share": share,
    }
    said = f"runs of hits by decision: {fmt(by) if by else 'none yet'}"
    if loads >= MISPREDICTED_WARN_MIN and share > MISPREDICTED_WARN_SHARE:
        return Check(
            LOAD_COST,
            Status.WARN,
            f"{said}: {share:.0%} of recent loads took over 2x more or less than predicted, so "
            "load-or-recompute decisions are guesses; check the tiers' read speed (kvtier bench "
            "tier) or set load_policy: always",
            numbers,
        )
    if loads < MISPREDICTED_WARN_MIN:
        return Check(
            LOAD_COST,
            Status.PASS,
            f"{said}; {num(loads)} predicted loads, too few to judge the predictions (below "
            f"{MISPREDICTED_WARN_MIN}; {share:.0%} of them missed by over 2x)",
            numbers,
        )
    return Check(
        LOAD_COST,
        Status.PASS,
        f"{said}; predictions within 2x ({share:.0%} of recent loads missed by more)",
        numbers,
    )


def states(s: Samples) -> Check:
    """A model with state groups: the tier holds boundary states beside its chunks. Chunks and
    no state at all is a tier written and never read: a hit ends only where a state is held."""
    if not s.exported(STATE_GROUPS):
        return absent(STATES, STATE_GROUPS)
    groups = s.scheduler_value(STATE_GROUPS) or 0.0
    if not groups:
        return Check(STATES, Status.PASS, "no state groups (attention KV only)", {"groups": 0})
    stored, parts = s.per_rank(STORED_TOKENS), s.per_rank(STATES_STORED)
    loaded = s.per_rank(STATES_LOADED)
    numbers: dict[str, Any] = {
        "groups": num(groups), "stored_tokens": fmt(stored), "state_parts_stored": fmt(parts),
        "state_parts_loaded": fmt(loaded),
    }  # fmt: skip
    bare = sorted(r for r, v in stored.items() if v > 0 and not parts.get(r))
    if bare:
        return Check(
            STATES,
            Status.FAIL,
            f"rank(s) {', '.join(map(str, bare))} stored chunks ({fmt(stored)} tokens) and no "
            f"boundary state of the model's {num(groups)} state group(s): no hit can end "
            "anywhere. vLLM keeps a state only where a prefill step ends on its block: run it "
            "with --enable-prefix-caching --mamba-cache-mode align and keep chunk_size at its "
            "default (one block); the server log names the block",
            numbers,
        )
    return Check(
        STATES,
        Status.PASS,
        f"state parts stored {fmt(parts)}, loaded {fmt(loaded)} (per rank)",
        numbers,
    )
