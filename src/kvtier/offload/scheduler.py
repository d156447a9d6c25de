"""OffloadScheduler: the engine-side half of the offload core (one per engine).

It decides, per request, what to load from the tier and what to save into it, emits one
`OffloadMeta` per step, and turns the ranks' reports into exactly one terminal per operation.
It knows no host: hosts call it through the methods below with `RequestView`s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from kvtier.config import KVTierConfig
from kvtier.keys import KeySpace
from kvtier.metrics import Metrics
from kvtier.offload.chunking import layout_for
from kvtier.offload.gate import LoadGate
from kvtier.offload.groups import ChunkGroups
from kvtier.offload.hooks import HOOK_ERROR, HookGuard, shown_id
from kvtier.offload.inflight import InFlight
from kvtier.offload.ledger import Kind, OpLedger
from kvtier.offload.load_planner import WITHDRAWN, LoadPlanner
from kvtier.offload.messages import LoadOp, OffloadMeta, SaveOp, WorkerReport
from kvtier.offload.planner import SavePlanner
from kvtier.offload.protocols import LookupPort, RequestView, StepRequest
from kvtier.offload.quorum import REPORT_LOST, Terminal
from kvtier.offload.request_state import LoadOutcome, LoadState, RequestState
from kvtier.offload.retention import RetentionHint
from kvtier.offload.steps import LOOKUP, META, REPORTS, HookClock
from kvtier.store import registry

log = logging.getLogger("kvtier")
# an operation with no report from every rank after this many `lease_ttl_s` lost its report
LOST_REPORT_TTLS = 2.0

T = TypeVar("T")


class OffloadScheduler:
    """Lookup, load decisions, save frontiers and operation terminals for one engine."""

    def __init__(
        self,
        config: KVTierConfig,
        lookup: LookupPort,
        *,
        model_id: str,
        block_size: int,
        world: int,
        metrics: Metrics,
        load_tokens_per_s: float | None = None,
        bytes_per_token: int | None = None,
        loads: bool = True,
        saves: bool = True,
        cold_misses: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
        groups: ChunkGroups | None = None,
    ) -> None:
        """`bytes_per_token` (per rank) turns the config's read-bandwidth seeds into token rates
        for the load gate; `load_tokens_per_s` overrides the seed outright. `loads=False` never
        loads (a prefill producer), `saves=False` never saves (a decode consumer).
        `cold_misses` answers a never-saved first chunk 0 without a lookup (default: where this
        scheduler is its tiers' only writer); False asks the ranks always, as a lookup port
        filled by others needs. `clock` bounds the wait behind another request's save.
        `groups` is a hybrid registration's chunk layout (`kvtier.offload.groups`): requests
        then give every group's block table (`group_block_ids`), and each chunk carries every
        group's positions."""
        self.config = config
        self.chunk = config.chunk_size
        if self.chunk % block_size:
            raise ValueError(
                f"chunk_size={self.chunk} is not a multiple of block_size={block_size}; "
                f"set chunk_size to a multiple of {block_size}"
            )
        self.block_size = block_size
        self._lookup = lookup
        self.keys = KeySpace(model_id, self.chunk)
        self._m = metrics
        self._reqs: dict[str, RequestState] = {}
        self.ops = OpLedger(world, clock)
        self._inflight = InFlight()
        self.layout = layout_for(groups, self.chunk, block_size)
        seeds = {}
        if bytes_per_token:
            seeds = {
                tier: gbps * 1e9 / bytes_per_token
                for tier, gbps in registry.read_seeds(config).items()
            }
        self.gate = LoadGate.seeded(
            config.prefill_tokens_per_s, load_tokens_per_s or seeds.get("memory"), seeds,
            margin=config.load_margin, probe_s=config.load_probe_s,
        )  # fmt: skip
        self.planner = SavePlanner(
            config, lookup, metrics, keys=self.keys, layout=self.layout, ledger=self.ops,
            inflight=self._inflight, bytes_per_token=bytes_per_token, loads=loads, saves=saves,
            cold_misses=cold_misses,
        )  # fmt: skip
        self.load_planner = LoadPlanner(
            config, lookup, metrics, self.gate, self._inflight, self.planner,
            layout=self.layout, ledger=self.ops, block_size=block_size, clock=clock,
        )  # fmt: skip
        self.clock = HookClock(metrics)
        self.guard = HookGuard(metrics)

    @property
    def epoch(self) -> int:
        """The namespace epoch keys are chained in (bumped by `reset`)."""
        return self.keys.epoch

    # ---- lookup -------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, req: RequestView, num_computed_tokens: int) -> int | None:
        """Tokens beyond the HBM hit that the tier will load for `req` (0 = none); None when
        not known yet (a lookup still in flight, or another request's load is bringing the
        same chunks into HBM): the host asks again at a later step.

        A positive answer holds a lease on every rank until the load's terminal or a withdrawal;
        `load_is_async` then says where the load runs.
        """
        if not self.config.enabled:
            return 0
        rid = req.request_id
        with self.clock.time(LOOKUP):
            return self.guard.run(
                "get_num_new_matched_tokens",
                rid,
                lambda: self._matched(req, num_computed_tokens),
                lambda: self._quarantine_to(rid, 0),
            )

    def load_is_async(self, req_id: str) -> bool:
        """Whether the request's promised load runs on the load lane while it waits parked
        (True) or inside the forward of the step that admits it (False)."""
        st = self._reqs.get(req_id)
        return st is None or st.load is None or not st.load.sync

    def _matched(self, req: RequestView, num_computed_tokens: int) -> int | None:
        st = self._state(req)
        st.asked_hbm = num_computed_tokens
        if st.quarantined:
            return 0
        if st.hbm_floor is None:
            st.hbm_floor = num_computed_tokens
        if st.epoch != self.keys.epoch:
            if st.busy() or st.load is not None:
                return 0  # its keys name the old epoch until its transfers end
            self.load_planner.cancel_lookup(st)  # its lease on every rank goes back
            del self._reqs[st.req_id]  # a new lifecycle: keyed in the new epoch
            st = self._state(req)
        if st.load is not None and st.load.op_id is None:
            if st.load.hbm == num_computed_tokens and st.load.block_ids is None:
                # asked again because the host could not allocate last time: the promise and
                # its lease still stand, so no second round trip to every rank
                return st.load.end - st.load.hbm
            self.load_planner.drop(st, WITHDRAWN, count=False)
        return self.load_planner.ask(st, num_computed_tokens)

    def update_state_after_alloc(
        self,
        req: RequestView,
        block_ids: Sequence[int],
        num_external_tokens: int,
        hbm_tokens: int | None = None,
    ) -> int:
        """Record the blocks allocated for a promised load; returns the tokens still promised.

        `hbm_tokens` is the HBM floor re-read after allocation when the host knows it better
        than at lookup time; a load that no longer pays off is withdrawn (0 is returned).
        """
        rid = req.request_id
        return self.guard.run(
            "update_state_after_alloc",
            rid,
            lambda: self._after_alloc(req, block_ids, num_external_tokens, hbm_tokens),
            lambda: self._quarantine_to(rid, 0, block_ids, num_external_tokens),
        )

    def _after_alloc(
        self,
        req: RequestView,
        block_ids: Sequence[int],
        num_external_tokens: int,
        hbm_tokens: int | None,
    ) -> int:
        st = self._reqs.get(req.request_id)
        if st is None or st.load is None or st.load.op_id is not None:
            return 0
        if num_external_tokens <= 0:
            self.load_planner.drop(st, WITHDRAWN)
            return 0
        load = st.load
        if hbm_tokens is not None and hbm_tokens != load.hbm:
            reason = self.load_planner.skip_reason(hbm_tokens, load.end)
            if reason is not None:
                self.load_planner.drop(st, reason)
                return 0
            load.hbm = hbm_tokens
        promised = load.end - load.hbm
        if num_external_tokens > promised:
            raise ValueError(
                f"request {st.req_id}: the host counts {num_external_tokens} external tokens, "
                f"more than the {promised} promised"
            )
        if num_external_tokens < promised:
            # the host granted less (a token budget, a block-aligned cut): load exactly that;
            # the chunk it ends in is read whole and written only up to the grant
            log.debug(
                "kvtier: load of %s cut from %d to %d granted tokens",
                shown_id(st.req_id), promised, num_external_tokens,
            )  # fmt: skip
            load.end = load.hbm + num_external_tokens
        self.load_planner.repredict(load)
        need_blocks = -(-load.end // self.block_size)
        if len(block_ids) < need_blocks:
            raise ValueError(
                f"request {st.req_id}: {len(block_ids)} blocks allocated for a load ending at "
                f"token {load.end}, which needs {need_blocks}"
            )
        load.block_ids = list(block_ids)
        load.tables = self.layout.tables(req)
        self.load_planner.track(st, load, +1)
        return load.end - load.hbm

    # ---- per step -----------------------------------------------------------------------------

    def build_meta(
        self, scheduled: Sequence[StepRequest], preempted: Iterable[str] = ()
    ) -> OffloadMeta:
        """The loads ready to go, the saves this step completes, the delayed frees, and the
        requests preempted in this step (whose in-flight saves the ranks cancel)."""
        with self.clock.time(META):
            meta = self._build_meta(scheduled, preempted)
        # one flush per step: this step's lookups and meta, the previous step's reports
        self.clock.flush()
        return meta

    def _build_meta(
        self, scheduled: Sequence[StepRequest], preempted: Iterable[str]
    ) -> OffloadMeta:
        self.load_planner.booked_s = 0.0
        # saves that read sliding-window blocks the host has handed out again this step:
        # cancelled before the step's forward writes them (chunks copied before commit)
        meta = self.ops.begin_step(bool(scheduled), preempted)
        for st in list(self._reqs.values()):
            load = st.load
            if load is not None and load.block_ids is not None and load.op_id is None:
                meta.loads.append(self._load_op(st, load))
        for item in scheduled:
            op = self.guard.run(
                "build_meta",
                item.view.request_id,
                lambda item=item: self._save_op(item),
                lambda item=item: self._quarantine_to(item.view.request_id, None),
            )
            if op is not None:
                meta.saves.append(op)
        return self.ops.end_step(meta)

    def _load_op(self, st: RequestState, load: LoadState) -> LoadOp:
        """The load's op for the ranks; one every rank fails at once when the load is doomed,
        or when building it raised (the host counts those tokens: it must recompute them)."""

        def doomed() -> LoadOp:
            st.quarantined = st.load_failed = True
            load.fail = load.fail or HOOK_ERROR
            return self.load_planner.failing(st, load)

        return self.guard.run(
            "build_meta", st.req_id, lambda: self.load_planner.emit(st, load), doomed
        )

    def _save_op(self, item: StepRequest) -> SaveOp | None:
        st = self._reqs.get(item.view.request_id) or self._state(item.view)
        return self.planner.emit(st, item)

    def blocks_allocated(self, block_ids: Iterable[int]) -> None:
        """The host handed these blocks to requests this step (any group): a save in flight
        that reads one of them as a sliding-window block is cancelled in this step's meta."""
        reused = self._inflight.reused(block_ids, self.ops)
        self.ops.cancel_saves(reused)
        for op_id in reused:
            log.debug("kvtier: save %s cancelled: a window block it reads was reused", op_id)

    # ---- reports ------------------------------------------------------------------------------

    def process_reports(self, reports: Sequence[WorkerReport]) -> list[LoadOutcome]:
        """Feed every rank's report; returns the load terminals reached. The first call after
        a step's `build_meta` closes that step: its time (sync loads left out) feeds the gate."""
        with self.clock.time(REPORTS):
            outcomes = []
            for report in reports:
                if report.selftest_load is not None:
                    self.gate.seed_from_selftest(*report.selftest_load)
                for result in report.results:
                    term = self.ops.report(report.rank, result)
                    if term is not None:
                        # read before `_terminal` closes the op: its fallback needs the owner
                        entry = self.ops.entry(term.op_id)
                        outcome = self.guard.run(
                            "update_connector_output",
                            entry[0] if entry is not None else None,
                            lambda term=term: self._terminal(term),
                            lambda term=term, entry=entry: self._forget_op(term, entry),
                        )
                        if outcome is not None:
                            outcomes.append(outcome)
            outcomes += self._end_lost_reports()
        step_s = self.ops.step_seconds()
        if step_s is not None:
            self.gate.observe_step(step_s)
        return outcomes

    def _end_lost_reports(self) -> list[LoadOutcome]:
        """Operations no rank finished reporting within twice `lease_ttl_s` lost a report (each
        rank ends its loads within `lease_ttl_s` and never sends a result twice): they end as
        failed here, or a lost report would keep a load open for good, its chunks parking
        every request that shares them and its request never saving again."""
        outcomes = []
        for op_id in self.ops.overdue(LOST_REPORT_TTLS * self.config.lease_ttl_s):
            term = Terminal(op_id, ok=False, reason=REPORT_LOST, nbytes=0, seconds=0.0, tier="")
            log.warning("kvtier: operation %s has no report from every rank after %.0f s: ended "
                        "as failed (%s)", op_id, LOST_REPORT_TTLS * self.config.lease_ttl_s,
                        REPORT_LOST)  # fmt: skip
            entry = self.ops.entry(op_id)
            outcome = self.guard.run(
                "update_connector_output",
                entry[0] if entry is not None else None,
                lambda term=term: self._terminal(term),
                lambda term=term, entry=entry: self._forget_op(term, entry),
            )
            if outcome is not None:
                outcomes.append(outcome)
        return outcomes

    def _terminal(self, term: Terminal) -> LoadOutcome | None:
        req_id, kind = self.ops.close(term.op_id)
        st = self._reqs.get(req_id)
        outcome = None
        if kind == "save":
            self.planner.ended(st, term)
        else:
            outcome = self.load_planner.ended(req_id, st, term)
        if st is not None and st.finished and not st.busy():
            del self._reqs[req_id]
        return outcome

    # ---- lifecycle ----------------------------------------------------------------------------

    def request_finished(self, req: RequestView) -> bool:
        """The request ended (finished or aborted). True: the host must delay freeing its blocks
        until the workers report it in `finished_sending`."""
        rid = req.request_id
        return self.guard.run(
            "request_finished", rid, lambda: self._finished(req), lambda: self._finish_after(rid)
        )

    def _finished(self, req: RequestView) -> bool:
        st = self._reqs.get(req.request_id)
        if st is None:
            return False
        self.load_planner.cancel_lookup(st)
        if st.load is not None and st.load.op_id is None:
            self.load_planner.drop(st, WITHDRAWN)
        st.finished = True
        if st.busy():
            self.ops.delay_free(st.req_id)
            return True
        del self._reqs[st.req_id]
        return False

    def request_preempted(self, req: RequestView) -> None:
        """The host takes the request's blocks back; an unsent load is withdrawn (its lease
        released). A load already sent cannot be: the ranks may still write those blocks, so a
        host preempts such a request only after its load's terminal (finished_recving)."""
        self.mark_readmitted(req.request_id)
        st = self._reqs.get(req.request_id)
        if st is None or st.load is None:
            return
        if st.load.op_id is not None:
            raise RuntimeError(
                f"request {st.req_id} was preempted while its load {st.load.op_id} is on the "
                "ranks, which may still write its blocks; wait for the load's finished_recving"
            )
        self.load_planner.drop(st, WITHDRAWN)

    def mark_readmitted(self, req_id: str) -> None:
        """The request was preempted: its later admissions (and the load one of them may
        already hold) are counted apart from first admissions, as the hosts count them, and
        what its saves on the ranks cover is saved again by its next admission."""
        st = self._reqs.get(req_id)
        if st is None:
            return
        st.readmitted = True
        self.planner.preempted(st)

    def reset(self) -> None:
        """Start a new namespace epoch: lookups and saves from now on chain from a fresh random
        seed, so no chunk stored before (by any engine) is reachable; requests keyed before
        neither load nor save again. For the host's cache resets (weights changed, pause); the
        host resets its own prefix cache with it."""
        epoch = self.keys.new_epoch()
        self.planner.new_epoch()
        log.info(
            "kvtier: namespace epoch %d: every chunk stored before is unreachable (%d requests "
            "keyed before it neither load nor save)",
            epoch,
            len(self._reqs),
        )

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The host's measured prefill rate feeds the load gate."""
        self.gate.observe_prefill(tokens, seconds)

    def has_pending_work(self) -> bool:
        """True while any operation awaits its terminal or a load awaits dispatch."""
        return bool(self.ops) or any(st.load is not None for st in self._reqs.values())

    def hit_tier(self, req_id: str) -> str:
        """The tier the request's external hit comes from: the deepest tier of the run its
        lookup found ("memory", "disk", "remote"; "" when unknown)."""
        st = self._reqs.get(req_id)
        return "" if st is None else st.hit_tier

    def hbm_floor(self, req_id: str) -> int:
        """Tokens of the request's own prefix-cache hit that the allocation following its
        latest ask keeps (0 when unknown or after a preemption): blocks below it are shared
        and only read."""
        st = self._reqs.get(req_id)
        if st is None or st.hbm_floor is None or st.readmitted:
            return 0
        return min(st.hbm_floor, st.asked_hbm)

    def pending_load(self, req_id: str) -> tuple[int, int] | None:
        """(floor, end) of the request's promised load, for hosts and tests."""
        st = self._reqs.get(req_id)
        if st is None or st.load is None:
            return None
        return st.load.hbm, st.load.end

    def saved_frontier(self, req_id: str) -> tuple[int, int] | None:
        """(committed, emitted) save frontiers of a request, for hosts and tests."""
        st = self._reqs.get(req_id)
        return None if st is None else (st.saved, st.emitted)

    # ---- internals ----------------------------------------------------------------------------

    def _state(self, req: RequestView) -> RequestState:
        st = self._reqs.get(req.request_id)
        if st is None:
            prompt = req.prompt_token_ids
            keys = self.keys.keys(prompt)
            st = self._reqs[req.request_id] = RequestState(
                req.request_id, len(prompt), keys, epoch=self.keys.epoch
            )
            hint = getattr(req, "retention", None)
            if isinstance(hint, RetentionHint) and self.planner.saves:
                st.retained = self.planner.hint(st.req_id, keys, hint)
        return st

    def quarantine(
        self, req_id: str, block_ids: Sequence[int] | None = None, counted: int = 0
    ) -> None:
        """A hook failed for `req_id`: it gets no lookup, load or save from now on. A lookup
        in flight is cancelled and a promise the host has not counted is withdrawn; one it
        counted (`counted` external tokens over `block_ids`) goes to the ranks as a load they
        fail at once, so the host recomputes those blocks. Ops already sent end as usual."""
        st = self._reqs.get(req_id)
        if st is None:
            return
        st.quarantined = st.load_failed = True
        if st.lookup is not None:
            lookup, st.lookup = st.lookup, None
            self.guard.run("quarantine", req_id, lambda: self._lookup.cancel(lookup), lambda: None)
        load = st.load
        if load is None or load.op_id is not None:
            return
        if load.block_ids is None and counted > 0 and block_ids is not None:
            # a hybrid host hands every group's table; given one flat table only, the failing
            # load claims it alone (the host recomputes every group's tokens)
            load.block_ids, tables = self.layout.counted_claim(block_ids)
            load.tables = tables if tables is not None else load.tables
            load.end = min(load.end, load.hbm + counted)
            self.load_planner.track(st, load, +1)
        if load.block_ids is None:
            self.load_planner.drop(st, HOOK_ERROR)
        else:
            load.fail = HOOK_ERROR

    def _quarantine_to(
        self, req_id: str, answer: T, block_ids: Sequence[int] | None = None, counted: int = 0
    ) -> T:
        self.quarantine(req_id, block_ids, counted)
        return answer

    def _forget_op(self, term: Terminal, entry: tuple[str, Kind] | None = None) -> None:
        """Processing an op's terminal raised: the op is gone, its request quarantined and
        its load forgotten (so no request waits behind its chunks), its saves rolled back.
        `entry` is the op's (request, kind) as read before processing began: the op may have
        been closed before the failure, and a finished request must still go. A load's ranks
        still hear its terminal (each keeps a load that succeeded there until it does)."""
        op_id = term.op_id
        owner = self.ops.forget(op_id) or entry
        self._inflight.close_save(op_id)
        st = self._reqs.get(owner[0]) if owner is not None else None
        if owner is not None and owner[1] == "load":
            # as `LoadPlanner.ended` words it: a load whose request finished first was unused
            self.ops.load_ended(op_id, term.ok and (st is None or not st.finished), None)
        if st is None:
            return None
        st.quarantined = st.load_failed = True
        st.saves.pop(op_id, None)
        if st.load is not None and st.load.op_id == op_id:
            self.load_planner.track(st, st.load, -1)
            st.load = None
        if st.finished and not st.busy():
            del self._reqs[st.req_id]
        return None

    def _finish_after(self, req_id: str) -> bool:
        """`request_finished` raised: the request is done. With an op in flight its blocks wait
        for the ranks' finished_sending (reported once none of its ops is in flight there), so
        no save still copying them can read a reused block; without one they are free now (a
        delay nobody ends would hold them until some later step)."""
        st = self._reqs.get(req_id)
        if st is None:
            return False
        st.finished = st.quarantined = True
        if st.lookup is not None:
            # its state goes below: a lookup left in flight would stay in the lookup client's
            # table for good (and its lease on every rank until the deadline)
            lookup, st.lookup = st.lookup, None
            self.guard.run(
                "request_finished", req_id, lambda: self._lookup.cancel(lookup), lambda: None
            )
        if st.load is not None and st.load.op_id is None:
            st.load = None  # its lease expires by its deadline
        if st.busy():
            self.ops.delay_free(req_id)
            return True
        del self._reqs[req_id]
        return False
