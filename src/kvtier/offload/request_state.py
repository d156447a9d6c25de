"""The scheduler's record of one request, and of the load it was promised (written here once;
the scheduler, its load planner and its layout read and update them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class LoadState:
    """A promised load: the tokens `[hbm, end)` it claims and where it stands."""

    hbm: int  # the HBM floor: nothing below it is written
    end: int  # tokens the load claims (a full-prompt hit is one short of the prompt)
    lookup_id: str
    block_ids: list[int] | None = None
    op_id: str | None = None
    sync: bool = False  # finished inside its step's forward, its request never parked
    step: int = 0  # the engine step that sent it to the ranks
    fail: str = ""  # sent as a load every rank fails at once (a hook failed after the promise)
    tables: list[list[int]] | None = None  # a hybrid load: every KV cache group's block table
    predicted_s: float = 0.0  # the cost model's predicted read time, checked at its terminal
    reads: tuple[tuple[str, int], ...] = ()  # (tier, tokens) the load reads from each tier
    promised_hbm: int = -1  # the floor `reads` start at (-1: `hbm`, as promised)

    def __post_init__(self) -> None:
        if self.promised_hbm < 0:
            self.promised_hbm = self.hbm


@dataclass
class RequestState:
    """One request's lifecycle in the scheduler: its chunk keys, its load, its save frontiers."""

    req_id: str
    prompt_len: int
    keys: list[bytes]
    load: LoadState | None = None
    load_failed: bool = False
    saved: int = 0  # committed save frontier (tokens): advanced only by a successful save
    emitted: int = 0  # emitted save frontier: saves in flight cover [saved, emitted)
    saves: dict[str, tuple[int, int]] = field(default_factory=dict)
    finished: bool = False
    lookup: Any = None  # a lookup in flight (polled again at the next ask)
    hit_tier: str = ""  # the deepest tier of the promised run (the hit's source)
    deferred: bool = False  # already counted as waiting behind another request's load
    save_wait_t0: float | None = None  # when it began waiting for another request's save
    load_wait_t0: float | None = None  # when it began waiting for another request's load
    hbm_floor: int | None = None  # tokens the HBM held at its first ask (computed before it)
    asked_hbm: int = 0  # tokens the HBM held at its latest ask (the allocation that follows)
    epoch: int = 0  # the namespace epoch its keys belong to
    quarantined: bool = False  # a hook failed for it: no lookup, load or save from now on
    readmitted: bool = False  # preempted once: later admissions are not first admissions
    admit_limit: int | None = None  # chunks admission lets it save (None: not decided yet)
    retained: int = 0  # leading chunks a client's hint retains: always saved

    def rewind(self, tokens: int) -> None:
        """Both save frontiers fall back to `tokens`: what lies above is saved again."""
        self.saved = min(self.saved, tokens)
        self.emitted = min(self.emitted, tokens)

    def busy(self) -> bool:
        """An operation of it is on the ranks (a save, or a load sent)."""
        return bool(self.saves) or (self.load is not None and self.load.op_id is not None)


@dataclass(frozen=True, slots=True)
class LoadOutcome:
    """A load's agreed terminal, translated back to its request."""

    req_id: str
    ok: bool
    tokens: int
    reason: str
    tier: str = ""  # the tier that served most of the load's chunks ("" when it failed)
