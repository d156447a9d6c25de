"""The HTML + PNG report of a `kvtier bench run` directory (matplotlib, Agg canvas, no pyplot).

`write_report(doc, out_dir)` draws, from the document `replay.analyse` returns:

    ttft_over_time.png        TTFT p50 per time bucket, one line per arm and repetition
    hit_rate_over_time.png    cache-read rate per bucket (client) and between scrapes (server)
    residency_over_time.png   kvtier_tier_residency_bytes per tier, sampled during the load
    ceiling_vs_measured.png   measured cache-read rate beside the simulated ceilings, per arm
    latency.png               TTFT and inter-token percentiles per arm (aiperf imports too)

and `report.html`, which embeds them with the summary table and per-arm details.
`kvtier bench report RUN_DIR` re-analyses a recorded run and re-renders all of it.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from kvtier.bench.table import MISS, PASS, cells_of, fmt, print_report, write_json

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

PNGS = (
    "ttft_over_time.png",
    "hit_rate_over_time.png",
    "residency_over_time.png",
    "ceiling_vs_measured.png",
    "latency.png",
)
_STYLES = ("-", "--", ":", "-.")
_DPI = 110


def write_report(doc: Mapping[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Write the PNGs and `report.html` under `out_dir`; returns their paths by short name."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    colors = _colors([*doc["arms"], *(a["name"] for a in doc.get("aiperf", []))])
    files = {
        "ttft": _save(_ttft_figure(doc, colors), out / PNGS[0]),
        "hit_rate": _save(_hit_figure(doc, colors), out / PNGS[1]),
        "residency": _save(_residency_figure(doc, colors), out / PNGS[2]),
        "ceiling": _save(_ceiling_figure(doc), out / PNGS[3]),
        "latency": _save(_latency_figure(doc), out / PNGS[4]),
    }
    page = out / "report.html"
    page.write_text(render_html(doc, [p.name for p in files.values()]), encoding="utf-8")
    files["html"] = page
    return files


def _colors(names: Sequence[str]) -> dict[str, str]:
    palette = [f"C{i}" for i in range(10)]
    return {n: palette[i % len(palette)] for i, n in enumerate(dict.fromkeys(names))}


def _figure(title: str, rows: int = 1) -> tuple[Figure, list[Axes]]:
    # matplotlib (kvtier[bench]) loads with the first figure, not with every module importing this
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4.8 if rows == 1 else 7.5), dpi=_DPI)
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(rows, 1, i + 1) for i in range(rows)]
    fig.suptitle(title)
    return fig, axes


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def _empty(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.35")


def _finish_time_axes(
    ax: Axes, doc: Mapping[str, Any], drawn: bool, ylabel: str, empty: str
) -> None:
    """Labels, grid, start-cut line and legend shared by every over-time chart."""
    if not drawn:
        _empty(ax, empty)
    cut = doc.get("cut_s") or 0
    if cut > 0:
        ax.axvline(cut, color="0.4", linestyle="--", linewidth=1, label=f"start cut {cut:g}s")
    ax.set_xlabel("seconds since the load started")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if drawn:
        ax.legend(fontsize=8)


def _ttft_figure(doc: Mapping[str, Any], colors: Mapping[str, str]) -> Figure:
    fig, (ax,) = _figure(f"TTFT p50 per {doc['bucket_s']:g}s bucket (by send time)")
    drawn = False
    for run in doc["runs"]:
        drawn |= _buckets(ax, doc, run, "ttft_p50_ms", 1.0, colors, "")
    _finish_time_axes(ax, doc, drawn, "TTFT p50 (ms)", "no completed request")
    return fig


def _hit_figure(doc: Mapping[str, Any], colors: Mapping[str, str]) -> Figure:
    fig, (ax,) = _figure("Cache-read rate over time (client: per bucket; server: per scrape)")
    drawn = False
    for run in doc["runs"]:
        drawn |= _buckets(ax, doc, run, "hit_rate", 100.0, colors, " (client)")
        server = run["series"]["server_hit"]
        if server:
            ax.plot(
                [p["t_s"] for p in server], [100.0 * p["hit_rate"] for p in server],
                _STYLES[run["rep"] % len(_STYLES)], marker="x", markersize=4, alpha=0.6,
                color=colors[run["arm"]], label=f"{run['arm']} rep {run['rep']} (server)",
            )  # fmt: skip
            drawn = True
    _finish_time_axes(ax, doc, drawn, "cache-read rate (%)", "no prompt tokens counted")
    ax.set_ylim(-2, 102)
    return fig


def _buckets(
    ax: Axes,
    doc: Mapping[str, Any],
    run: Mapping[str, Any],
    key: str,
    scale: float,
    colors: Mapping[str, str],
    suffix: str,
) -> bool:
    """Plot a run's per-bucket `key` (x `scale`) at the buckets' middles; False if it has none."""
    bucket = doc["bucket_s"]
    pts = [
        (b["t_s"] + bucket / 2, scale * b[key])
        for b in run["series"]["buckets"]
        if b[key] is not None
    ]
    if pts:
        xs, ys = zip(*pts, strict=True)
        ax.plot(
            xs, ys, _STYLES[run["rep"] % len(_STYLES)], marker="o", markersize=3,
            color=colors[run["arm"]], label=f"{run['arm']} rep {run['rep']}{suffix}",
        )  # fmt: skip
    return bool(pts)


def _residency_figure(doc: Mapping[str, Any], colors: Mapping[str, str]) -> Figure:
    fig, (ax,) = _figure("Tier residency (kvtier_tier_residency_bytes, summed over ranks)")
    tiers = sorted({t for run in doc["runs"] for t in run["series"]["residency"]})
    drawn = False
    for run in doc["runs"]:
        for tier, pts in sorted(run["series"]["residency"].items()):
            if not pts:
                continue
            ax.plot(
                [p[0] for p in pts], [p[1] / 2**20 for p in pts],
                _STYLES[tiers.index(tier) % len(_STYLES)], marker=".",
                color=colors[run["arm"]], label=f"{run['arm']} rep {run['rep']} {tier}",
            )  # fmt: skip
            drawn = True
    empty = "no tier residency samples (no kvtier tier, or no /metrics)"
    _finish_time_axes(ax, doc, drawn, "resident MiB", empty)
    return fig


def _ceiling_figure(doc: Mapping[str, Any]) -> Figure:
    fig, (ax,) = _figure("Cache-read rate: measured beside the ceilings (full window)")
    series = (
        ("server_hit_pct", "measured (server)"),
        ("client_hit_pct", "measured (client)"),
        ("ceiling_hbm_pct", "ceiling: HBM"),
        ("ceiling_hbm+tier_pct", "ceiling: HBM + tier"),
        ("ceiling_infinite_pct", "ceiling: infinite"),
    )

    def client(summary: Mapping[str, Any], key: str) -> float | None:
        return summary.get("cache_read_pct") if key == "client_hit_pct" else None

    groups = _groups(doc, series, client)
    _grouped_bars(ax, groups, series, "cache-read rate (%)")
    ax.set_ylim(0, 105)
    return fig


def _latency_figure(doc: Mapping[str, Any]) -> Figure:
    fig, axes = _figure("Latency percentiles (full window; mean over repetitions)", 2)
    for ax, key, label in ((axes[0], "ttft", "TTFT (ms)"), (axes[1], "itl", "ITL (ms)")):
        series = tuple((f"{key}_{p}_ms", p) for p in ("p50", "p90", "p99"))
        groups = _groups(doc, series, lambda summary, k: summary.get(k))
        _grouped_bars(ax, groups, series, label)
    return fig


Bars = dict[str, tuple[float, float, float] | None]


def _groups(
    doc: Mapping[str, Any],
    series: Sequence[tuple[str, str]],
    aiperf: Callable[[Mapping[str, Any], str], float | None],
) -> list[tuple[str, Bars]]:
    """A bar group per arm (its mean, min and max over repetitions, full window) and per aiperf
    import (`aiperf(summary, key)`, one value)."""
    groups = [
        (name, {k: _mean_span((arm["spread"].get("full") or {}).get(k)) for k, _ in series})
        for name, arm in doc["arms"].items()
    ]
    for a in doc.get("aiperf", []):
        groups.append(
            (f"aiperf {a['name']}", {k: _point(aiperf(a["summary"], k)) for k, _ in series})
        )
    return groups


def _mean_span(sp: Mapping[str, Any] | None) -> tuple[float, float, float] | None:
    if not sp or sp.get("mean") is None:
        return None
    return (sp["mean"], sp.get("min", sp["mean"]), sp.get("max", sp["mean"]))


def _point(v: float | None) -> tuple[float, float, float] | None:
    return None if v is None or not math.isfinite(v) else (v, v, v)


def _grouped_bars(
    ax: Axes,
    groups: Sequence[tuple[str, Mapping[str, tuple[float, float, float] | None]]],
    series: Sequence[tuple[str, str]],
    ylabel: str,
) -> None:
    """One group of bars per arm, one bar per series (min-max as an error bar)."""
    width = 0.8 / max(len(series), 1)
    drawn = False
    for j, (key, label) in enumerate(series):
        xs, ys, lo, hi = [], [], [], []
        for i, (_name, vals) in enumerate(groups):
            v = vals.get(key)
            if v is None:
                continue
            xs.append(i - 0.4 + width * (j + 0.5))
            ys.append(v[0])
            lo.append(max(v[0] - v[1], 0.0))
            hi.append(max(v[2] - v[0], 0.0))
        if xs:
            # min-max whiskers only where repetitions disagree
            err = [lo, hi] if any(lo) or any(hi) else None
            bars = ax.bar(xs, ys, width, label=label, color=f"C{j}", yerr=err, capsize=2)
            ax.bar_label(bars, fmt="%.3g", fontsize=7)
            drawn = True
    ax.set_xticks(range(len(groups)), [g[0] for g in groups])
    ax.set_ylabel(ylabel)
    ax.grid(True, axis="y", alpha=0.3)
    if drawn:
        ax.legend(fontsize=8)
    else:
        _empty(ax, "nothing measured")


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1100px; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th:first-child, td:first-child { text-align: left; }
.pass { color: #137333; font-weight: bold; } .miss { color: #c5221f; font-weight: bold; }
.note { color: #555; font-size: 0.85em; } pre { background: #f6f6f6; padding: 0.6em; }
img { max-width: 100%; border: 1px solid #eee; margin: 0.5em 0; }
"""


def render_html(doc: Mapping[str, Any], images: Sequence[str]) -> str:
    """The report page: run description, summary table, figures, per-arm details, checks."""
    e = html.escape
    table = doc["table"]
    meta = doc["meta"]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{e(table['title'])}</title><style>{_CSS}</style></head><body>",
        f"<h1>{e(table['title'])}</h1>",
        "<p class='note'>",
        f"run directory <code>{e(str(doc['run_dir']))}</code>; created {e(meta.get('created', ''))}"
        f"; kvtier {e(str(meta.get('kvtier')))}; window: full",
        f" and from {doc['cut_s']:g}s" if doc["cut_s"] > 0 else "",
        f"; buckets of {doc['bucket_s']:g}s</p>",
        "<h2>Summary</h2>",
        _summary_table(table),
        "<h2>Figures</h2>",
        *(f"<p><img src='{e(name)}' alt='{e(name)}'></p>" for name in images),
        "<h2>Arms</h2>",
        _arms_table(doc),
        _arm_commands(meta),
        "<h2>Checks</h2>",
        _checks_html(doc["checks"]),
    ]
    if doc.get("aiperf"):
        parts += ["<h2>aiperf imports</h2>", _aiperf_table(doc["aiperf"])]
    parts += [
        "<h2>Workload</h2>",
        f"<pre>{e(_json_lines(meta['workload']))}</pre>",
        f"<p class='note'>{meta['requests']} requests, {meta['prompt_tokens']} prompt tokens; "
        f"load {e(_json_lines(meta['load']))}; ceiling sizes "
        f"{e(_json_lines(meta['ceiling']))}</p>",
        "</body></html>",
    ]
    return "\n".join(parts)


def _table(head: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """An HTML table: `head` escaped, the cells as given (HTML)."""
    cols = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    lines = ["".join(f"<td>{c}</td>" for c in row) for row in rows]
    return "\n".join([f"<table><tr>{cols}</tr>", *(f"<tr>{x}</tr>" for x in lines), "</table>"])


def _summary_table(table: Mapping[str, Any]) -> str:
    e = html.escape
    rows = []
    for r in table["rows"]:
        *cells, verdict = cells_of(r)
        if verdict in (PASS, MISS):
            verdict = f"<span class='{verdict.lower()}'>{verdict}</span>"
        rows.append([*(e(c) for c in cells), verdict])
    head = ("measurement", "value", "raw", "ratio", "target", "result")
    parts = [_table(head, rows)]
    parts += [f"<p class='note'>[{i}] {e(n)}</p>" for i, n in enumerate(table["footnotes"], 1)]
    s = table["summary"]
    parts.append(f"<p>targets met: {s['passed']} of {s['targets']}</p>")
    return "\n".join(parts)


# (key, column, unit) of the HTML tables: the speeds both arms and aiperf imports show
_SPEEDS = (
    ("request_throughput", "req/s", ""),
    ("output_throughput", "tok/s", ""),
    ("ttft_p50_ms", "TTFT p50", "ms"),
    ("ttft_p90_ms", "TTFT p90", "ms"),
    ("ttft_p99_ms", "TTFT p99", "ms"),
    ("itl_p50_ms", "ITL p50", "ms"),
    ("itl_p99_ms", "ITL p99", "ms"),
)
_ARM_COLUMNS = (
    ("completed", "completed", ""),
    ("failed", "failed", ""),
    *_SPEEDS,
    ("server_hit_pct", "hit % (server)", "%"),
    ("client_hit_pct", "hit % (client)", "%"),
    ("ceiling_hbm_pct", "ceiling HBM", "%"),
    ("ceiling_hbm+tier_pct", "ceiling HBM+tier", "%"),
    ("ceiling_infinite_pct", "ceiling infinite", "%"),
)


def _arms_table(doc: Mapping[str, Any]) -> str:
    e = html.escape
    rows = []
    for name, arm in doc["arms"].items():
        for window, sp in arm["spread"].items():
            cells = []
            for key, _label, unit in _ARM_COLUMNS:
                v = sp.get(key) or {}
                text = "—" if v.get("mean") is None else fmt(v["mean"], unit)
                if v.get("mean") is not None and v.get("sd") is not None:
                    text += f" ± {fmt(v['sd'])}"
                cells.append(e(text))
            shown = "full" if window == "full" else f"from {doc['cut_s']:g}s"
            rows.append([e(name), shown, arm["reps"], *cells])
    head = ("arm", "window", "reps", *(label for _, label, _ in _ARM_COLUMNS))
    return _table(head, rows) + "<p class='note'>mean ± sample sd over repetitions</p>"


def _arm_commands(meta: Mapping[str, Any]) -> str:
    e = html.escape
    lines = []
    for a in meta["arms"]:
        what = a.get("command") or f"endpoint {a.get('url')}"
        lines.append(f"{a['name']}: {what}")
    order = ", ".join(f"{name}#{rep}" for rep, name in meta["order"])
    return f"<pre>{e(chr(10).join(lines))}</pre><p class='note'>run order: {e(order)}</p>"


def _checks_html(checks: Mapping[str, Any]) -> str:
    e = html.escape
    failing = checks["identities_failing"]
    items = [
        f"<li>{checks['identities_checked']} identities checked, {len(failing)} failing</li>",
        *(
            f"<li class='miss'>{e(f['arm'])} rep {f['rep']}: {e(f['expr'])}: "
            f"{f['lhs']} {e(f['op'])} {f['rhs']}</li>"
            for f in failing
        ),
        f"<li>HBM pool mismatches ({e(checks['pool_checked_by'])}): "
        f"{e('; '.join(checks['pool_mismatches']) or 'none')}</li>",
        f"<li>above the infinite ceiling: {e('; '.join(checks['above_infinite']) or 'none')}</li>",
        f"<li>requests failed or skipped: {checks['requests_failed']} of "
        f"{checks['requests_sent']}</li>",
    ]
    return "<ul>" + "\n".join(items) + "</ul>"


def _aiperf_table(runs: Sequence[Mapping[str, Any]]) -> str:
    e = html.escape
    keys = (("request_count", "requests", ""), *_SPEEDS, ("cache_read_pct", "cache read", "%"))
    rows = [
        [
            e(a["name"]),
            e(str(a.get("version"))),
            *(e(fmt(a["summary"].get(k), u)) for k, _, u in keys),
        ]
        for a in runs
    ]
    notes = [f"<p class='note'>{e(a['name'])}: {e(a['source'])}</p>" for a in runs]
    return "\n".join([_table(("aiperf run", "version", *(x for _, x, _ in keys)), rows), *notes])


def _json_lines(doc: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in doc.items() if v is not None)


def bench_report_command(
    run_dir: Path = typer.Argument(..., help="A directory `kvtier bench run` wrote."),
    start_cut: str | None = typer.Option(
        None, "--from", help="Start-cut window (e.g. 600s) [default: the run's]."
    ),
    bucket: str | None = typer.Option(
        None, "--bucket", help="Time-series bucket width [default: the run's]."
    ),
    aiperf: list[str] = typer.Option(
        [], "--aiperf", help="NAME=profile_export_aiperf.json to add (repeatable)."
    ),
) -> None:
    """Re-analyse a recorded run and re-render report.html, the PNGs and the summary table."""
    from kvtier.bench import replay
    from kvtier.errors import ConfigError

    try:
        if aiperf:
            replay.add_aiperf(run_dir, replay.named_paths(aiperf, "--aiperf"))
        cut = None if start_cut is None else replay.parse_seconds(start_cut, "--from")
        width = None if bucket is None else replay.parse_seconds(bucket, "--bucket")
        doc = replay.analyse(replay.load_run(run_dir), cut_s=cut, bucket_s=width)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from None
    write_json(Path(run_dir) / "summary.json", doc)
    files = write_report(doc, run_dir)
    print_report(doc["table"])
    typer.echo(f"report: {files['html']}")
