"""Whether, and how, a request's prefix is loaded from the tier instead of recomputed, and
what its load's op and terminal are.

Asked at each admission of a request (`get_num_new_matched_tokens`), it skips the lookup where
no load could pay (the HBM already holds enough, a first chunk this engine never saved, a load
that failed before), waits behind another request's load or save of the same chunks, polls the
all-rank lookup without blocking, and decides on the answer: the load's range above the HBM
floor, whether it beats recomputing (the load gate), and whether it runs inside the forward
(synchronous) or parked on the load lane. Once the host allocated its blocks, the load
becomes an op for the ranks; its terminal feeds the cost model and, on failure, rolls the
request's save frontiers back to what it recomputes.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable

from kvtier.config import KVTierConfig
from kvtier.lookup.result import deepest_tier
from kvtier.metrics import Metrics
from kvtier.offload.chunking import ChunkLayout
from kvtier.offload.cost import RECOMPUTE, LoadChoice
from kvtier.offload.gate import LoadGate
from kvtier.offload.hooks import HOOK_ERROR, shown_id
from kvtier.offload.inflight import InFlight
from kvtier.offload.ledger import OpLedger
from kvtier.offload.messages import ChunkRef, LoadOp
from kvtier.offload.planner import SavePlanner
from kvtier.offload.protocols import LookupPort, LookupResultLike
from kvtier.offload.quorum import REPORT_LOST, Terminal
from kvtier.offload.request_state import LoadOutcome, LoadState, RequestState
from kvtier.store import registry

log = logging.getLogger("kvtier")

# Skip reasons (the `reason` label of kvtier_skipped_loads_total).
HBM_SATISFIES = "hbm_satisfies"
UNALIGNED = "unaligned"
TOO_SMALL = "too_small"
SLOWER = "slower_than_recompute"
LOOKUP_TIMEOUT = "lookup_timeout"
WITHDRAWN = "withdrawn"
REPEAT = "failed_before"
# another request's load is bringing these chunks into HBM: wait for it instead of a second read
BEHIND_LOAD = "behind_inflight_load"
BEHIND_SAVE = "behind_inflight_save"
# load failure reason: a hybrid load's run needs sliding-window blocks its chunks do not store
# (a claim the host cut short of a chunk boundary); the host recomputes it
WINDOW = "window_not_stored"


class LoadPlanner:
    """The load decisions of one engine's scheduler (its lookups, gate and waits)."""

    def __init__(
        self,
        config: KVTierConfig,
        lookup: LookupPort,
        metrics: Metrics,
        gate: LoadGate,
        inflight: InFlight,
        planner: SavePlanner,
        *,
        layout: ChunkLayout,
        ledger: OpLedger,
        block_size: int,
        clock: Callable[[], float],
    ) -> None:
        self.config = config
        self.chunk = config.chunk_size
        self.block_size = block_size
        self.min_load = config.min_load(block_size)
        self.gate = gate
        self.layout = layout
        self._ledger = ledger
        self.policy = config.effective_load_policy
        # the tier of a hit when the lookup names none: "memory" only where there is no other
        self.sync_tier = "memory" if config.memory_only else ""
        # the tier kinds are registered before any engine is wired: read their order once,
        # not per load decision
        self._tier_order = registry.order()
        self.booked_s = 0.0  # predicted seconds of the sync loads promised this step
        self._lookup = lookup
        self._m = metrics
        self._inflight = inflight
        self._planner = planner
        self._clock = clock
        self._nonce = itertools.count()

    def ask(self, st: RequestState, num_computed_tokens: int) -> int | None:
        """Tokens beyond `num_computed_tokens` (the HBM hit) to load for `st`: 0 for none, None
        while not known (a lookup in flight, or another request's operation on its chunks);
        a positive answer leaves `st.load` promised, its lease held on every rank."""
        if st.load_failed:
            self._m.skipped_load(REPEAT).inc()
            return 0
        if not st.keys:
            return 0
        best = min(len(st.keys) * self.chunk, st.prompt_len - 1)
        if best - num_computed_tokens < self.min_load:
            # even a full tier hit could not beat HBM by a worthwhile load: skip the round trip
            self.cancel_lookup(st)
            self._m.skipped_load(HBM_SATISFIES if best <= num_computed_tokens else TOO_SMALL).inc()
            return 0
        first = num_computed_tokens // self.chunk
        if self._behind_load(st, first):
            # a lookup sent before that load was allocated would read its chunks a second
            # time: its lease goes back, and the answer is asked again once the load ends
            self.cancel_lookup(st)
            return None
        if st.lookup is None and self._behind_save(st, first):
            return None
        if st.lookup is None and self._planner.known_miss(st.keys[0]):
            self._m.cold_lookups.inc()
            return 0
        t0 = time.perf_counter()
        if st.lookup is None:
            ends = self.layout.ends(st.keys, st.prompt_len)
            st.lookup = self._lookup.begin(st.keys, f"lk{next(self._nonce)}", lease=True, ends=ends)
        result = self._lookup.poll(st.lookup, wait_ms=self.config.lookup_wait_ms)
        self._m.scheduler_lookup_seconds.observe(time.perf_counter() - t0)
        if result is None:
            return None  # still in flight: polled again at the next ask, never blocking
        lookup_id = st.lookup.lookup_id
        st.lookup = None
        try:
            return self._answered(st, num_computed_tokens, result, lookup_id)
        except BaseException:
            # between the answer and the promise the lease is held by this call alone
            if st.load is None or st.load.lookup_id != lookup_id:
                self._lookup.release([lookup_id])
            raise

    def _answered(
        self, st: RequestState, num_computed_tokens: int, result: LookupResultLike, lookup_id: str
    ) -> int:
        """The promise made of a lookup's answer (its lease released unless a load holds it)."""
        hit = result.hit_chunks * self.chunk
        self._m.lookups.inc()
        # lookup_hit_tokens is the lookup client's to count (it shares these metrics)
        # chunks the tier holds on every rank need no saving again
        st.saved = max(st.saved, hit)
        st.emitted = max(st.emitted, hit)
        if hit:
            self._planner.saw_head(st.keys[0])
        if hit == 0:
            self._lookup.release([lookup_id])
            if result.timed_out:
                self._m.skipped_load(LOOKUP_TIMEOUT).inc()
            return 0
        end = min(hit, st.prompt_len - 1)
        reason = self.skip_reason(num_computed_tokens, end)
        choice = None
        if reason is None:
            choice = self._choose(num_computed_tokens, end, result)
            # a state layout's load ends at the boundary whose state it reads, or not at all
            short = self.layout.exact_end and choice.end != end
            if choice.end <= num_computed_tokens or short:
                reason = SLOWER
            self._count_decisions(choice, recomputed=reason is not None)
        if reason is not None or choice is None:
            self._m.skipped_load(reason or SLOWER).inc()
            self._lookup.release([lookup_id])
            return 0
        # a tail only a slow tier holds is recomputed: the load ends at a chunk boundary, and
        # its tier is the deepest it reads (a memory head alone may run inside the forward)
        end = choice.end
        tokens = end - num_computed_tokens
        st.hit_tier = deepest_tier((t for t, _ in choice.reads()), self._tier_order)
        # a sync load blocks the forward for its whole read, with no deadline to abandon it:
        # only runs every rank holds in host memory qualify (a lookup that names no tier: only
        # a memory-only stack's)
        tier = st.hit_tier or self.sync_tier
        # a hybrid host can only take back a whole request whose load failed while it waits
        # (vLLM's failed_recving; block ids are per group), so a hybrid load never runs sync
        sync = (
            self.layout.sync_loads
            and tier == "memory"
            and self.gate.runs_in_forward(
                tokens, self.config.sync_load_fraction, self.booked_s, tier
            )
        )
        if sync:
            self.booked_s += self.gate.transfer_seconds(tokens, tier)
        st.load = LoadState(
            hbm=num_computed_tokens, end=end, lookup_id=lookup_id, sync=sync,
            predicted_s=choice.predicted_s, reads=choice.reads(),
        )  # fmt: skip
        return tokens

    def _choose(self, hbm: int, end: int, result: LookupResultLike) -> LoadChoice:
        """Load or recompute each run of the hit `[hbm, end)` by the tier that serves it
        (`load_policy`), counted per run."""
        runs = result.runs or ((result.tier or self.sync_tier, result.hit_chunks),)
        cost = self.gate.cost
        if self.policy == "always":
            return cost.load_all(hbm, end, runs, self.chunk)
        return cost.choose(hbm, end, runs, self.chunk, self.min_load, self._clock())

    def _count_decisions(self, choice: LoadChoice, recomputed: bool) -> None:
        """Count each run's decision; every run recomputed when the hit was turned away."""
        for seg in choice.segments:
            tier = seg.tier or "unknown"
            decision = RECOMPUTE if recomputed else seg.decision
            self._m.load_decision(decision, tier).inc()
            self._m.load_decision_tokens(decision, tier).inc(seg.end - seg.start)

    def repredict(self, load: LoadState) -> None:
        """After the host moved a promised load's floor or granted less: its reads and its
        prediction are those of what it will read."""
        head, keep = load.hbm - load.promised_hbm, load.end - load.hbm
        if not load.reads or (head == 0 and sum(n for _, n in load.reads) == keep):
            return
        load.reads = self.gate.cost.clipped(load.reads, max(head, 0), keep)
        load.promised_hbm = load.hbm
        load.predicted_s = self.gate.cost.predicted_seconds(load.reads)

    def _behind_load(self, st: RequestState, first: int) -> bool:
        """Whether `st` waits for another request's load of its chunks: their blocks land in
        HBM when it ends, one tier read per chunk. The wait is bounded by the loads' own
        deadline (`lease_ttl_s`): a load whose end never reaches this scheduler parks no
        other request for longer."""
        if not self._inflight.loading(st.keys[first:]):
            st.load_wait_t0 = None
            return False
        now = self._clock()
        if st.load_wait_t0 is None:
            st.load_wait_t0 = now
        if not st.deferred:
            st.deferred = True
            self._m.skipped_load(BEHIND_LOAD).inc()
        return now - st.load_wait_t0 < self.config.lease_ttl_s

    def _behind_save(self, st: RequestState, first: int) -> bool:
        """Whether `st` waits for another request's save of one of its chunks to land: a
        lookup now would miss the chunk a step before the tier holds it, and the prompt would
        be recomputed. The wait is bounded by `lookup_timeout_ms` (a save stuck on a rank)."""
        if not self._inflight.saving_for_others(st.keys[first:], st.saves):
            st.save_wait_t0 = None
            return False
        now = self._clock()
        if st.save_wait_t0 is None:
            st.save_wait_t0 = now
            self._m.skipped_load(BEHIND_SAVE).inc()
        return now - st.save_wait_t0 < self.config.lookup_timeout_ms / 1000.0

    def cancel_lookup(self, st: RequestState) -> None:
        if st.lookup is not None:
            self._lookup.cancel(st.lookup)
            st.lookup = None

    def skip_reason(self, hbm: int, end: int) -> str | None:
        if end <= hbm:
            return HBM_SATISFIES
        if hbm % self.block_size:
            return UNALIGNED
        if end - hbm < self.min_load:
            return TOO_SMALL
        return None

    def drop(self, st: RequestState, reason: str, count: bool = True) -> None:
        """Withdraw the request's unsent load: its lease goes back to every rank."""
        assert st.load is not None and st.load.op_id is None
        if st.load.block_ids is not None:
            self.track(st, st.load, -1)
        self._lookup.release([st.load.lookup_id])
        if count:
            self._m.skipped_load(reason).inc()
        st.load = None

    def track(self, st: RequestState, load: LoadState, delta: int) -> None:
        """Count (+1) or forget (-1) the chunk keys an allocated load brings into HBM."""
        keys = st.keys[load.hbm // self.chunk : -(-load.end // self.chunk)]
        self._inflight.track_load(keys, delta)

    # ---- the op and its terminal ---------------------------------------------------------------

    def emit(self, st: RequestState, load: LoadState) -> LoadOp:
        """The allocated load's op for the ranks (one they fail at once when it is doomed)."""
        if load.fail:
            return self.failing(st, load)
        chunks = self.layout.load_chunks(st.keys, load)
        if chunks is None:
            load.fail = WINDOW
            return self.failing(st, load)
        self._open(st, load)
        # only a load that goes out is predicted: a promise refused, aborted or preempted
        # before it is sent reads nothing
        self._m.load_predicted_seconds.observe(load.predicted_s)
        log.debug(
            "kvtier: %s load %s tokens [%d, %d)",
            "sync" if load.sync else "async", load.op_id, load.hbm, load.end,
        )  # fmt: skip
        return self._op(st, load, chunks)

    def failing(self, st: RequestState, load: LoadState) -> LoadOp:
        """A load every rank fails at once: the host counted its tokens, so it is sent (and
        ends) like any other, claiming its blocks for the host to recompute."""
        first = load.hbm // self.chunk
        key = st.keys[first] if first < len(st.keys) else bytes(16)
        self._open(st, load)
        return self._op(st, load, [ChunkRef(key, list(self.layout.claimed(load)))])

    def _open(self, st: RequestState, load: LoadState) -> None:
        assert load.block_ids is not None
        load.op_id = self._ledger.open("load", st.req_id)
        load.step = self._ledger.step

    def _op(self, st: RequestState, load: LoadState, chunks: list[ChunkRef]) -> LoadOp:
        assert load.op_id is not None
        return LoadOp(
            load.op_id, st.req_id, load.lookup_id, chunks, load.end - load.hbm,
            load.hbm // self.chunk, sync=load.sync, fail=load.fail, readmitted=st.readmitted,
        )  # fmt: skip

    def ended(self, req_id: str, st: RequestState | None, term: Terminal) -> LoadOutcome:
        """A load's terminal: the cost model learns from it; a failed one's chunks are
        recomputed, so the request's save frontiers fall back to its floor."""
        load = st.load if st is not None else None
        tokens = (load.end - load.hbm) if load is not None else 0
        sync_s = None
        if st is not None and load is not None:
            self.track(st, load, -1)
            st.load = None
            if load.sync:
                self._m.sync_loads.inc()
                sync_s = term.seconds
            self._m.load_parked_steps.observe(0 if load.sync else self._ledger.step - load.step + 1)
        # the ranks count a load's tokens retrieved on this word: a load whose request finished
        # first (aborted while it was parked) was never used, nor counted a hit by the host
        self._ledger.load_ended(term.op_id, term.ok and (st is None or not st.finished), sync_s)
        # no tier was read when the report never came, or when the ranks failed the load at
        # once (a hook error, a window not stored): neither is evidence of a tier's speed
        doomed = load is not None and load.fail
        if term.reason not in (REPORT_LOST, HOOK_ERROR, WINDOW) and not doomed:
            self._learn(load, term, tokens)
        if term.ok:
            return LoadOutcome(req_id, True, tokens, "", term.tier)
        self._m.load_failure(term.reason or "unknown").inc()
        if st is not None and load is not None:
            st.load_failed = True
            st.rewind((load.hbm // self.chunk) * self.chunk)
        log.warning(
            "kvtier: load %s failed on some rank (%s); request %s recomputes it",
            term.op_id, term.reason, shown_id(req_id),
        )  # fmt: skip
        return LoadOutcome(req_id, False, tokens, term.reason)

    def _learn(self, load: LoadState | None, term: Terminal, tokens: int) -> None:
        """Feed a load's measured time to the cost model, and its prediction's error to the
        metrics."""
        cost = self.gate.cost
        predicted = load.predicted_s if load is not None else 0.0
        # a failed load (a store's read timeout) is evidence too: its tiers' failure share
        # rises, and a wait longer than predicted teaches a slower read
        reads = load.reads if load is not None and load.reads else ((term.tier, tokens),)
        shifts = {t: cost.tier(t).shifts for t, _ in reads}
        cost.observe_read(reads, term.seconds, tokens, term.ok)
        for t, before in shifts.items():
            if cost.tier(t).shifts > before:
                self._m.load_speed_shift(t).inc()
        if term.ok or term.seconds > predicted > 0:
            if cost.observe_outcome(predicted, term.seconds):
                self._m.load_mispredictions.inc()
            if predicted > 0 and term.seconds > 0:
                self._m.load_prediction_ratio.observe(term.seconds / predicted)
            self._m.load_misprediction_share.set(cost.mispredicted_share)
