"""OffloadScheduler: the engine-side half of the offload core (one per engine).

It decides, per request, what to load from the tier and what to save into it, emits one
`OffloadMeta` per step, and turns the ranks' reports into exactly one terminal per operation.
It knows no host: hosts call it through the methods below with `RequestView`s.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvtier.config import KVTierConfig
from kvtier.keys import chain_keys, key_seed
from kvtier.metrics import Metrics
from kvtier.offload.admission import DECISIONS, AdmissionPolicy
from kvtier.offload.gate import LoadGate
from kvtier.offload.groups import ChunkGroups
from kvtier.offload.heads import SavedHeads, private_tiers
from kvtier.offload.hooks import HOOK_ERROR, HookGuard, shown_id
from kvtier.offload.messages import ChunkRef, LoadOp, OffloadMeta, SaveOp, WorkerReport
from kvtier.offload.protocols import LookupPort, RequestView, StepRequest
from kvtier.offload.quorum import Quorum, Terminal
from kvtier.offload.retention import (
    AdminCount,
    RetentionDecision,
    RetentionHint,
    RetentionLedger,
)
from kvtier.offload.steps import LOOKUP, META, REPORTS, HookClock

log = logging.getLogger("kvtier")

T = TypeVar("T")

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
# retention decisions kept for hosts to read; an unread one goes after this many newer ones
_DECISIONS_KEPT = 4096
# the ranks' answer to an admin request with no key left to send
_NOTHING = AdminCount(0, None)
# an admin call waits this long for the ranks (prefetch and forget touch disk and the store)
_ADMIN_TIMEOUT_MS = 5000
# a retention budget the scheduler cannot size (chunk bytes unknown): the ranks bound it
_UNBOUNDED = 1 << 40
# load failure reason: a hybrid load's run needs sliding-window blocks its chunks do not store
# (a claim the host cut short of a chunk boundary); the host recomputes it
WINDOW = "window_not_stored"


@dataclass
class _Load:
    hbm: int  # the HBM floor: nothing below it is written
    end: int  # tokens the load claims (a full-prompt hit is one short of the prompt)
    lookup_id: str
    block_ids: list[int] | None = None
    op_id: str | None = None
    sync: bool = False  # finished inside its step's forward, its request never parked
    step: int = 0  # the engine step that sent it to the ranks
    fail: str = ""  # sent as a load every rank fails at once (a hook failed after the promise)
    tables: list[list[int]] | None = None  # a hybrid load: every KV cache group's block table


@dataclass
class _Req:
    req_id: str
    prompt_len: int
    keys: list[bytes]
    load: _Load | None = None
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

    def busy(self) -> bool:
        return bool(self.saves) or (self.load is not None and self.load.op_id is not None)


@dataclass(frozen=True, slots=True)
class LoadOutcome:
    """A load's agreed terminal, translated back to its request."""

    req_id: str
    ok: bool
    tokens: int
    reason: str
    tier: str = ""  # the tier that served most of the load's chunks ("" when it failed)


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
        self.loads = loads
        self.saves = saves
        self.chunk = config.chunk_size
        if self.chunk % block_size:
            raise ValueError(
                f"chunk_size={self.chunk} is not a multiple of block_size={block_size}; "
                f"set chunk_size to a multiple of {block_size}"
            )
        self.block_size = block_size
        self.blocks_per_chunk = self.chunk // block_size
        self.world = world
        self._lookup = lookup
        self._model_id = model_id
        self._seed = key_seed(model_id, self.chunk)
        self.epoch = 0
        self._m = metrics
        self._reqs: dict[str, _Req] = {}
        self._quorum = Quorum(world)
        self._ops: dict[str, tuple[str, str]] = {}  # op id -> (req id, "load" | "save")
        self._nonce = itertools.count()
        self._delayed: list[str] = []
        self._terminals: dict[str, bool] = {}
        # chunk keys of loads with blocks allocated, not yet terminal: key -> loads
        self._loading: Counter[bytes] = Counter()
        # chunk keys of saves sent to the ranks, not yet terminal: key -> saves, and op -> keys
        self._saving: Counter[bytes] = Counter()
        self._save_keys: dict[str, list[bytes]] = {}
        self._clock = clock
        self.groups = groups
        if groups is not None and groups.block_size != block_size:
            raise ValueError(
                f"the KV cache groups' block size {groups.block_size} is not block_size="
                f"{block_size}"
            )
        # sliding-window blocks each save in flight reads (op id -> block ids): the host frees
        # such blocks while the request runs, and one handed to another request before the save
        # read it must not commit (the save is cancelled as for a preemption)
        self._window_reads: dict[str, set[int]] = {}
        self._reused: set[str] = set()  # op ids of such saves, cancelled in the next meta
        seeds = {}
        if bytes_per_token:
            seeds = {
                "memory": config.memory_read_gbps * 1e9 / bytes_per_token,
                "disk": config.disk_read_gbps * 1e9 / bytes_per_token,
                "remote": config.remote_read_gbps * 1e9 / bytes_per_token,
            }
        self.gate = LoadGate.seeded(
            config.prefill_tokens_per_s, load_tokens_per_s or seeds.get("memory"), seeds
        )
        self.min_load = config.min_load(block_size)
        # the tier of a hit when the lookup names none: "memory" only where there is no other
        self._sync_tier = "memory" if config.memory_only else ""
        # where this scheduler is its tiers' only writer, a never-saved first chunk is a miss
        # known without a round trip to the ranks
        if cold_misses is None:
            cold_misses = private_tiers(config, saves=saves)
        self._heads = SavedHeads() if cold_misses else None
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
        self.clock = HookClock(metrics)
        self.guard = HookGuard(metrics)
        self._step = 0  # engine steps so far (build_meta calls)
        self._step_t0: float | None = None  # when the busy step in flight was built
        self._sync_booked_s = 0.0  # predicted seconds of the sync loads promised this step
        self._sync_done_s = 0.0  # measured seconds of the sync loads that ended this step

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
        if st.epoch != self.epoch:
            if st.busy() or st.load is not None:
                return 0  # its keys name the old epoch until its transfers end
            del self._reqs[st.req_id]  # a new lifecycle: keyed in the new epoch
            st = self._state(req)
        if st.load is not None and st.load.op_id is None:
            if st.load.hbm == num_computed_tokens and st.load.block_ids is None:
                # asked again because the host could not allocate last time: the promise and
                # its lease still stand, so no second round trip to every rank
                return st.load.end - st.load.hbm
            self._drop_load(st, WITHDRAWN, count=False)
        if st.load_failed:
            self._m.skipped_load(REPEAT).inc()
            return 0
        if not st.keys:
            return 0
        best = min(len(st.keys) * self.chunk, st.prompt_len - 1)
        if best - num_computed_tokens < self.min_load:
            # even a full tier hit could not beat HBM by a worthwhile load: skip the round trip
            self._cancel_lookup(st)
            self._m.skipped_load(HBM_SATISFIES if best <= num_computed_tokens else TOO_SMALL).inc()
            return 0
        first = num_computed_tokens // self.chunk
        if st.lookup is None and self._behind_load(st, first):
            return None
        if st.lookup is None and self._behind_save(st, first):
            return None
        if st.lookup is None and self._heads is not None and st.keys[0] not in self._heads:
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
        if hit and self._heads is not None:
            self._heads.add(st.keys[0])
        if hit == 0:
            self._lookup.release([lookup_id])
            if result.timed_out:
                self._m.skipped_load(LOOKUP_TIMEOUT).inc()
            return 0
        end = min(hit, st.prompt_len - 1)
        reason = self._skip_reason(num_computed_tokens, end)
        if reason is not None:
            self._m.skipped_load(reason).inc()
            self._lookup.release([lookup_id])
            return 0
        tokens = end - num_computed_tokens
        st.hit_tier = getattr(result, "tier", "")
        # a sync load blocks the forward for its whole read, with no deadline to abandon it:
        # only runs every rank holds in host memory qualify (a lookup that names no tier: only
        # a memory-only stack's)
        tier = st.hit_tier or self._sync_tier
        # a hybrid host can only take back a whole request whose load failed while it waits
        # (vLLM's failed_recving; block ids are per group), so a hybrid load never runs sync
        sync = (
            self.groups is None
            and tier == "memory"
            and self.gate.runs_in_forward(
                tokens, self.config.sync_load_fraction, self._sync_booked_s, tier
            )
        )
        if sync:
            self._sync_booked_s += self.gate.transfer_seconds(tokens, tier)
        st.load = _Load(hbm=num_computed_tokens, end=end, lookup_id=lookup_id, sync=sync)
        return tokens

    def _behind_load(self, st: _Req, first: int) -> bool:
        """Whether `st` waits for another request's load of its chunks: their blocks land in
        HBM when it ends, one tier read per chunk. The wait is bounded by the loads' own
        deadline (`lease_ttl_s`): a load whose end never reaches this scheduler parks no
        other request for longer."""
        if not any(k in self._loading for k in st.keys[first:]):
            st.load_wait_t0 = None
            return False
        now = self._clock()
        if st.load_wait_t0 is None:
            st.load_wait_t0 = now
        if not st.deferred:
            st.deferred = True
            self._m.skipped_load(BEHIND_LOAD).inc()
        return now - st.load_wait_t0 < self.config.lease_ttl_s

    def _behind_save(self, st: _Req, first: int) -> bool:
        """Whether `st` waits for another request's save of one of its chunks to land: a
        lookup now would miss the chunk a step before the tier holds it, and the prompt would
        be recomputed. The wait is bounded by `lookup_timeout_ms` (a save stuck on a rank)."""
        own: Counter[bytes] = Counter()
        for op_id in st.saves:
            own.update(self._save_keys.get(op_id, ()))
        if not any(self._saving[k] > own[k] for k in st.keys[first:]):
            st.save_wait_t0 = None
            return False
        now = self._clock()
        if st.save_wait_t0 is None:
            st.save_wait_t0 = now
            self._m.skipped_load(BEHIND_SAVE).inc()
        return now - st.save_wait_t0 < self.config.lookup_timeout_ms / 1000.0

    def _cancel_lookup(self, st: _Req) -> None:
        if st.lookup is not None:
            self._lookup.cancel(st.lookup)
            st.lookup = None

    def _skip_reason(self, hbm: int, end: int) -> str | None:
        if end <= hbm:
            return HBM_SATISFIES
        if hbm % self.block_size:
            return UNALIGNED
        if end - hbm < self.min_load:
            return TOO_SMALL
        if self.config.load_gate and not self.gate.worth_loading(end - hbm):
            return SLOWER
        return None

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
            self._drop_load(st, WITHDRAWN)
            return 0
        load = st.load
        if hbm_tokens is not None and hbm_tokens != load.hbm:
            reason = self._skip_reason(hbm_tokens, load.end)
            if reason is not None:
                self._drop_load(st, reason)
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
                shown_id(st.req_id),
                promised,
                num_external_tokens,
            )
            load.end = load.hbm + num_external_tokens
        need_blocks = -(-load.end // self.block_size)
        if len(block_ids) < need_blocks:
            raise ValueError(
                f"request {st.req_id}: {len(block_ids)} blocks allocated for a load ending at "
                f"token {load.end}, which needs {need_blocks}"
            )
        load.block_ids = list(block_ids)
        if self.groups is not None:
            load.tables = _tables(req)
        self._track(st, load, +1)
        return load.end - load.hbm

    def _track(self, st: _Req, load: _Load, delta: int) -> None:
        """Count (+1) or forget (-1) the chunk keys an allocated load brings into HBM."""
        for key in st.keys[load.hbm // self.chunk : -(-load.end // self.chunk)]:
            self._loading[key] += delta
            if self._loading[key] <= 0:
                del self._loading[key]

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
        self._step += 1
        self._sync_booked_s = 0.0
        self._sync_done_s = 0.0
        self._step_t0 = time.perf_counter() if scheduled else None
        # saves that read sliding-window blocks the host has handed out again this step:
        # cancelled before the step's forward writes them (chunks copied before commit)
        meta = OffloadMeta(preempted=sorted(preempted), cancel_saves=sorted(self._reused))
        self._reused = set()
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
        meta.delayed_free, self._delayed = self._delayed, []
        meta.load_terminals, self._terminals = self._terminals, {}
        return meta

    def _load_op(self, st: _Req, load: _Load) -> LoadOp:
        """The load's op for the ranks; one every rank fails at once when the load is doomed,
        or when building it raised (the host counts those tokens: it must recompute them)."""

        def doomed() -> LoadOp:
            st.quarantined = st.load_failed = True
            load.fail = load.fail or HOOK_ERROR
            return self._failing_load(st, load)

        if load.fail:
            return self._failing_load(st, load)
        return self.guard.run("build_meta", st.req_id, lambda: self._emit_load(st, load), doomed)

    def _failing_load(self, st: _Req, load: _Load) -> LoadOp:
        assert load.block_ids is not None
        first = load.hbm // self.chunk
        if self.groups is not None and load.tables is not None:
            claimed = self.groups.claimed(load.tables, load.hbm, load.end)
        else:
            claimed = load.block_ids[load.hbm // self.block_size : -(-load.end // self.block_size)]
        load.op_id = f"ld{next(self._nonce)}"
        load.step = self._step
        self._quorum.open(load.op_id)
        self._ops[load.op_id] = (st.req_id, "load")
        key = st.keys[first] if first < len(st.keys) else bytes(16)
        return LoadOp(
            load.op_id, st.req_id, load.lookup_id, [ChunkRef(key, list(claimed))],
            load.end - load.hbm, first, sync=load.sync, fail=load.fail, readmitted=st.readmitted,
        )  # fmt: skip

    def _save_op(self, item: StepRequest) -> SaveOp | None:
        st = self._reqs.get(item.view.request_id)
        if st is None:
            st = self._state(item.view)
        return self._emit_save(st, item)

    def _emit_load(self, st: _Req, load: _Load) -> LoadOp:
        first = load.hbm // self.chunk
        last = -(-load.end // self.chunk)
        chunks = []
        if self.groups is not None:
            assert load.tables is not None
            for c in range(first, last):
                group_ids = self.groups.load_ids(load.tables, c, load.hbm, load.end)
                if group_ids is None:
                    load.fail = WINDOW
                    return self._failing_load(st, load)
                chunks.append(ChunkRef(st.keys[c], group_ids, _parent(st.keys, c)))
        for c in range(first, last) if self.groups is None else ():
            ids = []
            for b in range(self.blocks_per_chunk):
                token = (c * self.chunk) + b * self.block_size
                # below the floor: shared HBM blocks; past the claim: not ours to write
                inside = load.hbm <= token < load.end
                ids.append(load.block_ids[token // self.block_size] if inside else -1)
            chunks.append(ChunkRef(st.keys[c], ids, _parent(st.keys, c)))
        # kvtier's own ids: bounded whatever the host's request id is (a client's header)
        load.op_id = f"ld{next(self._nonce)}"
        load.step = self._step
        self._quorum.open(load.op_id)
        self._ops[load.op_id] = (st.req_id, "load")
        log.debug(
            "kvtier: %s load %s tokens [%d, %d)",
            "sync" if load.sync else "async",
            load.op_id,
            load.hbm,
            load.end,
        )
        return LoadOp(
            load.op_id,
            st.req_id,
            load.lookup_id,
            chunks,
            load.end - load.hbm,
            first,
            sync=load.sync,
            readmitted=st.readmitted,
        )

    def _emit_save(self, st: _Req, item: StepRequest) -> SaveOp | None:
        if not self.saves or st.quarantined:
            return None
        if st.load is not None:
            return None  # its blocks are being filled by a load
        if st.epoch != self.epoch:
            return None  # computed before a reset: nothing of it enters the new epoch
        computed = min(item.computed_after_step, st.prompt_len)
        if st.admit_limit is None:
            st.admit_limit = self._admit(st)
        aligned = (min(computed, st.admit_limit * self.chunk) // self.chunk) * self.chunk
        if aligned <= st.emitted:
            return None
        if self.groups is not None:
            return self._emit_group_save(st, item, aligned)
        blocks = item.view.block_ids
        if len(blocks) * self.block_size < aligned:
            raise ValueError(
                f"request {st.req_id}: {len(blocks)} blocks cannot hold {aligned} computed tokens"
            )
        chunks = []
        for c in range(st.emitted // self.chunk, aligned // self.chunk):
            b0 = c * self.blocks_per_chunk
            chunk_blocks = list(blocks[b0 : b0 + self.blocks_per_chunk])
            chunks.append(ChunkRef(st.keys[c], chunk_blocks, _parent(st.keys, c)))
        first = st.emitted // self.chunk
        op_id = self._open_save(st, chunks, first)
        st.saves[op_id] = (st.emitted, aligned)
        op = SaveOp(op_id, st.req_id, chunks, aligned - st.emitted, st.emitted // self.chunk)
        st.emitted = aligned
        return op

    def _emit_group_save(self, st: _Req, item: StepRequest, aligned: int) -> SaveOp | None:
        """A hybrid request's save of chunks [emitted, aligned): every group's positions of
        each chunk. Leading chunks whose sliding-window blocks the host no longer holds (freed
        below its window, or null blocks under an HBM hit) are passed over for good."""
        groups = self.groups
        assert groups is not None
        tables = _tables(item.view)
        before = item.computed_before_step
        if before is None:
            before = item.view.num_computed_tokens
        start = st.emitted
        first = max(start // self.chunk, groups.first_saveable(before))
        chunks: list[ChunkRef] = []
        window: set[int] = set()
        end = aligned
        for c in range(first, aligned // self.chunk):
            ids = groups.save_ids(tables, c)
            if ids is None:
                if chunks:
                    end = c * self.chunk  # the table ends here: the rest waits for a step
                    break
                first = c + 1
                continue
            chunks.append(ChunkRef(st.keys[c], ids, _parent(st.keys, c)))
            window.update(groups.window_ids(ids))
        st.emitted = end
        if not chunks:
            return None
        op_id = self._open_save(st, chunks, first)
        if window:
            self._window_reads[op_id] = window
        # the chunks passed over count as done: nothing can save them any more
        st.saves[op_id] = (start, end)
        return SaveOp(op_id, st.req_id, chunks, end - first * self.chunk, first)

    def _open_save(self, st: _Req, chunks: Sequence[ChunkRef], first: int) -> str:
        """Register a save of `chunks` (the first is chunk `first`): its op id, quorum and the
        keys other requests wait for."""
        op_id = f"sv{next(self._nonce)}"
        if self._heads is not None:
            self._heads.add(st.keys[0])
        self._quorum.open(op_id)
        self._ops[op_id] = (st.req_id, "save")
        # chunks under its HBM floor were computed, and saved, by a request before it: saving
        # them again keeps them in the tier, but nobody needs to wait for that
        floor = (st.hbm_floor or 0) // self.chunk
        self._save_keys[op_id] = [r.key for c, r in enumerate(chunks, first) if c >= floor]
        self._saving.update(self._save_keys[op_id])
        return op_id

    def blocks_allocated(self, block_ids: Iterable[int]) -> None:
        """The host handed these blocks to requests this step (any group): a save in flight
        that reads one of them as a sliding-window block is cancelled in this step's meta."""
        if not self._window_reads:
            return
        fresh = set(block_ids)
        for op_id, reads in self._window_reads.items():
            if op_id in self._ops and not reads.isdisjoint(fresh):
                self._reused.add(op_id)
                log.debug("kvtier: save %s cancelled: a window block it reads was reused", op_id)

    def _admit(self, st: _Req) -> int:
        """Decide once, before its first save, how many chunks the request may save."""
        hbm = (st.hbm_floor or 0) // self.chunk
        decision, seen = self.admission.decide(
            st.keys,
            hbm_chunks=hbm,
            tier_chunks=min(st.saved // self.chunk, len(st.keys)),
            # a prefill producer's saves are what its consumer loads; a retained prompt's
            # chunks are what its client said will come back
            forced=not self.loads or st.retained > 0,
        )
        if decision.candidates:
            self._m.admission(decision.decision).inc(decision.candidates)
        for label in DECISIONS:
            if seen.returns[label]:
                self._m.admission_return(label).inc(seen.returns[label])
        self._m.admission_pressure.set(self.admission.pressure)
        return decision.limit

    # ---- reports ------------------------------------------------------------------------------

    def process_reports(self, reports: Sequence[WorkerReport]) -> list[LoadOutcome]:
        """Feed every rank's report; returns the load terminals reached. The first call after
        a step's `build_meta` closes that step: its time (sync loads left out) feeds the gate."""
        with self.clock.time(REPORTS):
            outcomes = []
            for report in reports:
                for result in report.results:
                    term = self._quorum.report(report.rank, result)
                    if term is not None:
                        outcome = self.guard.run(
                            "update_connector_output",
                            self._ops.get(term.op_id, ("", ""))[0] or None,
                            lambda term=term: self._terminal(term),
                            lambda term=term: self._forget_op(term.op_id),
                        )
                        if outcome is not None:
                            outcomes.append(outcome)
        if self._step_t0 is not None:
            step_s = time.perf_counter() - self._step_t0 - self._sync_done_s
            self._step_t0 = None
            self.gate.observe_step(step_s)
        return outcomes

    def _terminal(self, term: Terminal) -> LoadOutcome | None:
        req_id, kind = self._ops.pop(term.op_id)
        st = self._reqs.get(req_id)
        if kind == "save":
            self._save_terminal(st, term)
            outcome = None
        else:
            outcome = self._load_terminal(req_id, st, term)
        if st is not None and st.finished and not st.busy():
            del self._reqs[req_id]
        return outcome

    def _save_terminal(self, st: _Req | None, term: Terminal) -> None:
        self._window_reads.pop(term.op_id, None)
        for key in self._save_keys.pop(term.op_id, ()):
            self._saving[key] -= 1
            if self._saving[key] <= 0:
                del self._saving[key]
        if st is None:
            return
        start, end = st.saves.pop(term.op_id)
        if term.ok:
            if start <= st.saved:
                st.saved = max(st.saved, end)
        else:
            self._m.save_failure(term.reason or "unknown").inc()
            st.emitted = min(st.emitted, start)  # saved again on a later step
            if term.reason == HOOK_ERROR:
                st.quarantined = True  # a defect, not a full tier: trying again fails again
            log.warning(
                "kvtier: save %s of request %s, tokens [%d, %d), failed (%s); it will be retried",
                term.op_id,
                shown_id(st.req_id),
                start,
                end,
                term.reason,
            )

    def _load_terminal(self, req_id: str, st: _Req | None, term: Terminal) -> LoadOutcome:
        self._terminals[term.op_id] = term.ok
        load = st.load if st is not None else None
        tokens = (load.end - load.hbm) if load is not None else 0
        if st is not None and load is not None:
            self._track(st, load, -1)
            st.load = None
            if load.sync:
                self._m.sync_loads.inc()
                self._sync_done_s += term.seconds
            self._m.load_parked_steps.observe(0 if load.sync else self._step - load.step + 1)
        if term.ok:
            self.gate.observe_load(tokens, term.seconds, term.tier)
            return LoadOutcome(req_id, True, tokens, "", term.tier)
        self._m.load_failure(term.reason or "unknown").inc()
        if st is not None and load is not None:
            st.load_failed = True
            # the recomputed chunks above the floor must be saved again
            floor = (load.hbm // self.chunk) * self.chunk
            st.saved = min(st.saved, floor)
            st.emitted = min(st.emitted, floor)
        log.warning(
            "kvtier: load %s failed on some rank (%s); request %s recomputes it",
            term.op_id,
            term.reason,
            shown_id(req_id),
        )
        return LoadOutcome(req_id, False, tokens, term.reason)

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
        self._cancel_lookup(st)
        if st.load is not None and st.load.op_id is None:
            self._drop_load(st, WITHDRAWN)
        st.finished = True
        if st.busy():
            self._delayed.append(st.req_id)
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
        self._drop_load(st, WITHDRAWN)

    def mark_readmitted(self, req_id: str) -> None:
        """The request was preempted: its later admissions (and the load one of them may
        already hold) are counted apart from first admissions, as the hosts count them."""
        st = self._reqs.get(req_id)
        if st is not None:
            st.readmitted = True

    def reset(self) -> None:
        """Start a new namespace epoch: lookups and saves from now on chain from a fresh random
        seed, so no chunk stored before (by any engine) is reachable; requests keyed before
        neither load nor save again. For the host's cache resets (weights changed, pause); the
        host resets its own prefix cache with it."""
        self.epoch += 1
        if self._heads is not None:
            self._heads.clear()
        self._seed = key_seed(self._model_id, self.chunk, epoch=os.urandom(16))
        log.info(
            "kvtier: namespace epoch %d: every chunk stored before is unreachable (%d requests "
            "keyed before it neither load nor save)",
            self.epoch,
            len(self._reqs),
        )

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The host's measured prefill rate feeds the load gate."""
        self.gate.observe_prefill(tokens, seconds)

    def has_pending_work(self) -> bool:
        """True while any operation awaits its terminal or a load awaits dispatch."""
        return bool(self._ops) or any(st.load is not None for st in self._reqs.values())

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

    def _state(self, req: RequestView) -> _Req:
        st = self._reqs.get(req.request_id)
        if st is None:
            prompt = req.prompt_token_ids
            keys = chain_keys(prompt, self.chunk, self._seed)
            st = self._reqs[req.request_id] = _Req(
                req.request_id, len(prompt), keys, epoch=self.epoch
            )
            hint = getattr(req, "retention", None)
            if isinstance(hint, RetentionHint) and self.saves:
                self._hint(st, hint)
        return st

    def _hint(self, st: _Req, hint: RetentionHint) -> None:
        """Grant a client's retention hint within the budget and tell the ranks (no wait: the
        ranks mark the keys now and protect each chunk from the moment it is stored)."""
        if not hint.retain:
            self.retention.note(st.keys, hint.session, hint.tenant)
            return
        decision, keys, until = self.retention.decide(st.keys, hint, self.chunk)
        self._decisions[st.req_id] = decision
        while len(self._decisions) > _DECISIONS_KEPT:
            self._decisions.popitem(last=False)
        self._m.retention(decision.status).inc()
        self._release_displaced()
        if keys:
            st.retained = len(keys)
            self._lookup.admin_send("retain", keys, until)
        self._m.retained_chunks.set(self.retention.retained_chunks())

    def _release_displaced(self) -> None:
        """Chunks a sooner hint took the room of (`retention_full: soonest`) stop being
        retained on the ranks too."""
        gone = self.retention.take_displaced()
        if gone:
            self._m.retention_displaced.inc(len(gone))
            self._lookup.admin_send("release", gone)

    def retention_decision(self, req_id: str) -> RetentionDecision | None:
        """What the request's retention hint was granted (once; None without a hint)."""
        return self._decisions.pop(req_id, None)

    # ---- admin: retain, release, prefetch, forget (any host's API calls these) ---------------

    def keys_for(
        self, prompt: Sequence[int] | None = None, session: str | None = None, tenant: str = ""
    ) -> list[bytes]:
        """The chunk keys of a prompt, of a conversation (`session`, its prompt_cache_key), or
        of every conversation of `tenant` (neither given)."""
        if prompt is not None:
            return chain_keys(prompt, self.chunk, self._seed)
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
        elif op == "forget":
            self.retention.release(keys)
        if op in ("release", "forget"):
            self._m.retained_chunks.set(self.retention.retained_chunks())
        if not keys:
            return {r: _NOTHING for r in range(self.world)}
        # a forgotten chain's head stays in the saved heads: its next lookup asks the ranks,
        # which answer the truth (a miss)
        return dict(self._lookup.admin(op, keys, timeout_ms=_ADMIN_TIMEOUT_MS))

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
            if self.groups is not None and block_ids and not isinstance(block_ids[0], int):
                # a hybrid host hands every group's table; given one flat table only, the
                # failing load claims it alone (the host recomputes every group's tokens)
                load.tables = [list(t) for t in block_ids]  # type: ignore[arg-type]
                block_ids = max(load.tables, key=len)
            load.block_ids = list(block_ids)
            load.end = min(load.end, load.hbm + counted)
            self._track(st, load, +1)
        if load.block_ids is None:
            self._drop_load(st, HOOK_ERROR)
        else:
            load.fail = HOOK_ERROR

    def _quarantine_to(
        self,
        req_id: str,
        answer: T,
        block_ids: Sequence[int] | None = None,
        counted: int = 0,
    ) -> T:
        self.quarantine(req_id, block_ids, counted)
        return answer

    def _forget_op(self, op_id: str) -> None:
        """Processing an op's terminal raised: the op is gone, its request quarantined and
        its load forgotten (so no request waits behind its chunks), its saves rolled back."""
        req_id, kind = self._ops.pop(op_id, (None, ""))
        self._terminals.pop(op_id, None)
        self._window_reads.pop(op_id, None)
        for key in self._save_keys.pop(op_id, ()):
            self._saving[key] -= 1
            if self._saving[key] <= 0:
                del self._saving[key]
        st = self._reqs.get(req_id) if req_id is not None else None
        if st is None:
            return None
        st.quarantined = st.load_failed = True
        st.saves.pop(op_id, None)
        if kind == "load" and st.load is not None and st.load.op_id == op_id:
            self._track(st, st.load, -1)
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
        if st.load is not None and st.load.op_id is None:
            st.load = None  # its lease expires by its deadline
        if st.busy():
            self._delayed.append(req_id)
            return True
        del self._reqs[req_id]
        return False

    def _drop_load(self, st: _Req, reason: str, count: bool = True) -> None:
        assert st.load is not None and st.load.op_id is None
        if st.load.block_ids is not None:
            self._track(st, st.load, -1)
        self._lookup.release([st.load.lookup_id])
        if count:
            self._m.skipped_load(reason).inc()
        st.load = None


def _tables(view: RequestView) -> list[list[int]]:
    """Every KV cache group's block table of a hybrid request (-1: a block the host dropped)."""
    tables = getattr(view, "group_block_ids", None)
    if tables is None:
        raise TypeError(
            f"{type(view).__name__} has no group_block_ids; a hybrid registration needs every "
            "KV cache group's block table from the host"
        )
    return [list(t) for t in tables]


def _parent(keys: Sequence[bytes], c: int) -> bytes:
    """The key of the chunk before chunk `c` (b"" for the first)."""
    return keys[c - 1] if c else b""


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
    return 65536 if chunks is None else min(max(16 * chunks, 4096), 1 << 20)
