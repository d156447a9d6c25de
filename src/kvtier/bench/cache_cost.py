"""`kvtier bench cache`'s cost view: kvtier's modelled tier hits (HBM 5%, tier 30% of each
stream's distinct chunks) weighted by the prefill time they save, per tier medium, for one model
shape, under `load_policy: always` and `cost` (`kvtier.cachemodel.cost_view`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtier.bench.table import Report, Row, Target
from kvtier.cachemodel.cost_view import Medium, Shape, time_saved
from kvtier.cachemodel.stream import Request

# the cell of the capacity table the cost view prices
CELL = (0.05, 0.3)
# Llama-3.1-8B, bf16: 128 KiB of KV per token; prefill measured on one H200 by the native engine
# (32,768 tokens in 1.18 s): a tier must read at >= 3.6 GB/s to beat it
SHAPE = Shape("Llama-3.1-8B, H200", 131072, 27_800.0)
MEDIA = (
    Medium("host memory", 20.0, 20e-6),
    Medium("local NVMe, PCIe Gen4", 6.5, 100e-6),
    Medium("shared store, 25 GbE", 2.5, 500e-6),
    Medium("shared store, 10 GbE", 1.0, 500e-6),
)
# a cost-policy saving below max(always, 0) by more than this share of the missed time is a
# defect: the policy may only ever save at least what loading everything or nothing saves
SLACK = 1e-9
PREFIX = "cost."  # the ids of its rows


def cost_rows(
    report: Report,
    workload: str,
    requests: Sequence[Request],
    floors: Sequence[int],
    leads: Sequence[int],
    chunk_tokens: int,
) -> list[dict[str, Any]]:
    """One row per medium for `workload`'s hits (`leads`, per request), added to `report`."""
    rows = []
    for medium in MEDIA:
        t = time_saved(
            requests, floors, leads, medium=medium, shape=SHAPE, chunk_tokens=chunk_tokens
        )
        row = {
            "workload": workload,
            "medium": medium.name,
            "read_gbps": medium.read_gbps,
            "always": 100 * t.share(t.always_s),
            "cost": 100 * t.share(t.cost_s),
            "loaded_runs": t.loaded_runs,
            "chunk_tokens": chunk_tokens,
            **t.to_json(),
        }
        rows.append(row)
        floor = 100 * max(t.share(t.always_s), 0.0)
        report.add(
            Row(
                id=f"{PREFIX}{workload.replace(' ', '_')}.{medium.name.replace(' ', '_')}",
                label=f"{workload}, {medium.name}: prefill time saved, cost policy",
                value=row["cost"],
                unit="%",
                target=Target("value", ">=", floor - 100 * SLACK),
                detail={"always": row["always"], "runs": t.runs, "loaded_runs": t.loaded_runs},
            )
        )
    return rows


def footnote() -> str:
    """What the cost view's columns mean."""
    return (
        f"cost view: kvtier's tier hits at HBM {100 * CELL[0]:.0f}%, tier {100 * CELL[1]:.0f}%, "
        f"priced for {SHAPE.name} ({SHAPE.bytes_per_token // 1024} KiB/token, prefill "
        f"{SHAPE.prefill_tokens_per_s:,.0f} tok/s: break-even {SHAPE.break_even_gbps():.1f} "
        "GB/s) by the product's load-or-recompute model; saved = prefill time the loads save, "
        "less their read time, over the prefill time of every chunk the HBM missed; always: "
        "every hit loaded; cost: load_policy cost (a run read slower than its prefill is "
        "recomputed); runs: hit runs the cost policy loaded of all"
    )


COLUMNS = (
    ("workload", "left", lambda r: r["workload"]),
    ("medium", "left", lambda r: r["medium"]),
    ("GB/s", "right", lambda r: f"{r['read_gbps']:g}"),
    ("always", "right", lambda r: f"{r['always']:+.1f}%"),
    ("cost", "right", lambda r: f"{r['cost']:+.1f}%"),
    ("runs", "right", lambda r: f"{r['loaded_runs']:,}/{r['runs']:,}"),
)
