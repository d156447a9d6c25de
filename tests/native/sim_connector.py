"""A scheduler-level stand-in for a connector and its ranks, and a driver that steps the native
`Scheduler` without a model, for the progress (wedge) tests.

`SimConnector` answers lookups from a per-request `Plan` (tier hit, sync or async, a failing
block, how many steps the ranks take), holds a lease from a positive answer until the load's
terminal or its withdrawal, and checks on every step that no block a load may still write has
been taken back by the host.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from kvtier.native.blocks import BlockManager
from kvtier.native.sampling import SamplingParams
from kvtier.native.sched_output import SchedulerOutput
from kvtier.native.scheduler import RankReport, Scheduler
from kvtier.native.sequence import Sequence


@dataclass(frozen=True)
class Plan:
    """What the tier holds for one request and how the ranks treat its load."""

    hit_tokens: int = 0  # leading prompt tokens the tier holds (whole blocks)
    is_async: bool = True
    fail_block: int | None = None  # index within the load's blocks that fails to load
    delay: int = 0  # steps after dispatch before the ranks report an async load
    send_delay: int = 0  # steps a finished request's blocks stay held for a save


@dataclass
class _Load:
    req_id: str
    blocks: list[int]
    is_async: bool
    fail: bool
    due: int


@dataclass
class SimConnector:
    """Scheduler half plus the ranks, in one object; `errors` lists contract violations."""

    plans: dict[str, Plan]
    block_size: int
    leases: dict[str, int] = field(default_factory=dict)  # req id -> leases opened
    released: dict[str, int] = field(default_factory=dict)  # req id -> leases closed
    promised: dict[str, tuple[int, int]] = field(default_factory=dict)  # id -> (floor, ext)
    unsent: dict[str, _Load] = field(default_factory=dict)
    inflight: dict[str, _Load] = field(default_factory=dict)
    saving: dict[str, int] = field(default_factory=dict)  # id -> steps until finished_sending
    errors: list[str] = field(default_factory=list)
    _sync_now: list[_Load] = field(default_factory=list)

    # ---- scheduler half -----------------------------------------------------------------------

    def _lease(self, rid: str) -> None:
        self.leases[rid] = self.leases.get(rid, 0) + 1

    def _release(self, rid: str) -> None:
        self.released[rid] = self.released.get(rid, 0) + 1

    def open_leases(self) -> dict[str, int]:
        """Leases taken and not released, by request."""
        return {
            r: n - self.released.get(r, 0)
            for r, n in self.leases.items()
            if n != self.released.get(r, 0)
        }

    def get_num_new_matched_tokens(self, seq: Any, hbm: int) -> tuple[int, bool]:
        rid = seq.request_id
        if rid in self.unsent or rid in self.inflight:
            self.errors.append(f"{rid} looked up again while its load is open")
        prev = self.promised.pop(rid, None)
        if prev is not None:
            if prev[0] == hbm:  # asked again before allocation: the promise stands
                self.promised[rid] = prev
                return prev[1], self.plans[rid].is_async
            self._release(rid)
        plan = self.plans.get(rid, Plan())
        ext = max(0, min(plan.hit_tokens, seq.num_tokens - 1) - hbm)
        if ext == 0:
            return 0, False
        self._lease(rid)
        self.promised[rid] = (hbm, ext)
        return ext, plan.is_async

    def update_state_after_alloc(self, seq: Any, block_ids: list[int], n: int) -> None:
        rid = seq.request_id
        prev = self.promised.pop(rid, None)
        if n <= 0:
            if prev is not None:
                self._release(rid)
            return
        if prev is None or prev[1] != n or prev[0] != seq.num_computed_tokens:
            self.errors.append(f"{rid} allocated {n} external tokens; promised {prev}")
            return
        floor = prev[0]
        plan = self.plans[rid]
        blocks = list(block_ids[floor // self.block_size : -(-(floor + n) // self.block_size)])
        fail = plan.fail_block is not None and plan.fail_block < len(blocks)
        self.unsent[rid] = _Load(rid, blocks, plan.is_async, fail, plan.delay)

    def build_connector_meta(self, out: SchedulerOutput) -> None:
        for load in self.unsent.values():
            if load.is_async:
                self.inflight[load.req_id] = load
            else:
                self._sync_now.append(load)
        self.unsent.clear()

    def encode_meta(self, meta: object) -> bytes:
        return b""

    def update_connector_output(self, output: Any) -> None:
        return

    def request_finished(self, seq: Any, block_ids: list[int]) -> bool:
        rid = seq.request_id
        self._withdraw(rid)
        delay = self.plans.get(rid, Plan()).send_delay
        if delay > 0 and block_ids:
            self.saving[rid] = delay
            return True
        return False

    def request_preempted(self, seq: Any) -> None:
        rid = seq.request_id
        if rid in self.inflight:
            self.errors.append(f"{rid} preempted while the ranks may still write its blocks")
        self._withdraw(rid)

    def _withdraw(self, rid: str) -> None:
        if self.promised.pop(rid, None) is not None or self.unsent.pop(rid, None) is not None:
            self._release(rid)

    def shutdown(self) -> None:
        return

    # ---- the ranks ----------------------------------------------------------------------------

    def rank_step(self) -> RankReport:
        """What the ranks report at the end of a step."""
        invalid: list[int] = []
        recving: list[str] = []
        for load in self._sync_now:
            self._release(load.req_id)
            if load.fail:
                invalid.append(load.blocks[self.plans[load.req_id].fail_block or 0])
        self._sync_now = []
        for rid, load in list(self.inflight.items()):
            if load.due > 0:
                load.due -= 1
                continue
            del self.inflight[rid]
            self._release(rid)
            recving.append(rid)
            if load.fail:
                invalid.append(load.blocks[self.plans[rid].fail_block or 0])
        sending = [rid for rid, left in self.saving.items() if left <= 1]
        for rid in list(self.saving):
            self.saving[rid] -= 1
            if self.saving[rid] <= 0:
                del self.saving[rid]
        return RankReport(finished_sending=sending, finished_recving=recving,
                          invalid_block_ids=invalid)  # fmt: skip

    def check_blocks(self, sched: Scheduler) -> None:
        """Every block a load may still write is owned by that load's request."""
        for rid, load in self.inflight.items():
            seq = sched.parked.get(rid)
            if seq is None and rid in sched.held:
                seq = sched.held[rid].seq
            if seq is None:
                self.errors.append(f"{rid}'s load is in flight but the request holds nothing")
                continue
            lost = [b for b in load.blocks if b not in seq.block_ids]
            if lost or any(sched.bm.ref_counts[b] <= 0 for b in load.blocks):
                self.errors.append(f"{rid}'s load blocks {lost or load.blocks} were taken back")


# ---- driving a scheduler ---------------------------------------------------------------------


@dataclass
class Arrival:
    """A request entering at a step."""

    step: int
    request_id: str
    prompt: list[int]
    max_tokens: int


@dataclass
class Run:
    """What a driven run did."""

    steps: int
    finished: dict[str, int]  # request id -> output tokens
    longest_stall: int  # most consecutive steps in which nothing progressed


def make_scheduler(
    num_blocks: int,
    block_size: int,
    connector: SimConnector | None,
    *,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 4,
) -> Scheduler:
    """A scheduler over a fresh pool; `connector=None` runs it without one (offload off)."""
    bm = BlockManager(num_blocks, block_size)
    sim = connector if connector is not None else SimConnector({}, block_size)
    return Scheduler(
        bm,
        sim,  # type: ignore[arg-type]
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=1 << 20,
        has_connector=connector is not None,
    )


def drive(
    sched: Scheduler, arrivals: list[Arrival], *, max_stall: int, max_steps: int, seed: int = 0
) -> Run:
    """Step until every request finished and nothing is held; stops (and reports) a stall
    longer than `max_stall` steps or a run longer than `max_steps`."""
    conn: SimConnector = sched.connector  # type: ignore[assignment]
    rng = random.Random(seed)
    todo = sorted(arrivals, key=lambda a: a.step)
    finished: dict[str, int] = {}
    step = stall = longest = 0
    while todo or sched.has_unfinished():
        while todo and todo[0].step <= step:
            a = todo.pop(0)
            params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
            sched.add(Sequence(a.request_id, a.prompt, params, seed=0, arrival=step))
        had_work = sched.has_unfinished()
        out = sched.schedule()
        conn.build_connector_meta(out)
        report = conn.rank_step()
        sampled = [
            rng.randrange(3, 1000) if sr.computed_after_step >= sr.seq.num_tokens else -1
            for sr in out.scheduled
        ]
        for o in sched.update_from_output(out, sampled, [report]):
            if o.finished:
                finished[o.request_id] = len(o.output_token_ids)
        conn.check_blocks(sched)
        moved = (
            out.total_num_scheduled_tokens > 0
            or report.finished_recving
            or report.finished_sending
        )
        stall = 0 if (moved or not had_work) else stall + 1
        longest = max(longest, stall)
        step += 1
        if stall > max_stall or step > max_steps:
            break
    return Run(step, finished, longest)
