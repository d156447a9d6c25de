"""The checks that say whether the tier is wired on every rank and is being read: kvtier
present, the lookup client's scope, a worker on every rank, every rank retrieving, external
queries and hits, and the counter identities of a drained server."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier import scrape
from kvtier.config import format_size
from kvtier.doctor.health import absent
from kvtier.doctor.result import (
    EXTERNAL,
    IDENTITIES,
    PRESENT,
    RETRIEVING,
    SCOPE_CHECK,
    WORKERS,
    Check,
    Status,
)
from kvtier.doctor.samples import Samples, log_retrievals, num, parse_client_line, sorted_ranks
from kvtier.scrape import (
    CAPACITY,
    EXT_HITS,
    EXT_QUERIES,
    HBM_HITS,
    HBM_QUERIES,
    LOAD_DECISION_TOKENS,
    LOADS,
    PROMPT_TOKENS,
    RETRIEVED,
    RUNNING,
    SCHEDULER,
    SCOPE,
    SKIPPED_LOADS,
    STORED,
    WAITING,
    WORLD_SIZE,
    Counters,
)

# lookups asked before "written and never read" is judged with a disk or remote tier, where
# every prompt is looked up: a young server's first prompts have had nothing to repeat
NEVER_READ_MIN = 8
# tier hits the scheduler turned away by design, not because a path is broken: the load
# policy predicted the load slower than the prefill it replaces (`load_policy: cost`), or the
# hit was below `min_load_tokens`. A tier whose every hit went that way was read, not idle.
DELIBERATE_SKIPS = ("slower_than_recompute", "too_small")


@dataclass(frozen=True)
class Context:
    """What the wiring checks share: the samples, the log, the intended TP and the world."""

    s: Samples
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


def present(s: Samples) -> Check:
    """Any kvtier_* tier metric at all (the engine gauges alone do not count)."""
    names = {n for n, _ in s.ms.samples if _is_tier_sample(n)}
    if not names:
        return Check(
            PRESENT,
            Status.FAIL,
            "no kvtier_* metric in /metrics: offload is not on or this is not a kvtier server",
            {"kvtier_samples": 0},
        )
    kvtier = sum(1 for n, _ in s.ms.samples if _is_tier_sample(n))
    ranks = sorted_ranks(s.worker_ranks())
    return Check(
        PRESENT,
        Status.PASS,
        f"{len(names)} kvtier_* series names, {kvtier} samples; worker ranks reporting: {ranks}",
        {"kvtier_samples": kvtier, "kvtier_names": len(names), "worker_ranks": ranks},
    )


def scope(c: Context) -> Check:
    """The scheduler's lookup client asks every rank of the world (and the log agrees)."""
    s = c.s
    scope = {
        int(t): v for (t,), v in s.group(SCOPE, "target", rank=SCHEDULER).items() if t.isdigit()
    }
    covered = sorted_ranks(t for t, v in scope.items() if v >= 1)
    numbers: dict[str, Any] = {
        "world": c.world_metric,
        "scope": covered,
        "tp": c.tp,
        "worker_ranks": sorted_ranks(c.worker_ranks),
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
    beyond = sorted_ranks(r for r in c.worker_ranks if r >= world)
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


def workers(c: Context) -> Check:
    """Every rank of the world runs a kvtier worker (reports its tier capacity)."""
    s = c.s
    capacity = s.per_rank(CAPACITY)
    prompt_tokens = s.total(PROMPT_TOKENS)
    numbers: dict[str, Any] = {
        "world": c.world,
        "capacity_bytes_by_rank": {str(r): num(v) for r, v in sorted(capacity.items())},
        "prompt_tokens": num(prompt_tokens),
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
            f"no rank reports {CAPACITY} after {num(prompt_tokens)} prompt tokens: "
            f"no worker is running kvtier on ranks {sorted_ranks(expected)}",
            numbers,
        )
    missing = sorted_ranks(expected - capacity.keys())
    extra = sorted_ranks(capacity.keys() - expected)
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
        f"workers on ranks {sorted_ranks(capacity)} of world={c.world}; tiers: {tiers}",
        numbers,
    )


def _ranks_tiers(s: Samples) -> str:
    """Each tier's byte budget per rank (the largest rank's, should ranks differ)."""
    by_tier: dict[str, float] = {}
    for (_, tier), v in s.group(CAPACITY, "rank", "tier").items():
        by_tier[tier] = max(by_tier.get(tier, 0.0), v)
    return ", ".join(f"{t} {format_size(int(v))}/rank" for t, v in sorted(by_tier.items()))


def retrieving(c: Context) -> Check:
    """Every rank retrieved tokens, and the same number (ranks load the same ops)."""
    s = c.s
    ranks = c.span
    got = s.per_rank(RETRIEVED)
    loads = s.per_rank(LOADS)
    tokens = {r: got.get(r, 0.0) for r in ranks}
    count = {r: loads.get(r, 0.0) for r in ranks}
    numbers: dict[str, Any] = {
        "retrieved_tokens_by_rank": {str(r): num(v) for r, v in tokens.items()},
        "loads_by_rank": {str(r): num(v) for r, v in count.items()},
    }
    if c.log_text is not None:
        numbers["log_retrieved_lines_by_rank"] = {
            str(r): n for r, n in sorted(log_retrievals(c.log_text).items())
        }
    hist = ", ".join(f"rank {r}: {num(count[r])} loads / {num(tokens[r])} tokens" for r in tokens)
    if not tokens:
        return Check(RETRIEVING, Status.UNDETERMINED, "no rank known; pass --tp", numbers)
    zero = [r for r, v in tokens.items() if v == 0]
    if len(zero) == len(tokens):
        return Check(RETRIEVING, Status.UNDETERMINED, _all_zero(s, hist), numbers)
    if zero:
        busy = [r for r in tokens if r not in zero]
        running, waiting = s.total(RUNNING), s.total(WAITING)
        if running + waiting > 0:
            # each rank ships its counters with its own step reports, up to a second apart
            # while requests run: one rank's first loads can be on the page before another's
            return Check(
                RETRIEVING,
                Status.WARN,
                f"ranks {zero} show no retrieval yet while ranks {busy} do ({hist}), but the "
                f"server is not drained ({num(running)} running, {num(waiting)} waiting): "
                "ranks ship their counters up to a second apart while requests run; run "
                "doctor again when it is idle",
                numbers,
            )
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


def _all_zero(s: Samples, hist: str) -> str:
    stored = s.total(STORED)
    queries = s.total(EXT_QUERIES)
    hits = s.total(EXT_HITS)
    hbm_hits = s.total(HBM_HITS)
    evictions = s.total("kvtier_evictions_total")
    causes = (
        "no rank has retrieved a token yet; three causes read the same here: "
        "(1) no reuse in the traffic yet (a prefix must repeat after it was stored); "
        f"(2) the reuse distance lies outside [HBM pool, tier): repeats were served by HBM "
        f"(prefix_cache_hits={num(hbm_hits)}) or evicted from the tier "
        f"(evictions={num(evictions)}); "
        f"(3) lookups never hit, the write-only tier: stored={num(stored)} tokens (all ranks), "
        f"external queries={num(queries)}, external hits={num(hits)}"
    )
    if stored > 0 and queries > 0 and hits == 0:
        lean = "the numbers fit (3) unless the traffic so far repeated no prefix"
    elif stored == 0:
        lean = "nothing is stored yet, so (1): send traffic that repeats a prefix"
    else:
        lean = "the numbers do not single out one cause"
    return f"{causes}. {lean} ({hist})"


def external(s: Samples) -> Check:
    """External queries reached the connector and some of them hit the tier."""
    queries = s.total(EXT_QUERIES)
    hits = s.total(EXT_HITS)
    stored = s.total(STORED)
    numbers = {
        "external_queries": num(queries),
        "external_hits": num(hits),
        "stored_tokens": num(stored),
    }
    if not (s.has(EXT_QUERIES) or s.has(EXT_HITS)):
        return Check(
            EXTERNAL,
            Status.UNDETERMINED,
            f"the server exports no {EXT_QUERIES} / {EXT_HITS} (vLLM 0.32 and kvtier serve "
            "export both, connector or not: check that the URL is the serving engine's "
            "/metrics)",
            numbers,
        )
    said = (
        f"external queries={num(queries)}, hits={num(hits)}, "
        f"stored={num(stored)} tokens (all ranks)"
    )
    if not s.exported(STORED):
        return absent(EXTERNAL, STORED)
    if hits > 0:
        return Check(EXTERNAL, Status.PASS, said, numbers)
    hbm_hits = s.total(HBM_HITS)
    hbm_skips = s.total(SKIPPED_LOADS, reason="hbm_satisfies")
    numbers.update(hbm_hits=num(hbm_hits), skipped_hbm_satisfies=num(hbm_skips))
    if queries > 0 and stored > 0 and (hbm_hits > 0 or hbm_skips > 0):
        return Check(
            EXTERNAL,
            Status.WARN,
            f"repeats fit in HBM: {said}, but the prefix cache answered the repeats "
            f"(prefix_cache_hits={num(hbm_hits)}; tier hits skipped because HBM already held "
            f"them: {num(hbm_skips)}), so the tier was never needed yet; it pays once repeats "
            "outgrow the HBM pool",
            numbers,
        )
    recomputed = s.total(LOAD_DECISION_TOKENS, decision="recompute")
    by_policy = {r: s.total(SKIPPED_LOADS, reason=r) for r in DELIBERATE_SKIPS}
    by_policy = {r: v for r, v in by_policy.items() if v > 0}
    if queries > 0 and stored > 0 and (recomputed > 0 or by_policy):
        found = s.scheduler_value("kvtier_lookup_hit_tokens_total") or 0.0
        numbers.update(
            policy_recomputed_tokens=num(recomputed),
            skipped_by_policy={r: num(v) for r, v in sorted(by_policy.items())},
            lookup_hit_tokens=num(found),
        )
        skips = ", ".join(f"{r} {num(v)}" for r, v in sorted(by_policy.items()))
        # not FAIL (the path works: lookups find the chunks), not PASS either: a tier whose
        # every hit is turned away costs its writes and saves nothing here
        return Check(
            EXTERNAL,
            Status.WARN,
            f"the tier is read but none of its hits loaded, by design: {said}; lookups found "
            f"{num(found)} tokens, the load policy recomputed {num(recomputed)} hit tokens "
            f"(skipped loads: {skips or 'none'}): predicted slower to load than to prefill, or "
            "below min_load_tokens. Its writes buy nothing while this holds: a faster tier, a "
            "lower min_load_tokens, or load_policy: always (see the load-cost check)",
            numbers,
        )
    cold = s.scheduler_value("kvtier_cold_lookups_total") or 0.0
    asked = s.scheduler_value("kvtier_lookups_total") or 0.0
    if queries > 0 and stored > 0 and cold > 0 and asked == 0:
        numbers.update(cold_lookups=num(cold), lookups=num(asked))
        return Check(
            EXTERNAL,
            Status.WARN,
            f"no repeated prefix yet: {said}, and every one of {num(cold)} lookups started "
            "with a chunk this engine never saved (answered without asking the ranks), so "
            "nothing could hit; the tier pays once prompts share a first chunk",
            numbers,
        )
    # below memory, every lookup asks the ranks, a first prompt too; with memory alone only a
    # prompt whose first chunk this engine saved does (the rest are cold): a repeat already
    lower = any(v > 0 for (t,), v in s.group(CAPACITY, "tier").items() if t != "memory")
    if queries > 0 and stored > 0 and lower and asked < NEVER_READ_MIN:
        numbers.update(lookups=num(asked))
        return Check(
            EXTERNAL,
            Status.UNDETERMINED,
            f"{said}, after {num(asked)} lookups: too few to tell a tier never read from "
            f"traffic that has not repeated a prefix yet (judged from {NEVER_READ_MIN}); "
            "rerun after traffic with repeated prefixes",
            numbers,
        )
    if queries > 0 and stored > 0:
        numbers.update(lookups=num(asked))
        return Check(
            EXTERNAL,
            Status.FAIL,
            f"tier written and never read: {said}, in {num(asked)} lookups; check the lookup "
            "scope, or, if the traffic so far repeated no prefix, rerun after traffic that does",
            numbers,
        )
    if queries == 0:
        why = "no HBM miss has reached the connector yet"
    else:
        why = "nothing is stored in the tier yet (prompts shorter than a chunk, or saves failing)"
    return Check(EXTERNAL, Status.UNDETERMINED, f"{said}: {why}", numbers)


def identities(c: Context) -> Check:
    """The counter identities of a drained server, at the server's TP size."""
    s = c.s
    names = (HBM_QUERIES, HBM_HITS, EXT_QUERIES, EXT_HITS, RUNNING, WAITING)
    absent = [n for n in names if not s.has(n)]
    if absent:
        return Check(
            IDENTITIES, Status.UNDETERMINED, f"the server exports no {', '.join(absent)}", {}
        )
    running, waiting = s.total(RUNNING), s.total(WAITING)
    numbers: dict[str, Any] = {"running": num(running), "waiting": num(waiting)}
    if running + waiting > 0:
        return Check(
            IDENTITIES,
            Status.WARN,
            f"not drained ({num(running)} running, {num(waiting)} waiting): counters are "
            "taken at different moments of a request, so the identities only close on an idle "
            "server; run doctor again when it is",
            numbers,
        )
    tp = c.world
    if tp is None:
        return Check(IDENTITIES, Status.UNDETERMINED, "TP unknown; pass --tp", numbers)
    ids = scrape.identities(Counters.of(c.s.ms), tp, offload=True)
    numbers["tp"] = tp
    numbers["identities"] = [i.to_json() for i in ids]
    failed = [i for i in ids if not i.holds]
    said = "; ".join(i.describe() for i in (failed or ids))
    return Check(IDENTITIES, Status.FAIL if failed else Status.PASS, said, numbers)
