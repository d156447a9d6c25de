"""`kvtier plan`: size the HBM pool and the tier for a model and a workload, before any run.

From an HF config (or a preset) it derives bytes per token per rank, turns the pool and the tier
into tokens, measures the workload's reuse distance and says where it falls against the window a
tier can serve: a reuse that fits in the HBM pool already hits there, one longer than the tier
never hits anywhere, only those in between are the tier's to win. A reuse distance is the cache
(in tokens) that reuse needs in order to hit under LRU, the reused block itself included, so a
reuse of distance `d` hits a cache of `c` tokens exactly when `d <= c`.

    workload.py   a synthetic prefix pool or a Mooncake trace, and its reuse distances
    window.py     the verdict against (HBM pool, tier], a trace's ceilings and hit curve
    sizing.py     the plan: bytes per token, pool and tier in tokens, fill times, break-even
    report.py     the report's rows and the printed table
    command.py    `kvtier plan`: model config, workload flags, table or JSON
    presets.py    named model configs
"""

from kvtier.plan.command import load_model_config, plan_command
from kvtier.plan.report import print_report, report_rows
from kvtier.plan.sizing import PlanResult, plan
from kvtier.plan.window import (
    ABOVE_TIER,
    BELOW_POOL,
    INSIDE,
    NO_REUSE,
    GiB,
    TraceCeilings,
    Verdict,
    trace_ceilings,
    trace_curve,
    window_verdict,
)
from kvtier.plan.workload import (
    SyntheticWorkload,
    Trace,
    Workload,
    parse_trace,
    read_trace,
    trace_reuse_profile,
)

__all__ = [
    "ABOVE_TIER",
    "BELOW_POOL",
    "INSIDE",
    "NO_REUSE",
    "GiB",
    "PlanResult",
    "SyntheticWorkload",
    "Trace",
    "TraceCeilings",
    "Verdict",
    "Workload",
    "load_model_config",
    "parse_trace",
    "plan",
    "plan_command",
    "print_report",
    "read_trace",
    "report_rows",
    "trace_ceilings",
    "trace_curve",
    "trace_reuse_profile",
    "window_verdict",
]
