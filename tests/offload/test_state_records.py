"""How a hybrid model's boundary states (Mamba / gated delta net groups) are saved, keyed
and restored next to attention KV: the real scheduler drives a real worker over real
tensors (its lookups answered by the worker's own TierStack, as a rank's LookupServer does),
and every restore is checked byte for byte against the state of the boundary it claims."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from kvtier.config import KVTierConfig
from kvtier.keys import Namespace, chain_keys, key_seed, state_key
from kvtier.metrics import Metrics
from kvtier.offload.device import CpuOps
from kvtier.offload.groups import FULL, SLIDING, STATE, ChunkGroups, GroupSpec
from kvtier.offload.messages import OffloadMeta
from kvtier.offload.pages import KVCacheDescription, describe_pages
from kvtier.offload.protocols import StepRequest
from kvtier.offload.scheduler import OffloadScheduler
from kvtier.offload.worker import OffloadWorker
from kvtier.store.memory import MemoryTier
from kvtier.store.stack import TierStack
from tests.offload.fakes import FakeLookup, FakeResult

BS = 16
CHUNK = 32  # two blocks a chunk
NB = 32  # blocks in the pool
FA = GroupSpec(FULL, BS, ("fa",))
# three state groups (Qwen3-Next keeps its gated-delta-net layers in three): 3 x 240 B of state
# is more than one 512-byte chunk, so a boundary's state is two parts
STATE_DETAIL = "gdn_attention 3x8,4x4x3 bfloat16,float32"
GDN = tuple(GroupSpec(STATE, BS, (f"gdn{i}#0", f"gdn{i}#1"), detail=STATE_DETAIL) for i in range(3))
SPECS = (FA, *GDN)


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """An attention layer of 256 B a block and three state layers of 48 + 192 B a block, each
    its own allocation, filled with random bytes."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        n = 1
        for d in shape:
            n *= d
        raw = torch.randint(0, 255, (n * torch.finfo(dtype).bits // 8,), generator=g)
        return raw.to(torch.uint8).view(dtype).view(*shape)

    out = {"fa": rnd(NB, 2, BS, 4, dtype=torch.float16)}
    for i in range(3):
        out[f"gdn{i}#0"] = rnd(NB, 3, 8, dtype=torch.bfloat16)
        out[f"gdn{i}#1"] = rnd(NB, 4, 4, 3, dtype=torch.float32)
    return out


def _desc(tensors: dict[str, torch.Tensor], groups: Sequence[GroupSpec] = SPECS) -> Any:
    return KVCacheDescription(tensors, NB, BS, "LBHNC", groups=tuple(groups))


def state_bytes(t: dict[str, torch.Tensor], ids: Sequence[int]) -> bytes:
    """The state groups' bytes of blocks `ids` (one per state group)."""
    out = b""
    for i, b in enumerate(ids):
        for j in (0, 1):
            out += t[f"gdn{i}#{j}"][b].contiguous().view(torch.uint8).numpy().tobytes()
    return out


def fa_bytes(t: dict[str, torch.Tensor], ids: Sequence[int]) -> bytes:
    return b"".join(t["fa"][b].contiguous().view(torch.uint8).numpy().tobytes() for b in ids)


class StackLookup(FakeLookup):
    """A lookup port answered by rank 0's own TierStack, as its LookupServer answers."""

    def __init__(self) -> None:
        super().__init__(0)
        self.stack: TierStack | None = None
        self.results: list[FakeResult] = []

    def lookup(self, keys: Sequence[bytes], lookup_id: str, lease: bool = True,
               ends: Sequence[bytes] | None = None) -> FakeResult:  # fmt: skip
        assert self.stack is not None
        run = self.stack.lookup_run(keys, lookup_id if lease else None, list(ends or ()))
        if lease:
            self.leased.append(lookup_id)
        res = FakeResult(run.chunks, tier=run.tier, runs=tuple(run.runs))
        self.results.append(res)
        return res

    def begin(self, keys, lookup_id, lease=True, ends=None):  # type: ignore[no-untyped-def]
        from tests.offload.fakes import FakePending

        self.ends.append(list(ends) if ends is not None else None)
        return FakePending(lookup_id, self.lookup(keys, lookup_id, lease, ends))

    def release(self, lookup_ids: Sequence[str]) -> None:
        super().release(lookup_ids)
        assert self.stack is not None
        for lid in lookup_ids:
            self.stack.release(lid)


@dataclass
class View:
    """A hybrid request view: every group's table and the states the host handed over."""

    request_id: str
    prompt_token_ids: list[int]
    group_block_ids: list[list[int]]
    num_computed_tokens: int = 0
    state_blocks: dict[int, list[int]] = field(default_factory=dict)

    @property
    def block_ids(self) -> list[int]:
        return self.group_block_ids[0]


class Rig:
    """One scheduler and one rank's worker over the tensors of `_tensors`."""

    def __init__(self, config: dict[str, Any] | None = None, seed: int = 0) -> None:
        self.t = _tensors(seed)
        self.metrics = Metrics(rank=0, registry=CollectorRegistry())
        cfg = {"memory_bytes": "1MiB", "chunk_size": CHUNK, "load_gate": False}
        cfg.update(config or {})
        self.config = KVTierConfig.from_dict(cfg)
        self.worker = OffloadWorker(
            self.config, rank=0, world=1, model_id="m", metrics=self.metrics,
            lookup_endpoint=None, ops=CpuOps(),
        )  # fmt: skip
        self.worker.register_kv_caches(_desc(self.t))
        self.lookup = StackLookup()
        self.lookup.stack = self.worker.stack
        self.smetrics = Metrics(rank=0, registry=CollectorRegistry())
        self.sched = OffloadScheduler(
            self.config, self.lookup, model_id="m", block_size=BS, world=1,
            metrics=self.smetrics, cold_misses=False, groups=ChunkGroups(SPECS, CHUNK),
        )  # fmt: skip
        assert self.worker.stack is not None
        self.stack: TierStack = self.worker.stack

    def close(self) -> None:
        self.worker.close()

    def step(self, scheduled: Sequence[StepRequest] = ()) -> tuple[OffloadMeta, list[Any]]:
        """One engine step: the scheduler's meta run on the rank, its report fed back."""
        meta = self.sched.build_meta(list(scheduled))
        self.worker.start_load_kv(meta)
        self.worker.wait_for_save(meta)
        assert self.worker.wait_idle(30.0)
        report = self.worker.take_report()
        outcomes = self.sched.process_reports([report])
        return meta, outcomes

    def keys(self, prompt: Sequence[int]) -> list[bytes]:
        return chain_keys(prompt, CHUNK, key_seed("m", CHUNK))


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 7 + salt) % 1000 for i in range(n)]


def tables(fa0: int, n: int, states: dict[int, int] | None = None) -> list[list[int]]:
    """An attention table fa0.. of n blocks, and state tables holding block `b` of the state
    after `(j + 1) * BS` tokens at position j (each state group its own block: b, b+1, b+2)."""
    out = [list(range(fa0, fa0 + n))]
    for g in range(3):
        row = [-1] * n
        for j, b in (states or {}).items():
            row[j] = b + g
        out.append(row)
    return out


@pytest.fixture
def rig() -> Any:
    r = Rig()
    yield r
    r.close()


def save_prompt(rig: Rig, p: list[int], fa0: int, handed: dict[int, int], rid: str = "a"
                ) -> dict[int, bytes]:  # fmt: skip
    """Request `rid` computes its whole prompt in one step; the host hands over the states at
    the boundaries `handed` (tokens -> first state block, one per state group from there)."""
    n = -(-len(p) // BS)
    view = View(rid, p, tables(fa0, n, {t // BS - 1: b for t, b in handed.items()}))
    assert rig.sched.get_num_new_matched_tokens(view, 0) == 0
    view.state_blocks = {t: [b, b + 1, b + 2] for t, b in handed.items()}
    meta, _ = rig.step([StepRequest(view, len(p), 0)])
    assert meta.saves, "nothing was saved"
    keys = rig.keys(p)
    for t in handed:
        assert all(rig.stack.memory.contains(state_key(keys[t // CHUNK - 1], j)) for j in (0, 1))
    rig.sched.request_finished(view)
    return {t: state_bytes(rig.t, [b, b + 1, b + 2]) for t, b in handed.items()}


# ---- keys and identity -----------------------------------------------------------------------


def test_state_keys_never_collide_with_chunk_keys_parts_or_other_boundaries() -> None:
    keys = chain_keys(prompt(32 * 8), CHUNK, key_seed("m", CHUNK))
    chunk_set = set(keys)
    states = {state_key(k, j) for k in keys for j in range(4)}
    assert len(states) == 4 * len(keys)
    assert not states & chunk_set
    # a state key of one chunk is never the chunk key of the next (a state record read as KV)
    assert all(state_key(keys[i], 0) != keys[i + 1] for i in range(len(keys) - 1))
    # another model or chunk size keys other boundaries
    other = chain_keys(prompt(32 * 8), CHUNK, key_seed("m2", CHUNK))
    assert not {state_key(k, 0) for k in other} & states


def _fp(groups: Sequence[GroupSpec], tensors: dict[str, torch.Tensor] | None = None) -> bytes:
    return describe_pages(_desc(tensors or _tensors(), groups)).fingerprint


def test_state_dtype_shape_or_mixer_alone_change_the_namespace() -> None:
    base = _fp(SPECS)
    # the same bytes per block, another state dtype (a CPU runner hands one uint8 view of the
    # whole state page, so the detail is all that tells them apart)
    as_bf16 = GroupSpec(STATE, BS, GDN[0].layers, detail="gdn_attention 3x8,4x4x3 bfloat16,"
                        "bfloat16")  # fmt: skip
    assert _fp((FA, as_bf16, *GDN[1:])) != base
    reshaped = GroupSpec(STATE, BS, GDN[0].layers,
                         detail="gdn_attention 3x8,4x3x4 bfloat16,float32")  # fmt: skip
    assert _fp((FA, reshaped, *GDN[1:])) != base
    mamba = GroupSpec(STATE, BS, GDN[0].layers, detail="mamba2 3x8,4x4x3 bfloat16,float32")
    assert _fp((FA, mamba, *GDN[1:])) != base
    # the tensor dtype alone (same detail, same bytes): float32 state viewed as int32
    t = _tensors()
    t["gdn0#1"] = t["gdn0#1"].view(torch.int32)
    assert _fp(SPECS, t) != base
    # the groups' order: group 1's state read as group 2's would be other bytes
    assert _fp((FA, GDN[1], GDN[0], GDN[2])) != base


def test_a_state_group_and_an_attention_group_of_the_same_pages_never_share_a_namespace() -> None:
    t = _tensors()
    # the first state layer's pages taken as an attention group (or a sliding window) instead
    as_full = GroupSpec(FULL, BS, GDN[0].layers)
    as_window = GroupSpec(SLIDING, BS, GDN[0].layers, reach=15)
    fps = {_fp(SPECS, t), _fp((FA, as_full, *GDN[1:]), t), _fp((FA, as_window, *GDN[1:]), t)}
    assert len(fps) == 3


def test_namespaces_of_tenants_ranks_and_chunk_sizes_keep_state_records_apart() -> None:
    fp = _fp(SPECS)
    base = Namespace("m", fp, "float16", CHUNK, 2, 0)
    others = [
        Namespace("m", fp, "float16", CHUNK, 2, 1),  # the other TP rank's state shard
        Namespace("m", fp, "float16", CHUNK, 2, 0, tenant="t2"),
        Namespace("m", fp, "float16", 2 * CHUNK, 2, 0),
        Namespace("m", fp, "float16", CHUNK, 2, 0, replicated=True),
    ]
    assert len({base.fingerprint, *(n.fingerprint for n in others)}) == 5


# ---- restores, byte for byte -----------------------------------------------------------------


def scramble(rig: Rig, blocks: Sequence[int]) -> None:
    """Overwrite blocks of every tensor (the saver's blocks reused: a restore reads the tier)."""
    for t in rig.t.values():
        raw = t.view(torch.uint8) if t.dtype != torch.uint8 else t
        for b in blocks:
            raw[b].fill_(0xA5)


def load_for(
    rig: Rig, p: list[int], fa0: int, state_pos_block: int, hbm: int = 0,
    grant: int | None = None, rid: str = "b",
) -> tuple[View, int, list[Any], Any]:  # fmt: skip
    """Request `rid` asks, is allocated (its state tables hold block `state_pos_block` + g at
    every position) and its load runs; (view, promised tokens, outcomes, load op)."""
    n = -(-len(p) // BS)
    tabs = tables(fa0, n)
    for g in range(1, 4):
        tabs[g] = [state_pos_block + g - 1] * n
    view = View(rid, p, tabs, num_computed_tokens=hbm)
    promised = rig.sched.get_num_new_matched_tokens(view, hbm)
    assert promised is not None
    if not promised:
        return view, 0, [], None
    got = rig.sched.update_state_after_alloc(view, view.block_ids, promised if grant is None
                                             else grant)  # fmt: skip
    assert got
    meta, outcomes = rig.step()
    (op,) = meta.loads
    return view, promised, outcomes, op


def test_a_restore_writes_the_state_of_the_boundary_it_ends_at_not_another(rig: Rig) -> None:
    p = prompt(100)
    saved = save_prompt(rig, p, fa0=0, handed={64: 16, 96: 20})
    assert saved[64] != saved[96]
    fa = fa_bytes(rig.t, range(0, 6))
    scramble(rig, [*range(0, 7), *range(16, 23)])
    view, promised, outcomes, op = load_for(rig, p, fa0=8, state_pos_block=28)
    assert promised == 96
    (out,) = outcomes
    assert out.ok
    assert fa_bytes(rig.t, range(8, 14)) == fa
    assert state_bytes(rig.t, [28, 29, 30]) == saved[96]
    assert rig.metrics.state_parts_loaded._value.get() == 2  # two parts of one boundary


def test_a_prompt_that_diverges_after_a_boundary_restores_that_boundarys_state(rig: Rig) -> None:
    p = prompt(100)
    saved = save_prompt(rig, p, fa0=0, handed={64: 16, 96: 20})
    scramble(rig, [*range(0, 7), *range(16, 23)])
    other = p[:70] + [999] * 30  # same first 70 tokens: shares chunks 0 and 1 only
    _, promised, (out,), op = load_for(rig, other, fa0=8, state_pos_block=28)
    assert (promised, out.ok) == (64, True)
    assert state_bytes(rig.t, [28, 29, 30]) == saved[64]
    keys = rig.keys(other)
    assert [r.key for r in op.chunks if r.part >= 0] == [state_key(keys[1], 0)]


def test_a_whole_prompt_on_a_chunk_boundary_ends_one_chunk_short(rig: Rig) -> None:
    p = prompt(100)
    saved = save_prompt(rig, p, fa0=0, handed={64: 16, 96: 20})
    scramble(rig, [*range(0, 7), *range(16, 23)])
    # 96 tokens: a hit may claim 95 at most, and no state is kept at 95: it ends at 64
    _, promised, (out,), _ = load_for(rig, p[:96], fa0=8, state_pos_block=28)
    assert (promised, out.ok) == (64, True)
    assert state_bytes(rig.t, [28, 29, 30]) == saved[64]


def test_a_host_grant_cut_to_an_earlier_boundary_restores_that_boundarys_state(rig: Rig) -> None:
    p = prompt(100)
    saved = save_prompt(rig, p, fa0=0, handed={64: 16, 96: 20})
    scramble(rig, [*range(0, 7), *range(16, 23)])
    _, promised, (out,), op = load_for(rig, p, fa0=8, state_pos_block=28, grant=64)
    assert promised == 96 and op.tokens == 64 and out.ok
    assert state_bytes(rig.t, [28, 29, 30]) == saved[64]


def test_a_grant_cut_to_a_boundary_without_a_state_fails_and_counts_no_state(rig: Rig) -> None:
    p = prompt(100)
    save_prompt(rig, p, fa0=0, handed={96: 20})
    before = state_bytes(rig.t, [28, 29, 30])
    _, promised, (out,), op = load_for(rig, p, fa0=8, state_pos_block=28, grant=64)
    assert promised == 96 and op.tokens == 64
    assert not out.ok, "a load ending where no state is held was counted a success"
    assert rig.metrics.state_parts_loaded._value.get() == 0
    assert state_bytes(rig.t, [28, 29, 30]) == before  # nothing written into the state blocks


def test_a_restore_below_an_hbm_hit_writes_nothing_under_the_floor(rig: Rig) -> None:
    p = prompt(100)
    saved = save_prompt(rig, p, fa0=0, handed={96: 20})
    scramble(rig, [*range(0, 7), *range(16, 23)])
    fa8 = fa_bytes(rig.t, [8, 9, 10])
    # the host's prefix cache holds 48 tokens (3 blocks): the load writes [48, 96) and the state
    _, promised, (out,), _ = load_for(rig, p, fa0=8, state_pos_block=28, hbm=48)
    assert (promised, out.ok) == (48, True)
    assert fa_bytes(rig.t, [8, 9, 10]) == fa8
    assert state_bytes(rig.t, [28, 29, 30]) == saved[96]


def test_a_missing_later_part_fails_the_load_and_counts_no_state(rig: Rig) -> None:
    p = prompt(100)
    save_prompt(rig, p, fa0=0, handed={96: 20})
    keys = rig.keys(p)
    # part 1 gone (a shared store's TTL, a write-behind drop): part 0, the lookup's key, stays
    assert rig.stack.memory.contains(state_key(keys[2], 1))
    rig.stack.memory.delete(state_key(keys[2], 1))
    _, promised, (out,), _ = load_for(rig, p, fa0=8, state_pos_block=28)
    assert promised == 96
    assert not out.ok
    assert rig.metrics.state_parts_loaded._value.get() == 0
    # it never loads again in this lifecycle: the host recomputes
    assert rig.sched._reqs["b"].load_failed


# ---- every rank's answer ---------------------------------------------------------------------


def test_the_all_rank_hit_ends_at_a_boundary_whose_state_every_rank_holds() -> None:
    """Each rank cuts its run back to the deepest end it holds. Rank 0 holds the states after
    chunks 1 and 3, rank 1 after chunks 1 and 2 (a save that failed on one rank, an eviction
    on one rank). The client took the minimum of the counts, 2 chunks: a boundary rank 0
    holds no state for, so every load failed there while both ranks hold the state after
    chunk 1. Each rank now names every end it holds (and leases it), and the hit ends at the
    deepest one all ranks hold."""
    import shutil

    from kvtier.lookup import LookupClient, LookupServer, endpoint_for, make_run_dir
    from kvtier.store.registry import order

    keys = chain_keys(prompt(32 * 4), CHUNK, key_seed("m", CHUNK))
    ends = [state_key(k, 0) for k in keys]
    stacks = []
    for held in ((0, 2), (0, 1)):
        m = Metrics(rank=len(stacks), registry=CollectorRegistry())
        st = TierStack(MemoryTier(64, 32 * 64, bytes(16), m), (), m)
        for k in keys:
            st.put(k, bytes(64))
        for i in held:
            st.put(ends[i], bytes(64), keys[i])
        stacks.append(st)
    run_dir = make_run_dir()
    eps = {r: endpoint_for(r, run_dir=run_dir) for r in range(2)}
    servers = [
        LookupServer(r, stacks[r], eps[r], Metrics(r, registry=CollectorRegistry())).start()
        for r in range(2)
    ]
    client = LookupClient(eps, Metrics(0, registry=CollectorRegistry()), chunk_size=CHUNK,
                          world=2, timeout_ms=5000, tier_order=order())  # fmt: skip
    try:
        client.wait_ready(10.0)
        pending = client.begin(keys, "lk1", lease=True, ends=ends)
        result = client.poll(pending, wait_ms=5000)
        assert result is not None
        hit = result.hit_chunks
        assert hit > 0, "both ranks hold the state after chunk 1: a hit was lost"
        held = {r: st.memory.contains(ends[hit - 1]) for r, st in enumerate(stacks)}
        assert all(held.values()), (
            f"the all-rank hit ends after chunk {hit} (per rank {result.per_rank}), where "
            f"ranks {[r for r, h in held.items() if not h]} hold no state: the load fails there "
            "and the request recomputes, though every rank holds the state after chunk 1"
        )
        assert hit == 1
        assert all(st.memory.is_leased(ends[0]) for st in stacks), "the common end is unleased"
        client.release(["lk1"])
    finally:
        client.close()
        for s in servers:
            s.close()
        shutil.rmtree(run_dir, ignore_errors=True)


# ---- eviction keeps a state whole ------------------------------------------------------------


def test_under_memory_churn_a_resident_part_zero_always_has_its_later_parts() -> None:
    """The lookup asks for part 0 only and leases only it: the later parts must never be
    evicted while part 0 stays, or every lookup of the prefix hits and every load fails."""
    m = Metrics(rank=0, registry=CollectorRegistry())
    stack = TierStack(MemoryTier(64, 24 * 64, bytes(16), m), (), m)
    g = torch.Generator().manual_seed(5)
    prompts = [chain_keys(prompt(CHUNK * 4, salt=s), CHUNK, key_seed("m", CHUNK))
               for s in range(12)]  # fmt: skip
    for step in range(400):
        keys = prompts[int(torch.randint(0, len(prompts), (1,), generator=g))]
        c = int(torch.randint(0, 4, (1,), generator=g))
        if step % 3 == 0:
            stack.lookup_run(keys, f"l{step}", [state_key(k, 0) for k in keys])
            stack.release(f"l{step}")
            continue
        # a save as the save lane commits it: state parts deepest first, then the chunks
        parts = [state_key(keys[c], j) for j in range(3)]
        for j in (2, 1, 0):
            if not stack.memory.contains(parts[j]):
                stack.put(parts[j], bytes(64), parts[j + 1] if j < 2 else keys[c])
        for i in range(c, -1, -1):
            if not stack.memory.contains(keys[i]):
                stack.put(keys[i], bytes(64), keys[i - 1] if i else b"")
        for ks in prompts:
            for k in ks:
                p = [state_key(k, j) for j in range(3)]
                if stack.memory.contains(p[0]):
                    assert stack.memory.contains(p[1]) and stack.memory.contains(p[2]), step


# ---- retention, forget and prefetch of a hybrid prompt ----------------------------------------


def _retaining_stack(slots: int = 16) -> tuple[TierStack, list[float]]:
    now = [1000.0]
    m = Metrics(rank=0, registry=CollectorRegistry())
    stack = TierStack(MemoryTier(64, slots * 64, bytes(16), m), (), m, retention_limit=64,
                      clock=lambda: now[0], state_parts=2)  # fmt: skip
    return stack, now


def _store_hybrid(stack: TierStack, keys: Sequence[bytes], parts: int = 2) -> list[bytes]:
    """A save as the save lane commits it: the last chunk's boundary state (parts deepest
    first), then the chunks deepest first; the state's keys."""
    c = len(keys) - 1
    skeys = [state_key(keys[c], j) for j in range(parts)]
    for j in reversed(range(parts)):
        stack.put(skeys[j], bytes(64), skeys[j + 1] if j + 1 < parts else keys[c])
    for i in reversed(range(len(keys))):
        stack.put(keys[i], bytes(64), keys[i - 1] if i else b"")
    return skeys


def test_a_retained_hybrid_prompt_keeps_the_state_its_hit_ends_at() -> None:
    """A client's retention hint (vLLM `kv_transfer_params`, the admin API) retains a prompt's
    chunk keys on every rank; the boundary state the prompt's hit must end at is a record of
    its own that nothing retains, so memory pressure evicts it (a leaf) and the retained
    prompt's lookup hits nothing."""
    stack, now = _retaining_stack()
    keys = chain_keys(prompt(CHUNK * 4), CHUNK, key_seed("m", CHUNK))
    ends = [state_key(k, 0) for k in keys]
    assert stack.admin("retain", keys, until=now[0] + 3600) == 4
    _store_hybrid(stack, keys)
    assert stack.lookup_run(keys, None, ends).chunks == 4
    # other traffic fills the tier
    for s in range(1, 12):
        other = chain_keys(prompt(CHUNK * 2, salt=s), CHUNK, key_seed("m", CHUNK))
        for i, k in enumerate(other):
            stack.put(k, bytes(64), other[i - 1] if i else b"")
    assert all(stack.memory.contains(k) for k in keys), "the retained chunks were evicted"
    assert stack.lookup_run(keys, None, ends).chunks == 4, (
        "the retained prompt's chunks are all held, but its boundary state was evicted: "
        f"state parts held {[stack.memory.contains(state_key(keys[3], j)) for j in range(2)]}"
    )


def test_forget_of_a_hybrid_prompt_deletes_its_boundary_states_too() -> None:
    """Forget is a user's "delete my conversation" reaching every tier; a recurrent state is
    derived from the conversation's tokens as much as its KV is."""
    stack, _ = _retaining_stack()
    keys = chain_keys(prompt(CHUNK * 4), CHUNK, key_seed("m", CHUNK))
    skeys = _store_hybrid(stack, keys)
    assert stack.admin("forget", keys) == 4
    assert not any(stack.memory.contains(k) for k in keys)
    left = [j for j, k in enumerate(skeys) if stack.memory.contains(k)]
    assert not left, f"state parts {left} of the forgotten prompt are still in memory"


def test_a_hybrid_ranks_admin_ops_reach_the_states_its_worker_saved(rig: Rig) -> None:
    """The rank's stack learns the state record's parts from the worker's codec: retain
    protects, and forget deletes, the boundary states a real save wrote."""
    p = prompt(100)
    save_prompt(rig, p, fa0=0, handed={64: 16, 96: 20})
    keys = rig.keys(p)
    states = [state_key(keys[c], j) for c in (1, 2) for j in (0, 1)]
    assert rig.stack.admin("retain", keys, until=time.time() + 3600) == len(keys)
    assert all(rig.stack.retention.holds(k) for k in states)
    assert rig.stack.admin("forget", keys) == len(keys)
    assert not any(rig.stack.memory.contains(k) for k in [*keys, *states])
    assert not any(rig.stack.retention.holds(k) for k in states)
