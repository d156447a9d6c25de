"""The `kvtier plan` report: (quantity, value, unit) rows and the printed table, verdict and
warnings."""

from __future__ import annotations

from kvtier.plan.sizing import PlanResult
from kvtier.plan.window import ABOVE_TIER, BELOW_POOL, INSIDE, NO_REUSE, GiB
from kvtier.plan.workload import SyntheticWorkload

_VERDICT_LABEL = {
    BELOW_POOL: "HBM already hits",
    INSIDE: "tier can hit",
    ABOVE_TIER: "tier too small",
    NO_REUSE: "no reuse",
}


def _bytes(n: int) -> str:
    return f"{n:,} ({n / GiB:.2f} GiB)"


def _secs(s: float) -> str:
    return f"{s:,.1f}" if s >= 10 else f"{s:.3g}"


def _pct(rate: float) -> str:
    return f"{100 * rate:.2f}%"


def report_rows(r: PlanResult) -> list[tuple[str, str, str]]:
    """(quantity, value, unit) rows of the report, in print order."""
    g = r.geometry
    rows: list[tuple[str, str, str]] = [
        ("model", f"{r.model} ({g.kind}, {g.num_layers} layers)", ""),
        ("KV dtype / TP / block size", f"{g.kv_dtype} / {g.tp_size} / {r.block_size}", ""),
        ("bytes per token per rank", f"{r.bytes_per_token:,}", "B"),
        *(
            [
                (
                    "tier bytes per cached token per rank (sliding windows)",
                    f"{r.tier_token_bytes:,}",
                    "B",
                )
            ]  # fmt: skip
            if r.tier_bytes_per_token
            else []
        ),
        *(
            [
                (
                    f"boundary state per rank ({g.state_layers} state layers)",
                    f"{g.state_bytes:,}",
                    "B",
                ),
                (
                    "state records per stored boundary (chunk-sized)",
                    f"{r.state_records} x {r.chunk_size * r.tier_token_bytes:,}",
                    "B",
                ),
            ]  # fmt: skip
            if g.state_layers
            else []
        ),
        (
            "bytes per token, all ranks",
            f"{r.total_bytes_per_token:,}" + (" (replicated)" if g.replicated_across_tp else ""),
            "B",
        ),
        (f"HBM pool per rank ({r.hbm_from})", f"{r.hbm_pool_tokens:,}", "tokens"),
        ("HBM pool per rank", _bytes(r.hbm_pool_bytes), "B"),
        ("tier per rank", _bytes(r.tier_bytes), "B"),
        ("tier per rank", f"{r.tier_tokens:,}", "tokens"),
        ("tier, all ranks (host memory pinned)", _bytes(r.tier_bytes_all_ranks), "B"),
        ("workload", r.workload.describe(), ""),
    ]
    if isinstance(r.workload, SyntheticWorkload):
        rows.append(("reuse distance", f"{r.reuse_distance_tokens:,}", "tokens"))
        rows.append(("  of which in flight", f"{r.workload.in_flight_tokens:,}", "tokens"))
    else:
        na = "n/a (no reuse)"
        rows.append(
            (
                "reuse distance median",
                na if r.reuse_distance_tokens is None else f"{r.reuse_distance_tokens:,}",
                "tokens",
            )
        )
        rows.append(
            (
                "reuse distance p90",
                na if r.reuse_p90_tokens is None else f"{r.reuse_p90_tokens:,}",
                "tokens",
            )
        )
        if r.profile is not None:
            p = r.profile
            rows.append(
                (
                    "reuses in HBM / window / above tier",
                    f"{p.below_pool:,} / {p.inside:,} / {p.above_tier:,}",
                    "reuses",
                )
            )
    rows += [
        ("window (HBM pool, tier]", f"({r.hbm_pool_tokens:,}, {r.tier_tokens:,}]", "tokens"),
        ("verdict", _VERDICT_LABEL[r.verdict.kind], ""),
        ("reusable working set", f"{r.reusable_tokens:,}", "tokens"),
        ("reusable working set per rank", _bytes(r.reusable_bytes), "B"),
        (
            "tier / reusable working set",
            "n/a" if r.tier_over_reusable is None else f"{r.tier_over_reusable:.2f}x",
            "",
        ),
        ("store bandwidth per rank", f"{r.store_gbps:g}", "GB/s"),
        ("tier fill time", _secs(r.tier_fill_s), "s"),
        ("working-set fill time", _secs(r.working_set_fill_s), "s"),
    ]
    if r.break_even_gbps is None:
        rows.append(("break-even read bandwidth per rank", "n/a: pass --prefill-tokens-per-s", ""))
    else:
        rows.append(("prefill rate", f"{r.prefill_tokens_per_s:,.0f}", "tokens/s"))
        rows.append(("break-even read bandwidth per rank", f"{r.break_even_gbps:.4g}", "GB/s"))
    if r.ceilings is None:
        rows.append(("hit ceiling", "n/a (see the note below)", ""))
    else:
        c = r.ceilings
        rows += [
            ("HBM hits (LRU pool alone)", _pct(c.hbm_rate), "of usable blocks"),
            ("tier hits, kvtier (real tier, predicted)", _pct(c.kvtier.rate), "of HBM misses"),
            ("tier hits, offline optimum (Belady)", _pct(c.optimum.rate), "of HBM misses"),
            ("tier hits, infinite tier", _pct(c.infinite.rate), "of HBM misses"),
        ]
    return rows


def print_report(r: PlanResult) -> None:
    """The report as a rich table, then the verdict and one WARNING line per problem."""
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    table = Table(title=f"kvtier plan: {r.model}")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_column("unit")
    for row in report_rows(r):
        table.add_row(*row)
    console.print(table)
    if not r.verdict.bad:
        console.print(f"verdict: {r.verdict.message}", soft_wrap=True, markup=False)
    console.print(f"ceilings: {r.ceiling_note}", soft_wrap=True, markup=False)
    for w in r.warnings:
        console.print(f"WARNING: {w}", soft_wrap=True, markup=False)
