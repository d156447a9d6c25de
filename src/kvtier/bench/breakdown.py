"""Where a served window's step time went, read from the kvtier histograms on `/metrics`.

The server exports, per step: the time each kvtier hook took (`kvtier_hook_seconds{hook}`, the
scheduler's hooks under `rank="scheduler"`, the ranks' under their rank) and the CPU time of
the thread inside it (`kvtier_hook_cpu_seconds{hook}`: the rest is waiting for the GIL or a
core), the CPU time of the ranks' copy lanes (`kvtier_lane_cpu_seconds`), each rank's whole step
(`kvtier_step_seconds`), the time the scheduler loop waited on each lookup call
(`kvtier_scheduler_lookup_seconds`) and the steps each load kept its request parked
(`kvtier_load_parked_steps`, 0 for a load finished inside its step's forward). A window's
counter delta holds their bucket deltas; quantiles interpolate within buckets as Prometheus'
`histogram_quantile` does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from functools import partial
from operator import attrgetter
from typing import Any

from kvtier.bench.table import Report, Row
from kvtier.scrape import LabelKey, MetricSet

SCHEDULER = "scheduler"
HOOK = "kvtier_hook_seconds"
HOOK_CPU = "kvtier_hook_cpu_seconds_total"
LANE_CPU = "kvtier_lane_cpu_seconds_total"
STEP = "kvtier_step_seconds"
LOOKUP_CALL = "kvtier_scheduler_lookup_seconds"
PARKED = "kvtier_load_parked_steps"
SYNC_LOADS = "kvtier_sync_loads_total"
# display order: the scheduler's hooks, then the ranks'
# the tier's cost a verdict accepts: kvtier's time on the step's path plus its copy lanes' CPU,
# as a share of the step (the demo measured 1-2% on 2 cores; a planted cost of 10% fails)
COST_SHARE_LIMIT = 0.05
SCHEDULER_HOOKS = ("lookup", "meta", "reports", "stats")
RANK_HOOKS = ("load", "save", "report")


@dataclass(frozen=True, slots=True)
class Hist:
    """One histogram's delta over a window, summed over the ranks it was read for."""

    count: float
    total: float
    buckets: tuple[tuple[float, float], ...]  # (upper bound, cumulative count), ascending

    def quantile(self, q: float) -> float | None:
        """The q-quantile (linear within its bucket); None without observations."""
        if self.count <= 0 or not self.buckets:
            return None
        rank = q * self.count
        lo_bound, lo_count = 0.0, 0.0
        for bound, cum in self.buckets:
            if cum >= rank:
                if math.isinf(bound):
                    return lo_bound  # beyond the last finite bucket: its bound is all we know
                if cum == lo_count:
                    return bound
                return lo_bound + (bound - lo_bound) * (rank - lo_count) / (cum - lo_count)
            lo_bound, lo_count = bound, cum
        return lo_bound

    @property
    def mean(self) -> float | None:
        """Mean observation; None without observations."""
        return self.total / self.count if self.count > 0 else None


def _of(key: LabelKey, scheduler: bool, labels: dict[str, str]) -> dict[str, str] | None:
    """The sample's labels when it is the scheduler's (or a rank's) and carries `labels`."""
    lab = dict(key)
    if (lab.get("rank") == SCHEDULER) != scheduler:
        return None
    if any(lab.get(k) != v for k, v in labels.items()):
        return None
    return lab


def hist(delta: MetricSet, name: str, *, scheduler: bool, **labels: str) -> Hist:
    """Histogram `name` in `delta`, over the scheduler (`rank="scheduler"`) or over every rank."""
    per_bound: dict[float, float] = {}
    count = total = 0.0
    for (sample, key), value in delta.samples.items():
        if not sample.startswith(name) or (lab := _of(key, scheduler, labels)) is None:
            continue
        suffix = sample[len(name) :]
        if suffix == "_bucket":
            bound = float(lab["le"])
            per_bound[bound] = per_bound.get(bound, 0.0) + value
        elif suffix == "_count":
            count += value
        elif suffix == "_sum":
            total += value
    return Hist(count, total, tuple(sorted(per_bound.items())))


@dataclass(frozen=True, slots=True)
class HookCost:
    """One hook over a window: steps it ran in, ms per such step (p50, p99, mean), ms per
    engine step (its total over every step, the share it takes of a step) and the CPU ms of
    its thread per engine step (the rest of its time it waited)."""

    hook: str
    side: str  # "scheduler" or "ranks"
    steps: int
    p50_ms: float | None
    p99_ms: float | None
    mean_ms: float | None
    per_step_ms: float | None
    cpu_per_step_ms: float | None


@dataclass(frozen=True, slots=True)
class Breakdown:
    """A window's step time next to what kvtier's hooks took of it, and the parked steps."""

    steps: int  # engine steps (per rank)
    step_p50_ms: float | None
    step_p99_ms: float | None
    step_mean_ms: float | None
    hooks: tuple[HookCost, ...]
    lookup_calls: int
    lookup_call_p50_ms: float | None
    lookup_call_p99_ms: float | None
    loads: int
    sync_loads: int
    parked_p50_steps: float | None
    parked_p99_steps: float | None
    parked_mean_steps: float | None
    lanes_cpu_per_step_ms: float | None  # per rank: copy work beside the step, not inside it

    def hook(self, name: str) -> HookCost | None:
        """The named hook's cost, if it is known."""
        return next((h for h in self.hooks if h.hook == name), None)

    @property
    def path_cpu_per_step_ms(self) -> float | None:
        """kvtier's own CPU on the step's path: every hook's thread CPU per engine step (the
        scheduler's, plus one rank's); None where no hook reported CPU time."""
        known = [h.cpu_per_step_ms for h in self.hooks if h.cpu_per_step_ms is not None]
        return sum(known) if known else None

    @property
    def path_per_step_ms(self) -> float | None:
        """kvtier's wall time on the step's path: every hook's time per engine step (the
        scheduler's, plus one rank's), waits included; None where no hook was timed."""
        known = [h.per_step_ms for h in self.hooks if h.per_step_ms is not None]
        return sum(known) if known else None

    @property
    def cost_share(self) -> float | None:
        """The tier's cost as a share of the step (`cost_share`); None without step times."""
        return cost_share(self.path_per_step_ms, self.lanes_cpu_per_step_ms, self.step_mean_ms)

    def to_json(self) -> dict[str, object]:
        """Every field (hooks as a list of objects) and the path's wall and CPU per step."""
        out = asdict(self)
        out["hooks"] = [asdict(h) for h in self.hooks]
        out["path_per_step_ms"] = self.path_per_step_ms
        out["path_cpu_per_step_ms"] = self.path_cpu_per_step_ms
        return out

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Breakdown:
        """The breakdown `to_json` wrote (a recorded run's summary)."""
        kw = {f.name: doc[f.name] for f in fields(cls) if f.name != "hooks"}
        return cls(hooks=tuple(HookCost(**h) for h in doc["hooks"]), **kw)


def cost_share(
    path_ms: float | None, lanes_cpu_ms: float | None, step_ms: float | None
) -> float | None:
    """kvtier's cost on a step as a share of it: its hooks' wall time on the step's path
    (waits included) plus its copy lanes' CPU (on a loaded host they take cores from the
    forward), over the step's mean time. Read within one window, so unlike an ON/OFF
    throughput ratio it does not move with the machine's speed between windows."""
    if path_ms is None or step_ms is None or step_ms <= 0:
        return None
    return (path_ms + (lanes_cpu_ms or 0.0)) / step_ms


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def breakdown(delta: MetricSet, world: int) -> Breakdown:
    """The step breakdown of one window's counter delta; `world` ranks per engine."""
    step = hist(delta, STEP, scheduler=False)
    steps = step.count / max(world, 1)
    hooks = []
    for side, names in ((SCHEDULER, SCHEDULER_HOOKS), ("ranks", RANK_HOOKS)):
        for name in names:
            h = hist(delta, HOOK, scheduler=side == SCHEDULER, hook=name)
            # the scheduler runs once per step; the ranks' sums are over `world` ranks
            per = steps if side == SCHEDULER else step.count
            cpu = _counter(delta, HOOK_CPU, scheduler=side == SCHEDULER, hook=name)
            hooks.append(
                HookCost(
                    name,
                    side,
                    int(h.count if side == SCHEDULER else h.count / max(world, 1)),
                    _ms(h.quantile(0.5)),
                    _ms(h.quantile(0.99)),
                    _ms(h.mean),
                    _ms(h.total / per) if per > 0 else None,
                    _ms(cpu / per) if cpu is not None and per > 0 else None,
                )
            )
    call = hist(delta, LOOKUP_CALL, scheduler=True)
    parked = hist(delta, PARKED, scheduler=True)
    return Breakdown(
        steps=int(steps),
        step_p50_ms=_ms(step.quantile(0.5)),
        step_p99_ms=_ms(step.quantile(0.99)),
        step_mean_ms=_ms(step.mean),
        hooks=tuple(hooks),
        lookup_calls=int(call.count),
        lookup_call_p50_ms=_ms(call.quantile(0.5)),
        lookup_call_p99_ms=_ms(call.quantile(0.99)),
        loads=int(parked.count),
        sync_loads=int(delta.total(SYNC_LOADS, rank=SCHEDULER)),
        parked_p50_steps=parked.quantile(0.5),
        parked_p99_steps=parked.quantile(0.99),
        parked_mean_steps=parked.mean,
        lanes_cpu_per_step_ms=_ms(lanes / step.count)
        if (lanes := _counter(delta, LANE_CPU, scheduler=False)) is not None and step.count > 0
        else None,
    )


def _counter(delta: MetricSet, name: str, *, scheduler: bool, **labels: str) -> float | None:
    """Counter `name`'s delta over the scheduler or over every rank; None when the server
    exports no such sample (an older kvtier), so a missing reading never reads as 0."""
    found = False
    total = 0.0
    for (sample, key), value in delta.samples.items():
        if sample != name or _of(key, scheduler, labels) is None:
            continue
        found = True
        total += value
    return total if found else None


def step_rows(
    report: Report, scope: str, shown: str, reps: Sequence[tuple[int, Breakdown]]
) -> None:
    """Rows `steps.<scope>.*`: the step time per rank and what kvtier took of it (its hooks,
    its CPU, the lookup calls' wait, the parked steps), means over the repetitions `reps`
    (each repetition in the detail); `shown` names the scope in labels. None without steps."""
    steps = [b for _, b in reps]
    if _known_mean([b.step_p50_ms for b in steps]) is None:
        return
    step_mean = _known_mean([b.step_mean_ms for b in steps])
    raw = step_mean if step_mean is not None and step_mean > 0 else None
    row = partial(_steps_row, report, scope, shown, reps, raw=raw)
    note = report.note(
        "step breakdown from the kvtier histograms on /metrics: step = one engine step on a "
        "rank, from its metadata to its report (the forward and every hook inside); a hook's "
        "value is its total time per engine step (ratio = its share of the step) and its "
        "detail the p50/p99 over the steps it ran in; scheduler hooks run in the engine "
        "process before (lookup, meta) and after (reports, stats) the forward, rank hooks "
        "around it (load: start_load_kv, where synchronous loads run; save: queueing saves; "
        "report: the rank's report and metrics snapshot); parked = engine steps a request "
        "waited per load, 0 for a load finished inside its step's forward"
    )
    step = attrgetter("step_p50_ms")
    row(
        "step_ms",
        f"kvtier step time per rank, p50 (raw = mean) {note}",
        step,
        p50=step,
        p99=attrgetter("step_p99_ms"),
        steps=attrgetter("steps"),
    )
    cpu = report.note(
        "CPU rows: thread CPU time inside kvtier's hooks (scheduler + one rank) per engine "
        "step, and of the ranks' copy lanes per step per rank; a hook's wall time less its CPU "
        "time is waiting (for the GIL behind a host thread, or a core), which the host's own "
        "code would wait too; CPU time is read within each window, so the share does not move "
        "with the machine's speed between windows as tok/s ratios do"
    )
    wall = attrgetter("path_per_step_ms")
    row(
        "path_ms",
        "kvtier time on the step's path (every hook, waits included), ms per step "
        "(raw = step mean)",
        wall,
        ms=wall,
    )
    path = attrgetter("path_cpu_per_step_ms")
    row(
        "path_cpu_ms",
        f"kvtier CPU on the step's path, ms per step (raw = step mean) {cpu}",
        path,
        ms=path,
    )
    lanes = attrgetter("lanes_cpu_per_step_ms")
    row("lanes_cpu_ms", "copy lanes' CPU, ms per step per rank (raw = step mean)", lanes, ms=lanes)
    for hook in steps[0].hooks:
        h = hook.hook
        if not any(c.steps for b in steps if (c := b.hook(h)) is not None):
            continue
        row(
            f"{hook.side}.{h}",
            f"{h} ({hook.side}), ms per step (raw = step mean)",
            _cost(h, "per_step_ms"),
            p50_ms=_cost(h, "p50_ms"),
            p99_ms=_cost(h, "p99_ms"),
            steps_run=_cost(h, "steps"),
            cpu_ms=_cost(h, "cpu_per_step_ms"),
        )
    row(
        "lookup_call_ms",
        "scheduler wait per lookup call, p50 (raw = step mean)",
        attrgetter("lookup_call_p50_ms"),
        p99_ms=attrgetter("lookup_call_p99_ms"),
        calls=attrgetter("lookup_calls"),
    )
    row(
        "parked_steps",
        "steps a request waited parked per load, mean",
        attrgetter("parked_mean_steps"),
        unit="steps",
        raw=None,
        p50=attrgetter("parked_p50_steps"),
        p99=attrgetter("parked_p99_steps"),
        loads=attrgetter("loads"),
        sync_loads=attrgetter("sync_loads"),
    )


def _steps_row(
    report: Report,
    scope: str,
    shown: str,
    reps: Sequence[tuple[int, Breakdown]],
    key: str,
    label: str,
    of: Callable[[Breakdown], float | None],
    unit: str = "ms",
    raw: float | None = None,
    **detail: Callable[[Breakdown], Any],
) -> None:
    """Row `steps.<scope>.<key>`: `of`'s mean over the repetitions (no row where it is
    unknown), each repetition's `detail` values in its detail."""
    value = _known_mean([of(b) for _, b in reps])
    if value is None:
        return
    per_rep = {
        f"rep{rep}.{k}": float(v)
        for k, get in detail.items()
        for rep, b in reps
        if (v := get(b)) is not None
    }
    report.add(Row(f"steps.{scope}.{key}", f"{shown}: {label}", value, unit, raw, None, per_rep))


def _cost(hook: str, field: str) -> Callable[[Breakdown], float | None]:
    """A hook's `field` in a breakdown (None where the hook is unknown)."""
    return lambda b: None if (c := b.hook(hook)) is None else getattr(c, field)


def _known_mean(xs: Sequence[float | None]) -> float | None:
    known = [x for x in xs if x is not None]
    return sum(known) / len(known) if known else None
