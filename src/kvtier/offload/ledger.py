"""The operations an engine has on its ranks, and the steps that carry them.

Each load or save gets an id of kvtier's own (bounded whatever a client names its request),
its request and kind are kept until its quorum's terminal, and what the next step's meta must
tell the ranks about them (load terminals reached, requests whose blocks wait for their saves,
saves cancelled by a reused window block) is collected here between steps. A step is timed
from its meta to the first reports after it, minus the sync loads that ran inside it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable
from typing import Literal

from kvtier.offload.messages import OffloadMeta, OpResult
from kvtier.offload.quorum import Quorum, Terminal

Kind = Literal["load", "save"]
_PREFIX = {"load": "ld", "save": "sv"}


class OpLedger:
    """Operation ids, their quorum and owners, and the per-step news for the ranks."""

    def __init__(self, world: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.quorum = Quorum(world)
        self._clock = clock
        self._opened_at: dict[str, float] = {}  # op id -> when it opened (open order)
        self.step = 0  # engine steps so far (metas built)
        self._ops: dict[str, tuple[str, Kind]] = {}  # op id -> (req id, kind)
        self._nonce = itertools.count()
        self._delayed: list[str] = []
        self._terminals: dict[str, bool] = {}
        self._cancelled: set[str] = set()
        self._step_t0: float | None = None  # when the busy step in flight was built
        self._sync_s = 0.0  # measured seconds of the sync loads that ended this step

    def __contains__(self, op_id: object) -> bool:
        return op_id in self._ops

    def __bool__(self) -> bool:
        return bool(self._ops)

    def open(self, kind: Kind, req_id: str) -> str:
        """A new operation of `req_id`: its id, with its quorum open."""
        op_id = f"{_PREFIX[kind]}{next(self._nonce)}"
        self.quorum.open(op_id)
        self._ops[op_id] = (req_id, kind)
        self._opened_at[op_id] = self._clock()
        return op_id

    def overdue(self, after_s: float) -> list[str]:
        """Open operations older than `after_s`, oldest first; their quorums are abandoned (a
        report for them from now on is ignored)."""
        now = self._clock()
        out = []
        for op_id, t in self._opened_at.items():
            if now - t < after_s:
                break  # opened in order: every later one is younger
            out.append(op_id)
        for op_id in out:
            self.quorum.abandon(op_id)
        return out

    def entry(self, op_id: str) -> tuple[str, Kind] | None:
        """(request, kind) of an open operation (None when it is not open)."""
        return self._ops.get(op_id)

    def owner(self, op_id: str) -> str:
        """The request an open operation belongs to ("" when it is not open)."""
        return self._ops.get(op_id, ("", "save"))[0]

    def report(self, rank: int, result: OpResult) -> Terminal | None:
        """One rank's result; the terminal when it completes the quorum."""
        return self.quorum.report(rank, result)

    def close(self, op_id: str) -> tuple[str, Kind]:
        """The operation reached its terminal: its (request, kind)."""
        self._opened_at.pop(op_id, None)
        return self._ops.pop(op_id)

    def forget(self, op_id: str) -> tuple[str, Kind] | None:
        """Processing its terminal failed: the operation is gone, its news unsent (the
        scheduler tells a load's ranks its terminal again)."""
        self._terminals.pop(op_id, None)
        self._opened_at.pop(op_id, None)
        return self._ops.pop(op_id, None)

    def load_ended(self, op_id: str, ok: bool, sync_s: float | None) -> None:
        """A load's terminal, told to the host at the next step; a sync load's time was spent
        inside this step's forward (`sync_s`), not by the engine's own work."""
        self._terminals[op_id] = ok
        if sync_s is not None:
            self._sync_s += sync_s

    def delay_free(self, req_id: str) -> None:
        """The request finished with an operation on the ranks: its blocks wait for it."""
        self._delayed.append(req_id)

    def cancel_saves(self, op_ids: Iterable[str]) -> None:
        """Saves reading a window block the host handed out again: cancelled next step."""
        self._cancelled.update(op_ids)

    def cancel_every_save(self) -> None:
        """Every save in flight cancelled next step (a cancelled save commits nothing): when
        the host cannot tell which of them read a block it handed out again."""
        self._cancelled.update(op_id for op_id, (_, kind) in self._ops.items() if kind == "save")

    def begin_step(self, busy: bool, preempted: Iterable[str]) -> OffloadMeta:
        """The next step's meta, holding what the ranks must cancel before its forward."""
        self.step += 1
        self._sync_s = 0.0
        self._step_t0 = time.perf_counter() if busy else None
        meta = OffloadMeta(preempted=sorted(preempted), cancel_saves=sorted(self._cancelled))
        self._cancelled = set()
        return meta

    def end_step(self, meta: OffloadMeta) -> OffloadMeta:
        """Hand the step's delayed frees and load terminals to its meta."""
        meta.delayed_free, self._delayed = self._delayed, []
        meta.load_terminals, self._terminals = self._terminals, {}
        return meta

    def step_seconds(self) -> float | None:
        """The engine's own time on the busy step just reported (sync loads left out), once."""
        if self._step_t0 is None:
            return None
        seconds = time.perf_counter() - self._step_t0 - self._sync_s
        self._step_t0 = None
        return seconds
