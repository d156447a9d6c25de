"""Shared result rows for every bench: one JSON document, rendered as a rich table.

A bench builds `Row`s (a measured value, optionally its raw baseline and a `Target`), wraps them
in a `Report`, writes `report.to_json()` with `write_json` and prints it with `render`. The table
is drawn from the JSON document itself, so what is shown is exactly what was written.
"""

from __future__ import annotations

import json
import math
import os
import platform
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

PASS = "PASS"
MISS = "MISS"

Detail = Mapping[str, float | int | str]


def ratio(measured: float, raw: float) -> float:
    """`measured / raw`: how a measured throughput or time compares with its raw baseline."""
    if not (math.isfinite(raw) and raw > 0):
        raise ValueError(f"raw baseline {raw!r} must be a positive finite number")
    return measured / raw


@dataclass(frozen=True, slots=True)
class Target:
    """A bound a row must meet: `on` its ratio to raw or its value, `op` ">=" or "<="."""

    on: Literal["ratio", "value"]
    op: Literal[">=", "<="]
    bound: float

    def __post_init__(self) -> None:
        if self.on not in ("ratio", "value") or self.op not in (">=", "<="):
            raise ValueError(
                f"target on={self.on!r} op={self.op!r}: use on 'ratio'|'value' and op '>='|'<='"
            )
        if not math.isfinite(self.bound):
            raise ValueError(f"target bound {self.bound!r} must be a finite number")

    def met(self, value: float, row_ratio: float | None) -> bool:
        """Whether `value` (or `row_ratio`, for a ratio target) meets the bound."""
        got = value if self.on == "value" else row_ratio
        if got is None:
            raise ValueError("a ratio target needs a row with a raw baseline")
        return got >= self.bound if self.op == ">=" else got <= self.bound

    def describe(self, unit: str) -> str:
        """Human form: `>= 0.85x raw` or `<= 2 ms`."""
        if self.on == "ratio":
            return f"{self.op} {self.bound:g}x raw"
        return f"{self.op} {self.bound:g} {unit}"


@dataclass(frozen=True, slots=True)
class Row:
    """One measurement: `value` in `unit`, its `raw` baseline (same unit) and `target`, if any."""

    id: str
    label: str
    value: float
    unit: str
    raw: float | None = None
    target: Target | None = None
    detail: Detail = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not math.isfinite(self.value):
            raise ValueError(f"row {self.id!r} value {self.value!r} is not a finite number")
        if self.raw is not None and not (math.isfinite(self.raw) and self.raw > 0):
            raise ValueError(f"row {self.id!r} raw baseline {self.raw!r} must be positive finite")
        if self.target is not None and self.target.on == "ratio" and self.raw is None:
            raise ValueError(f"row {self.id!r} has a ratio target but no raw baseline")

    @property
    def ratio(self) -> float | None:
        """`value / raw`, or None without a baseline."""
        return None if self.raw is None else ratio(self.value, self.raw)

    @property
    def passed(self) -> bool | None:
        """True/False against the target, None without one."""
        return None if self.target is None else self.target.met(self.value, self.ratio)

    def undetermined(self, why: str, **detail: Any) -> Row:
        """This row shown without its verdict (the data cannot decide it: too few samples,
        the machine's own noise), `why` said in its label and `detail`."""
        return Row(
            self.id,
            f"{self.label} (undetermined: {why})",
            self.value,
            self.unit,
            raw=self.raw,
            target=None,
            detail={**self.detail, "verdict": "undetermined", **detail},
        )

    def to_json(self) -> dict[str, Any]:
        """The row as a JSON object (target both as text and as its parts)."""
        t = self.target
        return {
            "id": self.id,
            "label": self.label,
            "value": self.value,
            "unit": self.unit,
            "raw": self.raw,
            "ratio": self.ratio,
            "target": None if t is None else t.describe(self.unit),
            "target_spec": None if t is None else {"on": t.on, "op": t.op, "bound": t.bound},
            "pass": self.passed,
            "detail": dict(self.detail),
        }


@dataclass(slots=True)
class Report:
    """A bench's whole result: rows in display order, numbered footnotes and free-form meta."""

    bench: str
    title: str
    rows: list[Row] = field(default_factory=list)
    footnotes: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def add(self, row: Row) -> Row:
        """Append `row` (ids must be unique) and return it."""
        if any(r.id == row.id for r in self.rows):
            raise ValueError(f"row id {row.id!r} is already in report {self.bench!r}")
        self.rows.append(row)
        return row

    def note(self, text: str) -> str:
        """Add a footnote (once: the same text again gets its first marker); returns its marker
        (`[n]`) to append to a row label."""
        if text not in self.footnotes:
            self.footnotes.append(text)
        return f"[{self.footnotes.index(text) + 1}]"

    def to_json(self) -> dict[str, Any]:
        """The report as a JSON document (what `write_json` writes and `render` draws)."""
        rows = [r.to_json() for r in self.rows]
        targeted = [r["pass"] for r in rows if r["pass"] is not None]
        return {
            "bench": self.bench,
            "title": self.title,
            "rows": rows,
            "summary": {"targets": len(targeted), "passed": sum(1 for p in targeted if p)},
            "footnotes": list(self.footnotes),
            "meta": self.meta,
        }


def write_json(path: str | Path, doc: Mapping[str, Any]) -> Path:
    """Write `doc` to `path` atomically, creating parent directories; NaN/inf are refused."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(doc, indent=2, allow_nan=False) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def machine() -> dict[str, Any]:
    """Where a bench ran: Python, platform and the cores this process may use."""
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cores": len(os.sched_getaffinity(0)),
    }


def fmt(value: float | None, unit: str = "") -> str:
    """A number with 3 significant digits (more for large values), or an em dash."""
    if value is None:
        return "—"
    text = f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return f"{text} {unit}".rstrip()


def render(doc: Mapping[str, Any]) -> Group:
    """A rich table of a report's JSON document, with its footnotes and a pass summary below."""
    table = Table(title=str(doc.get("title", doc.get("bench", "bench"))), title_justify="left")
    table.add_column("measurement")
    table.add_column("value", justify="right")
    table.add_column("raw", justify="right")
    table.add_column("ratio", justify="right")
    table.add_column("target")
    table.add_column("result")
    rows = doc.get("rows")
    if not isinstance(rows, list):
        raise ValueError("report document has no 'rows' list; build it with Report.to_json()")
    for row in rows:
        *cells, verdict = cells_of(row)
        style = {PASS: "bold green", MISS: "bold red"}.get(verdict, "dim")
        table.add_row(*cells, Text(verdict, style=style))
    parts: list[Table | Text] = [table]
    for i, note in enumerate(doc.get("footnotes", []), start=1):
        parts.append(Text(f"[{i}] {note}", style="dim"))
    summary = doc.get("summary")
    if isinstance(summary, Mapping):
        parts.append(Text(f"targets met: {summary['passed']} of {summary['targets']}"))
    return Group(*parts)


def cells_of(row: Mapping[str, Any]) -> tuple[str, str, str, str, str, str]:
    """A row's label, value, raw, ratio, target and verdict (PASS, MISS or an em dash), shown."""
    passed, r, raw = row.get("pass"), row.get("ratio"), row.get("raw")
    return (
        str(row["label"]),
        fmt(row["value"], row["unit"]),
        fmt(raw, row["unit"] if raw is not None else ""),
        "—" if r is None else f"{r:.2f}x",
        str(row.get("target") or "—"),
        "—" if passed is None else PASS if passed else MISS,
    )


def print_report(doc: Mapping[str, Any], console: Console | None = None) -> None:
    """Print `render(doc)` to `console` (stdout by default)."""
    (console or report_console()).print(render(doc))


def report_console() -> Console:
    """A console for result tables: the terminal's width, or 120 columns when output goes to a
    file or CI log (rich would assume 80 and squeeze the label columns to nothing)."""
    console = Console()
    return console if console.is_terminal else Console(width=120)
