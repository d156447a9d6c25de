"""ChainPolicy and the tiers that use it: evictions take leaves only, chains touched tail-first,
ghosts that move the split, and the same rules by slots (memory) and by bytes (disk)."""

from __future__ import annotations

import tempfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.metrics import Metrics
from kvtier.store.disk import DiskTier
from kvtier.store.memory import MemoryTier
from kvtier.store.policy import ChainPolicy
from kvtier.store.record import HEADER_BYTES

from .conftest import key_of, payload_of

NS = bytes(range(16))
SLOT = 32


def _all(_: bytes) -> bool:
    return True


def _fill(policy: ChainPolicy, chain: list[bytes]) -> None:
    """Admit a chain deepest-first, as a save commits it."""
    for i in range(len(chain) - 1, -1, -1):
        if chain[i] not in policy:
            policy.insert(chain[i], 1, chain[i - 1] if i else b"")


# ---- the policy alone ------------------------------------------------------------------------


def test_the_victim_is_the_oldest_leaf_never_a_parent():
    p = ChainPolicy(10)
    a = [key_of(i) for i in range(3)]
    b = [key_of(10 + i) for i in range(2)]
    _fill(p, a)
    _fill(p, b)
    # a[0] is the oldest entry but a parent: its chain's leaf goes first
    assert p.victim(_all) == a[2]
    p.evict(a[2])
    assert p.victim(_all) == a[1]
    with pytest.raises(ValueError, match="resident children"):
        p.evict(a[0])
    # a held leaf is passed over; with every leaf held there is no victim
    assert p.victim(lambda k: k != a[1]) == b[1]
    assert p.victim(lambda k: False) is None


def test_a_lookup_touches_the_run_tail_first_and_learns_links():
    p = ChainPolicy(10)
    chain = [key_of(i) for i in range(3)]
    for k in chain:  # stored without parents (a restarted disk tier's scan)
        p.insert(k, 1)
    other = key_of(9)
    p.insert(other, 1)
    p.touch(chain)
    assert [p.parent_of(k) for k in chain] == [b"", chain[0], chain[1]]
    assert p.frequent_count == 3 and p.recent_count == 1
    # frequent chain against a recent stranger: the stranger goes, then the chain tail-first
    order = []
    while len(p):
        v = p.victim(_all)
        order.append(v)
        p.evict(v)
    assert order == [other, chain[2], chain[1], chain[0]]


def test_a_save_under_a_resident_parent_refreshes_its_chain():
    p = ChainPolicy(10)
    old = [key_of(i) for i in range(2)]
    _fill(p, old)
    stranger = key_of(50)
    p.insert(stranger, 1)
    p.insert(key_of(2), 1, old[1])  # the next turn extends the old chain
    # the old chain is now newer than the stranger, and frequent (used twice)
    assert p.victim(_all) == stranger
    assert p.frequent_count == 2


def test_ghost_hits_move_the_split_and_readmit_as_frequent():
    p = ChainPolicy(4, ghost_fraction=0.5)
    keys = [key_of(i) for i in range(6)]
    for k in keys[:4]:
        p.insert(k, 1)
    p.evict(p.victim(_all))  # keys[0] -> recent ghost
    assert p.target == 0
    p.insert(keys[0], 1)
    assert p.target == 1 and p.frequent_count == 1
    # the ghost list holds only ghost_fraction of the capacity
    for k in keys[1:4]:
        p.evict(k)
    p.insert(keys[1], 1)  # evicted before the last two ghosts: forgotten
    assert p.recent_count == 1 and p.target == 1


def test_sizes_weigh_the_lists():
    p = ChainPolicy(100)
    p.insert(key_of(0), 60)
    p.insert(key_of(1), 30)
    assert p.used == 90
    assert p.evict(p.victim(_all)) == 60
    assert p.used == 30
    with pytest.raises(ValueError, match="size must be > 0"):
        p.insert(key_of(2), 0)
    with pytest.raises(ValueError, match="resident key"):
        p.insert(key_of(1), 5)


def test_many_touches_stay_exact_after_compaction():
    p = ChainPolicy(8)
    keys = [key_of(i) for i in range(8)]
    for k in keys:
        p.insert(k, 1)
    for _ in range(200):
        for k in keys[1:]:
            p.touch([k])
    assert len(p._leaves[1]) <= 2 * len(p) + 64 + 1
    assert p.victim(_all) == keys[0]


# ---- the property, per tier ------------------------------------------------------------------


@st.composite
def _workloads(draw: st.DrawFn) -> tuple[list[int | None], list[tuple[str, int]]]:
    """A random prefix forest and a stream of saves, lookups and leases over its chains."""
    n = draw(st.integers(3, 20))
    parents: list[int | None] = [None]
    for i in range(1, n):
        parents.append(draw(st.one_of(st.none(), st.integers(0, i - 1))))
    kinds = st.sampled_from(["save", "save", "lookup", "lease", "release"])
    ops = draw(st.lists(st.tuples(kinds, st.integers(0, n - 1)), min_size=1, max_size=50))
    return parents, ops


def _chain(parents: list[int | None], i: int) -> list[int]:
    out: list[int] = []
    node: int | None = i
    while node is not None:
        out.append(node)
        node = parents[node]
    return out[::-1]


class _Driver:
    """Drives one tier the way the engine does: saves commit deepest-first with parents,
    lookups lease and touch the run, leases get released."""

    def __init__(self, tier: MemoryTier | DiskTier) -> None:
        self.tier = tier
        self.lease = 0

    def save(self, chain: list[bytes]) -> None:
        for i in range(len(chain) - 1, -1, -1):
            parent = chain[i - 1] if i else b""
            if isinstance(self.tier, MemoryTier):
                view = self.tier.reserve(chain[i], parent)
                if view is not None:
                    self.tier.commit(chain[i], 4)
            else:
                self.tier.put(chain[i], payload_of(i, 16), parent=parent)

    def lookup(self, chain: list[bytes]) -> None:
        self.tier.lookup_prefix(chain)

    def hold(self, chain: list[bytes]) -> None:
        self.lease += 1
        self.tier.lease(f"l{self.lease}", chain)

    def release(self) -> None:
        if self.lease:
            self.tier.release(f"l{self.lease}")
            self.lease -= 1


def _run(tier: MemoryTier | DiskTier, parents: list[int | None], ops: list[tuple[str, int]]):
    keys = [key_of(i) for i in range(len(parents))]
    parent_key = {keys[i]: (keys[p] if p is not None else None) for i, p in enumerate(parents)}
    d = _Driver(tier)
    before: set[bytes] = set()
    for kind, node in ops:
        chain = [keys[i] for i in _chain(parents, node)]
        {"save": d.save, "lookup": d.lookup, "lease": d.hold}.get(kind, lambda _: d.release())(
            chain
        )
        after = {k for k in keys if tier.contains(k)}
        gone = before - after
        orphaned = {k for k in after & before if parent_key[k] in gone}
        assert not orphaned, f"{kind} {node} evicted the parent of a resident chunk"
        before = after


@settings(max_examples=60, deadline=None)
@given(_workloads(), st.integers(2, 6))
def test_memory_evictions_never_orphan_a_resident_chunk(workload, slots):
    tier = MemoryTier(SLOT, slots * SLOT, NS, Metrics(), pin_memory=False)
    _run(tier, *workload)


@settings(max_examples=40, deadline=None)
@given(_workloads(), st.integers(2, 6))
def test_disk_evictions_never_orphan_a_resident_chunk(workload, records):
    with tempfile.TemporaryDirectory() as root:
        tier = DiskTier(root, records * (HEADER_BYTES + 16), NS, Metrics())
        _run(tier, *workload)
        tier.close()
