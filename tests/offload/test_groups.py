"""Hybrid registrations in the offload core: which blocks of a chunk each KV cache group stores
and loads (`kvtier.offload.groups`), the grouped codec's bytes, and the scheduler's per-group
saves, loads, HBM floor and cancels of saves whose sliding-window blocks the host handed out."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from kvtier.config import KVTierConfig
from kvtier.errors import LayoutError
from kvtier.metrics import Metrics
from kvtier.offload.device import ops_for
from kvtier.offload.group_codec import GroupedCodec, codec_for
from kvtier.offload.groups import FULL, SLIDING, ChunkGroups, GroupSpec
from kvtier.offload.load_planner import WINDOW
from kvtier.offload.messages import OpResult, WorkerReport
from kvtier.offload.pages import KVCacheDescription, describe_pages
from kvtier.offload.protocols import StepRequest
from kvtier.offload.scheduler import OffloadScheduler
from tests.offload.fakes import FakeLookup

BS = 16
CHUNK = 256  # 16 blocks
# gpt-oss: a 128-token window; a hit at a boundary reads the 127 tokens before it
SW = GroupSpec(SLIDING, BS, ("sw.0",), reach=127)
FA = GroupSpec(FULL, BS, ("fa.0",))


def test_positions_full_chunk_and_window_tail():
    assert FA.positions(16) == 16
    # 127 tokens before a boundary (128 before the token one short of it): 8 blocks of 16
    assert SW.positions(16) == 8
    # a window wider than the chunk: the whole chunk
    assert GroupSpec(SLIDING, BS, reach=1023).positions(16) == 16
    # vLLM's CPU block of 128: one of two blocks
    assert GroupSpec(SLIDING, 128, reach=127).positions(2) == 1
    # a window that ends on a block edge needs one block more for the one-short hit
    assert GroupSpec(SLIDING, BS, reach=128).positions(16) == 9


def test_skipped_blocks_follow_vllm_sliding_window_manager():
    # vLLM: skipped tokens = max(0, computed - window + 1 - extra_retained)
    assert SW.skipped_blocks(100) == 0
    assert SW.skipped_blocks(600) == (600 - 127) // BS
    assert FA.skipped_blocks(10_000) == 0


def tables(n_blocks: int) -> list[list[int]]:
    """A full-attention table 100.. and a sliding-window table 500.. of n_blocks each."""
    return [list(range(100, 100 + n_blocks)), list(range(500, 500 + n_blocks))]


def test_save_ids_are_every_full_block_and_the_window_tail():
    g = ChunkGroups([FA, SW], CHUNK)
    assert (g.positions, g.total_positions) == ((16, 8), 24)
    t = tables(32)
    ids = g.save_ids(t, 1)
    assert ids == list(range(116, 132)) + list(range(524, 532))
    assert g.window_ids(ids) == list(range(524, 532))


def test_a_dropped_window_block_makes_the_chunk_unsaveable():
    g = ChunkGroups([FA, SW], CHUNK)
    t = tables(32)
    t[1][30] = -1  # vLLM's null block in the window tail
    assert g.save_ids(t, 1) is None
    t[1][3] = -1  # below the window tail of chunk 0: never read
    assert g.save_ids(t, 0) is not None
    assert g.save_ids(tables(20), 1) is None  # the table does not reach the chunk's end


def test_first_saveable_chunk_is_the_first_whose_window_tail_is_still_held():
    g = ChunkGroups([FA, SW], CHUNK)
    assert g.first_saveable(0) == 0
    # at 600 computed tokens vLLM freed sliding-window blocks below (600-127)//16 = 29:
    # chunk 1's tail starts at block 24, chunk 2's at 40
    assert g.first_saveable(600) == 2
    assert ChunkGroups([FA], CHUNK).first_saveable(10_000) == 0


def test_load_writes_the_window_before_the_claims_end_only():
    g = ChunkGroups([FA, SW], CHUNK)
    t = tables(32)
    # a whole-prompt hit of 512 tokens claims 511: the window then starts at block 24
    c0 = g.load_ids(t, 0, 0, 511)
    c1 = g.load_ids(t, 1, 0, 511)
    assert c0 == list(range(100, 116)) + [-1] * 8
    assert c1 == list(range(116, 132)) + list(range(524, 532))
    assert sorted(g.claimed(t, 0, 511)) == list(range(100, 132)) + list(range(524, 532))
    # above an HBM floor of 256 tokens nothing below block 16 is written
    assert g.load_ids(t, 0, 256, 511) == [-1] * 24
    assert g.claimed(t, 256, 511) == list(range(116, 132)) + list(range(524, 532))


def test_a_claim_cut_deeper_than_the_stored_window_cannot_load():
    cpu = GroupSpec(SLIDING, 128, ("sw",), reach=127)
    g = ChunkGroups([GroupSpec(FULL, 128, ("fa",)), cpu], CHUNK)
    t = [[10, 11, 12, 13], [20, 21, 22, 23]]
    # cut at 384 (a block edge inside chunk 1): the window needs block 2, chunk 1 stores block 3
    assert g.load_ids(t, 1, 0, 384) is None
    assert g.load_ids(t, 1, 0, 511) == [12, 13, 23]


def _desc(groups: Sequence[GroupSpec], layers: int = 1) -> tuple[KVCacheDescription, dict]:
    """Groups whose layer tensors alias one pool, as vLLM's hybrid allocator lays them out."""
    pool = [torch.zeros(8, 2, BS, 4, dtype=torch.bfloat16) for _ in range(layers)]
    tensors = {}
    for g in groups:
        for i, name in enumerate(g.layers):
            tensors[name] = pool[i]
    return KVCacheDescription(tensors, 8, BS, "LBHNC", groups=tuple(groups)), tensors


def test_grouped_codec_round_trips_every_group_over_aliasing_tensors():
    fa = GroupSpec(FULL, BS, ("fa",))
    sw = GroupSpec(SLIDING, BS, ("sw",), reach=BS - 1)  # one block of a two-block chunk
    desc, t = _desc([fa, sw])
    pages = describe_pages(desc)
    codec = codec_for(pages, 2, ops_for(torch.device("cpu")))
    assert isinstance(codec, GroupedCodec)
    assert codec.blocks_per_chunk == 3
    page = 2 * BS * 4 * 2
    assert codec.chunk_bytes == 3 * page
    pool = t["fa"]
    for b in range(8):
        pool[b].fill_(b + 1)
    buf = torch.empty(codec.chunk_bytes, dtype=torch.uint8)
    # chunk: full blocks 1, 2; the window block 5 (another group's block of the same pool)
    codec.gather([1, 2, 5], buf)
    pool.zero_()
    assert codec.scatter(buf, [3, 4, -1]) == 2
    assert pool[3].eq(2).all() and pool[4].eq(3).all() and pool[6].eq(0).all()
    codec.scatter(buf, [-1, -1, 6])
    assert pool[6].eq(6).all()


def test_group_spec_and_block_size_are_in_the_fingerprint():
    fa = GroupSpec(FULL, BS, ("fa",))
    base = describe_pages(_desc([fa, GroupSpec(SLIDING, BS, ("sw",), reach=127)])[0])
    wider = describe_pages(_desc([fa, GroupSpec(SLIDING, BS, ("sw",), reach=255)])[0])
    as_full = describe_pages(_desc([fa, GroupSpec(FULL, BS, ("sw",))])[0])
    assert len({base.fingerprint, wider.fingerprint, as_full.fingerprint}) == 3
    assert "sliding_window(reach=127)" in base.describe()


def test_groups_must_cover_the_registered_tensors():
    desc, t = _desc([GroupSpec(FULL, BS, ("fa",))])
    bad = KVCacheDescription(
        {**t, "stray": torch.zeros(8, 2, BS, 4)}, 8, BS, "LBHNC", groups=desc.groups
    )
    with pytest.raises(LayoutError, match="tensors in no group \\['stray'\\]"):
        describe_pages(bad)


class HybridView:
    """A request view with every group's block table."""

    def __init__(self, req_id: str, prompt: list[int], groups: list[list[int]]) -> None:
        self.request_id = req_id
        self.prompt_token_ids = prompt
        self.num_computed_tokens = 0
        self.group_block_ids = groups

    @property
    def block_ids(self) -> list[int]:
        return self.group_block_ids[0]


def hybrid_scheduler(hits: int = 0) -> tuple[OffloadScheduler, FakeLookup]:
    lookup = FakeLookup(hits)
    sched = OffloadScheduler(
        # any load would fit in the forward: a hybrid one still runs asynchronously
        KVTierConfig(chunk_size=CHUNK, load_gate=False, sync_load_fraction=1.0),
        lookup,
        model_id="m",
        block_size=BS,
        world=1,
        metrics=Metrics(rank=0),
        load_tokens_per_s=1e12,
        cold_misses=False,
        groups=ChunkGroups([FA, SW], CHUNK),
    )
    return sched, lookup


def prompt(n: int) -> list[int]:
    return [(i * 7) % 1000 for i in range(n)]


def test_save_carries_each_groups_positions_and_skips_chunks_whose_window_is_gone():
    sched, _ = hybrid_scheduler()
    view = HybridView("a", prompt(1100), tables(70))
    assert sched.get_num_new_matched_tokens(view, 0) == 0
    # the whole prompt in one step from 0: every chunk's window tail is still held
    meta = sched.build_meta([StepRequest(view, 1100, 0)])
    (op,) = meta.saves
    assert op.first_chunk == 0 and len(op.chunks) == 4
    assert op.chunks[1].block_ids == list(range(116, 132)) + list(range(524, 532))
    # another request whose step starts at 600 computed tokens: chunks 0 and 1 lost their tails
    other = HybridView("b", prompt(1100)[::-1], tables(70))
    sched.get_num_new_matched_tokens(other, 0)
    meta = sched.build_meta([StepRequest(other, 1100, 600)])
    (op,) = meta.saves
    assert op.first_chunk == 2 and len(op.chunks) == 2


def test_a_save_whose_window_block_is_handed_out_again_is_cancelled():
    sched, _ = hybrid_scheduler()
    view = HybridView("a", prompt(600), tables(40))
    sched.get_num_new_matched_tokens(view, 0)
    (op,) = sched.build_meta([StepRequest(view, 600, 0)]).saves
    # a full-attention block of the save reused: nothing to cancel (held until finished_sending)
    sched.blocks_allocated([105])
    assert sched.build_meta([]).cancel_saves == []
    # its window block 524 handed to another request: that save is cancelled this step, alone
    sched.blocks_allocated([524])
    meta = sched.build_meta([])
    assert (meta.cancel_saves, meta.preempted) == ([op.op_id], [])
    assert sched.build_meta([]).cancel_saves == []
    sched.process_reports([WorkerReport(rank=0, results=[OpResult(op.op_id, True)])])
    sched.blocks_allocated([524])
    assert sched.build_meta([]).cancel_saves == []


def test_hybrid_load_restores_every_group_above_the_floor():
    sched, lookup = hybrid_scheduler(hits=2)
    sched.gate.observe_step(1.0)  # a measured step: a dense load this fast runs in the forward
    view = HybridView("a", prompt(512), tables(32))
    assert sched.get_num_new_matched_tokens(view, 0) == 511
    # vLLM takes a hybrid model's failed load back only while its request waits for it
    assert sched.load_is_async("a")
    assert sched.update_state_after_alloc(view, view.block_ids, 511) == 511
    (load,) = sched.build_meta([]).loads
    assert [len(c.block_ids) for c in load.chunks] == [24, 24]
    assert load.chunks[0].block_ids == list(range(100, 116)) + [-1] * 8
    assert load.chunks[1].block_ids == list(range(116, 132)) + list(range(524, 532))


def test_hybrid_load_cut_inside_the_window_fails_for_a_recompute():
    cpu = [GroupSpec(FULL, 128, ("fa",)), GroupSpec(SLIDING, 128, ("sw",), reach=127)]
    lookup = FakeLookup(2)
    sched = OffloadScheduler(
        KVTierConfig(chunk_size=CHUNK, load_gate=False),
        lookup,
        model_id="m",
        block_size=128,
        world=1,
        metrics=Metrics(rank=0),
        cold_misses=False,
        groups=ChunkGroups(cpu, CHUNK),
    )
    view = HybridView("a", prompt(600), [[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]])
    assert sched.get_num_new_matched_tokens(view, 0) == 512
    # the host grants 384 tokens: the window at 384 needs block 2, which chunk 1 does not store
    assert sched.update_state_after_alloc(view, view.block_ids, 384) == 384
    (load,) = sched.build_meta([]).loads
    assert load.fail == WINDOW
    assert sorted(load.chunks[0].block_ids) == [10, 11, 12, 22]


def test_hbm_floor_is_the_latest_asks_local_hit_and_none_after_a_preemption():
    sched, _ = hybrid_scheduler()
    view = HybridView("a", prompt(600), tables(40))
    assert sched.hbm_floor("a") == 0
    sched.get_num_new_matched_tokens(view, 256)
    assert sched.hbm_floor("a") == 256
    # asked again after vLLM's own cache lost a block: the allocation writes from 128 on
    sched.get_num_new_matched_tokens(view, 128)
    assert sched.hbm_floor("a") == 128
    sched.mark_readmitted("a")
    assert sched.hbm_floor("a") == 0
