"""MemoryTier: slots, chain-aware eviction, leases, verified reads, reserve/commit, threads."""

from __future__ import annotations

import threading
from collections import OrderedDict

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.metrics import Metrics
from kvtier.store.memory import MemoryTier

from .conftest import FakeClock, key_of, payload_of

SLOT = 64
NS = bytes(range(16))
JOIN_S = 20.0


def _tier(metrics: Metrics, slots: int, clock: FakeClock | None = None, **kw) -> MemoryTier:
    extra = {"clock": clock} if clock is not None else {}
    return MemoryTier(SLOT, slots * SLOT, NS, metrics, pin_memory=False, **extra, **kw)


def _failures(m: Metrics) -> float:
    return m.value("verify_failures_total", tier="memory", reason="checksum_mismatch")


def _all_pinned(m: Metrics) -> float:
    return m.value("store_failures_total", tier="memory", reason="all_pinned")


# ---- construction and bad input --------------------------------------------------------------


def test_zero_slots_names_both_sizes_and_the_fix(metrics: Metrics):
    with pytest.raises(ValueError, match=r"capacity_bytes=100 .* slot_bytes=128.*at least 128"):
        MemoryTier(128, 100, NS, metrics)


def test_layout_and_gauges(metrics: Metrics):
    tier = MemoryTier(SLOT, 5 * SLOT + 7, NS, metrics, pin_memory=False)
    assert tier.name == "memory"
    assert tier.num_slots == 5
    assert metrics.value("tier_capacity_bytes", tier="memory") == 5 * SLOT
    assert metrics.value("tier_residency_bytes", tier="memory") == 0
    st0 = tier.stats()
    assert (st0.free, st0.used, st0.reserved, st0.quarantined) == (5, 0, 0, 0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"slot_bytes": 0}, "slot_bytes must be > 0"),
        ({"namespace": b"short"}, "namespace must be 16 bytes, got 5"),
        ({"ghost_fraction": 1.5}, r"ghost_fraction=1.5 must lie in \[0, 1\]"),
    ],
)
def test_bad_construction(metrics: Metrics, kwargs: dict, match: str):
    args = {"slot_bytes": SLOT, "capacity_bytes": 4 * SLOT, "namespace": NS, **kwargs}
    with pytest.raises(ValueError, match=match):
        MemoryTier(metrics=metrics, **args)


def test_pin_memory_follows_cuda(metrics: Metrics):
    if torch.cuda.is_available():
        tier = MemoryTier(SLOT, 2 * SLOT, NS, metrics, pin_memory=True)
        assert tier.reserve(key_of(0)).is_pinned()
    else:
        with pytest.raises(ValueError, match="pin_memory=True needs CUDA"):
            MemoryTier(SLOT, 2 * SLOT, NS, metrics, pin_memory=True)
        assert not MemoryTier(SLOT, 2 * SLOT, NS, metrics).reserve(key_of(0)).is_pinned()


def test_bad_writes_are_errors_naming_sizes(metrics: Metrics):
    tier = _tier(metrics, 2)
    with pytest.raises(ValueError, match="chunk key must be 16 bytes, got 3"):
        tier.put(b"abc", b"x")
    with pytest.raises(ValueError, match=f"payload of {SLOT + 1} bytes .* slot of {SLOT} bytes"):
        tier.put(key_of(0), bytes(SLOT + 1))
    strided = memoryview(bytes(2 * SLOT))[::2]
    with pytest.raises(ValueError, match="C-contiguous"):
        tier.put(key_of(0), strided)
    assert tier.stats().free == 2 and len(tier) == 0


# ---- writes and reads ------------------------------------------------------------------------


def test_put_get_read_into_round_trip_and_lengths(metrics: Metrics):
    tier = _tier(metrics, 4)
    full, short = payload_of(1, SLOT), payload_of(2, 10)
    assert tier.put(key_of(1), full)
    assert tier.put(key_of(2), memoryview(bytearray(short)))
    assert tier.put(key_of(3), b"")
    assert tier.get(key_of(1)) == full
    assert tier.get(key_of(2)) == short
    assert tier.get(key_of(3)) == b""
    assert tier.get(key_of(4)) is None
    dst = torch.zeros(10, dtype=torch.uint8)
    assert tier.read_into(key_of(2), dst)
    assert bytes(dst.numpy()) == short
    assert not tier.read_into(key_of(4), dst)
    assert len(tier) == 3 and tier.residency_bytes() == 3 * SLOT


def test_tensor_payloads_store_their_raw_bytes(metrics: Metrics):
    tier = _tier(metrics, 2)
    t = torch.arange(16, dtype=torch.float32)  # 64 bytes
    assert tier.put(key_of(0), t)
    assert tier.get(key_of(0)) == t.numpy().tobytes()
    strided = torch.arange(32, dtype=torch.int16)[::2]  # not contiguous: 32 bytes
    assert tier.put(key_of(1), strided)
    assert tier.get(key_of(1)) == strided.contiguous().numpy().tobytes()


def test_reput_keeps_the_first_bytes_and_refreshes_recency(metrics: Metrics):
    tier = _tier(metrics, 2)
    a, b, c = key_of(0), key_of(1), key_of(2)
    assert tier.put(a, payload_of(0, SLOT))
    assert tier.put(b, payload_of(1, SLOT))
    assert tier.put(a, payload_of(99, SLOT))  # refresh: a is now MRU of probation
    assert tier.put(c, payload_of(2, SLOT))  # so b, not a, is the victim
    assert not tier.contains(b) and tier.contains(a) and tier.contains(c)
    assert tier.get(a) == payload_of(0, SLOT)  # not rewritten
    assert metrics.value("evictions_total", tier="memory") == 1


def test_read_into_checks_dst(metrics: Metrics):
    tier = _tier(metrics, 1)
    assert tier.put(key_of(0), payload_of(0, SLOT))
    with pytest.raises(ValueError, match="uint8 dst"):
        tier.read_into(key_of(0), torch.zeros(SLOT // 4, dtype=torch.float32))
    with pytest.raises(ValueError, match=f"dst holds {SLOT - 1} bytes .* {SLOT} bytes"):
        tier.read_into(key_of(0), torch.zeros(SLOT - 1, dtype=torch.uint8))
    # the failed call left no read pin behind: the slot can still be evicted
    assert tier.put(key_of(1), payload_of(1, SLOT))
    assert not tier.contains(key_of(0))


def test_lookup_prefix_counts_leading_keys_and_touches_them(metrics: Metrics):
    tier = _tier(metrics, 4)
    keys = [key_of(i) for i in range(4)]
    for k in keys[:2] + keys[3:]:
        assert tier.put(k, payload_of(0, 8))
    assert tier.lookup_prefix(keys) == 2
    assert tier.lookup_prefix([keys[2], keys[0]]) == 0
    assert tier.stats().frequent == 2 and tier.stats().recent == 1


def test_reads_leave_recency_alone_and_lookups_refresh_the_run(metrics: Metrics):
    tier = _tier(metrics, 3)
    a, b, c, d = (key_of(i) for i in range(4))
    for k in (a, b, c):
        assert tier.put(k, payload_of(0, 8))
    assert tier.get(a) is not None  # a load reading a: no reference, a is still the oldest
    assert tier.put(d, payload_of(3, 8))
    assert not tier.contains(a)
    tier.touch([b])  # a lookup used b: c is now the oldest
    assert tier.put(a, payload_of(0, 8))
    assert tier.contains(b) and not tier.contains(c)


def test_a_parent_outlives_its_children_whatever_its_age(metrics: Metrics):
    tier = _tier(metrics, 3)
    head, mid, tail, other = (key_of(i) for i in range(4))
    # committed deepest-first, as a save does: the head is written last
    for key, parent in ((tail, mid), (mid, head), (head, b"")):
        view = tier.reserve(key)
        assert view is not None
        tier.commit(key, 8, parent=parent)
    assert tier.put(other, payload_of(3, 8))  # evicts the chain's leaf, never its head
    assert tier.contains(head) and tier.contains(mid) and not tier.contains(tail)
    # re-saving the leaf never makes its room by evicting its own parent, the oldest leaf
    assert tier.put(tail, payload_of(2, 8), parent=mid)
    assert tier.contains(mid) and tier.contains(tail) and not tier.contains(other)


# ---- verification ----------------------------------------------------------------------------


def test_corrupt_slot_is_a_miss_counted_once_and_freed(metrics: Metrics):
    tier = _tier(metrics, 2)
    k, data = key_of(0), payload_of(0, SLOT)
    assert tier.put(k, data)
    assert tier.lease("L", [k]) == 1
    tier.view(k)[5] ^= 0x01
    tier.release("L")
    dst = torch.full((SLOT,), 7, dtype=torch.uint8)
    assert not tier.read_into(k, dst)
    assert bytes(dst.numpy()) == bytes([7]) * SLOT  # verified before a byte was copied
    assert _failures(metrics) == 1
    assert not tier.contains(k)
    assert tier.get(k) is None
    assert _failures(metrics) == 1
    s = tier.stats()
    assert (s.free, s.used, s.quarantined) == (2, 0, 0)
    assert metrics.value("tier_residency_bytes", tier="memory") == 0


@pytest.mark.parametrize("reader", ["get", "view"])
def test_corruption_seen_by_get_and_view(metrics: Metrics, reader: str):
    tier = _tier(metrics, 2)
    k = key_of(0)
    assert tier.put(k, payload_of(0, SLOT))
    tier.lease("L", [k])
    tier.view(k)[0] ^= 0x80
    assert getattr(tier, reader)(k) is None
    assert _failures(metrics) == 1
    # still leased, so the slot is held back (a holder of the old view may still read it)
    assert tier.stats().quarantined == 1 and tier.stats().free == 1
    tier.release("L")
    s = tier.stats()
    assert (s.free, s.used, s.quarantined) == (2, 0, 0)


def test_quarantined_slot_returns_when_its_lease_expires(metrics: Metrics, clock: FakeClock):
    tier = _tier(metrics, 1, clock, lease_ttl_s=5.0)
    k = key_of(0)
    assert tier.put(k, payload_of(0, SLOT))
    tier.lease("L", [k])
    tier.view(k)[1] ^= 0xFF
    assert tier.get(k) is None
    assert not tier.put(key_of(1), payload_of(1, SLOT))  # its only slot is quarantined
    assert _all_pinned(metrics) == 1
    clock.advance(5.0)
    assert tier.put(key_of(1), payload_of(1, SLOT))
    assert tier.get(key_of(1)) == payload_of(1, SLOT)
    assert metrics.value("lease_expiries_total") == 1


def test_verify_reads_off_skips_the_check(metrics: Metrics):
    tier = _tier(metrics, 1, verify_reads=False)
    k = key_of(0)
    assert tier.put(k, bytes(SLOT))
    tier.lease("L", [k])
    tier.view(k)[3] = 9
    got = tier.get(k)
    assert got is not None and got[3] == 9
    assert _failures(metrics) == 0


def test_view_needs_a_lease(metrics: Metrics):
    tier = _tier(metrics, 1)
    k = key_of(0)
    assert tier.put(k, payload_of(0, SLOT))
    with pytest.raises(ValueError, match="call lease"):
        tier.view(k)
    assert tier.view(key_of(1)) is None


# ---- leases and pinning ----------------------------------------------------------------------


def test_lease_counts_leading_keys_and_pins_every_present_one(metrics: Metrics):
    tier = _tier(metrics, 3)
    a, b, c, d = (key_of(i) for i in range(4))
    for k in (a, c):
        assert tier.put(k, payload_of(0, 8))
    assert tier.lease("L", [a, b, c]) == 1  # b is missing: one leading key, a and c pinned
    assert tier.put(b, payload_of(1, 8))  # the last free slot
    assert tier.put(d, payload_of(3, 8))  # recent order a, c, b: a and c are pinned
    assert tier.contains(a) and tier.contains(c) and tier.contains(d)
    assert not tier.contains(b)


def test_all_slots_pinned_put_fails_counted(metrics: Metrics):
    tier = _tier(metrics, 2)
    a, b, c = key_of(0), key_of(1), key_of(2)
    assert tier.put(a, payload_of(0, SLOT)) and tier.put(b, payload_of(1, SLOT))
    assert tier.lease("L", [a, b]) == 2
    assert not tier.put(c, payload_of(2, SLOT))
    assert tier.reserve(c) is None
    assert _all_pinned(metrics) == 2
    assert metrics.value("evictions_total", tier="memory") == 0
    assert tier.contains(a) and tier.contains(b) and not tier.contains(c)
    tier.release("L")
    tier.release("L")
    assert metrics.value("lease_double_releases_total") == 1
    assert tier.put(c, payload_of(2, SLOT))
    assert not tier.contains(a) and tier.contains(b)
    assert metrics.value("evictions_total", tier="memory") == 1


def test_empty_lease_releases_without_double_count(metrics: Metrics):
    tier = _tier(metrics, 1)
    assert tier.lease("miss", [key_of(0)]) == 0
    tier.release("miss")
    assert metrics.value("lease_releases_total") == 1
    assert metrics.value("lease_double_releases_total") == 0


def test_expire_leases_unpins(metrics: Metrics, clock: FakeClock):
    tier = _tier(metrics, 1, clock, lease_ttl_s=2.0)
    assert tier.put(key_of(0), payload_of(0, 8))
    tier.lease("L", [key_of(0)])
    clock.advance(1.0)
    assert tier.expire_leases() == 0
    clock.advance(1.0)
    assert tier.expire_leases() == 1
    assert metrics.value("lease_expiries_total") == 1
    assert tier.put(key_of(1), payload_of(1, 8))
    assert not tier.contains(key_of(0))


def test_residency_gauge_equals_used_slots(metrics: Metrics):
    tier = _tier(metrics, 3)

    def gauge() -> float:
        return metrics.value("tier_residency_bytes", tier="memory")

    for i in range(5):
        assert tier.put(key_of(i), payload_of(i, 1 + i))
        assert gauge() == tier.stats().used * SLOT == min(i + 1, 3) * SLOT
    tier.close()
    assert gauge() == 0
    with pytest.raises(RuntimeError, match="closed"):
        tier.put(key_of(9), b"x")
    with pytest.raises(RuntimeError, match="closed"):
        tier.contains(key_of(9))


# ---- reserve / commit / abort ----------------------------------------------------------------


def test_reserve_commit_publishes_the_written_slot(metrics: Metrics):
    tier = _tier(metrics, 2)
    k, data = key_of(0), payload_of(0, SLOT)
    slot = tier.reserve(k)
    assert slot is not None and slot.dtype == torch.uint8 and slot.numel() == SLOT
    slot.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    assert not tier.contains(k) and tier.stats().reserved == 1
    assert tier.reserve(k) is None  # one reservation per key
    tier.commit(k)
    assert tier.get(k) == data
    assert tier.stats().reserved == 0
    assert tier.reserve(k) is None  # resident already
    with pytest.raises(ValueError, match="not reserved"):
        tier.commit(k)


@pytest.mark.parametrize("cached", [4, 1])
def test_a_reused_slots_view_is_made_without_a_torch_op(
    metrics: Metrics, cached: int, monkeypatch: pytest.MonkeyPatch
):
    """A slot's view is sliced once and kept (each slice is a torch op, where a thread running
    Python beside the copy lanes takes the GIL); past `_VIEWS` slots it is sliced each time.
    Either way the view is the slot's bytes."""
    import kvtier.store.memory as memory
    from tests.torch_ops import TorchOps

    monkeypatch.setattr(memory, "_VIEWS", cached)
    tier = _tier(metrics, 2)
    for i in range(2):  # slot 0, then slot 1 (beyond the cache when it holds one)
        k, data = key_of(i), payload_of(i, SLOT)
        slot = tier.reserve(k)
        assert slot is not None
        slot.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        tier.commit(k)
        tier.delete(k)
        with TorchOps() as seen:
            again = tier.reserve(k)  # the same slot, handed out again
        assert again is not None and again.data_ptr() == slot.data_ptr()
        assert bytes(again.numpy()) == data  # forget does not clear the bytes
        sliced = i >= cached
        assert (seen.ops != []) == sliced, (i, seen.ops)
        again[:].copy_(torch.frombuffer(bytearray(payload_of(9, SLOT)), dtype=torch.uint8))
        tier.commit(k)
        with tier.pinned_view(k) as view:
            assert view is not None and bytes(view.numpy()) == payload_of(9, SLOT)
        # k stays resident: the next key takes the next slot


def test_commit_with_length_and_abort(metrics: Metrics):
    tier = _tier(metrics, 2)
    a, b = key_of(0), key_of(1)
    view = tier.reserve(a)
    view[:3].copy_(torch.tensor([1, 2, 3], dtype=torch.uint8))
    tier.commit(a, 3)
    assert tier.get(a) == b"\x01\x02\x03"
    assert tier.reserve(b) is not None
    assert tier.stats().free == 0
    tier.abort(b)
    s = tier.stats()
    assert (s.free, s.used, s.reserved) == (1, 1, 0)
    assert not tier.contains(b)
    with pytest.raises(ValueError, match="not reserved"):
        tier.abort(b)
    with pytest.raises(ValueError, match=r"nbytes=65 must lie in \[0, 64\]"):
        tier.commit(a, SLOT + 1)


def test_put_racing_a_reservation_keeps_one_copy(metrics: Metrics):
    tier = _tier(metrics, 3)
    k = key_of(0)
    view = tier.reserve(k)
    assert tier.put(k, payload_of(1, SLOT))
    view.fill_(0)
    tier.commit(k)  # the put published first; the reserved slot goes back
    assert tier.get(k) == payload_of(1, SLOT)
    s = tier.stats()
    assert (s.free, s.used, s.reserved) == (2, 1, 0)


# ---- threads ---------------------------------------------------------------------------------


def test_concurrent_writers_and_readers_never_see_wrong_bytes(metrics: Metrics):
    tier = MemoryTier(4096, 6 * 4096, NS, metrics, pin_memory=False)
    keys = [key_of(i) for i in range(16)]
    datas = [payload_of(i, 4096) for i in range(16)]
    errors: list[str] = []
    hits = [0]

    def writer(offset: int) -> None:
        for n in range(600):
            i = (n * 7 + offset) % 16
            if n % 3:
                tier.put(keys[i], datas[i])
            else:
                view = tier.reserve(keys[i])
                if view is not None:
                    view.copy_(torch.frombuffer(bytearray(datas[i]), dtype=torch.uint8))
                    tier.commit(keys[i])

    def reader(offset: int) -> None:
        dst = torch.empty(4096, dtype=torch.uint8)
        for n in range(900):
            i = (n * 5 + offset) % 16
            if n % 2 and tier.read_into(keys[i], dst):
                ok = bytes(dst.numpy()) == datas[i]
            elif (got := tier.get(keys[i])) is not None:
                ok = got == datas[i]
            else:
                continue
            hits[0] += 1
            if not ok:
                errors.append(f"wrong bytes for key {i}")

    threads = [threading.Thread(target=writer, args=(o,)) for o in (0, 3)]
    threads += [threading.Thread(target=reader, args=(o,)) for o in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert hits[0] > 0
    assert _failures(metrics) == 0
    s = tier.stats()
    assert s.free + s.used == 6 and s.reserved == 0 and s.quarantined == 0
    assert len(set(tier._index.values())) == s.used


# ---- the model -------------------------------------------------------------------------------

# A forest over KEYS: each key's parent in its chain (None: a head). Chains are root-to-node paths.
KEYS = [key_of(i) for i in range(7)]
PARENT = {0: None, 1: 0, 2: 1, 3: 2, 4: 0, 5: None, 6: 5}
PARENT_KEY = {KEYS[i]: (KEYS[p] if p is not None else b"") for i, p in PARENT.items()}


def _chain(i: int) -> list[bytes]:
    path = []
    node: int | None = i
    while node is not None:
        path.append(KEYS[node])
        node = PARENT[node]
    return path[::-1]


CHAINS = [_chain(i) for i in range(len(KEYS))]
IDS = ["l0", "l1", "l2", "l3"]
SLOTS = 4
GHOSTS = 0.5  # 2 ghosts per list
TTL = 10.0
MAX_LEASES = 3


class Model:
    """Chain-aware ARC with leases in plain Python lists: what the tier must do, step by step.

    Lists are ordered oldest first; a victim is the first key of the list ARC picks (then of the
    other) that no resident key names as its parent and no lease holds."""

    def __init__(self) -> None:
        self.now = 0.0
        self.clock = 0
        self.last_walk = 0
        self.lists: tuple[list[bytes], list[bytes]] = ([], [])  # recent, frequent
        self.ghosts: tuple[list[bytes], list[bytes]] = ([], [])
        self.target = 0.0
        self.parent: dict[bytes, bytes] = {}
        self.gen: dict[bytes, int] = {}
        self.data: dict[bytes, bytes] = {}
        self.leases: OrderedDict[str, tuple[float, list[bytes]]] = OrderedDict()
        self.evictions = self.all_pinned = 0
        self.released = self.expired = self.doubles = 0
        self.evicted_with_children = 0

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def pinned(self) -> set[bytes]:
        return {k for _, keys in self.leases.values() for k in keys}

    def expire(self) -> None:
        while self.leases and next(iter(self.leases.values()))[0] <= self.now:
            self.leases.popitem(last=False)
            self.expired += 1

    def children(self, key: bytes) -> list[bytes]:
        return [k for k in self.data if self.parent.get(k) == key]

    def which(self, key: bytes) -> int:
        return 0 if key in self.lists[0] else 1

    def reference(self, key: bytes, gen: int) -> None:
        self.lists[self.which(key)].remove(key)
        self.lists[1].append(key)
        self.gen[key] = gen

    def link(self, key: bytes, parent: bytes) -> None:
        if parent and key in self.data and key not in self.parent:
            self.parent[key] = parent

    def touch(self, keys: list[bytes]) -> None:
        prev = b""
        for k in keys:
            self.link(k, prev)
            prev = k
        gen = self.tick()
        for k in reversed(keys):
            if k in self.data:
                self.reference(k, gen)

    def adapt(self, direction: int) -> None:
        b1, b2 = len(self.ghosts[0]), len(self.ghosts[1])
        if direction > 0:
            self.target = min(SLOTS, self.target + (max(1.0, b2 / b1) if b1 else 1.0))
        else:
            self.target = max(0.0, self.target - (max(1.0, b1 / b2) if b2 else 1.0))

    def admit(self, key: bytes, payload: bytes, parent: bytes) -> None:
        where = 0
        for w, direction in ((0, +1), (1, -1)):
            if key in self.ghosts[w]:
                self.adapt(direction)
                self.ghosts[w].remove(key)
                where = 1
        self.data[key] = payload
        self.lists[where].append(key)
        self.gen[key] = self.tick()
        if parent:
            self.parent[key] = parent
        # the chain above a new chunk is used by the save that wrote it, up to where the
        # previous such walk reached
        up = self.parent.get(key)
        if up is not None and up in self.data:
            gen = self.tick()
            while up is not None and up in self.data and self.gen[up] != self.last_walk:
                self.reference(up, gen)
                up = self.parent.get(up)
            self.last_walk = gen

    def allocate(self, parent: bytes = b"") -> bool:
        if len(self.data) < SLOTS:
            return True
        # the slot for a child never comes from its parent
        pinned = self.pinned() | {parent}
        over = len(self.lists[0]) > self.target or not self.lists[1]
        for w in (0, 1) if over else (1, 0):
            for k in self.lists[w]:
                if k not in pinned and not self.children(k):
                    self.lists[w].remove(k)
                    del self.data[k], self.gen[k]
                    self.parent.pop(k, None)
                    self.ghosts[w].append(k)
                    del self.ghosts[w][: -int(GHOSTS * SLOTS)]
                    self.evictions += 1
                    return True
        self.all_pinned += 1
        return False

    def put(self, key: bytes, payload: bytes, parent: bytes) -> bool:
        self.expire()
        if key in self.data:
            self.link(key, parent)
            self.touch([key])
            return True
        if not self.allocate(parent):
            return False
        self.admit(key, payload, parent)
        return True

    def get(self, key: bytes) -> bytes | None:
        return self.data.get(key)

    def lookup_prefix(self, keys: list[bytes]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.data:
            n += 1
        self.touch(keys[:n])
        return n

    def lease(self, lid: str, keys: list[bytes]) -> int:
        present = [k for k in keys if k in self.data]
        leading = 0
        while leading < len(keys) and keys[leading] in self.data:
            leading += 1
        self.expire()
        if lid in self.leases:
            held = self.leases.pop(lid)[1] + present
        else:
            held = present
            while len(self.leases) >= MAX_LEASES:
                self.leases.popitem(last=False)
                self.expired += 1
        self.leases[lid] = (self.now + TTL, held)
        return leading

    def release(self, lid: str) -> None:
        if lid in self.leases:
            del self.leases[lid]
            self.released += 1
        else:
            self.doubles += 1


class MemoryTierMachine(RuleBasedStateMachine):
    """The tier and the model take the same steps and must agree after every one; no step
    evicts a chunk that a resident chunk names as its parent."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Model()
        self.m = Metrics()
        self.tier = MemoryTier(
            SLOT,
            SLOTS * SLOT,
            NS,
            self.m,
            lease_ttl_s=TTL,
            max_leases=MAX_LEASES,
            ghost_fraction=GHOSTS,
            clock=lambda: self.model.now,
            pin_memory=False,
        )
        self.before: set[bytes] = set()

    def _resident(self) -> set[bytes]:
        return {k for k in KEYS if self.tier.contains(k)}

    @rule(key=st.sampled_from(KEYS), payload=st.binary(max_size=SLOT))
    def put(self, key: bytes, payload: bytes) -> None:
        parent = PARENT_KEY[key]
        assert self.tier.put(key, payload, parent) == self.model.put(key, payload, parent)

    @rule(
        key=st.sampled_from(KEYS),
        payload=st.binary(min_size=1, max_size=SLOT),
        at_reserve=st.booleans(),
    )
    def reserve_commit(self, key: bytes, payload: bytes, at_reserve: bool) -> None:
        parent = PARENT_KEY[key]
        view = self.tier.reserve(key, parent) if at_reserve else self.tier.reserve(key)
        m = self.model
        m.expire()
        if key in m.data:
            m.touch([key])
            assert view is None
            return
        assert (view is not None) == m.allocate(parent if at_reserve else b"")
        if view is None:
            return
        view[: len(payload)].copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        self.tier.commit(key, len(payload), parent=b"" if at_reserve else parent)
        m.admit(key, payload, parent)
        assert self.tier.parent_of(key) == parent

    @rule(key=st.sampled_from(KEYS))
    def reserve_abort(self, key: bytes) -> None:
        view = self.tier.reserve(key)
        m = self.model
        m.expire()
        if key in m.data:
            m.touch([key])
            assert view is None
            return
        assert (view is not None) == m.allocate()
        if view is not None:
            self.tier.abort(key)

    @rule(key=st.sampled_from(KEYS))
    def get(self, key: bytes) -> None:
        assert self.tier.get(key) == self.model.get(key)

    @rule(key=st.sampled_from(KEYS))
    def read_into(self, key: bytes) -> None:
        want = self.model.get(key)
        dst = torch.zeros(len(want) if want is not None else 1, dtype=torch.uint8)
        assert self.tier.read_into(key, dst) == (want is not None)
        if want is not None:
            assert bytes(dst.numpy()) == want

    @rule(chain=st.sampled_from(CHAINS))
    def lookup_prefix(self, chain: list[bytes]) -> None:
        assert self.tier.lookup_prefix(chain) == self.model.lookup_prefix(chain)

    @rule(lid=st.sampled_from(IDS), keys=st.lists(st.sampled_from(KEYS), max_size=4))
    def lease(self, lid: str, keys: list[bytes]) -> None:
        assert self.tier.lease(lid, keys) == self.model.lease(lid, keys)

    @rule(lid=st.sampled_from(IDS))
    def release(self, lid: str) -> None:
        self.tier.release(lid)
        self.model.release(lid)

    @rule(dt=st.sampled_from([1.0, 4.0, 10.0]))
    def advance(self, dt: float) -> None:
        self.model.now += dt

    @precondition(lambda self: self.model.leases)
    @rule()
    def expire(self) -> None:
        before = self.model.pinned()
        self.model.expire()
        assert self.tier.expire_leases() == len(before - self.model.pinned())

    @invariant()
    def agrees_with_model(self) -> None:
        m, tier = self.model, self.tier
        resident = self._resident()
        assert resident == set(m.data)
        # an eviction takes leaves only: no chunk resident across the step names an evicted
        # key as its parent (a child written after its parent left is a new orphan, not this)
        gone = self.before - resident
        assert not {k for k in resident & self.before if PARENT_KEY[k] in gone}
        self.before = resident
        s = tier.stats()
        assert s.free + s.used == SLOTS and s.reserved == 0 and s.quarantined == 0
        assert (s.used, s.recent, s.frequent) == (len(m.data), len(m.lists[0]), len(m.lists[1]))
        # never two keys in one slot
        assert len(set(tier._index.values())) == len(tier._index)
        # a leased key is never evicted
        assert m.pinned() <= set(m.data)
        assert self.m.value("tier_residency_bytes", tier="memory") == len(m.data) * SLOT
        assert self.m.value("evictions_total", tier="memory") == m.evictions
        assert _all_pinned(self.m) == m.all_pinned
        assert self.m.value("lease_releases_total") == m.released
        assert self.m.value("lease_expiries_total") == m.expired
        assert self.m.value("lease_double_releases_total") == m.doubles


MemoryTierMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=40, deadline=None
)
TestMemoryTierMachine = MemoryTierMachine.TestCase
