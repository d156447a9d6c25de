"""Continuous batching with chunked prefill, recompute preemption and the connector's
scheduler-side hooks (vLLM v1 semantics, see `kvtier.native.connector`).

Why one module over 500 lines: one step's admission, preemption and parking rules read each
other's state (a parked load holds its blocks, a parked request is never preempted), so they
stay in one class; the block manager and request state are apart (`blocks`, `sequence`).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from kvtier.native.blocks import BlockManager
from kvtier.native.connector import (
    ConnectorOutput,
    KVOutputAggregator,
    SchedulerConnector,
    external_cache_hit_sources,
)
from kvtier.native.sampling import TokenLogprobs
from kvtier.native.sched_output import ScheduledRequest, SchedulerOutput
from kvtier.native.sequence import (
    ExternalLoad,
    RequestOutput,
    Sequence,
    SequenceStatus,
    loggable,
)

log = logging.getLogger("kvtier.native")


@dataclass
class RankReport:
    """What one rank's connector returned at the end of a step."""

    finished_sending: Seq[str] = ()
    finished_recving: Seq[str] = ()
    invalid_block_ids: Seq[int] = ()
    worker_meta: bytes = b""


@dataclass
class SchedulerStats:
    """Counters with vLLM's meanings (prefix-cache counters live in the BlockManager)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    requests_failed: int = 0  # sampling raised: finished with reason "error"
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    # external queries and hits of admissions after a preemption, apart (as vLLM counts them)
    preempted_external_queries: int = 0
    preempted_external_hits: int = 0
    external_load_failures: int = 0
    # external hits by the tier that served them (vLLM's CacheHitSource values)
    external_hits_by_source: dict[str, int] = field(default_factory=dict)


@dataclass
class _Held:
    """A finished request whose blocks stay allocated until the ranks are done with them."""

    seq: Sequence
    wait_send: bool  # the connector asked to delay the free (request_finished -> True)
    wait_recv: bool  # aborted while a load was writing into its blocks


@dataclass
class _Limits:
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)


class Scheduler:
    """Decides which requests run each step and applies each step's results."""

    def __init__(
        self,
        block_manager: BlockManager,
        connector: SchedulerConnector,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        eos_token_ids: Seq[int] = (),
        world: int = 1,
        has_connector: bool = True,
    ) -> None:
        self.bm = block_manager
        self.block_size = block_manager.block_size
        self.connector = connector
        self.has_connector = has_connector
        self.limits = _Limits(
            max_num_batched_tokens, max_num_seqs, max_model_len, frozenset(eos_token_ids)
        )
        self.waiting: deque[Sequence] = deque()
        # loaded and ready to prefill the rest; served before `waiting` because they hold
        # blocks (a preempted request at the head of `waiting` must not block them)
        self.ready: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.parked: dict[str, Sequence] = {}  # WAITING_FOR_REMOTE_KVS
        self.held: dict[str, _Held] = {}
        self.stats = SchedulerStats()
        self.aggregator = KVOutputAggregator(world)
        self._finished_ids: set[str] = set()
        self._loaded: list[tuple[Sequence, int]] = []  # loads counted in this step: (seq, tokens)
        self._resampled: set[str] = set()  # sampled tokens thrown away since the last step

    # ---- requests -----------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new request."""
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """True while any request waits, runs, loads, or holds blocks for the connector."""
        return bool(self.waiting or self.ready or self.running or self.parked or self.held)

    def get(self, request_id: str) -> Sequence | None:
        """The live (not yet finished) request with this id."""
        if request_id in self.parked:
            return self.parked[request_id]
        for seq in self.running:
            if seq.request_id == request_id:
                return seq
        for seq in (*self.ready, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return None

    def abort(self, request_id: str, reason: str = "abort") -> bool:
        """Finish a live request now (reason "abort", or "stop" for a stop string the server
        matched); False if it is not live."""
        seq = self.get(request_id)
        if seq is None:
            return False
        loading = seq.status is SequenceStatus.WAITING_FOR_REMOTE_KVS
        if loading:
            del self.parked[request_id]
        elif seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.ready:
            self.ready.remove(seq)
        else:
            self.waiting.remove(seq)
        if reason == "abort":
            self.stats.requests_aborted += 1
        else:
            self.stats.requests_finished += 1
        self._finish(seq, reason, wait_recv=loading)
        return True

    # ---- scheduling ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan one step: running requests first (decode before new prefill), then admissions."""
        budget = self.limits.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: set[str] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.bm.can_append(seq, seq.num_computed_tokens + n):
                victim = self._victim()
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            self.bm.append_slots(seq, seq.num_computed_tokens + n)
            scheduled.append(ScheduledRequest(seq, n, is_new=False))
            budget -= n
            i += 1
        has_sync_loads = False
        if not preempted:
            budget, has_sync_loads = self._admit(budget, scheduled)
        finished, self._finished_ids = self._finished_ids, set()
        resampled, self._resampled = self._resampled, set()
        return SchedulerOutput(scheduled, finished, preempted, has_sync_loads, resampled)

    def _admit(self, budget: int, scheduled: list[ScheduledRequest]) -> tuple[int, bool]:
        limit = self.limits.max_num_seqs
        while self.ready and budget > 0 and len(self.running) < limit:
            # loaded after an asynchronous load: its blocks and computed prefix are kept
            seq = self.ready[0]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.bm.can_append(seq, seq.num_computed_tokens + n):
                return budget, False
            self.bm.append_slots(seq, seq.num_computed_tokens + n)
            self._start(self.ready.popleft(), n, scheduled)
            budget -= n
        has_sync_loads = False
        skipped: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < limit:
            seq = self.waiting[0]
            hits = self.bm.lookup(seq)
            hbm = len(hits) * self.block_size
            ext, is_async = self._ask_connector(seq, hbm)
            if ext is None:
                skipped.append(self.waiting.popleft())
                continue
            if is_async:
                # the whole prefill is allocated now, so the loaded request resumes without
                # asking for a block; and it parks only if what the admitted requests still
                # need to finish their prefill stays free (else nothing could run: a wedge)
                if not self.bm.can_allocate(hits, seq.num_tokens, reserve=self._reserve()):
                    break
                self._allocate(seq, hits, seq.num_tokens, ext, is_async=True)
                self.waiting.popleft()
                seq.status = SequenceStatus.WAITING_FOR_REMOTE_KVS
                self.parked[seq.request_id] = seq
                continue
            n = min(seq.num_tokens - hbm - ext, budget)
            if not self.bm.can_allocate(hits, hbm + ext + n):
                break
            self._allocate(seq, hits, hbm + ext + n, ext, is_async=False)
            # a synchronous load is done before this step's forward reads it
            seq.num_computed_tokens = hbm + ext
            has_sync_loads = has_sync_loads or ext > 0
            self._start(self.waiting.popleft(), n, scheduled)
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        return budget, has_sync_loads

    def _reserve(self) -> int:
        """Free blocks the admitted requests need to hold every token they have."""
        admitted = (*self.running, *self.ready, *self.parked.values())
        return sum(self.bm.blocks_short(s) for s in admitted)

    def _victim(self) -> Sequence:
        """Who gives way when a running request cannot grow: a loaded request still waiting
        for a seat first, then the latest admitted. A parked request is never taken: the
        ranks may still write its blocks, and its load ends within the load deadline."""
        return self.ready[-1] if self.ready else self.running[-1]

    def _ask_connector(self, seq: Sequence, hbm: int) -> tuple[int | None, bool]:
        if not self.has_connector:
            return 0, False
        ext, is_async = self.connector.get_num_new_matched_tokens(seq, hbm)
        if ext is None:
            return None, False
        if ext < 0 or hbm + ext > seq.num_tokens - 1:
            raise RuntimeError(
                f"connector offered {ext} external tokens to {loggable(seq.request_id)} beyond "
                f"an HBM hit of {hbm} with {seq.num_tokens} tokens; it must leave the last token "
                "to compute (a full hit answers num_tokens - 1 - hbm)"
            )
        return ext, bool(is_async) and ext > 0

    def _allocate(
        self, seq: Sequence, hits: list[int], num_tokens: int, ext: int, *, is_async: bool
    ) -> None:
        self.bm.allocate(seq, hits, num_tokens)  # num_computed_tokens = HBM hit
        hbm = seq.num_computed_tokens
        if ext == 0 and seq.num_cached_tokens < 0:
            seq.num_cached_tokens, seq.num_external_tokens = hbm, 0
        if self.has_connector and not seq.preempted:
            self.stats.external_prefix_cache_queries += seq.num_tokens - hbm
        elif self.has_connector:
            self.stats.preempted_external_queries += seq.num_tokens - hbm
        seq.load = ExternalLoad(hbm, hbm + ext, is_async) if ext > 0 else None
        self.connector.update_state_after_alloc(seq, list(seq.block_ids), ext)

    def _start(self, seq: Sequence, n: int, scheduled: list[ScheduledRequest]) -> None:
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        scheduled.append(ScheduledRequest(seq, n, is_new=True))

    def _preempt(self, seq: Sequence) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.ready.remove(seq)  # loaded; its good blocks stay in the prefix cache
        self.connector.request_preempted(seq)
        seq.preempted = True
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        seq.load = None
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.stats.num_preemptions += 1
        log.debug("preempted %s (recompute)", loggable(seq.request_id))

    # ---- results ------------------------------------------------------------------------------

    def update_from_output(
        self,
        out: SchedulerOutput,
        sampled: Seq[int],
        reports: Seq[RankReport],
        logprobs: Seq[TokenLogprobs | None] = (),
        failed: Mapping[str, str] | None = None,
    ) -> list[RequestOutput]:
        """Apply one step: advance computed tokens, append samples, settle connector reports.

        `sampled[i]` is the token of `out.scheduled[i]` (-1 where it did not sample) and
        `logprobs[i]` its logprobs; a request in `failed` (its sampling raised) finishes with
        reason "error" and the error text.
        """
        lps = list(logprobs) or [None] * len(out.scheduled)
        failed = failed or {}
        expect_recv = self.parked.keys() | {k for k, h in self.held.items() if h.wait_recv}
        expect_send = {k for k, h in self.held.items() if h.wait_send}
        sending: set[str] = set()
        recving: set[str] = set()
        invalid: set[int] = set()
        for rank, rep in enumerate(reports):
            s, r = self.aggregator.add(
                rank, rep.finished_sending, rep.finished_recving, expect_send, expect_recv
            )
            sending |= s
            recving |= r
            invalid.update(rep.invalid_block_ids)
        if invalid:
            self._mark_invalid(invalid, out)
        outputs = [
            o
            for sr, tok, lp in zip(out.scheduled, sampled, lps, strict=True)
            if (o := self._advance(sr, tok, lp, failed.get(sr.request_id)))
        ]
        resumed = [self.parked.pop(rid) for rid in recving if rid in self.parked]
        resumed.sort(key=lambda s: s.arrival)
        for seq in resumed:
            self._finish_load(seq)
        self.ready.extend(resumed)
        for rid in recving:
            if rid in self.held:
                self.held[rid].wait_recv = False
                self._maybe_free(rid)
        for rid in sending:
            if rid in self.held:
                self.held[rid].wait_send = False
                self._maybe_free(rid)
        self.connector.update_connector_output(
            ConnectorOutput(sending, recving, invalid, [r.worker_meta for r in reports])
        )
        self._count_sources()
        return outputs

    def _count_sources(self) -> None:
        # asked after update_connector_output: the connector knows the serving tier by then
        loaded, self._loaded = self._loaded, []
        by_source = self.stats.external_hits_by_source
        for seq, tokens in loaded:
            for source, n in external_cache_hit_sources(self.connector, seq, tokens).items():
                by_source[source] = by_source.get(source, 0) + n

    def _mark_invalid(self, invalid: set[int], out: SchedulerOutput) -> None:
        loading = list(self.parked.values())
        loading += [sr.seq for sr in out.scheduled if sr.seq.load is not None]
        loading += [h.seq for h in self.held.values() if h.wait_recv and h.seq.load is not None]
        owner: dict[int, tuple[Sequence, int]] = {}
        for seq in loading:
            assert seq.load is not None
            for i in seq.load.block_range(self.block_size):
                owner[seq.block_ids[i]] = (seq, i)
        for b in invalid:
            hit = owner.get(b)
            if hit is None:
                log.warning("ignoring load error on block %d: no load is writing it", b)
                continue
            seq, i = hit
            load = seq.load
            assert load is not None
            load.first_bad_block = (
                i if load.first_bad_block is None else min(i, load.first_bad_block)
            )
        self.bm.uncache([b for b in invalid if b in owner])

    def _finish_load(self, seq: Sequence) -> None:
        load = seq.load
        assert load is not None
        good = load.good_end(self.block_size)
        self._count_load(seq, load, good)
        seq.num_computed_tokens = good
        seq.load = None
        seq.status = SequenceStatus.WAITING
        self.bm.cache_blocks(seq, good)

    def _count_load(self, seq: Sequence, load: ExternalLoad, good: int) -> None:
        if seq.num_cached_tokens < 0:  # the first admission's outcome, reported once
            seq.num_cached_tokens, seq.num_external_tokens = load.start, good - load.start
        if seq.preempted:
            self.stats.preempted_external_hits += good - load.start
        else:
            self.stats.external_prefix_cache_hits += good - load.start
            if good > load.start:  # by source too: first admissions only, as vLLM counts
                self._loaded.append((seq, good - load.start))
        if load.first_bad_block is not None:
            self.stats.external_load_failures += 1
            log.warning(
                "external load of %s failed from block %d: recomputing tokens [%d, %d)",
                loggable(seq.request_id), load.first_bad_block, good, load.end,
            )  # fmt: skip

    def _advance(
        self, sr: ScheduledRequest, token: int, lp: TokenLogprobs | None, error: str | None
    ) -> RequestOutput | None:
        seq = sr.seq
        seq.num_computed_tokens += sr.num_new_tokens
        load = seq.load
        if load is not None:  # a synchronous load done in this step
            seq.load = None
            good = load.good_end(self.block_size)
            self._count_load(seq, load, good)
            if load.first_bad_block is not None:
                # everything from the first bad block on was computed from bad KV: redo it
                seq.num_computed_tokens = good
                self.bm.cache_blocks(seq, good)
                if token >= 0:
                    # rank 0 drew a token from that KV: a clean run never drew it, so the
                    # request's seeded generator goes back to where it stood before the draw
                    self._resampled.add(seq.request_id)
                return None
        self.bm.cache_blocks(seq, seq.num_computed_tokens)
        if seq.num_computed_tokens < seq.num_tokens:
            return None  # a prefill chunk that did not reach the end of the prompt
        if error is not None:
            self.running.remove(seq)
            self.stats.requests_failed += 1
            self._finish(seq, "error", wait_recv=False)
            return self._output(seq, [], "error", error=error)
        if token < 0:
            raise RuntimeError(
                f"rank 0 sampled no token for {loggable(seq.request_id)}, which needed one"
            )
        if not seq.output_token_ids:
            self.stats.prompt_tokens += seq.num_prompt_tokens
        seq.append_token(token)
        self.stats.generation_tokens += 1
        reason = self._stop_reason(seq, token)
        if reason is not None:
            self.running.remove(seq)
            self.stats.requests_finished += 1
            self._finish(seq, reason, wait_recv=False)
        return self._output(seq, [token], reason, logprobs=lp)

    def _output(
        self,
        seq: Sequence,
        new: list[int],
        reason: str | None,
        *,
        logprobs: TokenLogprobs | None = None,
        error: str | None = None,
    ) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new,
            output_token_ids=list(seq.output_token_ids),
            finished=reason is not None,
            finish_reason=reason,
            prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=max(seq.num_cached_tokens, 0),
            num_external_tokens=seq.num_external_tokens,
            logprobs=logprobs,
            error=error,
            retention=seq.retention_granted if reason is not None else None,
        )

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if not p.ignore_eos and token in self.limits.eos_token_ids:
            return "stop"
        if token in p.stop_token_ids:
            return "stop"
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.limits.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str, *, wait_recv: bool) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._finished_ids.add(seq.request_id)
        delay = bool(self.connector.request_finished(seq, list(seq.block_ids)))
        granted = getattr(self.connector, "retention_decision", None)
        if seq.retention is not None and callable(granted):
            seq.retention_granted = granted(seq.request_id)
        if delay or wait_recv:
            self.held[seq.request_id] = _Held(seq, wait_send=delay, wait_recv=wait_recv)
        else:
            self.bm.free(seq)
            self.aggregator.forget(seq.request_id)

    def _maybe_free(self, req_id: str) -> None:
        h = self.held[req_id]
        if not (h.wait_send or h.wait_recv):
            del self.held[req_id]
            self.bm.free(h.seq)
            self.aggregator.forget(req_id)
