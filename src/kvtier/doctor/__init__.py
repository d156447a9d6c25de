"""`kvtier doctor URL`: read a server's /metrics (and its startup log) and say, check by check,
whether the offload tier is wired on every rank and is being read, with the numbers.

`diagnose()` is pure (metrics text in, checks out); `doctor_command` fetches, prints a table or
JSON and exits 1 on any FAIL (2 when the server cannot be read), so it can gate a deployment.

    result.py     Status, Check and the check names
    samples.py    typed lookups over one scrape, and what the startup log says
    coverage.py   the tier on every rank and read: present, scope, workers, retrieving, ...
    health.py     what must stay at zero or closed: failures, leases, timeouts, breakers, ...
    command.py    diagnose, fetching, the table and JSON, the command
"""

from kvtier.doctor.command import (
    DoctorError,
    diagnose,
    doctor_command,
    fetch_metrics,
    metrics_url,
    render_json,
    render_table,
)
from kvtier.doctor.result import (
    ADMISSION,
    BREAKERS,
    CHECK_NAMES,
    DROPPED,
    EXTERNAL,
    HOOK_ERRORS,
    IDENTITIES,
    LEASES,
    LOAD_COST,
    LOAD_FAILURES,
    POLICY,
    PRESENT,
    PROGRESS,
    RETRIEVING,
    SAVE_FAILURES,
    SCOPE_CHECK,
    SKIPPED,
    STATES,
    STORE_FAILURES,
    TIMEOUTS,
    VERIFY,
    WORKERS,
    Check,
    Status,
)
from kvtier.doctor.samples import parse_client_line

__all__ = [
    "ADMISSION",
    "LOAD_COST",
    "BREAKERS",
    "CHECK_NAMES",
    "DROPPED",
    "EXTERNAL",
    "HOOK_ERRORS",
    "IDENTITIES",
    "LEASES",
    "LOAD_FAILURES",
    "POLICY",
    "PRESENT",
    "PROGRESS",
    "RETRIEVING",
    "SAVE_FAILURES",
    "SCOPE_CHECK",
    "SKIPPED",
    "STATES",
    "STORE_FAILURES",
    "TIMEOUTS",
    "VERIFY",
    "WORKERS",
    "Check",
    "DoctorError",
    "Status",
    "diagnose",
    "doctor_command",
    "fetch_metrics",
    "metrics_url",
    "parse_client_line",
    "render_json",
    "render_table",
]
