"""Whether, and how, a request's prefix is loaded from the tier instead of recomputed.

Asked at each admission of a request (`get_num_new_matched_tokens`), it skips the lookup where
no load could pay (the HBM already holds enough, a first chunk this engine never saved, a load
that failed before), waits behind another request's load or save of the same chunks, polls the
all-rank lookup without blocking, and decides on the answer: the load's range above the HBM
floor, whether it beats recomputing (the load gate), and whether it runs inside the forward
(synchronous) or parked on the load lane.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

from kvtier.config import KVTierConfig
from kvtier.lookup.result import deepest_tier
from kvtier.metrics import Metrics
from kvtier.offload.cost import LoadChoice
from kvtier.offload.gate import LoadGate
from kvtier.offload.inflight import InFlight
from kvtier.offload.planner import SavePlanner
from kvtier.offload.protocols import LookupPort, LookupResultLike
from kvtier.offload.request_state import LoadState, RequestState
from kvtier.store import registry

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
        block_size: int,
        sync_loads: bool,
        clock: Callable[[], float],
    ) -> None:
        self.config = config
        self.chunk = config.chunk_size
        self.block_size = block_size
        self.min_load = config.min_load(block_size)
        self.gate = gate
        self.sync_loads = sync_loads
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
            st.lookup = self._lookup.begin(st.keys, f"lk{next(self._nonce)}", lease=True)
        result = self._lookup.poll(st.lookup, wait_ms=self.config.lookup_wait_ms)
        self._m.scheduler_lookup_seconds.observe(time.perf_counter() - t0)
        if result is None:
            return None  # still in flight: polled again at the next ask, never blocking
        lookup_id = st.lookup.lookup_id
        st.lookup = None
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
            if choice.end <= num_computed_tokens:
                reason = SLOWER
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
            self.sync_loads
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
        self._m.load_predicted_seconds.observe(choice.predicted_s)
        return tokens

    def _choose(self, hbm: int, end: int, result: LookupResultLike) -> LoadChoice:
        """Load or recompute each run of the hit `[hbm, end)` by the tier that serves it
        (`load_policy`), counted per run."""
        runs = result.runs or ((result.tier or self.sync_tier, result.hit_chunks),)
        cost = self.gate.cost
        if self.policy == "always":
            choice = cost.load_all(hbm, end, runs, self.chunk)
        else:
            choice = cost.choose(hbm, end, runs, self.chunk, self.min_load, self._clock())
        for seg in choice.segments:
            tier = seg.tier or "unknown"
            self._m.load_decision(seg.decision, tier).inc()
            self._m.load_decision_tokens(seg.decision, tier).inc(seg.end - seg.start)
        return choice

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

