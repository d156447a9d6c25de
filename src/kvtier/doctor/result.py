"""What one doctor check says: its outcome, a sentence with the numbers, the numbers; and the
names of every check, in the order doctor runs them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any


class Status(StrEnum):
    """Outcome of one check; only FAIL makes the command exit non-zero."""

    PASS = "PASS"
    WARN = "WARN"
    FAIL = "FAIL"
    UNDETERMINED = "UNDETERMINED"


@dataclass(frozen=True)
class Check:
    """One check: its name, outcome, a sentence with the numbers, and the numbers themselves."""

    name: str
    status: Status
    detail: str
    numbers: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """Plain fields (status as its string)."""
        out = asdict(self)
        out["status"] = str(self.status)
        return out


PRESENT = "kvtier present"
PROGRESS = "engine progress"
SCOPE_CHECK = "lookup client on every rank"
WORKERS = "a worker on every rank"
RETRIEVING = "every rank retrieving"
EXTERNAL = "external queries and hits"
IDENTITIES = "identities"
VERIFY = "verify failures"
HOOK_ERRORS = "hook errors"
LEASES = "leases"
TIMEOUTS = "lookup timeouts"
DROPPED = "dropped writes"
LOAD_FAILURES = "load failures"
SAVE_FAILURES = "save failures"
STORE_FAILURES = "store failures"
SKIPPED = "skipped loads"
BREAKERS = "breakers"
POLICY = "failed loads recompute"
ADMISSION = "admission"
RETENTION = "retention"
LOAD_COST = "load or recompute"
STATES = "boundary states"
FAILS_REQUEST = "kvtier_load_failure_fails_request"

CHECK_NAMES = (
    PRESENT,
    PROGRESS,
    SCOPE_CHECK,
    WORKERS,
    RETRIEVING,
    EXTERNAL,
    IDENTITIES,
    VERIFY,
    HOOK_ERRORS,
    LEASES,
    TIMEOUTS,
    DROPPED,
    LOAD_FAILURES,
    SAVE_FAILURES,
    STORE_FAILURES,
    SKIPPED,
    BREAKERS,
    POLICY,
    ADMISSION,
    RETENTION,
    LOAD_COST,
    STATES,
)
