"""The layer-by-layer ("waves") sync-load path on the simulated device: every layer
reads its own loaded bytes at the moment its forward runs, for any wave count, several sync loads
in one step, fragmented and contiguous chunks mixed, HBM-floor positions, a miss in the middle;
no page outside a load's blocks is written; slots are let go; a queued forward is not overtaken.

Nothing here sleeps to synchronise: every wait is on a condition with a deadline."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch

from kvtier.offload.messages import ChunkRef, LoadOp, OffloadMeta, SaveOp, WorkerReport
from kvtier.offload.pages import KVCacheDescription, describe_pages, manager_view
from kvtier.offload.simdevice import CopyModel, SimEvent, SimOps, _Item, _SimLane
from kvtier.offload.waves import plan_waves
from kvtier.offload.worker import OffloadWorker
from tests.offload.test_worker import BS, config, rank0
from tests.offload.vllm_views import build, gqa, mla

DEADLINE_S = 10.0


def _reached(ev: SimEvent, what: str = "mark") -> None:
    assert ev._set.wait(DEADLINE_S), f"{what} not reached within {DEADLINE_S}s (a hang)"


class Rig:
    """A worker on the simulated device over a vLLM-shaped KV cache, random bytes in it."""

    def __init__(
        self,
        *,
        layers: int = 8,
        waves: int = 4,
        chunk: int = 32,
        nb: int = 64,
        layout: str = "LBNHC",
        gbps: float = 0.01,
        specs: list | None = None,
        register_order: Callable[[list[str]], list[str]] | None = None,
        depth: int = 2,
        clock: Callable[[], float] | None = None,
        kernel_block_size: int | None = None,
    ) -> None:
        self.ops = SimOps(CopyModel(gbps=gbps, latency_us=10))
        self.nb = nb
        self.k = chunk // BS
        self.raw, self.views = build(
            specs or gqa(num_layers=layers, block_size=BS), nb, layout,
            kernel_block_size=kernel_block_size,
        )  # fmt: skip
        gen = torch.Generator().manual_seed(11)
        self.raw.copy_(torch.randint(-128, 127, self.raw.shape, generator=gen, dtype=torch.int8))
        self.names = list(self.views)
        order = register_order(self.names) if register_order else self.names
        cfg = config(memory_bytes="4MiB", chunk_size=chunk, load_waves=waves, transfer_depth=depth)
        kw = {} if clock is None else {"clock": clock}
        self.worker: OffloadWorker = rank0(cfg, self.ops, **kw)  # type: ignore[arg-type]
        self.worker.register_kv_caches(
            KVCacheDescription({n: self.views[n] for n in order}, nb, BS, layout)
        )
        self._lk = 0

    def close(self) -> None:
        self.worker.close()
        self.ops.close()

    # ---- pages ---------------------------------------------------------------------------------

    def page(self, name: str, b: int) -> torch.Tensor:
        return manager_view(self.views[name], self.nb)[b].clone().view(torch.uint8).flatten()

    def fill(self, blocks: Sequence[int], value: int) -> None:
        for v in self.views.values():
            for b in blocks:
                manager_view(v, self.nb)[b].view(torch.uint8).fill_(value)

    def snapshot(self) -> dict[str, list[torch.Tensor]]:
        return {n: [self.page(n, b) for b in range(self.nb)] for n in self.names}

    # ---- tiers ---------------------------------------------------------------------------------

    def save(self, chunks: Sequence[tuple[bytes, list[int]]]) -> dict[bytes, dict[str, list]]:
        """Save each (key, block ids) chunk; the pages each holds, per layer."""
        refs = [ChunkRef(k, list(b)) for k, b in chunks]
        tokens = len(chunks) * self.k * BS
        self.worker.wait_for_save(OffloadMeta(saves=[SaveOp(f"sv{len(refs)}", "s", refs, tokens)]))
        assert self.worker.wait_idle(DEADLINE_S)
        assert [r.ok for r in self.worker.take_report().results] == [True]
        return {k: {n: [self.page(n, x) for x in b] for n in self.names} for k, b in chunks}

    def sync_load(
        self, op_id: str, refs: Sequence[tuple[bytes, list[int]]], sync: bool = True
    ) -> LoadOp:
        assert self.worker.stack is not None
        self._lk += 1
        lk = f"lk{self._lk}"
        keys = [k for k, _ in refs]
        self.worker.stack.lookup(keys, lk)
        chunks = [ChunkRef(k, list(b)) for k, b in refs]
        return LoadOp(op_id, f"q-{op_id}", lk, chunks, len(refs) * self.k * BS, sync=sync)

    # ---- the forward ---------------------------------------------------------------------------

    def forward(
        self,
        blocks: Sequence[int],
        on_layer: Callable[[int, str], None] | None = None,
        order: Sequence[str] | None = None,
    ) -> dict[str, dict[int, torch.Tensor]]:
        """Per layer: `wait_for_layer_load`, then a compute-stream kernel that snapshots the
        layer's pages of `blocks` (what the layer's attention would read)."""
        seen: dict[str, dict[int, torch.Tensor]] = {}

        def compute(i: int, name: str) -> None:
            seen[name] = {b: self.page(name, b) for b in blocks}
            if on_layer is not None:
                on_layer(i, name)

        for i, name in enumerate(order or self.names):
            self.worker.wait_for_layer_load(name)
            self.ops.run_on_compute(lambda i=i, name=name: compute(i, name))
        _reached(self.ops.compute.record(), "the forward")
        self.worker.wait_for_save(OffloadMeta())
        return seen

    def settle(self) -> None:
        for s in list(self.ops._streams):
            _reached(s.record(), f"stream {s.name}")

    def held_slots(self) -> int:
        assert self.worker.stack is not None
        return sum(self.worker.stack.memory._readers)


@pytest.fixture
def rigs() -> Iterator[list[Rig]]:
    made: list[Rig] = []
    yield made
    for r in made:
        r.close()


def _key(i: int) -> bytes:
    return bytes([0x40 + i]) * 16


def _saved(rigs: list[Rig], n: int, **kw: Any) -> tuple[
    Rig, dict[bytes, dict[str, list]], list[tuple[bytes, list[int]]]
]:  # fmt: skip
    """A rig (`kw`) with a wave plan and its first `n` chunks saved: their pages, and the
    (key, block ids) of each."""
    rig = Rig(**kw)
    rigs.append(rig)
    assert rig.worker.enable_layer_waves(rig.names)
    src = [(_key(c), list(range(c * rig.k, (c + 1) * rig.k))) for c in range(n)]
    return rig, rig.save(src), src


def _restore(rigs: list[Rig], n: int, zero: bool = True, **kw: Any) -> tuple[
    Rig, dict[bytes, dict[str, list]], list[tuple[bytes, list[int]]], list[int]
]:  # fmt: skip
    """A rig (`kw`) with a wave plan and `n` chunks saved; the restore's refs, onto the next
    `n` chunks' blocks, and those blocks (zeroed unless not `zero`)."""
    rig, saved, src = _saved(rigs, n, **kw)
    refs = [(k, [b + n * rig.k for b in ids]) for k, ids in src]
    dst = [b for _, ids in refs for b in ids]
    if zero:
        rig.fill(dst, 0)
    return rig, saved, refs, dst


def _expect(
    saved: dict[bytes, dict[str, list]], refs: Sequence[tuple[bytes, list[int]]]
) -> dict[tuple[str, int], torch.Tensor]:
    """(layer, destination block) -> the page the load must put there."""
    out = {}
    for key, dst in refs:
        for name, pages in saved[key].items():
            for pos, b in enumerate(dst):
                if b >= 0:
                    out[(name, b)] = pages[pos]
    return out


def _check_seen(seen: dict[str, dict[int, torch.Tensor]], want: dict) -> None:
    bad = [(n, b) for (n, b), page in want.items() if not torch.equal(seen[n][b], page)]
    assert not bad, f"layers read pages not yet (or wrongly) loaded: {bad[:8]} of {len(bad)}"


def _check_untouched(
    rig: Rig, before: dict[str, list[torch.Tensor]], written: set[tuple[str, int]]
) -> None:
    bad = [
        (n, b)
        for n in rig.names
        for b in range(rig.nb)
        if (n, b) not in written and not torch.equal(rig.page(n, b), before[n][b])
    ]
    assert not bad, f"pages outside the loads' blocks changed: {bad[:8]} of {len(bad)}"


# ---- every layer reads its bytes, for any wave plan ---------------------------------------------


@pytest.mark.parametrize(
    ("layers", "waves", "layout", "kbs"),
    [
        (8, 2, "LBNHC", None),
        (8, 3, "LBNHC", None),
        (7, 4, "LBHNC", None),
        (3, 8, "LBNHC", None),
        (2, 2, "LBNHC", None),
        (5, 64, "LBNHC", None),
        (6, 4, "LBHNC", 8),  # vLLM kernel blocks: two per manager block
    ],
    ids=["8L-2w", "8L-3w", "7L-4w-LBHNC", "3L-8w", "2L-2w", "5L-64w", "6L-4w-kernel-blocks"],
)
def test_every_layer_reads_its_loaded_bytes_and_nothing_else_is_written(
    rigs: list[Rig], layers: int, waves: int, layout: str, kbs: int | None
) -> None:
    rig = Rig(layers=layers, waves=waves, layout=layout, kernel_block_size=kbs)
    rigs.append(rig)
    assert rig.worker.enable_layer_waves(rig.names)
    plan = rig.worker._waves
    assert plan is not None
    n = 4
    src = [(_key(c), list(range(c * rig.k, (c + 1) * rig.k))) for c in range(n)]
    saved = rig.save(src)
    refs = [(k, [b + n * rig.k for b in ids]) for k, ids in src]
    dst = [b for _, ids in refs for b in ids]
    rig.fill(dst, 0)
    before = rig.snapshot()
    joins = rig.ops.stats.joins["MainThread"]
    rig.worker.start_load_kv(OffloadMeta(loads=[rig.sync_load("ld", refs)]))
    assert rig.ops.stats.joins["MainThread"] == joins  # nothing joined before layer 0
    seen = rig.forward(dst)
    want = _expect(saved, refs)
    _check_seen(seen, want)
    # one join per wave that holds rows (more waves than layers leaves some empty)
    used = {w for w in plan.of_layer.values() if w >= 0}
    assert rig.ops.stats.joins["MainThread"] - joins == len(used)
    # each layer's wave is consecutive and non-decreasing in the forward's order
    ws = [plan.of_layer[x] for x in rig.names]
    assert ws == sorted(ws) and ws[0] == 0
    rig.settle()
    _check_untouched(rig, before, set(want))
    rep = rig.worker.take_report()
    assert [(r.ok, r.nbytes) for r in rep.results] == [
        (True, len(dst) * rig.worker.codec.bytes_per_block)  # type: ignore[union-attr]
    ]
    assert rep.invalid_block_ids == []
    assert rig.held_slots() == 0
    assert rig.worker._path is not None and rig.worker._path.sync_loads.reap()


# ---- several sync loads in one step: contiguous, fragmented, HBM floor ---------------------------


def _step_checked(rig: Rig, loads: list[LoadOp], blocks: list[int], want: dict) -> WorkerReport:
    """One step of `loads` and a forward over `blocks`: every layer read `want`'s bytes and no
    page outside them changed; the step's report."""
    before = rig.snapshot()
    rig.worker.start_load_kv(OffloadMeta(loads=loads))
    seen = rig.forward(blocks)
    _check_seen(seen, want)
    rig.settle()
    _check_untouched(rig, before, set(want))
    return rig.worker.take_report()


def test_three_sync_loads_mixing_fragmented_contiguous_and_floored_chunks_in_one_step(
    rigs: list[Rig],
) -> None:
    # 8 blocks a chunk: a chunk of 8 separate runs goes through staging and a scatter kernel
    rig, saved, src = _saved(rigs, 6, layers=8, waves=4, chunk=8 * BS, nb=128, gbps=0.002, depth=2)
    k = rig.k
    base = 6 * k
    contiguous = lambda c: [base + c * k + i for i in range(k)]  # noqa: E731
    # fragmented: every other block from a region of its own (8 runs > 4)
    frag0 = [base + 2 * k + 2 * i for i in range(k)]
    frag1 = [base + 2 * k + 2 * i + 1 for i in range(k)]
    frag2 = [base + 4 * k + 2 * i for i in range(k)]
    # floored: its first 3 blocks are the HBM hit (-1), never written
    floored = [-1, -1, -1] + [base + 6 * k + i for i in range(k - 3)]
    hbm = [base + 7 * k + i for i in range(3)]  # the HBM blocks' stand-ins, never named
    load_a = [(_key(0), contiguous(0)), (_key(1), frag0)]
    load_b = [(_key(2), frag1), (_key(3), frag2), (_key(4), floored)]
    load_c = [(_key(5), contiguous(1))]
    refs = load_a + load_b + load_c
    dst = [b for _, ids in refs for b in ids if b >= 0]
    assert len(set(dst)) == len(dst)
    rig.fill(dst, 0)
    rig.fill(hbm, 0x5A)
    ops = [rig.sync_load("a", load_a), rig.sync_load("b", load_b), rig.sync_load("c", load_c)]
    rep = _step_checked(rig, ops, dst, _expect(saved, refs))
    assert sorted(r.op_id for r in rep.results if r.ok) == ["a", "b", "c"]
    assert rep.invalid_block_ids == []
    assert rig.held_slots() == 0


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_fragmented_sync_chunks_beyond_the_staging_ring_reuse_buffers_after_their_scatter(
    rigs: list[Rig], depth: int
) -> None:
    # four fragmented chunks through a ring of `depth` staging buffers, in two loads of one
    # step, the scatters held back on the device: a copy into a buffer must wait for the
    # scatter that last read it, or that scatter reads the next chunk's bytes
    rig, saved, src = _saved(
        rigs, 6, layers=4, waves=2, chunk=8 * BS, nb=160, gbps=0.05, depth=depth
    )
    k = rig.k
    base = 6 * k
    frags = [[base + 2 * k * (c // 2) + 2 * i + c % 2 for i in range(k)] for c in range(6)]
    path = rig.worker._path
    assert path is not None
    path.sync_lane = lane = rig.ops.lane()  # what the first sync load makes, on this thread
    gate = SimEvent(rig.ops)
    lane.kernels.put(_Item("wait", None, dep=gate))  # type: ignore[attr-defined]
    refs_a = [(src[0][0], frags[0]), (src[1][0], frags[1])]
    refs_b = [(src[2][0], frags[2]), (src[3][0], frags[3])]
    refs = refs_a + refs_b
    dst = [b for _, ids in refs for b in ids]
    rig.fill(dst, 0)
    loads = [rig.sync_load("a", refs_a), rig.sync_load("b", refs_b)]
    rig.worker.start_load_kv(OffloadMeta(loads=loads))
    probe = lane.copies.record()  # type: ignore[attr-defined]
    assert not probe._set.wait(0.3), "a copy into a staging buffer ran before its last scatter"
    gate._complete(0.0)
    _check_seen(rig.forward(dst), _expect(saved, refs))
    rig.settle()
    assert all(r.ok for r in rig.worker.take_report().results)
    # a second step through the same ring (its last readers are the first step's scatters)
    refs = [(src[4][0], frags[4]), (src[5][0], frags[5]), (src[0][0], frags[0])]
    dst = [b for _, ids in refs for b in ids]
    rig.fill(dst, 0)
    rig.worker.start_load_kv(OffloadMeta(loads=[rig.sync_load("c", refs)]))
    _check_seen(rig.forward(dst), _expect(saved, refs))
    rig.settle()
    assert [r.ok for r in rig.worker.take_report().results] == [True]
    assert rig.held_slots() == 0


# ---- the forward's order is not the registration's ---------------------------------------------


@pytest.mark.parametrize(
    "reorder",
    [lambda n: list(reversed(n)), lambda n: n[0::2] + n[1::2]],
    ids=["reversed", "evens-then-odds"],  # 8 stacks of one row; two strided stacks of four
)
def test_layers_registered_in_another_order_than_the_forward_still_wait_for_their_own_wave(
    rigs: list[Rig], reorder: Callable[[list[str]], list[str]]
) -> None:
    rig = Rig(layers=8, waves=4, register_order=reorder)
    rigs.append(rig)
    assert rig.worker.enable_layer_waves(rig.names)  # the forward's order
    plan = rig.worker._waves
    assert plan is not None
    assert [plan.of_layer[n] for n in rig.names] == [0, 0, 1, 1, 2, 2, 3, 3]
    src = [(_key(c), list(range(c * rig.k, (c + 1) * rig.k))) for c in range(4)]
    saved = rig.save(src)
    refs = [(k, [b + 4 * rig.k for b in ids]) for k, ids in src]
    dst = [b for _, ids in refs for b in ids]
    rig.fill(dst, 0)
    rig.worker.start_load_kv(OffloadMeta(loads=[rig.sync_load("ld", refs)]))
    _check_seen(rig.forward(dst), _expect(saved, refs))


def test_two_stacks_mla_with_indexer_named_in_forward_order_each_read_their_bytes(
    rigs: list[Rig],
) -> None:
    # two allocations' stacks (latent, indexer keys): each layer's two tensors in its wave
    rig = Rig(specs=mla(num_layers=6, block_size=BS, indexer=True), waves=3, gbps=0.02)
    rigs.append(rig)
    attn = [n for n in rig.names if n.endswith(".attn")]
    idx = [n for n in rig.names if n.endswith("k_cache")]
    forward = [x for pair in zip(attn, idx, strict=True) for x in pair]
    assert rig.worker.enable_layer_waves(forward)
    src = [(_key(c), list(range(c * rig.k, (c + 1) * rig.k))) for c in range(3)]
    saved = rig.save(src)
    refs = [(k, [b + 3 * rig.k for b in ids]) for k, ids in src]
    dst = [b for _, ids in refs for b in ids]
    rig.fill(dst, 0)
    rig.worker.start_load_kv(OffloadMeta(loads=[rig.sync_load("ld", refs)]))
    _check_seen(rig.forward(dst, order=forward), _expect(saved, refs))


# ---- a miss part-way: the chunks before it land before the host's recompute ---------------------


def test_a_miss_midway_fails_the_load_and_its_landed_chunks_never_overwrite_the_recompute(
    rigs: list[Rig],
) -> None:
    rig, _, src = _saved(rigs, 2, layers=8, waves=4, gbps=0.005)
    # chunk 2 was never saved: a miss after two chunks were deferred to the waves
    refs = [
        (src[0][0], [b + 8 for b in src[0][1]]),
        (src[1][0], [b + 8 for b in src[1][1]]),
        (_key(9), [12, 13]),
    ]
    claimed = [b for _, ids in refs for b in ids]
    rig.fill(claimed, 0)
    rig.worker.start_load_kv(OffloadMeta(loads=[rig.sync_load("ld", refs)]))
    rig.forward(claimed)
    rep = rig.worker.take_report()
    assert [(r.op_id, r.ok) for r in rep.results] == [("ld", False)]
    assert sorted(rep.invalid_block_ids) == sorted(claimed)
    # the host recomputes those blocks on the compute stream in its next step
    rig.ops.run_on_compute(lambda: rig.fill(claimed, 0x33))
    rig.settle()
    bad = [(n, b) for n in rig.names for b in claimed if not bool((rig.page(n, b) == 0x33).all())]
    assert not bad, f"a failed load's queued copies landed over the recompute: {bad[:6]}"
    assert rig.held_slots() == 0


# ---- the fence: a forward still queued on the compute stream is not overtaken --------------------


def test_wave_copies_wait_for_the_forward_still_queued_on_the_compute_stream(
    rigs: list[Rig],
) -> None:
    rig, saved, refs, dst = _restore(rigs, 2, layers=4, waves=2, gbps=0.05)
    # the previous step's work on the compute stream, still writing these blocks
    gate = threading.Event()
    started = threading.Event()

    def earlier_forward() -> None:
        started.set()
        assert gate.wait(DEADLINE_S)
        rig.fill(dst, 0x77)

    rig.ops.run_on_compute(earlier_forward)
    assert started.wait(DEADLINE_S)
    rig.worker.start_load_kv(OffloadMeta(loads=[rig.sync_load("ld", refs)]))
    # copies are queued behind the fence: give them every chance to run early, then check
    lane = rig.worker._path.sync_lane  # type: ignore[union-attr]
    probe = lane.copies.record()  # reached only once every queued copy ran
    assert not probe._set.wait(0.3), "a wave copy ran before the fence of the queued forward"
    gate.set()
    seen = rig.forward(dst)
    _check_seen(seen, _expect(saved, refs))


# ---- no plan where it gains nothing or cannot be right -------------------------------------------


def test_no_plan_for_a_hybrid_registration_or_a_single_layer() -> None:
    from kvtier.offload.groups import FULL, GroupSpec

    pool = [torch.zeros(8, 2, BS, 4, dtype=torch.bfloat16) for _ in range(4)]
    names = [f"l{i}" for i in range(4)]
    spec = GroupSpec(FULL, BS, tuple(names))
    desc = KVCacheDescription(dict(zip(names, pool, strict=True)), 8, BS, "LBHNC", groups=(spec,))
    pages = describe_pages(desc)
    assert plan_waves(pages, [len(pages.segments)], names, 4) is None
    _, views = build(gqa(num_layers=1, block_size=BS), 8, "LBNHC")
    one = describe_pages(KVCacheDescription(views, 8, BS, "LBNHC"))
    assert plan_waves(one, [len(one.segments)], list(views), 4) is None


# ---- a kvtier defect after a sync load's copies were queued --------------------------------------


class _RaiseOnce:
    """A metric whose first `observe` raises (a defect of kvtier's own in the load's
    bookkeeping, after its copies were queued), then counts."""

    def __init__(self) -> None:
        self.raised = False

    def observe(self, value: float) -> None:
        if not self.raised:
            self.raised = True
            raise RuntimeError("injected: bookkeeping failed after the copies were queued")


def test_a_hook_error_after_a_sync_load_was_queued_still_reports_it_and_orders_its_copies(
    rigs: list[Rig], monkeypatch: pytest.MonkeyPatch
) -> None:
    rig, _, refs, dst = _restore(rigs, 4, layers=8, waves=4, gbps=0.005)
    boom = _RaiseOnce()
    monkeypatch.setattr(rig.worker.metrics, "load_seconds", boom)
    rig.worker.start_load_kv(OffloadMeta(loads=[rig.sync_load("ld", refs)]))
    assert boom.raised
    rig.forward(dst)
    # the host recomputes on the compute stream right after this step's forward
    rig.ops.run_on_compute(lambda: rig.fill(dst, 0x33))
    rig.settle()
    rep = rig.worker.take_report()
    # the guard's fallback promises a failed report (blocks recomputed), never an op left open
    assert [(r.op_id, r.ok) for r in rep.results] == [("ld", False)], (
        f"the sync load was never reported: results {rep.results}, "
        f"in flight {dict(rig.worker._book.inflight)}"
    )
    assert sorted(rep.invalid_block_ids) == sorted(dst)
    assert rig.worker.wait_idle(1.0)
    bad = [(n, b) for n in rig.names for b in dst if not bool((rig.page(n, b) == 0x33).all())]
    assert not bad, f"the load's copies landed over the recompute: {bad[:6]}"


def test_an_async_load_whose_bookkeeping_raised_is_still_reported_by_its_deadline(
    rigs: list[Rig], monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [0.0]
    rig = Rig(layers=4, waves=2, gbps=0.05, clock=lambda: now[0])
    rigs.append(rig)
    src = [(_key(0), list(range(rig.k)))]
    rig.save(src)
    refs = [(src[0][0], [b + rig.k for b in src[0][1]])]
    boom = _RaiseOnce()
    monkeypatch.setattr(rig.worker.metrics, "load_seconds", boom)
    rig.worker.start_load_kv(OffloadMeta(loads=[rig.sync_load("as", refs, sync=False)]))
    path = rig.worker._path
    assert path is not None
    path.load_lane.call(lambda lane: None, DEADLINE_S)  # every job queued before has run
    assert boom.raised
    first = rig.worker.take_report()
    # past its deadline, a load not reported is reported failed: its parked request resumes
    now[0] += rig.worker.config.lease_ttl_s + 1
    later = rig.worker.take_report()
    results = first.results + later.results
    assert [(r.op_id, r.ok) for r in results] == [("as", False)], (
        f"the parked request's load never ends: results {results}, "
        f"in flight {dict(rig.worker._book.inflight)}"
    )
    assert "q-as" in first.finished_recving + later.finished_recving


def test_a_bad_block_id_in_a_later_sync_load_fails_it_alone_and_writes_none_of_its_blocks(
    rigs: list[Rig],
) -> None:
    rig, saved, src = _saved(rigs, 4, layers=8, waves=4, gbps=0.01)
    good = [(k, [b + 4 * rig.k for b in ids]) for k, ids in src[:2]]
    # its first chunk is fine (deferred to the waves), its second names a block past the cache
    bad = [(src[2][0], [b + 4 * rig.k for b in src[2][1]]), (src[3][0], [rig.nb - 1, rig.nb])]
    dst = [b for _, ids in good for b in ids]
    bad_dst = [b for b in bad[0][1] + bad[1][1] if b < rig.nb]
    rig.fill(dst + bad_dst, 0)
    loads = [rig.sync_load("good", good), rig.sync_load("bad", bad)]
    rep = _step_checked(rig, loads, dst, _expect(saved, good))
    assert sorted((r.op_id, r.ok) for r in rep.results) == [("bad", False), ("good", True)]
    assert set(bad_dst) <= set(rep.invalid_block_ids)
    assert not set(dst) & set(rep.invalid_block_ids)
    assert rig.held_slots() == 0


def test_a_layer_whose_join_failed_never_reads_unloaded_pages_under_a_successful_load(
    rigs: list[Rig], monkeypatch: pytest.MonkeyPatch
) -> None:
    rig, saved, refs, dst = _restore(rigs, 4, layers=8, waves=4, gbps=0.005)
    # the copies wait for a gate layer 0's compute opens (or a 2 s deadline, so a forward that
    # rightly waits for wave 0 is not stuck): layer 0 runs before its wave landed iff unordered
    path = rig.worker._path
    assert path is not None
    path.sync_lane = lane = rig.ops.lane()  # what the first sync load makes, on this thread
    gate = SimEvent(rig.ops)
    lane.copies.put(_Item("wait", None, dep=gate))  # type: ignore[attr-defined]
    timer = threading.Timer(0.5, lambda: gate.done() or gate._complete(0.0))
    timer.start()
    rig.worker.start_load_kv(OffloadMeta(loads=[rig.sync_load("ld", refs)]))
    real = rig.ops.join
    failed = []

    def join(mark: object) -> None:
        if not failed:  # layer 0's join: the device refuses to order the compute stream
            failed.append(mark)
            raise RuntimeError("injected: stream wait failed")
        real(mark)  # type: ignore[arg-type]

    monkeypatch.setattr(rig.ops, "join", join)
    seen = rig.forward(dst, on_layer=lambda i, _: i == 0 and gate._complete(0.0))
    timer.cancel()
    assert failed
    rep = rig.worker.take_report()
    want = _expect(saved, refs)
    unloaded = sorted({b for (n, b), page in want.items() if not torch.equal(seen[n][b], page)})
    ok = [r.ok for r in rep.results if r.op_id == "ld"]
    # either every layer read its bytes, or the load is not reported loaded (blocks recomputed)
    assert not unloaded or (ok == [False] and set(unloaded) <= set(rep.invalid_block_ids)), (
        f"the load reports {ok} (invalid {rep.invalid_block_ids}) while layers read "
        f"{len(unloaded)} blocks before their copies landed"
    )


def test_a_join_the_device_refuses_and_a_host_wait_that_fails_overrule_the_loads_report(
    rigs: list[Rig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """When neither the compute stream nor the host can be ordered after a sync load's
    copies (the device is lost), the load reported loaded at `start_load_kv` is turned into
    a failure before the step's report leaves: its blocks recomputed, never read as loaded."""
    rig, _, refs, dst = _restore(rigs, 4, zero=False, layers=8, waves=4, gbps=0.005)
    rig.worker.start_load_kv(OffloadMeta(loads=[rig.sync_load("ld", refs)]))

    refused: set[int] = set()
    host_wait = SimEvent.wait

    def join(mark: Any) -> None:
        refused.add(id(mark))
        raise RuntimeError("injected: stream wait failed")

    def wait(mark: SimEvent) -> None:  # the host wait for a refused mark fails too
        if id(mark) in refused:
            raise RuntimeError("injected: device lost")
        host_wait(mark)

    monkeypatch.setattr(rig.ops, "join", join)
    monkeypatch.setattr(SimEvent, "wait", wait)
    rig.forward(dst)
    rep = rig.worker.take_report()
    assert [(r.op_id, r.ok, r.reason) for r in rep.results] == [("ld", False, "hook_error")]
    assert set(dst) <= set(rep.invalid_block_ids)
    assert rig.worker.degraded
    assert rig.worker.metrics.value("load_failures_total", reason="hook_error") == 1


def test_no_plan_when_the_host_leaves_a_registered_kv_tensor_unnamed(rigs: list[Rig]) -> None:
    """A tensor no named layer waits for would land in some wave that the layer reading it
    (under another name) never joins: the plan is refused and sync loads join before the
    forward."""
    rig = Rig(layers=8, waves=4, gbps=0.005)
    rigs.append(rig)
    assert not rig.worker.enable_layer_waves(rig.names[:-1])
    assert rig.worker._waves is None
    assert rig.worker.enable_layer_waves(rig.names)


def test_layer_zero_of_a_step_with_two_sync_loads_computes_before_the_first_loads_last_wave(
    rigs: list[Rig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several prompts restored in one step are several sync loads. Each load was issued
    whole, its waves at its end: the second load's wave 0 (and the staging copy of a
    fragmented chunk, which the forward joins before layer 0) queued behind every wave of the
    first, so layer 0 waited for all of them. Now every load's scatter chunks go first, then
    all loads' copy-engine chunks wave-major: layer 0 computes while the first load's last
    wave is still held back, and every layer reads its bytes."""
    rig, saved, src = _saved(rigs, 4, layers=8, waves=4, chunk=8 * BS, nb=128, gbps=0.002)
    k = rig.k
    base = 4 * k
    load_a = [(_key(0), [base + i for i in range(k)]), (_key(1), [base + k + i for i in range(k)])]
    # fragmented (every other block: 8 runs) and contiguous chunks in the second load
    load_b = [(_key(2), [base + 2 * k + 2 * i for i in range(k)]),
              (_key(3), [base + 4 * k + i for i in range(k)])]  # fmt: skip
    refs = load_a + load_b
    dst = [b for _, ids in refs for b in ids]
    rig.fill(dst, 0)
    # the copies of the last wave wait for a gate layer 0's compute opens (or a 2 s deadline,
    # so a forward that waited for every wave before layer 0 still ends)
    gate = SimEvent(rig.ops)
    timer = threading.Timer(0.5, lambda: gate.done() or gate._complete(0.0))
    timer.start()
    copies = [0]
    gated_at: list[int] = []
    real = _SimLane.copy_regions
    # the last wave holds layers 6 and 7: in this layer-major layout, pages from layer 6's on
    wave3 = rig.views[rig.names[6]].data_ptr()

    def gated(self: _SimLane, pieces, to_host, fence=None):  # type: ignore[no-untyped-def]
        if not gated_at and min(span.kv for span in pieces) >= wave3:
            gated_at.append(copies[0])  # the first copy of the last wave, whichever load's
            self.copies.put(_Item("wait", None, dep=gate))
        copies[0] += 1
        return real(self, pieces, to_host, fence)

    monkeypatch.setattr(_SimLane, "copy_regions", gated)
    ops = [rig.sync_load("a", load_a), rig.sync_load("b", load_b)]
    rig.worker.start_load_kv(OffloadMeta(loads=ops))
    assert copies[0] == 4 * 3  # a's two chunks and b's contiguous one, once a wave
    assert gated_at
    early: list[bool] = []

    def on_layer(i: int, _name: str) -> None:
        if i == 0:
            early.append(not gate.done())
            gate._complete(0.0)

    seen = rig.forward(dst, on_layer=on_layer)
    timer.cancel()
    assert early == [True], "layer 0 waited for the first load's last wave"
    _check_seen(seen, _expect(saved, refs))
    rep = rig.worker.take_report()
    assert sorted(r.op_id for r in rep.results if r.ok) == ["a", "b"]
    rig.settle()
    assert rig.held_slots() == 0


def test_a_wave_copy_that_fails_to_queue_fails_every_load_waiting_on_waves_and_frees_slots(
    rigs: list[Rig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step's wave copies are queued after every sync load reported: one that cannot be
    queued turns the loads that had chunks waiting into failures (blocks invalid), what was
    queued lands first, and every slot is let go; a load without such chunks stays loaded."""
    rig, _, src = _saved(rigs, 3, layers=8, waves=4, chunk=8 * BS, nb=128, gbps=0.01)
    k = rig.k
    base = 3 * k
    load_a = [(_key(0), [base + i for i in range(k)])]
    load_b = [(_key(1), [base + 2 * k + 2 * i for i in range(k)])]  # fragmented only
    load_c = [(_key(2), [base + k + i for i in range(k)])]
    calls = [0]
    real = _SimLane.copy_regions

    def failing(self: _SimLane, pieces, to_host, fence=None):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 5:
            raise RuntimeError("injected: the copy could not be queued")
        return real(self, pieces, to_host, fence)

    monkeypatch.setattr(_SimLane, "copy_regions", failing)
    ops = [rig.sync_load("a", load_a), rig.sync_load("b", load_b), rig.sync_load("c", load_c)]
    rig.worker.start_load_kv(OffloadMeta(loads=ops))
    rig.forward([b for _, ids in load_a + load_b + load_c for b in ids])
    rep = rig.worker.take_report()
    assert sorted((r.op_id, r.ok) for r in rep.results) == [("a", False), ("b", True),
                                                             ("c", False)]  # fmt: skip
    assert sorted(rep.invalid_block_ids) == sorted(load_a[0][1] + load_c[0][1])
    rig.settle()
    assert rig.held_slots() == 0
