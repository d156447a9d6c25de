"""State groups (Mamba, gated delta net, short conv, linear attention) in the offload core: a
boundary's state is a record of its own, cut into chunk-sized parts; a hit may end only at a
boundary whose state the tier holds; a load writes the attention groups' blocks and the state
of its last boundary, together or not at all."""

from __future__ import annotations

import pytest
import torch

from kvtier.config import KVTierConfig
from kvtier.keys import state_key
from kvtier.metrics import Metrics
from kvtier.offload.device import ops_for
from kvtier.offload.group_codec import GroupedCodec, codec_for
from kvtier.offload.groups import FULL, STATE, ChunkGroups, GroupSpec
from kvtier.offload.load_planner import SLOWER
from kvtier.offload.messages import ChunkRef
from kvtier.offload.pages import KVCacheDescription, describe_pages
from kvtier.offload.protocols import StepRequest
from kvtier.offload.scheduler import OffloadScheduler
from kvtier.offload.selftest import SELF_TEST_KEY
from kvtier.store.memory import MemoryTier
from kvtier.store.stack import TierStack
from tests.offload.fakes import FakeLookup

BS = 16
CHUNK = 32  # two blocks
FA = GroupSpec(FULL, BS, ("fa",))
GDN = GroupSpec(STATE, BS, ("gdn#0", "gdn#1"), detail="gdn_attn 3x8,2x4x4 bfloat16,float32")


def test_a_state_group_has_no_position_in_a_chunk_record():
    g = ChunkGroups([FA, GDN], CHUNK)
    assert (g.positions, g.states) == ((2, 0), (1,))
    tables = [[10, 11, 12, 13], [-1, 21, -1, 23]]
    assert g.save_ids(tables, 1) == [12, 13]
    assert g.load_ids(tables, 1, 0, 64) == [12, 13]
    # the state after 64 tokens sits in the state table's block 64 // 16 - 1
    assert g.state_ids(tables, 64) == [23]
    assert g.state_ids(tables, 48) is None  # vLLM's null block: no state there
    # a failed load's claim: the attention blocks and the state block it would have written
    assert sorted(g.claimed(tables, 0, 64)) == [10, 11, 12, 13, 23]
    assert "state(gdn_attn" in g.describe() and "a record of its own" in g.describe()


def _state_desc() -> tuple[KVCacheDescription, dict[str, torch.Tensor]]:
    """One pool of 8 blocks of 256 bytes: an attention layer's pages (fa) and a state layer's
    two state tensors (conv 48 bytes, ssm 128 bytes) aliasing it, as vLLM's hybrid pool does."""
    pool = torch.zeros(8, 256, dtype=torch.uint8)
    fa = pool.view(torch.float16).view(8, 2, BS, 4)  # 256 bytes a block
    conv = pool[:, :48].view(torch.bfloat16).view(8, 3, 8)
    ssm = pool[:, 48:176].view(torch.float32).view(8, 2, 4, 4)
    tensors = {"fa": fa, "gdn#0": conv, "gdn#1": ssm}
    desc = KVCacheDescription(tensors, 8, BS, "LBHNC", groups=(FA, GDN))
    return desc, {"pool": pool, **tensors}


def test_the_state_record_round_trips_in_chunk_sized_parts_zero_padded():
    desc, t = _state_desc()
    pages = describe_pages(desc)
    codec = codec_for(pages, 2, ops_for(torch.device("cpu")))
    assert isinstance(codec, GroupedCodec)
    assert codec.chunk_bytes == 512  # two attention blocks
    assert (codec.states.state_bytes, codec.states.parts) == (176, 1)
    pool = t["pool"]
    for b in range(8):
        pool[b] = torch.arange(256, dtype=torch.int32).add(b).to(torch.uint8)
    buf = torch.full((512,), 0xEE, dtype=torch.uint8)
    codec.gather([5], buf, 0)
    assert torch.equal(buf[:176], pool[5, :176])
    assert bool((buf[176:] == 0).all()), "a slot's stale bytes went into the record"
    before = pool.clone()
    assert codec.scatter(buf, [2], 0) == 1
    assert torch.equal(pool[2, :176], before[5, :176])
    assert torch.equal(pool[2, 176:], before[2, 176:]), "a state load wrote past the state"
    assert torch.equal(pool[[0, 1, 3, 4, 5, 6, 7]], before[[0, 1, 3, 4, 5, 6, 7]])


def test_a_state_larger_than_a_chunk_is_several_records_part_zero_the_leaf():
    desc, t = _state_desc()
    codec = codec_for(describe_pages(desc), 1, ops_for(torch.device("cpu")))
    assert isinstance(codec, GroupedCodec)
    # a one-block chunk holds 256 bytes: the 176-byte state is one part; shrink the part size
    codec.states.part_bytes = 64
    codec.states.parts = 3
    pool = t["pool"]
    pool[6] = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    parts = [torch.empty(64, dtype=torch.uint8) for _ in range(3)]
    for j, buf in enumerate(parts):
        codec.gather([6], buf, j)
    assert torch.equal(torch.cat(parts)[:176], pool[6, :176])
    assert bool((parts[2][176 - 128 :] == 0).all())
    pool[1].zero_()
    for j, buf in enumerate(parts):
        codec.scatter(buf, [1], j)
    assert torch.equal(pool[1, :176], pool[6, :176])
    chunk_key = bytes(range(16))
    refs = codec.records([ChunkRef(b"a" * 16, [1]), ChunkRef(state_key(chunk_key, 0), [6],
                                                           chunk_key, 0)])  # fmt: skip
    keys = [state_key(chunk_key, j) for j in range(3)]
    assert [(r.key, r.parent, r.part) for r in refs[1:]] == [
        (keys[0], keys[1], 0), (keys[1], keys[2], 1), (keys[2], chunk_key, 2),
    ]  # fmt: skip


def test_the_state_layout_is_in_the_fingerprint():
    desc, _ = _state_desc()
    base = describe_pages(desc)
    other = GroupSpec(STATE, BS, GDN.layers, detail="mamba2 3x8,2x4x4 bfloat16,float32")
    swapped = describe_pages(KVCacheDescription(desc.tensors, 8, BS, "LBHNC", groups=(FA, other)))
    assert base.fingerprint != swapped.fingerprint
    assert "state(gdn_attn 3x8,2x4x4 bfloat16,float32)" in base.describe()


class StateView:
    """A hybrid request view with the state blocks the host handed over this step."""

    def __init__(self, req_id: str, prompt: list[int], groups: list[list[int]]) -> None:
        self.request_id = req_id
        self.prompt_token_ids = prompt
        self.num_computed_tokens = 0
        self.group_block_ids = groups
        self.state_blocks: dict[int, list[int]] = {}

    @property
    def block_ids(self) -> list[int]:
        return self.group_block_ids[0]


METRICS = Metrics(rank=0)


def state_scheduler(hits: int = 0) -> tuple[OffloadScheduler, FakeLookup]:
    lookup = FakeLookup(hits)
    sched = OffloadScheduler(
        KVTierConfig(chunk_size=CHUNK, load_gate=False),
        lookup,
        model_id="m",
        block_size=BS,
        world=1,
        metrics=METRICS,
        cold_misses=False,
        groups=ChunkGroups([FA, GDN], CHUNK),
    )
    return sched, lookup


def prompt(n: int) -> list[int]:
    return [(i * 7) % 1000 for i in range(n)]


def test_a_save_stores_the_handed_over_boundary_states_and_guards_their_blocks():
    sched, lookup = state_scheduler()
    view = StateView("a", prompt(100), [list(range(100, 107)), [-1] * 7])
    assert sched.get_num_new_matched_tokens(view, 0) == 0
    # the lookup asks for a hit ending at a held state, never past token 99
    (ends,) = lookup.ends
    assert ends is not None and len(ends) == 3
    # vLLM materialized the states after 64 and 96 tokens (and one off a chunk boundary)
    view.state_blocks = {64: [33], 96: [35], 80: [34]}
    (op,) = sched.build_meta([StepRequest(view, 100, 0)]).saves
    chunks = [r for r in op.chunks if r.part < 0]
    states = [r for r in op.chunks if r.part >= 0]
    assert [r.block_ids for r in chunks] == [[100, 101], [102, 103], [104, 105]]
    assert ends == [state_key(r.key, 0) for r in chunks]
    assert [(r.key, r.parent, r.block_ids) for r in states] == [
        (state_key(chunks[1].key, 0), chunks[1].key, [33]),
        (state_key(chunks[2].key, 0), chunks[2].key, [35]),
    ]  # fmt: skip
    # vLLM hands a state block to another request before the save read it: cancelled
    sched.blocks_allocated([35])
    assert sched.build_meta([]).cancel_saves == [op.op_id]


def test_a_load_ends_at_the_held_state_and_writes_it_with_the_attention_blocks():
    sched, _ = state_scheduler(hits=2)
    view = StateView("a", prompt(100), [list(range(100, 107)), [-1, -1, -1, 43, -1, -1, -1]])
    assert sched.get_num_new_matched_tokens(view, 0) == 64
    assert sched.update_state_after_alloc(view, view.block_ids, 64) == 64
    (load,) = sched.build_meta([]).loads
    chunks = [r for r in load.chunks if r.part < 0]
    (state,) = [r for r in load.chunks if r.part >= 0]
    assert [r.block_ids for r in chunks] == [[100, 101], [102, 103]]
    assert (state.key, state.parent, state.block_ids) == (
        state_key(chunks[1].key, 0), chunks[1].key, [43],
    )  # fmt: skip


def test_a_state_load_is_never_cut_short_of_its_boundary():
    sched, _ = state_scheduler(hits=3)
    # the tail chunk lives in a tier the cost model would rather recompute from: a state
    # layout cannot stop at another boundary (its state is not held there), so it skips
    sched.load_planner.policy = "cost"
    view = StateView("a", prompt(100), [list(range(100, 107)), [-1] * 7])

    class Cut:
        end = 64
        predicted_s = 0.0
        segments = ()

        @staticmethod
        def reads() -> tuple[tuple[str, int], ...]:
            return (("memory", 64),)

    sched.load_planner._choose = lambda hbm, end, result: Cut()  # type: ignore[method-assign]
    before = METRICS.skipped_load(SLOWER)._value.get()
    assert sched.get_num_new_matched_tokens(view, 0) == 0
    assert METRICS.skipped_load(SLOWER)._value.get() == before + 1


def _stack(slots: int = 8, nbytes: int = 64) -> TierStack:
    m = Metrics(rank=0)
    return TierStack(MemoryTier(nbytes, slots * nbytes, bytes(16), m), (), m)


def test_a_lookup_with_ends_is_cut_back_to_the_deepest_held_end():
    stack = _stack()
    keys = [bytes([i]) * 16 for i in range(4)]
    ends = [state_key(k, 0) for k in keys]
    for k in keys:
        stack.put(k, bytes(64))
    assert stack.lookup_run(keys, None, ends).chunks == 0  # no state held: no hit at all
    stack.put(ends[1], bytes(64))
    run = stack.lookup_run(keys, "L1", ends)
    assert (run.chunks, run.tier) == (2, "memory")
    # the state is leased with the run: eviction cannot take it before the load
    assert stack.memory.is_leased(ends[1])
    stack.release("L1")
    assert not stack.memory.is_leased(ends[1])
    # an end past the attention run never counts; ends shorter than the keys cap the run
    stack.put(ends[3], bytes(64))
    stack.memory.delete(keys[2])
    assert stack.lookup_run(keys, None, ends).chunks == 2
    stack.put(keys[2], bytes(64))
    assert stack.lookup_run(keys, None, ends).chunks == 4
    assert stack.lookup_run(keys, None, ends[:3]).chunks == 2


def test_a_worker_saves_and_restores_a_boundary_state_under_the_device_harness() -> None:
    from prometheus_client import CollectorRegistry

    from kvtier.offload.messages import LoadOp, OffloadMeta, SaveOp
    from kvtier.offload.worker import OffloadWorker
    from tests.offload.separation import DeviceSeparation, TaggedOps

    mode = DeviceSeparation()
    desc, t = _state_desc()
    pool = t["pool"]
    g = torch.Generator().manual_seed(3)
    pool.copy_(torch.randint(0, 255, pool.shape, generator=g).to(torch.uint8))
    mode.tag(pool)
    metrics = Metrics(rank=0, registry=CollectorRegistry())
    worker = OffloadWorker(
        KVTierConfig.from_dict({"memory_bytes": "1MiB", "chunk_size": CHUNK}), rank=0, world=1,
        model_id="m", metrics=metrics, lookup_endpoint=None, ops=TaggedOps(mode),
    )  # fmt: skip
    try:
        with mode:
            worker.register_kv_caches(desc)
            # the chunk's blocks 1, 2; the state in block 5 (host copies: explicit, per row)
            want = [pool[b].to("cpu", copy=True) for b in (1, 2, 5)]
            chunk = bytes([7]) * 16
            state = ChunkRef(state_key(chunk, 0), [5], chunk, 0)
            save = SaveOp("s", "r1", [ChunkRef(chunk, [1, 2]), state], CHUNK)
            worker.wait_for_save(OffloadMeta(saves=[save]))
            assert worker.wait_idle(30.0)
            (result,) = worker.take_report().results
            assert result.ok and result.nbytes == 2 * worker.codec.chunk_bytes
            assert worker.stack is not None
            assert worker.stack.lookup_run([chunk], "lk", [state.key]).chunks == 1
            back = [ChunkRef(chunk, [6, 7]), ChunkRef(state.key, [3], chunk, 0)]
            load = LoadOp("l", "r2", "lk", back, CHUNK)
            worker.start_load_kv(OffloadMeta(loads=[load]))
            assert worker.wait_idle(30.0)
            assert worker.take_report().results[0].ok
            got = [pool[b].to("cpu", copy=True) for b in (6, 7, 3)]
        # the attention pages whole; the state block's state bytes (its padding is the pool's)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert torch.equal(got[2][:176], want[2][:176])
        assert metrics.state_parts_stored._value.get() == 1
        assert metrics.state_parts_loaded._value.get() == 1
    finally:
        worker.close()


def test_the_startup_self_test_moves_a_boundary_state_through_the_real_paths(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from prometheus_client import CollectorRegistry

    from kvtier.errors import StartupError
    from kvtier.offload.device import CpuOps
    from kvtier.offload.group_codec import StateCodec
    from kvtier.offload.worker import OffloadWorker

    def worker() -> OffloadWorker:
        return OffloadWorker(
            KVTierConfig.from_dict({"memory_bytes": "1MiB", "chunk_size": CHUNK}), rank=0,
            world=1, model_id="m", metrics=Metrics(rank=0, registry=CollectorRegistry()),
            lookup_endpoint=None, ops=CpuOps(),
        )  # fmt: skip

    desc, _ = _state_desc()
    ok = worker()
    ok.register_kv_caches(desc)
    assert ok.stack is not None and ok.stack.memory.contains(state_key(SELF_TEST_KEY, 0))
    ok.close()
    # a state path that writes nothing back: startup stops naming a state tensor
    monkeypatch.setattr(StateCodec, "scatter", lambda self, src, ids, part: 0)
    bad = worker()
    with pytest.raises(StartupError, match="KV tensor 'gdn#0'"):
        bad.register_kv_caches(desc)


def test_the_ends_below_memory_are_asked_of_a_lower_tier_in_one_batch() -> None:
    from kvtier.store.base import TierBase

    class Lower(TierBase):
        """A lower tier holding `held`, counting its presence batches."""

        name = "remote"
        pins = False

        def __init__(self, held: set[bytes]) -> None:
            self.held = held
            self.batches: list[int] = []

        def contains(self, key: bytes) -> bool:
            return key in self.held

        def contains_many(self, keys):  # type: ignore[no-untyped-def]
            self.batches.append(len(keys))
            return [k in self.held for k in keys]

    keys = [bytes([i]) * 16 for i in range(6)]
    ends = [state_key(k, 0) for k in keys]
    lower = Lower({*keys, ends[1]})
    m = Metrics(rank=0)
    stack = TierStack(MemoryTier(64, 8 * 64, bytes(16), m), (lower,), m)
    assert stack.lookup_run(keys, None, ends).chunks == 2
    # one batch for the chunks and one for every end key, not a round trip per end key
    assert lower.batches == [6, 6]


def test_a_looked_up_state_is_as_recent_as_the_run_it_ends() -> None:
    stack = _stack(slots=4)
    chunk, other, newer = b"a" * 16, b"x" * 16, b"y" * 16
    state = state_key(chunk, 0)
    stack.put(chunk, bytes(64))
    stack.put(state, bytes(64), chunk)
    stack.put(other, bytes(64))
    stack.put(newer, bytes(64))
    assert stack.lookup_run([chunk], "L", [state]).chunks == 1
    stack.release("L")
    # a fifth record evicts the least recent leaf: the untouched one, not the state just used
    stack.put(b"z" * 16, bytes(64))
    assert stack.memory.contains(state) and stack.memory.contains(chunk)
    assert not stack.memory.contains(other)
