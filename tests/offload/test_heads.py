"""A prompt whose first chunk this scheduler never saved is a miss known without a lookup, where
the scheduler is its tiers' only writer (memory-only); anywhere else the ranks are asked."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvtier.config import KVTierConfig
from kvtier.metrics import Metrics
from kvtier.offload.heads import SavedHeads, private_tiers
from kvtier.offload.messages import OpResult, WorkerReport
from kvtier.offload.protocols import StepRequest
from kvtier.offload.scheduler import OffloadScheduler
from tests.offload.fakes import FakeLookup, FakeResult, SlotView
from tests.record_key import RECORD_KEY

CHUNK = 32
BLOCK = 16


class CountingLookup(FakeLookup):
    """Counts the lookups that reach the port."""

    def __init__(self, hits: int = 0) -> None:
        super().__init__(hits)
        self.asked = 0

    def lookup(self, keys: Sequence[bytes], lookup_id: str, lease: bool = True) -> FakeResult:
        self.asked += 1
        return super().lookup(keys, lookup_id, lease)


def make(hits: int = 0, **cfg) -> tuple[OffloadScheduler, CountingLookup, Metrics]:
    lookup, metrics = CountingLookup(hits), Metrics(rank=0)
    config = KVTierConfig(chunk_size=CHUNK, load_gate=False, **cfg)
    sched = OffloadScheduler(
        config, lookup, model_id="m", block_size=BLOCK, world=1, metrics=metrics
    )
    return sched, lookup, metrics


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 7 + salt) % 1000 for i in range(n)]


def blocks(n_tokens: int) -> list[int]:
    return list(range(-(-n_tokens // BLOCK)))


def save_all(sched: OffloadScheduler, req_id: str, p: list[int]) -> None:
    """The request computes and saves its prompt, and the save lands on the (one) rank."""
    view = SlotView(req_id, p, block_ids=blocks(len(p)))
    sched.get_num_new_matched_tokens(view, 0)
    (save,) = sched.build_meta([StepRequest(view, len(p))]).saves
    assert save.chunks[0].key  # the first chunk is among the saved
    sched.process_reports([WorkerReport(rank=0, results=[OpResult(save.op_id, True)])])


def test_a_never_saved_first_chunk_is_answered_without_a_lookup():
    sched, lookup, metrics = make(hits=3)
    p = prompt(3 * CHUNK + 1)
    assert sched.get_num_new_matched_tokens(SlotView("a", p), 0) == 0
    assert lookup.asked == 0 and lookup.outstanding() == set()
    assert metrics.value("cold_lookups_total") == 1


def test_once_its_first_chunk_is_saved_a_prefix_asks_the_ranks_and_hits():
    sched, lookup, metrics = make(hits=3)
    p = prompt(3 * CHUNK + 1)
    save_all(sched, "a", p)
    assert metrics.value("cold_lookups_total") == 1  # request a itself, before its save
    # another request with the same prefix: its first chunk was saved, so the ranks are asked
    assert sched.get_num_new_matched_tokens(SlotView("b", p), 0) == 3 * CHUNK
    assert lookup.asked == 1
    # a prompt with another first chunk is still cold
    assert sched.get_num_new_matched_tokens(SlotView("c", prompt(3 * CHUNK + 1, 5)), 0) == 0
    assert lookup.asked == 1 and metrics.value("cold_lookups_total") == 2


@pytest.mark.parametrize(
    "cfg",
    [
        {"disk_dir": "/tmp/kvtier-heads-test", "disk_bytes": 1 << 20},
        {"remote_url": "redis://127.0.0.1:1", "record_key": RECORD_KEY},
    ],
    ids=["disk", "remote"],
)
def test_a_tier_others_may_have_written_is_always_asked(cfg):
    # a disk tier may hold an earlier process's records, a remote one other engines'
    sched, lookup, metrics = make(hits=3, **cfg)
    assert sched.get_num_new_matched_tokens(SlotView("a", prompt(3 * CHUNK + 1)), 0) == 3 * CHUNK
    assert lookup.asked == 1 and metrics.value("cold_lookups_total") == 0


def test_a_scheduler_that_never_saves_always_asks():
    # a decode consumer finds what a producer saved: none of it is its own
    config = KVTierConfig(chunk_size=CHUNK, load_gate=False)
    assert private_tiers(config, saves=True) and not private_tiers(config, saves=False)
    lookup, metrics = CountingLookup(3), Metrics(rank=0)
    sched = OffloadScheduler(
        config, lookup, model_id="m", block_size=BLOCK, world=1, metrics=metrics, saves=False
    )
    assert sched.get_num_new_matched_tokens(SlotView("a", prompt(3 * CHUNK + 1)), 0) == 3 * CHUNK
    assert lookup.asked == 1 and metrics.value("cold_lookups_total") == 0


def test_reset_forgets_the_saved_heads():
    sched, lookup, _ = make(hits=3)
    p = prompt(3 * CHUNK + 1)
    save_all(sched, "a", p)
    sched.reset()
    # the new epoch keys the same prompt anew: nothing of it was saved in this epoch
    assert sched.get_num_new_matched_tokens(SlotView("b", p), 0) == 0
    assert lookup.asked == 0


def test_saved_heads_are_bounded_oldest_untouched_first():
    heads = SavedHeads(capacity=2)
    heads.add(b"a" * 16)
    heads.add(b"b" * 16)
    heads.add(b"a" * 16)  # touched: now the newest
    heads.add(b"c" * 16)
    assert len(heads) == 2
    assert b"a" * 16 in heads and b"c" * 16 in heads and b"b" * 16 not in heads
    with pytest.raises(ValueError, match="capacity=0 must be >= 1"):
        SavedHeads(capacity=0)
