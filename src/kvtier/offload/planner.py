"""What a request may write into the tier and keep there, decided for the scheduler:

- **admission** (`offload/admission.py`): how many of a request's chunks are worth writing,
  decided once before its first save; a P/D producer's saves and a retained prompt's always go;
- **retention** (`offload/retention.py`): a client's hint or an admin call retains a prompt's
  chunks on every rank within the budget; decisions wait here until the host reads them;
- **first chunks saved** (`offload/heads.py`): where this scheduler is its tiers' only writer,
  a prompt whose first chunk it never saved is a miss known without asking the ranks;
- **saves**: each step, the admitted whole chunks a request computed past its emitted frontier
  become one save op; its terminal commits the frontier, or rolls it back to be saved again.

The scheduler owns the operations' lifecycle (lookups, quorum, terminals); the planner owns
these choices, so admission, retention, cold misses and save frontiers change here only.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from kvtier.config import MAX_ADMISSION_HISTORY, KVTierConfig
from kvtier.keys import KeySpace
from kvtier.metrics import Metrics
from kvtier.offload.admission import DECISIONS, AdmissionPolicy
from kvtier.offload.chunking import ChunkLayout
from kvtier.offload.heads import SavedHeads, private_tiers
from kvtier.offload.hooks import HOOK_ERROR, shown_id
from kvtier.offload.inflight import InFlight
from kvtier.offload.ledger import OpLedger
from kvtier.offload.messages import ChunkRef, SaveOp
from kvtier.offload.protocols import LookupPort, StepRequest
from kvtier.offload.quorum import Terminal
from kvtier.offload.request_state import RequestState
from kvtier.offload.retention import AdminCount, RetentionDecision, RetentionHint, RetentionLedger

log = logging.getLogger("kvtier")

# retention decisions kept for hosts to read; an unread one goes after this many newer ones
_DECISIONS_KEPT = 4096
# the ranks' answer to an admin request with no key left to send
_NOTHING = AdminCount(0, None)
# an admin call waits this long for the ranks (prefetch and forget touch disk and the store)
_ADMIN_TIMEOUT_MS = 5000
# a retention budget the scheduler cannot size (chunk bytes unknown): the ranks bound it
_UNBOUNDED = 1 << 40


class SavePlanner:
    """Admission, retention and the first chunks saved, for one engine's scheduler.

    `keys` gives a prompt's chunk keys in the scheduler's current epoch; `world` is how many
    ranks answer an admin call; `loads=False` is a P/D producer (every save forced),
    `saves=False` a consumer that never saves."""

    def __init__(
        self,
        config: KVTierConfig,
        lookup: LookupPort,
        metrics: Metrics,
        *,
        keys: KeySpace,
        layout: ChunkLayout,
        ledger: OpLedger,
        inflight: InFlight,
        bytes_per_token: int | None,
        loads: bool,
        saves: bool,
        cold_misses: bool | None,
    ) -> None:
        self.chunk = config.chunk_size
        self.world = ledger.quorum.world
        self.saves = saves
        self._lookup = lookup
        self._m = metrics
        self._keys = keys
        self._layout = layout
        self._ledger = ledger
        self._inflight = inflight
        self._forced = not loads
        self.admission = AdmissionPolicy(
            config.admission,
            capacity=_tier_chunks(config, bytes_per_token),
            history=_admission_history(config, bytes_per_token),
        )
        self.retention = RetentionLedger(
            _retention_budget(config, bytes_per_token),
            tenant_share=config.retention_tenant_share,
            default_ttl_s=config.retention_ttl_s,
            max_ttl_s=config.retention_max_ttl_s,
            full=config.retention_full,
        )
        # request id -> what its hint was granted, until the host reads it (bounded)
        self._decisions: OrderedDict[str, RetentionDecision] = OrderedDict()
        # where this scheduler is its tiers' only writer, a never-saved first chunk is a miss
        # known without a round trip to the ranks
        if cold_misses is None:
            cold_misses = private_tiers(config, saves=saves)
        self._heads = SavedHeads() if cold_misses else None

    # ---- first chunks ----------------------------------------------------------------------

    def known_miss(self, first_key: bytes) -> bool:
        """A prompt starting with `first_key` cannot hit (this scheduler never saved it)."""
        return self._heads is not None and first_key not in self._heads

    def saw_head(self, first_key: bytes) -> None:
        """A save or a hit named this first chunk."""
        if self._heads is not None:
            self._heads.add(first_key)

    def new_epoch(self) -> None:
        """Every key of the old epoch is unreachable: none is a known head any more, and what
        was retained gives its budget back (the ranks release it)."""
        if self._heads is not None:
            self._heads.clear()
        gone = self.retention.reset()
        if gone:
            self._lookup.admin_send("release", gone)
        self._m.retained_chunks.set(0)

    # ---- admission -------------------------------------------------------------------------

    def admit(
        self, keys: Sequence[bytes], hbm_tokens: int, saved_tokens: int, retained: int
    ) -> int:
        """Chunks the request may save (decided once, before its first save)."""
        decision, seen = self.admission.decide(
            keys,
            hbm_chunks=hbm_tokens // self.chunk,
            tier_chunks=min(saved_tokens // self.chunk, len(keys)),
            # a prefill producer's saves are what its consumer loads; a retained prompt's
            # chunks are what its client said will come back
            forced=self._forced or retained > 0,
        )
        if decision.candidates:
            self._m.admission(decision.decision).inc(decision.candidates)
        for label in DECISIONS:
            if seen.returns[label]:
                self._m.admission_return(label).inc(seen.returns[label])
        if seen.rejected_roomy:
            self._m.admission_rejected_roomy.inc(seen.rejected_roomy)
        self._m.admission_pressure.set(self.admission.pressure)
        return decision.limit

    # ---- saves --------------------------------------------------------------------------------

    def emit(self, st: RequestState, item: StepRequest) -> SaveOp | None:
        """The save of the admitted whole chunks `st` computed past its emitted frontier this
        step (None: nothing new, or the request may not save)."""
        if not self.saves or st.quarantined or st.load is not None:
            return None  # a load's blocks are still being filled
        if st.epoch != self._keys.epoch:
            return None  # computed before a reset: nothing of it enters the new epoch
        computed = min(item.computed_after_step, st.prompt_len)
        if st.admit_limit is None:
            st.admit_limit = self.admit(st.keys, st.hbm_floor or 0, st.saved, st.retained)
        aligned = (min(computed, st.admit_limit * self.chunk) // self.chunk) * self.chunk
        if aligned <= st.emitted:
            return None
        start = st.emitted
        plan = self._layout.save_chunks(st.keys, item, start, aligned)
        # chunks passed over (a window the host no longer holds) count as done: nothing can
        # save them any more
        st.emitted = plan.end
        if not plan.chunks:
            return None
        op_id = self._open(st, plan.chunks, plan.first, plan.window)
        st.saves[op_id] = (start, plan.end)
        return SaveOp(op_id, st.req_id, plan.chunks, plan.end - plan.first * self.chunk, plan.first)

    def _open(
        self, st: RequestState, chunks: Sequence[ChunkRef], first: int, window: set[int]
    ) -> str:
        """Open a save of `chunks` (the first is chunk `first`) and publish the keys other
        requests wait for; `window`: the sliding-window blocks it reads."""
        op_id = self._ledger.open("save", st.req_id)
        self.saw_head(st.keys[0])
        # chunks under its HBM floor were computed, and saved, by a request before it: saving
        # them again keeps them in the tier, but nobody needs to wait for that
        floor = (st.hbm_floor or 0) // self.chunk
        keys = [r.key for c, r in enumerate(chunks, first) if c >= floor]
        self._inflight.open_save(op_id, keys, window)
        return op_id

    def preempted(self, st: RequestState) -> None:
        """The ranks cancel the request's saves still out: what they cover goes out again with
        its next admission. Their failure comes back when the save lane gets to it; after a
        short re-admission has finished, no later step of the request would save the range.
        A range that did commit is found resident."""
        if st.saves:
            st.emitted = min(st.emitted, min(start for start, _ in st.saves.values()))

    def ended(self, st: RequestState | None, term: Terminal) -> None:
        """A save's terminal: its range commits, or goes back to be saved on a later step."""
        self._inflight.close_save(term.op_id)
        if st is None:
            return
        start, end = st.saves.pop(term.op_id)
        if term.ok:
            if start <= st.saved:
                st.saved = max(st.saved, end)
            return
        self._m.save_failure(term.reason or "unknown").inc()
        if not any(s <= start and end <= e for s, e in st.saves.values()):
            # (a save still out that covers the range, sent again after a preemption, decides)
            st.emitted = min(st.emitted, start)
        if term.reason == HOOK_ERROR:
            st.quarantined = True  # a defect, not a full tier: trying again fails again
        # a cancelled sliding-window save comes back only while the host still holds its blocks
        then = (
            "the request saves nothing more"
            if st.quarantined
            else "a later step saves the range again if the host still holds its blocks"
        )
        log.warning(
            "kvtier: save %s of request %s, tokens [%d, %d), failed (%s); %s",
            term.op_id, shown_id(st.req_id), start, end, term.reason, then,
        )  # fmt: skip

    # ---- retention ---------------------------------------------------------------------------

    def hint(self, req_id: str, keys: Sequence[bytes], hint: RetentionHint) -> int:
        """Grant a client's retention hint within the budget and tell the ranks (no wait: the
        ranks mark the keys now and protect each chunk from the moment it is stored); the
        leading chunks retained."""
        if not hint.retain:
            self.retention.note(keys, hint.session, hint.tenant)
            return 0
        decision, granted, until = self.retention.decide(keys, hint, self.chunk)
        self._decisions[req_id] = decision
        while len(self._decisions) > _DECISIONS_KEPT:
            self._decisions.popitem(last=False)
        self._m.retention(decision.status).inc()
        self._release_displaced()
        if granted:
            self._lookup.admin_send("retain", granted, until)
        self._m.retained_chunks.set(self.retention.retained_chunks())
        return len(granted)

    def _release_displaced(self) -> None:
        """Chunks a sooner hint took the room of (`retention_full: soonest`) stop being
        retained on the ranks too."""
        gone = self.retention.take_displaced()
        if gone:
            self._m.retention_displaced.inc(len(gone))
            self._lookup.admin_send("release", gone)

    def _retain_shortened(self) -> None:
        """Chunks a conversation let go of that others still hold, until their (earlier)
        deadline: a rank keeps the later of two, so it is told by a release, then a retain."""
        by_until: dict[float, list[bytes]] = {}
        for key, until in self.retention.take_shortened().items():
            by_until.setdefault(until, []).append(key)
        for until, keys in by_until.items():
            self._lookup.admin_send("release", keys)
            self._lookup.admin_send("retain", keys, until)

    def retention_decision(self, req_id: str) -> RetentionDecision | None:
        """What the request's retention hint was granted (once; None without a hint)."""
        return self._decisions.pop(req_id, None)

    # ---- admin: retain, release, prefetch, forget (any host's API calls these) -------------

    def keys_for(
        self, prompt: Sequence[int] | None = None, session: str | None = None, tenant: str = ""
    ) -> list[bytes]:
        """The chunk keys of a prompt, of a conversation (`session`, its prompt_cache_key), or
        of every conversation of `tenant` (neither given)."""
        if prompt is not None:
            return self._keys.keys(prompt)
        return self.retention.keys_of(session, tenant)

    def retain(self, prompt: Sequence[int], hint: RetentionHint) -> RetentionDecision:
        """Retain a prompt as a hint on a request would, and wait for the ranks' answers."""
        return self.retain_keys(self.keys_for(prompt), hint)

    def retain_keys(self, keys: Sequence[bytes], hint: RetentionHint) -> RetentionDecision:
        """Retain chunk `keys` (a prompt's or a conversation's) within the budget, waiting for
        the ranks."""
        decision, granted, until = self.retention.decide(keys, hint, self.chunk)
        self._m.retention(decision.status).inc()
        self._release_displaced()
        if granted:
            self._lookup.admin("retain", granted, until)
        self._m.retained_chunks.set(self.retention.retained_chunks())
        return decision

    def admin(
        self, op: str, keys: Sequence[bytes], holder: tuple[str, str | None] | None = None
    ) -> dict[int, Any]:
        """Release, prefetch or forget `keys` on every rank; the ranks' answers. A release by
        `holder` (tenant, session) lets go only of what no other conversation still retains."""
        if op == "release":
            keys = self.retention.release(keys, holder)
            self._retain_shortened()
        elif op == "forget":
            self.retention.release(keys)
        if op in ("release", "forget"):
            self._m.retained_chunks.set(self.retention.retained_chunks())
        if not keys:
            return {r: _NOTHING for r in range(self.world)}
        # a forgotten chain's head stays in the saved heads: its next lookup asks the ranks,
        # which answer the truth (a miss)
        return dict(self._lookup.admin(op, keys, timeout_ms=_ADMIN_TIMEOUT_MS))


def _retention_budget(config: KVTierConfig, bytes_per_token: int | None) -> int:
    """Chunks clients may retain: the budget's share of a rank's largest private tier (as the
    ranks bound it); unknown chunk sizes leave the bound to the ranks alone."""
    if not bytes_per_token:
        return _UNBOUNDED if config.retention_budget > 0 else 0
    chunks = max(config.memory_bytes, config.disk_bytes) // (config.chunk_size * bytes_per_token)
    return int(config.retention_budget * chunks)


def _tier_chunks(config: KVTierConfig, bytes_per_token: int | None) -> int | None:
    """Chunks a rank's own tiers hold (None: unknown, or a shared store behind them)."""
    if not bytes_per_token or config.remote_url:
        return None
    return max(
        1, (config.memory_bytes + config.disk_bytes) // (config.chunk_size * bytes_per_token)
    )


def _admission_history(config: KVTierConfig, bytes_per_token: int | None) -> int:
    """Chunk keys the admission policy remembers: the config's, else 16 x the tiers' chunks."""
    if config.admission_history:
        return config.admission_history
    chunks = _tier_chunks(config, bytes_per_token)
    return 65536 if chunks is None else min(max(16 * chunks, 4096), MAX_ADMISSION_HISTORY)
