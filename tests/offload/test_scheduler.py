"""OffloadScheduler decisions, leases, frontiers and terminals, against a fake lookup port."""

from __future__ import annotations

import pytest

from kvtier.config import KVTierConfig
from kvtier.metrics import Metrics
from kvtier.offload.messages import OpResult, WorkerReport
from kvtier.offload.protocols import StepRequest
from kvtier.offload.scheduler import OffloadScheduler
from tests.offload.fakes import FakeLookup, SlotView
from tests.record_key import RECORD_KEY

CHUNK = 32
BLOCK = 16


def make(hits: int = 0, world: int = 2, **cfg) -> tuple[OffloadScheduler, FakeLookup, Metrics]:
    lookup = FakeLookup(hits)
    metrics = Metrics(rank=0)
    config = KVTierConfig(chunk_size=CHUNK, load_gate=False, **cfg)
    # the fake port answers hits nobody saved: ask it always
    sched = OffloadScheduler(
        config,
        lookup,
        model_id="m",
        block_size=BLOCK,
        world=world,
        metrics=metrics,
        cold_misses=False,
    )
    return sched, lookup, metrics


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 7 + salt) % 1000 for i in range(n)]


def blocks(n_tokens: int, base: int = 100) -> list[int]:
    return list(range(base, base + -(-n_tokens // BLOCK)))


def report_all(
    sched: OffloadScheduler,
    op_id: str,
    world: int = 2,
    ok: bool = True,
    failing_rank: int | None = None,
) -> list:
    reports = [
        WorkerReport(
            rank=r,
            results=[
                OpResult(
                    op_id, ok and r != failing_rank, "" if ok and r != failing_rank else "miss"
                )
            ],
        )
        for r in range(world)
    ]
    return sched.process_reports(reports)


def test_full_prompt_hit_claims_one_token_less():
    sched, lookup, _ = make(hits=4)
    view = SlotView("a", prompt(4 * CHUNK))
    need = sched.get_num_new_matched_tokens(view, 0)
    assert need == 4 * CHUNK - 1
    assert sched.pending_load("a") == (0, 4 * CHUNK - 1)


def test_load_covers_only_blocks_between_floor_and_claim():
    sched, lookup, _ = make(hits=3)
    p = prompt(3 * CHUNK + 5)
    view = SlotView("a", p, computed=BLOCK)  # one HBM block: unaligned to the chunk
    need = sched.get_num_new_matched_tokens(view, BLOCK)
    assert need == 3 * CHUNK - BLOCK
    ids = blocks(len(p))
    assert sched.update_state_after_alloc(view, ids, need) == need
    meta = sched.build_meta([])
    (op,) = meta.loads
    assert op.tokens == need
    # first chunk: its first block is below the HBM floor and must not be written
    assert op.chunks[0].block_ids == [-1, ids[1]]
    assert [c.block_ids for c in op.chunks[1:]] == [ids[2:4], ids[4:6]]
    assert op.lookup_id in lookup.leased


@pytest.mark.parametrize(
    ("hits", "hbm", "min_load", "reason"),
    [
        (2, 2 * CHUNK, None, "hbm_satisfies"),
        (3, 5, None, "unaligned"),
        (3, 2 * CHUNK + 0, 2 * CHUNK, "too_small"),
    ],
)
def test_skips_are_counted_and_release_the_lease(hits, hbm, min_load, reason):
    sched, lookup, metrics = make(hits=hits, min_load_tokens=min_load)
    view = SlotView("a", prompt(4 * CHUNK), computed=hbm)
    assert sched.get_num_new_matched_tokens(view, hbm) == 0
    assert metrics.value("skipped_loads_total", reason=reason) == 1
    assert lookup.outstanding() == set()


def test_slower_than_recompute_is_skipped():
    lookup = FakeLookup(4)
    metrics = Metrics(rank=0)
    config = KVTierConfig(chunk_size=CHUNK, prefill_tokens_per_s=1e9)
    sched = OffloadScheduler(
        config,
        lookup,
        model_id="m",
        block_size=BLOCK,
        world=1,
        metrics=metrics,
        load_tokens_per_s=1000.0,
        cold_misses=False,
    )
    assert sched.get_num_new_matched_tokens(SlotView("a", prompt(4 * CHUNK)), 0) == 0
    assert metrics.value("skipped_loads_total", reason="slower_than_recompute") == 1
    assert lookup.outstanding() == set()


def test_lookup_timeout_counts_as_a_skip():
    sched, lookup, metrics = make(hits=0)
    lookup.timed_out = (1,)
    assert sched.get_num_new_matched_tokens(SlotView("a", prompt(4 * CHUNK)), 0) == 0
    assert metrics.value("skipped_loads_total", reason="lookup_timeout") == 1


def test_quorum_one_failure_fails_the_load_and_rolls_back_the_save_frontier():
    sched, lookup, metrics = make(hits=3)
    p = prompt(3 * CHUNK + 10)
    view = SlotView("a", p)
    need = sched.get_num_new_matched_tokens(view, 0)
    sched.update_state_after_alloc(view, blocks(len(p)), need)
    (op,) = sched.build_meta([]).loads
    assert sched.saved_frontier("a") == (3 * CHUNK, 3 * CHUNK)
    # rank 0 succeeds first: not terminal yet
    assert sched.process_reports([WorkerReport(0, [OpResult(op.op_id, True)])]) == []
    (outcome,) = sched.process_reports([WorkerReport(1, [OpResult(op.op_id, False, "miss")])])
    assert not outcome.ok and outcome.req_id == "a"
    assert metrics.value("load_failures_total", reason="miss") == 1
    # the recomputed chunks will be saved again
    assert sched.saved_frontier("a") == (0, 0)
    # one external attempt per lifecycle
    assert sched.get_num_new_matched_tokens(view, 0) == 0
    assert metrics.value("skipped_loads_total", reason="failed_before") == 1
    # the recompute's step saves the chunks again
    view.advance(len(p), blocks(len(p)))
    meta = sched.build_meta([StepRequest(view, len(p))])
    assert [len(s.chunks) for s in meta.saves] == [3]


def test_duplicate_and_stale_reports_are_ignored():
    sched, _, _ = make(hits=2)
    p = prompt(2 * CHUNK + 3)
    view = SlotView("a", p)
    need = sched.get_num_new_matched_tokens(view, 0)
    sched.update_state_after_alloc(view, blocks(len(p)), need)
    (op,) = sched.build_meta([]).loads
    dup = WorkerReport(0, [OpResult(op.op_id, True)])
    assert sched.process_reports([dup, dup]) == []
    # rank 0's second vote is ignored; rank 1 completes the quorum: exactly one terminal
    (outcome,) = report_all(sched, op.op_id)
    assert outcome.ok and outcome.tokens == 2 * CHUNK
    assert sched.process_reports([WorkerReport(1, [OpResult(op.op_id, True)])]) == []
    assert sched.process_reports([WorkerReport(0, [OpResult("zz#ld99", True)])]) == []


def test_save_frontier_commits_on_success_and_rolls_back_on_failure():
    sched, _, metrics = make(hits=0, world=1)
    p = prompt(4 * CHUNK)
    view = SlotView("a", p)
    assert sched.get_num_new_matched_tokens(view, 0) == 0
    view.advance(0, blocks(len(p)))
    meta = sched.build_meta([StepRequest(view, 2 * CHUNK + 3)])
    (save,) = meta.saves
    assert [c.block_ids for c in save.chunks] == [blocks(len(p))[0:2], blocks(len(p))[2:4]]
    assert sched.saved_frontier("a") == (0, 2 * CHUNK)
    sched.process_reports([WorkerReport(0, [OpResult(save.op_id, False, "no_slot")])])
    assert sched.saved_frontier("a") == (0, 0)
    assert metrics.value("save_failures_total", reason="no_slot") == 1
    (again,) = sched.build_meta([StepRequest(view, 2 * CHUNK + 3)]).saves
    sched.process_reports([WorkerReport(0, [OpResult(again.op_id, True)])])
    assert sched.saved_frontier("a") == (2 * CHUNK, 2 * CHUNK)


def test_a_save_cancelled_by_a_preemption_is_saved_again_at_the_readmission():
    """The ranks cancel a preempted request's saves; their failure comes back when the save lane
    gets to it. Re-admitted and finished before that (a short request, a busy lane), the request
    saved the range nowhere: no later step of it was left to save it again. Seen as 3 chunks
    missing from a vLLM run's second pass."""
    sched, _, _ = make(hits=0, world=1)
    p = prompt(4 * CHUNK)
    view = SlotView("a", p)
    assert sched.get_num_new_matched_tokens(view, 0) == 0
    view.advance(0, blocks(len(p)))
    (first,) = sched.build_meta([StepRequest(view, 2 * CHUNK + 3)]).saves
    sched.request_preempted(view)
    assert sched.build_meta([], preempted=["a"]).preempted == ["a"]
    # admitted again at once: the range goes out again, from the new blocks
    view.advance(0, blocks(len(p), base=200))
    assert sched.get_num_new_matched_tokens(view, 0) == 0
    (again,) = sched.build_meta([StepRequest(view, 2 * CHUNK + 3)]).saves
    assert [c.key for c in again.chunks] == [c.key for c in first.chunks]
    assert [c.block_ids for c in again.chunks] == [blocks(len(p), base=200)[0:2],
                                                   blocks(len(p), base=200)[2:4]]  # fmt: skip
    # the cancelled save's failure while the second is out sends no third one
    sched.process_reports([WorkerReport(0, [OpResult(first.op_id, False, "preempted")])])
    assert sched.build_meta([StepRequest(view, 2 * CHUNK + 4)]).saves == []
    assert sched.request_finished(view) is True  # its save is still out: its free waits
    sched.process_reports([WorkerReport(0, [OpResult(again.op_id, True)])])
    assert sched.saved_frontier("a") is None and not sched.has_pending_work()


def test_finished_request_with_save_in_flight_delays_its_free():
    sched, _, _ = make(hits=0, world=1)
    p = prompt(2 * CHUNK)
    view = SlotView("a", p, block_ids=blocks(len(p)))
    sched.get_num_new_matched_tokens(view, 0)
    (save,) = sched.build_meta([StepRequest(view, len(p))]).saves
    assert sched.request_finished(view) is True
    assert sched.build_meta([]).delayed_free == ["a"]
    sched.process_reports([WorkerReport(0, [OpResult(save.op_id, True)])])
    assert sched.saved_frontier("a") is None  # state dropped after the last terminal
    assert not sched.has_pending_work()


def test_withdrawn_promise_releases_lease_on_every_path():
    sched, lookup, metrics = make(hits=2)
    p = prompt(2 * CHUNK + 1)
    a, b, c = SlotView("a", p), SlotView("b", p), SlotView("c", p)
    for v in (a, b, c):
        assert sched.get_num_new_matched_tokens(v, 0) > 0
    sched.update_state_after_alloc(a, blocks(len(p)), 0)  # host declined the tokens
    sched.request_finished(b)  # aborted before allocation
    sched.request_preempted(c)  # preempted before dispatch
    assert lookup.outstanding() == set()
    assert metrics.value("skipped_loads_total", reason="withdrawn") == 3
    assert not sched.has_pending_work()


def test_scheduler_never_writes_slot_views():
    sched, _, _ = make(hits=2)
    view = SlotView("a", prompt(2 * CHUNK + 1))
    need = sched.get_num_new_matched_tokens(view, 0)
    sched.update_state_after_alloc(view, blocks(2 * CHUNK + 1), need)
    (op,) = sched.build_meta([]).loads
    report_all(sched, op.op_id)
    sched.request_finished(view)  # no AttributeError from a __slots__ view anywhere


def test_chunk_not_multiple_of_block_is_refused():
    with pytest.raises(ValueError, match="multiple of 48"):
        OffloadScheduler(
            KVTierConfig(chunk_size=64),
            FakeLookup(),
            model_id="m",
            block_size=48,
            world=1,
            metrics=Metrics(),
        )


def test_no_lookup_when_even_a_full_hit_could_not_pay():
    sched, lookup, metrics = make(hits=4)
    p = prompt(4 * CHUNK)
    # HBM already holds all but the last token: nothing to ask the ranks
    assert sched.get_num_new_matched_tokens(SlotView("a", p), 4 * CHUNK - 1) == 0
    assert lookup.leased == [] and metrics.value("lookups_total") == 0
    assert metrics.value("skipped_loads_total", reason="hbm_satisfies") == 1


def test_asked_again_before_allocation_reuses_the_promise_without_a_lookup():
    sched, lookup, metrics = make(hits=2)
    view = SlotView("a", prompt(2 * CHUNK + 1))
    first = sched.get_num_new_matched_tokens(view, 0)
    # the host could not allocate and asks again next step: same answer, same lease
    assert sched.get_num_new_matched_tokens(view, 0) == first == 2 * CHUNK
    assert metrics.value("lookups_total") == 1 and len(lookup.leased) == 1
    # a different HBM floor means a different promise: look up afresh
    assert sched.get_num_new_matched_tokens(view, BLOCK) == 2 * CHUNK - BLOCK
    assert metrics.value("lookups_total") == 2
    assert lookup.outstanding() == {lookup.leased[-1]}


def hold_lookups(lookup: FakeLookup) -> list:
    """Every lookup `lookup` begins stays in flight until the test sets it ready: the list."""
    real_begin = lookup.begin
    held: list = []

    def slow_begin(keys, lookup_id, lease=True, ends=None):
        p = real_begin(keys, lookup_id, lease, ends)
        p.ready = False
        held.append(p)
        return p

    lookup.begin = slow_begin  # type: ignore[method-assign]
    return held


def test_a_lookup_still_in_flight_answers_not_yet_known_and_never_blocks():
    """The scheduler loop waits at most lookup_wait_ms; the answer comes at a later ask."""
    sched, lookup, metrics = make(hits=4, lookup_wait_ms=0)
    held = hold_lookups(lookup)
    view = SlotView("a", prompt(4 * CHUNK))
    assert sched.get_num_new_matched_tokens(view, 0) is None
    assert sched.get_num_new_matched_tokens(view, 0) is None
    assert len(held) == 1  # asked again: polled, not sent again
    held[0].ready = True
    assert sched.get_num_new_matched_tokens(view, 0) == 4 * CHUNK - 1
    assert metrics.value("scheduler_lookup_seconds_count") == 3


def test_a_request_gone_while_its_lookup_is_in_flight_releases_the_lease():
    sched, lookup, _ = make(hits=4)
    view = SlotView("a", prompt(4 * CHUNK))
    p = lookup.begin(view.prompt_token_ids, "x")
    p.ready = False
    sched._state(view).lookup = p  # a lookup sent at an earlier ask, still in flight
    assert sched.get_num_new_matched_tokens(view, 0) is None
    assert sched.request_finished(view) is False
    assert lookup.outstanding() == set()


def test_a_load_granted_fewer_tokens_than_promised_loads_exactly_the_grant():
    sched, lookup, _ = make(hits=4)
    view = SlotView("a", prompt(4 * CHUNK + 1))
    promised = sched.get_num_new_matched_tokens(view, 0)
    assert promised == 4 * CHUNK
    granted = 3 * CHUNK - BLOCK  # e.g. cut to a block boundary by the host
    ids = blocks(granted)
    assert sched.update_state_after_alloc(view, ids, granted) == granted
    (op,) = sched.build_meta([]).loads
    assert op.tokens == granted
    # three chunks read whole; the third writes only the block inside the grant
    assert [c.block_ids for c in op.chunks] == [ids[0:2], ids[2:4], [ids[4], -1]]


def test_a_host_counting_more_than_promised_gets_a_load_that_fails_so_it_recomputes():
    """A contract violation inside a hook costs its request the tier, never the engine
    (invariant 18): the host already counts those tokens, so the ranks are sent a load they
    fail at once and the host recomputes every block of it."""
    sched, lookup, metrics = make(hits=4)
    other = SlotView("b", prompt(4 * CHUNK + 1, salt=3))
    assert sched.get_num_new_matched_tokens(other, 0) == 4 * CHUNK
    ids = blocks(5 * CHUNK)
    sched.update_state_after_alloc(other, ids, 5 * CHUNK)  # more than promised: no raise
    assert metrics.value("hook_errors_total", hook="update_state_after_alloc") == 1
    (op,) = sched.build_meta([]).loads
    assert op.fail == "hook_error" and op.req_id == "b"
    assert [b for c in op.chunks for b in c.block_ids] == ids[: 4 * CHUNK // BLOCK]
    report_all(sched, op.op_id, ok=False)
    # quarantined: it never asks the tier again, and it saves nothing
    assert sched.get_num_new_matched_tokens(other, 0) == 0
    assert not sched.build_meta([StepRequest(other, 4 * CHUNK + 1)]).saves
    assert not sched.has_pending_work()


def test_a_second_request_waits_for_the_load_of_the_same_chunks_instead_of_reading_them():
    sched, lookup, metrics = make(hits=4)
    a = SlotView("a", prompt(4 * CHUNK + 1))
    b = SlotView("b", prompt(4 * CHUNK + 1))  # same prefix
    need = sched.get_num_new_matched_tokens(a, 0)
    sched.update_state_after_alloc(a, blocks(need), need)
    (op,) = sched.build_meta([]).loads
    leased = len(lookup.leased)
    assert sched.get_num_new_matched_tokens(b, 0) is None
    assert sched.get_num_new_matched_tokens(b, 0) is None
    assert len(lookup.leased) == leased  # no second lookup, no second read
    assert metrics.value("skipped_loads_total", reason="behind_inflight_load") == 1
    report_all(sched, op.op_id)
    # a's blocks are in HBM now: b asks with that floor and needs the tier for nothing more
    assert sched.get_num_new_matched_tokens(b, 4 * CHUNK) == 0


def test_a_second_request_whose_lookup_was_in_flight_waits_for_the_first_ones_load():
    """The two lookups overlap (a busy lookup server answers after the first ask): when both
    answer, the first request's load is allocated before the second request's answer is
    read. The second still waits for that load, and releases its lease: one tier read."""
    sched, lookup, metrics = make(hits=4, lookup_wait_ms=0)
    held = hold_lookups(lookup)
    a = SlotView("a", prompt(4 * CHUNK + 1))
    b = SlotView("b", prompt(4 * CHUNK + 1))  # same prefix
    assert sched.get_num_new_matched_tokens(a, 0) is None
    assert sched.get_num_new_matched_tokens(b, 0) is None
    assert len(held) == 2
    for p in held:
        p.ready = True
    need = sched.get_num_new_matched_tokens(a, 0)
    sched.update_state_after_alloc(a, blocks(need), need)
    assert sched.get_num_new_matched_tokens(b, 0) is None
    (op,) = sched.build_meta([]).loads
    assert op.req_id == "a"
    assert metrics.value("skipped_loads_total", reason="behind_inflight_load") == 1
    # b's lease went back: only a's is held, by the load on the ranks
    assert lookup.outstanding() == {op.lookup_id}
    report_all(sched, op.op_id)
    assert sched.get_num_new_matched_tokens(b, 4 * CHUNK) == 0


def test_preempting_a_request_whose_load_is_on_the_ranks_is_refused():
    sched, lookup, _ = make(hits=2, world=1)
    p = prompt(2 * CHUNK + 1)
    view = SlotView("a", p)
    need = sched.get_num_new_matched_tokens(view, 0)
    sched.update_state_after_alloc(view, blocks(len(p)), need)
    (op,) = sched.build_meta([]).loads
    with pytest.raises(RuntimeError, match=r"request a was preempted while its load ld\d+ is on"):
        sched.request_preempted(view)
    assert sched.pending_load("a") == (0, need)  # the load stands, its blocks still promised
    (outcome,) = report_all(sched, op.op_id, world=1)
    assert outcome.ok and sched.pending_load("a") is None
    sched.request_preempted(view)  # after the terminal: nothing left to withdraw
    assert not sched.has_pending_work()


class KeyLookup(FakeLookup):
    """A FakeLookup that remembers the keys of every lookup."""

    def __init__(self, hits: int = 0) -> None:
        super().__init__(hits)
        self.keys: list[list[bytes]] = []

    def lookup(self, keys, lookup_id, lease=True):
        self.keys.append(list(keys))
        return super().lookup(keys, lookup_id, lease)


def test_reset_starts_a_namespace_epoch_that_reaches_no_older_chunk():
    lookup = KeyLookup(hits=0)
    config = KVTierConfig(chunk_size=CHUNK, load_gate=False)
    sched = OffloadScheduler(
        config,
        lookup,
        model_id="m",
        block_size=BLOCK,
        world=1,
        metrics=Metrics(rank=0),
        cold_misses=False,  # every lookup reaches the port, which records its keys
    )
    p = prompt(3 * CHUNK + 1)
    before = SlotView("a", p, computed=0, block_ids=blocks(len(p)))
    sched.get_num_new_matched_tokens(before, 0)
    (old_save,) = sched.build_meta([StepRequest(before, len(p))]).saves
    old_keys = {c.key for c in old_save.chunks}
    assert old_keys == set(lookup.keys[0])

    assert sched.epoch == 0
    sched.reset()
    assert sched.epoch == 1
    # a live request keyed before the reset saves nothing more under its old keys
    long = SlotView("a", p, computed=len(p), block_ids=blocks(len(p)))
    assert sched.build_meta([StepRequest(long, len(p) + CHUNK)]).saves == []
    # new lookups and saves of the same tokens use keys no earlier chunk has
    after = SlotView("b", p, computed=0, block_ids=blocks(len(p)))
    sched.get_num_new_matched_tokens(after, 0)
    assert not set(lookup.keys[-1]) & old_keys
    (new_save,) = sched.build_meta([StepRequest(after, len(p))]).saves
    assert not {c.key for c in new_save.chunks} & old_keys
    # the request from before the reset, asked again (re-admitted), is keyed anew too
    for result in (OpResult(old_save.op_id, True, ""), OpResult(new_save.op_id, True, "")):
        sched.process_reports([WorkerReport(rank=0, results=[result])])
    sched.get_num_new_matched_tokens(SlotView("a", p), 0)
    assert lookup.keys[-1] == lookup.keys[-2]  # same tokens, same (new) epoch
    sched.reset()
    sched.get_num_new_matched_tokens(SlotView("c", p), 0)
    assert not set(lookup.keys[-1]) & (old_keys | set(lookup.keys[-2]))


def _admit(sched: OffloadScheduler, req: str, n_tokens: int) -> tuple[SlotView, int]:
    view = SlotView(req, prompt(n_tokens, salt=ord(req[0])))
    need = sched.get_num_new_matched_tokens(view, 0)
    assert need and need > 0
    assert sched.update_state_after_alloc(view, blocks(n_tokens), need) == need
    return view, need


def test_a_load_that_fits_the_share_of_a_step_runs_in_the_forward():
    sched, _, metrics = make(hits=3, world=1, sync_load_fraction=0.25)
    # a busy step measured between its meta and its reports feeds the step estimate
    sched.build_meta([StepRequest(SlotView("w", prompt(8)), 8)])
    sched.process_reports([])
    assert sched.gate.step.samples == 1
    _admit(sched, "a", 3 * CHUNK + 4)
    assert not sched.load_is_async("a")
    (op,) = sched.build_meta([]).loads
    assert op.sync
    report_all(sched, op.op_id, world=1)
    # it never parked its request
    assert metrics.value("load_parked_steps_count") == 1
    assert metrics.value("load_parked_steps_sum") == 0
    assert metrics.value("sync_loads_total") == 1


def test_an_async_load_counts_the_steps_its_request_waited():
    sched, _, metrics = make(hits=3, world=1, sync_load_fraction=0.0)
    sched.build_meta([StepRequest(SlotView("w", prompt(8)), 8)])
    sched.process_reports([])
    _admit(sched, "a", 3 * CHUNK + 4)
    assert sched.load_is_async("a")
    (op,) = sched.build_meta([]).loads  # step 1: sent to the ranks, the request parks
    assert not op.sync
    sched.build_meta([])  # steps 2 and 3 pass without its terminal
    sched.build_meta([])
    report_all(sched, op.op_id, world=1)  # reported after step 3: it resumes in step 4
    assert metrics.value("load_parked_steps_sum") == 3
    assert metrics.value("sync_loads_total") == 0


def test_sync_loads_of_one_step_share_its_budget():
    lookup = FakeLookup(3)
    metrics = Metrics(rank=0)
    config = KVTierConfig(chunk_size=CHUNK, load_gate=False, sync_load_fraction=0.25)
    sched = OffloadScheduler(
        config,
        lookup,
        model_id="m",
        block_size=BLOCK,
        world=1,
        metrics=metrics,
        load_tokens_per_s=1e5,  # 96 tokens: 0.96 ms
        cold_misses=False,
    )
    sched.gate.observe_step(0.004)  # a quarter of a 4 ms step: room for one such load
    _admit(sched, "a", 3 * CHUNK + 4)
    _admit(sched, "b", 3 * CHUNK + 4)
    assert [sched.load_is_async(r) for r in "ab"] == [False, True]
    assert [op.sync for op in sched.build_meta([]).loads] == [True, False]
    # a new step has the whole share again
    _admit(sched, "c", 3 * CHUNK + 4)
    assert not sched.load_is_async("c")


def test_a_stack_with_lower_tiers_keeps_every_load_asynchronous():
    # a read from disk or a remote store may block: it never runs inside the forward
    sched, _, metrics = make(
        hits=3, world=1, sync_load_fraction=1e9, remote_url="redis://127.0.0.1:6379/0",
        record_key=RECORD_KEY,
    )
    sched.gate.observe_step(1.0)
    _admit(sched, "a", 3 * CHUNK + 4)
    assert sched.load_is_async("a")


def test_a_second_request_waits_for_the_save_of_the_same_chunks_then_loads_them():
    sched, lookup, metrics = make(hits=0)
    p = prompt(2 * CHUNK + 1)
    a = SlotView("a", p, block_ids=blocks(len(p)))
    assert sched.get_num_new_matched_tokens(a, 0) == 0  # a miss: a computes it all
    (save,) = sched.build_meta([StepRequest(a, len(p))]).saves
    # a request never waits behind its own saves (a preempted one asking again)
    assert sched.get_num_new_matched_tokens(a, 0) == 0
    lookup.hits = 2  # what the ranks will hold once the save lands
    leased = len(lookup.leased)
    b = SlotView("b", p)  # same prefix, while a's save is still on the ranks
    assert sched.get_num_new_matched_tokens(b, 0) is None
    assert sched.get_num_new_matched_tokens(b, 0) is None
    assert len(lookup.leased) == leased  # no lookup that would miss the chunks a step early
    assert metrics.value("skipped_loads_total", reason="behind_inflight_save") == 1
    report_all(sched, save.op_id)
    assert sched.get_num_new_matched_tokens(b, 0) == 2 * CHUNK
    assert len(lookup.leased) == leased + 1


def test_the_wait_behind_a_save_is_bounded_by_lookup_timeout_ms():
    now = [100.0]
    lookup, metrics = FakeLookup(0), Metrics(rank=0)
    sched = OffloadScheduler(
        KVTierConfig(chunk_size=CHUNK, load_gate=False, lookup_timeout_ms=200),
        lookup,
        model_id="m",
        block_size=BLOCK,
        world=2,
        metrics=metrics,
        cold_misses=False,
        clock=lambda: now[0],
    )
    p = prompt(2 * CHUNK + 1)
    a = SlotView("a", p, block_ids=blocks(len(p)))
    sched.get_num_new_matched_tokens(a, 0)
    assert sched.build_meta([StepRequest(a, len(p))]).saves  # and it never lands
    lookup.hits = 2
    b = SlotView("b", p)
    assert sched.get_num_new_matched_tokens(b, 0) is None
    now[0] += 0.19
    assert sched.get_num_new_matched_tokens(b, 0) is None
    now[0] += 0.02  # past 200 ms: b asks the ranks rather than wait on a stuck save
    assert sched.get_num_new_matched_tokens(b, 0) == 2 * CHUNK


def test_nobody_waits_for_a_save_of_chunks_the_saver_found_in_hbm():
    sched, lookup, metrics = make(hits=0)
    p = prompt(3 * CHUNK + 1)
    a = SlotView("a", p, block_ids=blocks(len(p)))
    # a's first two chunks were in HBM (computed by a request before it): its save of them
    # again only refreshes the tier
    assert sched.get_num_new_matched_tokens(a, 2 * CHUNK) == 0
    (save,) = sched.build_meta([StepRequest(a, len(p))]).saves
    assert len(save.chunks) == 3
    lookup.hits = 2
    b = SlotView("b", prompt(2 * CHUNK + 1))  # shares those two chunks only
    assert sched.get_num_new_matched_tokens(b, 0) == 2 * CHUNK
    assert metrics.value("skipped_loads_total", reason="behind_inflight_save") == 0
    c = SlotView("c", prompt(3 * CHUNK + 1))  # shares the chunk a computed: waits for it
    assert sched.get_num_new_matched_tokens(c, 0) is None


def test_by_default_the_one_block_past_the_hbm_floor_is_loaded():
    # vLLM's small pool kept 3 of a prefix's 4 blocks: the tier has the 4th, inside a chunk
    # whose first half is in HBM; loading it reads that chunk whole, writes one block
    sched, lookup, metrics = make(hits=2)
    p = prompt(2 * CHUNK + 1)
    assert sched.get_num_new_matched_tokens(SlotView("a", p), 3 * BLOCK) == BLOCK
    assert metrics.value("skipped_loads_total", reason="too_small") == 0
    # min_load_tokens still sets a floor of its own
    sched, _, metrics = make(hits=2, min_load_tokens=CHUNK)
    assert sched.get_num_new_matched_tokens(SlotView("a", p), 3 * BLOCK) == 0
    assert metrics.value("skipped_loads_total", reason="too_small") == 1


def test_the_gate_starts_from_the_self_tests_load_where_it_is_faster_than_the_seed():
    """The gate's memory rate began at the config's 5 GB/s seed, which sent a GPU's first
    restore to the load lane chunk by chunk; a rank's self-test load through the real path now
    starts it, where faster (one chunk's time errs low: a slower reading keeps the seed)."""
    def seeded() -> OffloadScheduler:
        # 5 GB/s over 1 KiB per token: the seed is ~4.9M tokens/s
        return OffloadScheduler(
            KVTierConfig(chunk_size=CHUNK), FakeLookup(0), model_id="m", block_size=BLOCK,
            world=1, metrics=Metrics(rank=0), bytes_per_token=1024, cold_misses=False,
        )  # fmt: skip

    sched = seeded()
    memory = sched.gate.cost.tier("memory")
    seed = memory.seconds(256)
    sched.process_reports([WorkerReport(0, selftest_load=(256, seed / 4))])
    assert memory.seconds(256) == pytest.approx(seed / 4, rel=0.05)
    assert memory.samples == 1
    slow = seeded()
    slow.process_reports([WorkerReport(0, selftest_load=(256, seed * 10))])
    assert slow.gate.cost.tier("memory").seconds(256) == seed
    assert slow.gate.cost.tier("memory").samples == 0


def _cost_sched(runs: tuple[tuple[str, int], ...], **cfg) -> tuple[OffloadScheduler, Metrics]:
    """A scheduler whose prefill was measured at 10k tokens/s, over a lookup answering `runs`;
    memory reads at 1M tokens/s, the remote store at 2k (5x slower than recomputing)."""
    hits = sum(n for _, n in runs)
    metrics = Metrics(rank=0)
    config = KVTierConfig(chunk_size=CHUNK, prefill_tokens_per_s=10_000.0, **cfg)
    sched = OffloadScheduler(
        config, FakeLookup(hits, runs=runs), model_id="m", block_size=BLOCK, world=1,
        metrics=metrics, cold_misses=False, bytes_per_token=1000,
    )  # fmt: skip
    cost = sched.gate.cost
    for _ in range(20):
        cost.tier("memory").observe(4 * CHUNK, 4 * CHUNK / 1e6)
        cost.tier("remote").observe(4 * CHUNK, 4 * CHUNK / 2000.0)
        sched.observe_prefill(4 * CHUNK, 4 * CHUNK / 10_000.0)
    return sched, metrics


def test_the_head_in_memory_is_loaded_and_the_tail_only_the_slow_store_holds_is_recomputed():
    sched, metrics = _cost_sched((("memory", 2), ("remote", 2)), sync_load_fraction=0.25)
    sched.gate.observe_step(1.0)
    view = SlotView("a", prompt(5 * CHUNK))
    assert sched.get_num_new_matched_tokens(view, 0) == 2 * CHUNK
    # what it reads is memory's alone: it may run inside the forward (the lookup's deepest
    # tier, the store, would have parked it)
    assert sched.update_state_after_alloc(view, blocks(5 * CHUNK), 2 * CHUNK) == 2 * CHUNK
    assert not sched.load_is_async("a")
    assert metrics.value("load_decisions_total", decision="load", tier="memory") == 1
    assert metrics.value("load_decisions_total", decision="recompute", tier="remote") == 1
    assert metrics.value("load_decision_tokens_total", decision="recompute", tier="remote") == (
        2 * CHUNK
    )


def test_a_hit_only_a_slow_store_holds_is_recomputed_and_counted():
    sched, metrics = _cost_sched((("remote", 4),))
    assert sched.get_num_new_matched_tokens(SlotView("a", prompt(5 * CHUNK)), 0) == 0
    assert metrics.value("skipped_loads_total", reason="slower_than_recompute") == 1
    assert metrics.value("load_decisions_total", decision="recompute", tier="remote") == 1


def test_load_policy_always_loads_every_hit():
    sched, metrics = _cost_sched((("memory", 2), ("remote", 2)), load_policy="always")
    assert sched.get_num_new_matched_tokens(SlotView("a", prompt(5 * CHUNK)), 0) == 4 * CHUNK
    assert metrics.value("load_decisions_total", decision="load", tier="remote") == 1


def test_a_load_far_off_its_prediction_is_counted_and_teaches_the_model():
    sched, metrics = _cost_sched((("memory", 3),))
    view, need = _admit(sched, "a", 3 * CHUNK + 4)
    (op,) = sched.build_meta([]).loads
    predicted = sched._reqs["a"].load.predicted_s  # type: ignore[union-attr]
    # learnt from 4-chunk loads only: the fit cannot split latency from rate exactly
    assert predicted == pytest.approx(3 * CHUNK / 1e6, rel=0.5)
    assert metrics.value("load_predicted_seconds_count") == 1
    sched.process_reports(
        [WorkerReport(0, results=[OpResult(op.op_id, True, seconds=10 * predicted, tier="memory")])]
    )
    assert metrics.value("load_mispredictions_total") == 1
    assert metrics.value("load_prediction_ratio_count") == 1
    assert metrics.value("load_misprediction_share") == 1.0
    assert sched.gate.cost.tier("memory").seconds(3 * CHUNK) > 1.5 * predicted


def test_a_tier_that_slowed_down_is_counted_and_predicted_from_two_loads():
    sched, metrics = _cost_sched((("memory", 3),))
    for req in ("a", "b"):
        _admit(sched, req, 3 * CHUNK + 4)
        (op,) = sched.build_meta([]).loads
        slow = 4 * sched._reqs[req].load.predicted_s  # type: ignore[union-attr]
        sched.process_reports(
            [WorkerReport(0, results=[OpResult(op.op_id, True, seconds=slow, tier="memory")])]
        )
    # two loads 4x slower than predicted: the model drops its 20 fast reads and predicts the
    # new speed (forgetting alone would still be near the old one)
    assert metrics.value("load_speed_shifts_total", tier="memory") == 1
    assert sched.gate.cost.tier("memory").seconds(3 * CHUNK) == pytest.approx(slow, rel=0.2)


def test_a_read_that_timed_out_teaches_the_model_the_store_is_slow():
    """A load that failed after waiting out the store's timeout was the seed's silent cost:
    every restore paid the wait, then recomputed, and nothing learnt. Its time is evidence."""
    sched, metrics = _cost_sched((("remote", 3),))
    cost = sched.gate.cost
    cost.tiers["remote"] = type(cost.tier("remote"))(1e6)  # believed fast
    view, need = _admit(sched, "a", 3 * CHUNK + 4)
    (op,) = sched.build_meta([]).loads
    sched.process_reports(
        [WorkerReport(0, results=[OpResult(op.op_id, False, "timeout", seconds=0.5)])]
    )
    # cut short by the timeout: the read takes longer than the wait, learnt as twice it
    assert cost.tier("remote").seconds(3 * CHUNK) == pytest.approx(1.0, rel=0.1)
    # the next request with the same hit recomputes instead of waiting again
    assert sched.get_num_new_matched_tokens(SlotView("b", prompt(3 * CHUNK + 4, 9)), 0) == 0
    assert metrics.value("load_decisions_total", decision="recompute", tier="remote") == 1
