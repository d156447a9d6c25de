"""The report of `kvtier bench e2e`, for either host: one builder over the arms a run had
(a `Cast` names them, a `Wording` holds the host's footnotes). Where more than one arm is
compared with the baseline, row ids and labels name the arm; with an `again` arm (the baseline
run twice in a row, an A/A pair) the no-reuse targets also judge the A/A ratio."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.bench import analysis
from kvtier.bench.arms import ArmRun, Window, Workload
from kvtier.bench.breakdown import Breakdown, breakdown, step_rows
from kvtier.bench.ceiling import Ceiling
from kvtier.bench.table import Report, Row, Target
from kvtier.bench.workload import NO_REUSE, PREFIX_POOL
from kvtier.scrape import Counters, Identity, identities

NO_REUSE_TARGET = 0.97
NO_REUSE_TTFT_TARGET = 1.03
# the two identities shown in rows of their own (for the tier arm); the rest are counted
MAIN_IDENTITIES = (
    ("hbm_misses_eq_external_queries", "HBM queries - hits == ext queries"),
    ("retrieved_eq_external_hits", "sum retrieved / TP == ext hits"),
)
_SPEED_UNITS = {
    "output_throughput": ("output tok/s", "tok/s"),
    "request_throughput": ("requests/s", "req/s"),
    "ttft_p50_ms": ("TTFT p50", "ms"),
    "ttft_p99_ms": ("TTFT p99", "ms"),
}


@dataclass(frozen=True, slots=True)
class Cast:
    """The arms of one report: `tier` (the only one exporting kvtier's retrieved counter),
    `base` (every ratio's denominator), `others` compared like the tier, and how rows name
    them; `pool_metrics` are the prefix pool's speed rows; `again` is the baseline run once
    more right after it (the A/A pair), or None."""

    host: str
    tier: str
    base: str
    labels: Mapping[str, str]
    others: tuple[str, ...] = ()
    pool_metrics: tuple[str, ...] = ("output_throughput", "ttft_p50_ms", "ttft_p99_ms")
    again: str | None = None
    outputs: str = "token ids"  # what the load engine returns to compare ("texts": vllm-bench)

    @property
    def compared(self) -> tuple[str, ...]:
        """The arms measured against the baseline, the tier first."""
        return (self.tier, *self.others)

    @property
    def output_checked(self) -> tuple[str, ...]:
        """The arms whose greedy outputs are compared with the baseline's: the compared ones,
        then the A/A arm."""
        return (*self.compared, *(() if self.again is None else (self.again,)))

    @property
    def named(self) -> bool:
        """Row ids and labels name the arm: more than one arm is compared with the baseline."""
        return bool(self.others)

    def says(self, what: str, arm: str) -> str:
        """`what` of `arm` in a label: `hit rate ON`, or `hit rate, kvtier` when named."""
        return f"{what}, {self.labels[arm]}" if self.named else f"{what} {self.labels[arm]}"

    def row_id(self, stem: str, arm: str) -> str:
        """`stem.arm` when named; a lone compared arm's rows are `stem` alone."""
        return f"{stem}.{arm}" if self.named else stem

    def arm_id(self, stem: str, arm: str) -> str:
        """`stem.arm` when named, else `stem_arm` (`hit_rate_on`, `hit_rate_off`)."""
        return f"{stem}.{arm}" if self.named else f"{stem}_{arm}"


@dataclass(frozen=True, slots=True)
class Wording:
    """The host's footnotes, in the order their markers are numbered: `lead` on the first
    row (arms, what was not run), then the prefix pool, ceilings, identities, the other
    checks and the no-reuse workload."""

    lead: tuple[str, ...]
    pool: str
    ceilings: str
    identities: str
    checks: str
    no_reuse: str


@dataclass(frozen=True, slots=True)
class WindowResult:
    """One window of one arm's repetition, analysed: client summary, counters, checks."""

    arm: str
    rep: int
    workload: str
    summary: analysis.Summary
    counters: Counters
    identities: list[Identity]
    checks: list[Identity]
    steps: Breakdown | None = None  # where the step time went (kvtier arms only)

    def to_json(self) -> dict[str, Any]:
        """The window as the report's meta lists it."""
        return {
            "arm": self.arm,
            "rep": self.rep,
            "workload": self.workload,
            "summary": self.summary.to_json(),
            "counters": self.counters.to_json(),
            "identities": [i.to_json() for i in self.identities],
            "client_server": [i.to_json() for i in self.checks],
            "step_breakdown": None if self.steps is None else self.steps.to_json(),
        }


def analyse(run: ArmRun, window: Window, tp: int, *, has_retrieved: bool = True) -> WindowResult:
    """Summary, counters, identities and (for an offloading arm exporting kvtier's counters)
    the step breakdown of one window; a window with no completed request raises."""
    records = window.load.records
    summary = analysis.summarize(records, window.load.duration_s)
    if summary.completed == 0:
        raise RuntimeError(
            f"{run.arm.upper()} rep {run.rep} {window.workload}: no request completed "
            f"(errors: {summary.errors}); server log: {run.log_path}"
        )
    counters = Counters.of(window.delta)
    return WindowResult(
        run.arm,
        run.rep,
        window.workload,
        summary,
        counters,
        identities(counters, tp, run.offload, has_retrieved=has_retrieved),
        analysis.client_server_checks(records, counters),
        breakdown(window.delta, tp) if run.offload and has_retrieved else None,
    )


class _Results:
    """The analysed windows of every arm, looked up by arm and workload."""

    def __init__(self, cast: Cast, runs: Sequence[ArmRun], tp: int) -> None:
        self.cast = cast
        self.runs = runs
        self.all = [
            analyse(r, w, tp, has_retrieved=r.arm == cast.tier)
            for r in runs
            for w in r.windows.values()
        ]

    def pick(self, arm: str, workload: str) -> list[WindowResult]:
        """`arm`'s windows of `workload`, by repetition."""
        xs = (x for x in self.all if x.arm == arm and x.workload == workload)
        return sorted(xs, key=lambda x: x.rep)

    def metric(self, arm: str, workload: str, name: str) -> float:
        """The mean of summary field `name` over the repetitions."""
        return _mean(_values(self.pick(arm, workload), name))

    def hit(self, arm: str) -> float:
        """The prefix pool's mean server hit rate, in %."""
        return _mean([x.counters.hit_rate for x in self.pick(arm, PREFIX_POOL)]) * 100

    def ext(self, arm: str) -> float:
        """The prefix pool's mean external (tier) hit rate, in %."""
        return _mean([x.counters.external_hit_rate for x in self.pick(arm, PREFIX_POOL)]) * 100

    def vs(self, arm: str, base: str, workload: str, name: str, row_id: str, label: str,
           unit: str, target: Target | None = None) -> Row:  # fmt: skip
        """`arm`'s mean of `name` with `base`'s as raw, each repetition in the detail."""
        return Row(
            row_id,
            label,
            self.metric(arm, workload, name),
            unit,
            raw=_positive(self.metric(base, workload, name)),
            target=target,
            detail=_per_rep(self.pick(arm, workload), self.pick(base, workload), name),
        )

    def comparisons(self, workloads: Sequence[Workload]) -> dict[str, dict[str, list[Any]]]:
        """Per compared arm (and the A/A arm) and workload, its greedy outputs against the
        baseline's, by rep."""
        reps = sorted({r.rep for r in self.runs})
        return {
            arm: {
                wl.name: [
                    analysis.compare_outputs(
                        _window(self.runs, arm, rep, wl.name).load.records,
                        _window(self.runs, self.cast.base, rep, wl.name).load.records,
                    )
                    for rep in reps
                ]
                for wl in workloads
            }
            for arm in self.cast.output_checked
        }


def build_report(
    cast: Cast,
    wording: Wording,
    runs: Sequence[ArmRun],
    servers: Sequence[Mapping[str, Any]],
    workloads: Sequence[Workload],
    ceilings: Mapping[str, Mapping[str, Ceiling]],
    tp: int,
    quick: bool,
) -> Report:
    """The e2e report of `runs` (every arm of `cast`, every repetition); `servers` go to meta."""
    res = _Results(cast, runs, tp)
    report = Report("e2e", f"kvtier bench e2e ({cast.host}, TP {tp}{', quick' if quick else ''})")
    marks = "".join(report.note(text) for text in (*wording.lead, wording.pool))
    _speed_rows(report, res, f" {marks}")
    _hit_rows(report, res, ceilings[PREFIX_POOL], report.note(wording.ceilings))
    _identity_rows(report, res, wording)
    comparisons = res.comparisons(workloads)
    _output_rows(report, res, comparisons)
    report.add(_failed_row(res.all))
    _no_reuse_rows(report, res, report.note(wording.no_reuse))
    _breakdown_rows(report, res.all, cast.tier)
    outputs = {
        arm: {w: [c.to_json() for c in cs] for w, cs in by_wl.items()}
        for arm, by_wl in comparisons.items()
    }
    report.meta["windows"] = [x.to_json() for x in res.all]
    # a lone compared arm's outputs are by workload, several arms' by arm first
    report.meta["outputs"] = outputs if cast.named else outputs[cast.tier]
    report.meta["servers"] = list(servers)
    return report


def _speed_rows(report: Report, res: _Results, marks: str) -> None:
    """The prefix pool's throughput and TTFT of each compared arm against the baseline."""
    c = res.cast
    first = True
    for name in c.pool_metrics:
        what, unit = _SPEED_UNITS[name]
        for arm in c.compared:
            label = f"prefix pool: {what}, {c.labels[arm]} (raw = {c.labels[c.base]})"
            rid = c.row_id(f"{PREFIX_POOL}.{name}", arm)
            report.add(res.vs(arm, c.base, PREFIX_POOL, name, rid, label + (marks * first), unit))
            first = False


def _hit_rows(report: Report, res: _Results, cp: Mapping[str, Ceiling], ceil_note: str) -> None:
    """The prefix pool's hit rates next to the ceilings simulated on the same prompts: the
    tier arm's against HBM+tier and the infinite bound, the others' against their own."""
    c, t, p = res.cast, res.cast.tier, PREFIX_POOL
    tier_ceiling = _positive(cp["hbm+tier"].hit_rate * 100)
    bound = _positive(cp["infinite"].hit_rate * 100)

    def split(arm: str) -> dict[str, float]:
        return {"external_pct": res.ext(arm), "hbm_pct": res.hit(arm) - res.ext(arm)}

    what = f"prefix pool: {c.says('hit rate', t)} (raw = HBM+tier ceiling) {ceil_note}"
    report.add(
        Row(c.arm_id(f"{p}.hit_rate", t), what, res.hit(t), "%", tier_ceiling, None, split(t))
    )
    if c.named:
        what = f"prefix pool: {c.says('HBM hit rate', t)} (raw = HBM+tier ceiling's HBM share)"
        hbm_share = _positive(cp["hbm+tier"].hbm_rate * 100)
        report.add(Row(f"{p}.hbm_hit_rate.{t}", what, res.hit(t) - res.ext(t), "%", hbm_share))
        what = (
            f"prefix pool: {c.says('external hit rate', t)} (raw = HBM+tier ceiling's tier share)"
        )
    else:
        what = f"prefix pool: {c.says('tier hit rate', t)} (raw = its ceiling share)"
    tier_share = _positive(cp["hbm+tier"].external_rate * 100)
    report.add(Row(c.arm_id(f"{p}.external_hit_rate", t), what, res.ext(t), "%", tier_share))
    # another arm's store is unbounded (ExampleConnector's): only the infinite cache bounds it
    for arm, raw, ceiling in (
        *((a, bound, "infinite-cache bound") for a in c.others),
        (c.base, _positive(cp["hbm"].hit_rate * 100), "HBM ceiling"),
    ):
        what = f"prefix pool: {c.says('hit rate', arm)} (raw = {ceiling})"
        report.add(
            Row(c.arm_id(f"{p}.hit_rate", arm), what, res.hit(arm), "%", raw, None, split(arm))
        )
    report.add(
        Row(
            c.row_id(f"{p}.hit_rate_bound", t),
            f"prefix pool: {c.says('hit rate', t)} (raw = infinite-cache bound)",
            res.hit(t),
            "%",
            raw=bound,
            target=None if bound is None else Target("ratio", "<=", 1.0),
        )
    )
    # found in the tier is live: a hit the load policy chose to recompute (`load_policy: cost`,
    # a loaded CPU host's memory load predicted slower than a small model's prefill) was found
    # there by design; a tier never read finds nothing either way
    ext = sum(x.counters.ext_hits for x in res.pick(t, p))
    turned = sum(x.counters.policy_recomputed for x in res.pick(t, p))
    report.add(
        Row(
            c.arm_id(f"{p}.external_hits", t),
            f"prefix pool: {c.says('external hit tokens', t)} + tier hits the load policy "
            "recomputed (tier is live)",
            ext + turned,
            "tokens",
            target=Target("value", ">=", 1),
            detail={
                "external_hits": ext,
                "policy_recomputed": turned,
                "retrieved_all_ranks": sum(x.counters.retrieved for x in res.pick(t, p)),
                **{
                    f"{a}_external_hits": sum(x.counters.ext_hits for x in res.pick(a, p))
                    for a in c.others
                },
            },
        )
    )


def _identity_rows(report: Report, res: _Results, wording: Wording) -> None:
    """The tier arm's two main identities (worst window), then every other check counted."""
    c = res.cast
    note = report.note(wording.identities)
    tier_windows = [x for x in res.all if x.arm == c.tier]
    for ident, short in MAIN_IDENTITIES:
        found = [(x, i) for x in tier_windows for i in x.identities if i.name == ident]
        first = found[0][1] if found else None
        shown = "" if first is None else f" ({_n(first.lhs)} == {_n(first.rhs)})"
        whose = f"identity, {c.labels[c.tier]}: " if c.named else "identity: "
        report.add(
            Row(
                f"identity.{ident}",
                f"{whose}{short}{shown}" + (f" {note}" if ident.startswith("hbm") else ""),
                max((abs(i.lhs - i.rhs) for _, i in found), default=0.0),
                "tokens",
                target=Target("value", "<=", 0),
                detail={f"{x.workload}.rep{x.rep}": i.describe() for x, i in found},
            )
        )
    main = {name for name, _ in MAIN_IDENTITIES}
    other = [
        (x, i)
        for x in res.all
        for i in x.identities + x.checks
        if not (x.arm == c.tier and i.name in main)
    ]
    failing = [(x, i) for x, i in other if not i.holds]
    report.add(
        Row(
            "identity.other_failing",
            f"other checks failing {report.note(wording.checks)}",
            len(failing),
            "checks",
            target=Target("value", "<=", 0),
            detail={
                f"{x.arm}.{x.workload}.rep{x.rep}.{i.name}": i.describe()
                for x, i in (failing or other)[:24]
            },
        )
    )


def _output_rows(
    report: Report, res: _Results, comparisons: Mapping[str, Mapping[str, list[Any]]]
) -> None:
    """Greedy outputs differing from the baseline's: none allowed for the tier arm nor for
    the A/A arm (the baseline itself, so a difference there means the host is not
    deterministic and the tier's zero proves nothing), the others' as measured."""
    c = res.cast
    for arm, by_wl in comparisons.items():
        cmp = [x for cs in by_wl.values() for x in cs]
        tier, again = arm == c.tier, arm == c.again
        report.add(
            Row(
                "outputs.mismatches" if tier else f"outputs.mismatches.{arm}",
                f"{c.says('greedy outputs differing', arm)} vs {c.labels[c.base]} ({c.outputs})"
                + ("" if tier else " (A/A)" if again else ", as measured"),
                sum(x.mismatches for x in cmp),
                "requests",
                target=Target("value", "<=", 0) if tier or again else None,
                detail={
                    "compared": sum(x.compared for x in cmp),
                    "missing": sum(x.missing for x in cmp),
                    "first_mismatches": json.dumps(
                        {w: [x.first_mismatches for x in cs] for w, cs in by_wl.items()}
                    ),
                },
            )
        )


def _no_reuse_rows(report: Report, res: _Results, nr_note: str) -> None:
    """No reuse against the baseline, its targets' worst repetitions, then the tier arm
    against each other arm on the prefix pool."""
    c, q = res.cast, NO_REUSE
    noisy = _unresolved(res)
    for name in ("output_throughput", "ttft_p50_ms"):
        what, unit = _SPEED_UNITS[name]
        for arm in c.compared:
            target = name == "output_throughput" and arm == c.tier
            label = f"no reuse: {what}, {c.labels[arm]} (raw = {c.labels[c.base]})"
            row = res.vs(
                arm, c.base, q, name, c.row_id(f"{q}.{name}", arm),
                label + (f" {nr_note}" if target else ""), unit,
                Target("ratio", ">=", NO_REUSE_TARGET) if target else None,
            )  # fmt: skip
            report.add(_undetermined(row, noisy.get(name)) if target else row)
    sep = " / " if c.named else "/"
    shown = f"{c.labels[c.tier]}{sep}{c.labels[c.base]}"
    _no_reuse_worst(report, res.pick(c.tier, q), res.pick(c.base, q), shown, noisy=noisy)
    if c.again is not None:
        _noise_floor_rows(report, res, c.again, sep)
    for arm in c.others:
        for name, target in (
            ("output_throughput", Target("ratio", ">=", 1.0)),
            ("ttft_p50_ms", Target("ratio", "<=", 1.0)),
        ):
            what, unit = _SPEED_UNITS[name]
            row = res.vs(
                c.tier, arm, PREFIX_POOL, name, f"{PREFIX_POOL}.{name}.{c.tier}_vs_{arm}",
                f"prefix pool: {what}, {c.labels[c.tier]} (raw = {c.labels[arm]})", unit,
                target,
            )  # fmt: skip
            report.add(_within_noise(row, _pool_noise(res, name, target)))


def _pool_noise(res: _Results, name: str, target: Target) -> float | None:
    """The prefix pool's A/A pair's worst repetition of `name`, folded toward `target`'s
    side (None without an A/A arm): how far the machine alone moved that ratio in this run."""
    c = res.cast
    if c.again is None:
        return None
    a, base = res.pick(c.again, PREFIX_POOL), res.pick(c.base, PREFIX_POOL)
    row = _worst_rep_row("aa", "aa", a, base, name, Target("value", target.op, 1.0), folded=True)
    return None if row is None else row.value


def _within_noise(row: Row, aa: float | None) -> Row:
    """A row judged on a ratio bound of 1.0 (no margin) that misses it by less than the A/A
    pair moved: UNDETERMINED, not a MISS (two arms as fast as each other read either side of
    1.0 from run to run); a miss beyond the A/A pair's reach stays a MISS."""
    t, r = row.target, row.ratio
    if t is None or aa is None or r is None or row.passed is not False:
        return row
    if (r < aa) if t.op == ">=" else (r > aa):
        return row
    return row.undetermined(f"{r:.3f}x is within the A/A pair's {aa:.3f}x", aa_worst_rep=aa)


def _failed_row(results: Sequence[WindowResult]) -> Row:
    """Requests that failed in any window of any arm; must be none."""
    return Row(
        "requests.failed",
        "requests failed, all arms",
        sum(x.summary.failed for x in results),
        "requests",
        target=Target("value", "<=", 0),
        detail={
            "sent": sum(x.summary.requests for x in results),
            "osl_mismatch": sum(x.summary.osl_mismatch for x in results),
            "errors": json.dumps(sorted({e for x in results for e in x.summary.errors})[:5]),
        },
    )


def _window(runs: Sequence[ArmRun], arm: str, rep: int, workload: str) -> Window:
    for r in runs:
        if r.arm == arm and r.rep == rep:
            return r.windows[workload]
    raise KeyError(f"no {arm} run for repetition {rep}")


def _values(xs: Sequence[WindowResult], name: str) -> list[float]:
    return [float(getattr(x.summary, name)) for x in xs]


def _ratios(a: Sequence[WindowResult], base: Sequence[WindowResult], name: str) -> dict[int, float]:
    """`name` of `a` over `base`, paired by repetition, where the ratio is defined."""
    by_rep = [{x.rep: v for x, v in zip(xs, _values(xs, name), strict=True)} for xs in (a, base)]
    return analysis.paired_ratios(*by_rep)


def _per_rep(
    a: Sequence[WindowResult], base: Sequence[WindowResult], name: str
) -> dict[str, float]:
    """Each repetition's value of both arms (keyed by arm) and their paired ratio; with two or
    more repetitions also the sample sd per arm and the mean and sd of the paired ratios."""
    out: dict[str, float] = {}
    ratios = _ratios(a, base, name)
    for x, b, vx, vb in zip(a, base, _values(a, name), _values(base, name), strict=True):
        out[f"rep{x.rep}.{x.arm}"] = vx
        out[f"rep{x.rep}.{b.arm}"] = vb
        if x.rep in ratios:
            out[f"rep{x.rep}.ratio"] = ratios[x.rep]
    if len(a) >= 2:
        out[f"{a[0].arm}.sd"] = analysis.spread(_values(a, name)).sd
        out[f"{base[0].arm}.sd"] = analysis.spread(_values(base, name)).sd
    if len(ratios) >= 2:
        sp = analysis.spread(ratios.values())
        out["ratio.mean"], out["ratio.sd"] = sp.mean, sp.sd
    return out


_WORKLOAD_NAMES = {PREFIX_POOL: "prefix pool", NO_REUSE: "no reuse"}


def _breakdown_rows(report: Report, results: Sequence[WindowResult], arm: str) -> None:
    """Per workload, `arm`'s step time on the ranks and what kvtier took of it."""
    for workload, shown in _WORKLOAD_NAMES.items():
        xs = sorted((x for x in results if x.arm == arm and x.workload == workload and x.steps),
                    key=lambda x: x.rep)  # fmt: skip
        step_rows(report, workload, shown, [(x.rep, x.steps) for x in xs if x.steps is not None])


def _noise_floor_rows(report: Report, res: _Results, again: str, sep: str) -> None:
    """The A/A pair (the baseline against itself run right after) under the no-reuse targets:
    a miss says this run cannot resolve them; then the prefix pool's A/A, as measured. An
    arm's ratio to itself has no sign worth keeping, so each repetition's is folded toward
    the side its target judges (1.04 counts as 1/1.04 for a ">=" target)."""
    c = res.cast
    note = report.note(
        f"A/A: {c.labels[again]} is the {c.labels[c.base]} arm started once more right after "
        f"it, the same way; its ratio to {c.labels[c.base]} (either way round) is what the "
        "machine alone moves a ratio by in this run; where it misses a target, that target's "
        "margin is inside this run's noise and the tier's row cannot be judged from this run"
    )
    shown = f"{c.labels[again]}{sep}{c.labels[c.base]} (A/A)"
    _no_reuse_worst(
        report, res.pick(again, NO_REUSE), res.pick(c.base, NO_REUSE), shown, key="aa_worst_rep",
        note=f" {note}", folded=True,
    )  # fmt: skip
    for name in ("output_throughput", "ttft_p50_ms"):
        what, _unit = _SPEED_UNITS[name]
        op = ">=" if name == "output_throughput" else "<="
        row = _worst_rep_row(
            f"{PREFIX_POOL}.{name}.aa_worst_rep",
            f"prefix pool: {what} {shown}, worst repetition",
            res.pick(again, PREFIX_POOL),
            res.pick(c.base, PREFIX_POOL),
            name,
            Target("value", op, 1.0),
            judged=False,
            folded=True,
        )
        if row is not None:
            report.add(row)


_NO_REUSE_TARGETS = (
    ("output_throughput", "output tok/s", Target("value", ">=", NO_REUSE_TARGET)),
    ("ttft_p50_ms", "TTFT p50", Target("value", "<=", NO_REUSE_TTFT_TARGET)),
)


def _unresolved(res: _Results) -> dict[str, float]:
    """Per no-reuse metric, the A/A pair's worst repetition where it misses the target
    itself: this run's noise is wider than the target's margin, so the tier's rows on that
    metric cannot be judged from it (a miss there would be the machine's, not the tier's)."""
    c = res.cast
    if c.again is None:
        return {}
    a, base = res.pick(c.again, NO_REUSE), res.pick(c.base, NO_REUSE)
    out = {}
    for name, _label, target in _NO_REUSE_TARGETS:
        row = _worst_rep_row("aa", "aa", a, base, name, target, folded=True)
        if row is not None and row.passed is False:
            out[name] = row.value
    return out


def _undetermined(row: Row | None, aa: float | None) -> Row | None:
    """`row` without its verdict when the A/A pair's worst repetition `aa` missed the same
    target: UNDETERMINED, never a MISS on the machine's noise (the value stays shown)."""
    if row is None or aa is None or row.target is None:
        return row
    return row.undetermined(
        f"the A/A pair itself read {aa:.3f}x, outside the target", aa_worst_rep=aa
    )


def _no_reuse_worst(
    report: Report,
    a: Sequence[WindowResult],
    base: Sequence[WindowResult],
    what: str,
    *,
    key: str = "worst_rep",
    note: str = "",
    folded: bool = False,
    noisy: Mapping[str, float] | None = None,
) -> None:
    """The no-reuse targets, met in every repetition: throughput and TTFT p50 ratios
    (`folded`: see `_worst_rep_row`); a metric in `noisy` is shown undetermined."""
    for name, label, target in _NO_REUSE_TARGETS:
        row = _worst_rep_row(
            f"{NO_REUSE}.{name}.{key}",
            f"no reuse: {label} {what}, worst repetition"
            + (note if name == "output_throughput" else ""),
            a,
            base,
            name,
            target,
            folded=folded,
        )
        row = _undetermined(row, (noisy or {}).get(name))
        if row is not None:
            report.add(row)


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _worst_rep_row(
    key: str,
    label: str,
    a: Sequence[WindowResult],
    base: Sequence[WindowResult],
    name: str,
    target: Target,
    *,
    judged: bool = True,
    folded: bool = False,
) -> Row | None:
    """The worst paired repetition ratio of `name` (`a` over `base`) against `target`: the
    lowest for a ">=" target, the highest for "<="; each repetition's ratio in the detail.
    Unless `judged`, the target only picks the worst side and the row has none; `folded`
    judges each ratio r as min(r, 1/r) (">=") or max(r, 1/r) ("<=")."""
    ratios = {f"rep{rep}.ratio": r for rep, r in _ratios(a, base, name).items()}
    if not ratios:
        return None
    values = list(ratios.values())
    judged_values = [_fold(r, target.op) for r in values] if folded else values
    worst = min(judged_values) if target.op == ">=" else max(judged_values)
    sp = analysis.spread(values)
    detail: dict[str, float] = {**ratios, "mean": sp.mean}
    if sp.n >= 2:
        detail["sd"] = sp.sd
    return Row(key, label, worst, "x", target=target if judged else None, detail=detail)


def _fold(r: float, op: str) -> float:
    """An unsigned ratio on the side `op` judges: min(r, 1/r) for ">=", max(r, 1/r) for "<="."""
    return min(r, 1 / r) if op == ">=" else max(r, 1 / r)


def _positive(x: float) -> float | None:
    """A raw baseline must be positive: a zero ceiling shows as no baseline."""
    return x if math.isfinite(x) and x > 0 else None


def _n(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.6g}"
