"""`kvtier bench cache`: what the tier's replacement policy serves under capacity pressure, as
ratios to the offline optimum, next to the previous policy and behind the scheduler's
admission; then the retention rows, with clients that hint their next turn. Streams, columns
and targets: docs/benchmarks.md."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvtier.bench import cache_cost
from kvtier.bench.table import MISS, PASS, Report, Row, Target, report_console, write_json
from kvtier.cachemodel import workloads
from kvtier.cachemodel.hinting import NORMALIZATIONS, hint_point
from kvtier.cachemodel.legacy import legacy_predict
from kvtier.cachemodel.optimum import infinite_leading, optimal_leading
from kvtier.cachemodel.predict import drive_tier, predict, tally
from kvtier.cachemodel.stream import Request, from_trace, hbm_floors, working_set
from kvtier.cachemodel.trace import MOONCAKE_BLOCK, read_trace_rows
from kvtier.cachemodel.turns import Turn, trace_turns
from kvtier.data import MOONCAKE_SYNTHETIC, bundled_trace, resolve_trace
from kvtier.errors import ConfigError
from kvtier.offload.admission import ADAPTIVE

DEFAULT_TRACE = bundled_trace()
DEFAULT_JSON = Path("runs/bench-cache.json")

HBM_FRACTIONS = (0.0, 0.05)
CAPACITIES = (0.1, 0.3, 0.5, 1.0)
QUICK_CAPACITIES = (0.1, 0.3)

SESSIONS = "sessions"
TARGET_HBM, TARGET_TIER, TARGET_RATIO = 0.05, 0.3, 0.55
MAX_LOSS_POINTS = 2.0

RETENTION_TIERS = (0.1, 0.3)
QUICK_RETENTION_TIERS = (0.3,)
# retained chunks' cap (of the tier) and the conversations hinting in the mixed run
RETENTION_BUDGET, RETENTION_SHARE = 0.7, 0.5
RETENTION_RATIO = 0.8

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Workload(Generic[T]):
    """A named stream (of requests, or of timed conversation turns) and where it came from."""

    name: str
    describe: str
    build: Callable[[], list[T]]
    chunk_tokens: int = 256  # tokens a chunk stands for (the cost view prices them)


def default_workloads(trace: Path | None) -> list[Workload[Request]]:
    """The table's streams; the Mooncake row needs `trace` (None leaves it out)."""
    out = [
        Workload(
            "zipf pool",
            "200 prefixes of 4-16 chunks, Zipf(1.0) popularity, 1 one-off tail chunk, 8000 reqs",
            lambda: workloads.prefix_pool(zipf=1.0),
        ),
        Workload(
            "uniform pool",
            "200 prefixes of 4-16 chunks, uniform popularity, 1 one-off tail chunk, 8000 reqs",
            lambda: workloads.prefix_pool(),
        ),
        Workload(
            SESSIONS,
            "1500 chat sessions over 2000 s, 8 turns on average, 4 shared system prompts, think "
            "5 s or (30%) 1000 s",
            lambda: workloads.sessions(),
        ),
        Workload(
            "round-robin turns",
            "100 conversations x 8 turns, every turn t before any t+1 (bench run multi_turn)",
            lambda: workloads.round_robin(),
        ),
    ]
    if trace is not None:
        out.append(
            Workload(
                "mooncake trace",
                f"{trace.name}, one chunk per {MOONCAKE_BLOCK}-token block",
                lambda: from_trace(read_trace_rows(trace), MOONCAKE_BLOCK),
                MOONCAKE_BLOCK,
            )
        )
    return out


def retention_workloads(trace: Path | None) -> list[Workload[Turn]]:
    """The retention rows' streams; the Mooncake row needs `trace` (None leaves it out)."""
    out = [
        Workload(
            SESSIONS,
            "the sessions above, each turn at its time, next turn known to its client",
            lambda: workloads.session_turns(),
        ),
        Workload(
            "agent loops",
            "600 agents over 2000 s, 12 steps on average, 4 shared system prompts of 4 chunks, "
            "tool pauses 3 s or (10%) a person's 600 s",
            lambda: workloads.agent_turns(),
        ),
    ]
    if trace is not None:
        out.append(
            Workload(
                "mooncake trace",
                f"{trace.name} at its timestamps, a turn's next the first later prompt holding it",
                lambda: trace_turns(read_trace_rows(trace), MOONCAKE_BLOCK),
            )
        )
    return out


def run(
    *,
    quick: bool = False,
    trace: Path | None = DEFAULT_TRACE,
    json_path: Path | None = None,
    progress: Callable[[str], None] = lambda _: None,
    workload_list: Sequence[Workload[Request]] | None = None,
    retention_list: Sequence[Workload[Turn]] | None = None,
    retention_budget: float = RETENTION_BUDGET,
    only: Sequence[str] = (),
    retention: bool = True,
) -> dict[str, Any]:
    """Run the table, write its JSON document and return it. `workload_list` and
    `retention_list` replace the default streams; given `workload_list` alone, no retention
    rows are run. `only` keeps the default streams of those names (`--workload`);
    `retention=False` leaves the retention rows out (`--no-retention`)."""
    trace = None if trace is None else resolve_trace(trace)
    if only:
        workload_list, retention_list = _only(
            only, default_workloads(trace), retention_workloads(trace)
        )
    if trace is not None and not trace.is_file():
        raise ConfigError(
            f"--trace {str(trace)!r} is not a file; pass a Mooncake JSONL trace, "
            f"{MOONCAKE_SYNTHETIC!r} (the default, bundled with kvtier) or --no-trace to leave "
            "its rows out"
        )
    capacities = QUICK_CAPACITIES if quick else CAPACITIES
    report = Report(
        bench="cache",
        title="kvtier bench cache: tier hits under capacity pressure, as ratios to the optimum",
    )
    workloads = workload_list if workload_list is not None else default_workloads(trace)
    cost: list[dict[str, Any]] = []
    rows = _capacity_rows(report, workloads, capacities, progress, cost)
    _add_target(report, rows)
    report.meta["table"] = rows
    report.meta["cost"] = cost
    if not retention:
        retention_list = []
    elif retention_list is None and workload_list is None:
        retention_list = retention_workloads(trace)
    kept = _retention(
        report,
        retention_list or (),
        QUICK_RETENTION_TIERS if quick else RETENTION_TIERS,
        retention_budget,
        progress,
    )
    report.meta["retention"] = kept
    report.footnotes.extend(
        [
            "rates are tier hits over the chunks the HBM missed (all chunks for the tier alone); "
            "tier and HBM sizes are fractions of each stream's distinct chunks",
            "optimum: Belady over the stream, a deeper chunk first on ties (prefix-closed, exact "
            "for the tier alone; behind HBM the reference point); infinite: cold misses only",
            "kvtier: a rank's TierStack over the real MemoryTier, driven as scheduler and worker "
            "do (lookup touches the run, saves commit deepest-first under their parents); "
            "previous: the segmented LRU as the previous engine drove it",
        ]
    )
    if cost:
        report.footnotes.append(cache_cost.footnote())
    if kept:
        report.footnotes.append(
            f"retention: HBM 5% and tier sized of ('of') all distinct chunks ('distinct') or the "
            f"peak live working set ('live': chunks referenced again and alive at once); hints "
            f"retain a prompt until the conversation's next turn + 5 s, at most "
            f"{100 * retention_budget:.0f}% of the tier retained (a hint due back sooner "
            f"displaces later ones, then clips: retention_full=soonest); mixed: "
            f"{100 * RETENTION_SHARE:.0f}% of the "
            "conversations hint ('mix: hint', 'silent'); silent w/o: the silent ones when nobody "
            "hints; floor: the same on a tier shrunk by the budget; clipped: hints cut short "
            "(the JSON adds displaced and rejected chunks)"
        )
    doc = report.to_json()
    write_json(json_path or DEFAULT_JSON, doc)
    return doc


def _capacity_rows(
    report: Report,
    workloads: Sequence[Workload[Request]],
    capacities: Sequence[float],
    progress: Callable[[str], None],
    cost: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """Each stream's rows: per HBM and tier size, kvtier's hits next to the optimum's, the
    infinite tier's and the previous policy's (added to `report` as they are made); the cost
    view's rows of the cell it prices go to `cost`."""
    rows: list[dict[str, Any]] = []
    for w in workloads:
        requests = w.build()
        ws = working_set(requests)
        progress(f"{w.name}: {len(requests):,} requests, working set {ws:,} chunks")
        for hbm_f in HBM_FRACTIONS:
            floors = hbm_floors(requests, round(hbm_f * ws))
            infinite = tally(requests, floors, infinite_leading(requests))
            for cap_f in capacities:
                cap = max(1, round(cap_f * ws))
                opt = tally(requests, floors, optimal_leading(requests, cap))
                done = drive_tier(requests, cap, floors)
                kv = tally(requests, floors, done.leads, written=done.written)
                if (hbm_f, cap_f) == cache_cost.CELL:
                    cost += cache_cost.cost_rows(
                        report, w.name, requests, floors, done.leads, w.chunk_tokens
                    )
                adm = predict(requests, cap, floors, admission=ADAPTIVE)
                old = legacy_predict(requests, cap, floors)
                rows.append(
                    {
                        "workload": w.name,
                        "hbm_fraction": hbm_f,
                        "tier_fraction": cap_f,
                        "tier_chunks": cap,
                        "optimum": 100 * opt.rate,
                        "infinite": 100 * infinite.rate,
                        "kvtier": 100 * kv.rate,
                        "admission": 100 * adm.rate,
                        "written": kv.written,
                        "admission_written": adm.written,
                        "admission_rejected_returns": adm.regret,
                        "previous": 100 * old.rate,
                        "missed_chunks": kv.missed,
                    }
                )
                _add_row(report, rows[-1])
        report.meta.setdefault("workloads", {})[w.name] = {
            "describe": w.describe,
            "requests": len(requests),
            "working_set_chunks": ws,
        }
    return rows


def _retention(
    report: Report,
    streams: Sequence[Workload[Turn]],
    capacities: Sequence[float],
    budget: float,
    progress: Callable[[str], None],
) -> list[dict[str, Any]]:
    """The retention rows and their targets; the rows as plain dicts."""
    rows: list[dict[str, Any]] = []
    for w in streams:
        turns = w.build()
        progress(f"retention, {w.name}: {len(turns):,} turns")
        for norm in NORMALIZATIONS:
            for cap_f in capacities:
                p = hint_point(turns, norm, TARGET_HBM, cap_f, budget=budget, share=RETENTION_SHARE)
                r = {"workload": w.name, "describe": w.describe, **p.to_json()}
                rows.append(r)
                report.add(
                    Row(
                        id=f"retention.{w.name.replace(' ', '_')}.{norm}.tier{cap_f:g}",
                        label=f"{_retention_label(r)}: with hints",
                        value=r["hinted"],
                        unit="%",
                        raw=r["optimum"] if r["optimum"] > 0 else None,
                        detail={k: r[k] for k in ("plain", "mixed_silent", "silent_floor")},
                    )
                )
                if (w.name, cap_f) == (SESSIONS, TARGET_TIER):
                    report.add(
                        Row(
                            id=f"target.retention_{norm}",
                            label=f"{_retention_label(r)}: hinted / optimum",
                            value=_ratio(r["hinted"], r["optimum"]) or 0.0,
                            unit="x",
                            target=Target("value", ">=", RETENTION_RATIO),
                            detail={"without_hints": _ratio(r["plain"], r["optimum"]) or 0.0},
                        )
                    )
    if rows:
        below = [_retention_label(r) for r in rows if r["mixed_silent"] < r["silent_floor"]]
        report.add(
            Row(
                id="target.retention_silent_floor",
                label="retention rows where the silent conversations fall below their floor",
                value=float(len(below)),
                unit="rows",
                target=Target("value", "<=", 0.0),
                detail={"rows": below},
            )
        )
    return rows


def _retention_label(r: dict[str, Any]) -> str:
    return f"{r['workload']}, HBM 5%, tier {100 * r['tier_fraction']:.0f}% {r['normalization']}"


def _ratio(value: float, optimum: float) -> float | None:
    return value / optimum if optimum > 0 else None


def _label(r: dict[str, Any]) -> str:
    hbm = f"HBM {100 * r['hbm_fraction']:.0f}%" if r["hbm_fraction"] else "tier alone"
    return f"{r['workload']}, {hbm}, tier {100 * r['tier_fraction']:.0f}%"


def _add_row(report: Report, r: dict[str, Any]) -> None:
    slug = f"{r['workload'].replace(' ', '_')}.hbm{r['hbm_fraction']:g}.tier{r['tier_fraction']:g}"
    report.add(
        Row(
            id=slug,
            label=_label(r),
            value=r["kvtier"],
            unit="%",
            raw=r["optimum"] if r["optimum"] > 0 else None,
            target=Target("value", ">=", r["previous"] - MAX_LOSS_POINTS),
            detail={"previous": r["previous"], "infinite": r["infinite"], "optimum": r["optimum"]},
        )
    )


def _slug(name: str) -> str:
    return name.lower().replace(" ", "-").replace("_", "-")


def _only(
    names: Sequence[str],
    table: Sequence[Workload[Request]],
    retention: Sequence[Workload[Turn]],
) -> tuple[list[Workload[Request]], list[Workload[Turn]]]:
    """The default streams named in `names` (any of "mooncake trace", mooncake-trace,
    mooncake_trace); an unknown name is an error listing the known ones."""
    known = {_slug(w.name) for w in (*table, *retention)}
    wanted = {_slug(n) for n in names}
    if unknown := sorted(wanted - known):
        raise ConfigError(
            f"--workload {', '.join(unknown)} is unknown; use one of {', '.join(sorted(known))}"
            + ("" if "mooncake-trace" in known else " (mooncake-trace needs a --trace)")
        )
    return (
        [w for w in table if _slug(w.name) in wanted],
        [w for w in retention if _slug(w.name) in wanted],
    )


def _add_target(report: Report, rows: Sequence[dict[str, Any]]) -> None:
    for r in rows:
        if (r["workload"], r["hbm_fraction"], r["tier_fraction"]) == (
            SESSIONS,
            TARGET_HBM,
            TARGET_TIER,
        ):
            ratio = _ratio(r["kvtier"], r["optimum"])
            report.add(
                Row(
                    id="target.sessions_ratio_to_optimum",
                    label=f"{_label(r)}: kvtier / optimum",
                    value=0.0 if ratio is None else ratio,
                    unit="x",
                    target=Target("value", ">=", TARGET_RATIO),
                    detail={"previous": _ratio(r["previous"], r["optimum"]) or 0.0},
                )
            )


def print_table(doc: dict[str, Any], console: Console | None = None) -> None:
    """The table with the previous policy as a column, then the targets."""
    verdict = ("result", "left", lambda r: _verdict(r["kvtier"] >= r["previous"] - MAX_LOSS_POINTS))
    rows = doc["meta"]["table"]
    out = console or report_console()
    out.print(_rich_table(doc["title"], (*_POLICY_COLUMNS, verdict), rows))
    for i, note in enumerate(doc["footnotes"], start=1):
        out.print(Text(f"[{i}] {note}", style="dim"))
    if doc["meta"].get("cost"):
        title = f"cost view: prefill time the hits save, {cache_cost.SHAPE.name}"
        out.print(_rich_table(title, cache_cost.COLUMNS, doc["meta"]["cost"], no_wrap=2))
    if doc["meta"].get("retention"):
        title = "retention hints: a client that knows its next turn, behind a 5% HBM"
        out.print(_rich_table(title, _RETENTION_COLUMNS, doc["meta"]["retention"], no_wrap=2))
    for row in doc["rows"]:
        if row["id"].startswith("target."):
            verdict = PASS if row["pass"] else MISS
            was = "".join(
                f" ({name.replace('_', ' ')} {row['detail'][name]:.2f})"
                for name in ("previous", "without_hints")
                if name in row["detail"]
            )
            out.print(
                f"target: {row['label']} = {row['value']:.2f}{was}, {row['target']}: {verdict}"
            )
    priced = [r for r in doc["rows"] if r["id"].startswith(cache_cost.PREFIX)]
    if priced:
        worse = [r["label"] for r in priced if r["pass"] is False]
        out.print(
            "target: the cost policy saves at least what loading every hit or none saves, in "
            f"every cost row: {PASS if not worse else MISS}"
            + (f" ({', '.join(worse)})" if worse else "")
        )
    losses = [
        r
        for r in doc["rows"]
        if not r["id"].startswith(("target.", cache_cost.PREFIX)) and r["pass"] is False
    ]
    out.print(
        f"target: no row more than {MAX_LOSS_POINTS:g} points below the previous policy: "
        f"{PASS if not losses else MISS}"
        + (f" ({', '.join(r['label'] for r in losses)})" if losses else "")
    )
    s = doc["summary"]
    out.print(f"targets met: {s['passed']} of {s['targets']}")


Column = tuple[str, str, Callable[[dict[str, Any]], str | Text]]


def _rich_table(
    title: str, columns: Sequence[Column], rows: Sequence[dict[str, Any]], no_wrap: int = 0
) -> Table:
    """A table of `rows`, one column per (name, justify, cell); the first `no_wrap` unwrapped."""
    table = Table(title=title, title_justify="left")
    for i, (name, justify, _cell) in enumerate(columns):
        table.add_column(name, justify=justify, no_wrap=i < no_wrap)  # type: ignore[arg-type]
    for r in rows:
        table.add_row(*(cell(r) for _name, _justify, cell in columns))
    return table


def _pct(key: str) -> Callable[[dict[str, Any]], str]:
    return lambda r: f"{r[key]:.1f}%"


def _share(key: str) -> Callable[[dict[str, Any]], str]:
    return lambda r: f"{100 * r[key]:.0f}%"


def _of_optimum(key: str) -> Callable[[dict[str, Any]], str]:
    return lambda r: _fmt_ratio(_ratio(r[key], r["optimum"]))


def _verdict(ok: bool) -> Text:
    return Text(PASS, style="bold green") if ok else Text(MISS, style="bold red")


_POLICY_COLUMNS: tuple[Column, ...] = (
    ("workload", "left", lambda r: r["workload"]),
    ("HBM", "right", _share("hbm_fraction")),
    ("tier", "right", _share("tier_fraction")),
    ("optimum", "right", _pct("optimum")),
    ("infinite", "right", _pct("infinite")),
    ("kvtier", "right", _pct("kvtier")),
    ("/opt", "right", _of_optimum("kvtier")),
    ("previous", "right", _pct("previous")),
    ("/opt", "right", _of_optimum("previous")),
    ("Δ pts", "right", lambda r: f"{r['kvtier'] - r['previous']:+.1f}"),
    ("admission", "right", _pct("admission")),
    ("/opt", "right", _of_optimum("admission")),
    ("writes", "right", lambda r: _fmt_ratio(_ratio(r["admission_written"], r["written"]))),
)
# the retention rows: no hints, hints and a mixed run next to the optimum
_RETENTION_COLUMNS: tuple[Column, ...] = (
    ("workload", "left", lambda r: r["workload"]),
    ("of", "left", lambda r: r["normalization"]),
    ("tier", "right", _share("tier_fraction")),
    ("optimum", "right", _pct("optimum")),
    ("no hints", "right", _pct("plain")),
    ("/opt", "right", _of_optimum("plain")),
    ("hints", "right", _pct("hinted")),
    ("/opt", "right", _of_optimum("hinted")),
    ("mix: hint", "right", _pct("mixed_hinted")),
    ("silent", "right", _pct("mixed_silent")),
    ("silent w/o", "right", _pct("silent_plain")),
    ("floor", "right", _pct("silent_floor")),
    ("clipped", "right", lambda r: f"{r['hints']['clipped']:,}"),
)


def _fmt_ratio(r: float | None) -> str:
    return "—" if r is None else f"{r:.2f}"
