"""MemoryTier: slots, SLRU eviction, leases, verified reads, reserve/commit, threads."""

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
        ({"protected_fraction": 1.5}, r"protected_fraction=1.5 must lie in \[0, 1\]"),
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


def test_lookup_prefix_counts_leading_keys_and_promotes_them(metrics: Metrics):
    tier = _tier(metrics, 4, protected_fraction=0.5)
    keys = [key_of(i) for i in range(4)]
    for k in keys[:2] + keys[3:]:
        assert tier.put(k, payload_of(0, 8))
    assert tier.lookup_prefix(keys) == 2
    assert tier.lookup_prefix([keys[2], keys[0]]) == 0
    assert tier.stats().protected == 2 and tier.stats().probation == 1


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
    assert tier.put(d, payload_of(3, 8))  # probation LRU order a, c, b: a and c are pinned
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

KEYS = [key_of(i) for i in range(7)]
IDS = ["l0", "l1", "l2", "l3"]
SLOTS = 4
PROTECTED = 0.5  # 2 protected places
TTL = 10.0
MAX_LEASES = 3


class Model:
    """SLRU with leases in plain Python: what the tier must do, step by step."""

    def __init__(self) -> None:
        self.now = 0.0
        self.cap = int(PROTECTED * SLOTS)
        self.prob: OrderedDict[bytes, None] = OrderedDict()
        self.prot: OrderedDict[bytes, None] = OrderedDict()
        self.data: dict[bytes, bytes] = {}
        self.leases: OrderedDict[str, tuple[float, list[bytes]]] = OrderedDict()
        self.evictions = self.all_pinned = 0
        self.released = self.expired = self.doubles = 0

    def pinned(self) -> set[bytes]:
        return {k for _, keys in self.leases.values() for k in keys}

    def expire(self) -> None:
        while self.leases and next(iter(self.leases.values()))[0] <= self.now:
            self.leases.popitem(last=False)
            self.expired += 1

    def hit(self, key: bytes) -> None:
        if key in self.prot:
            self.prot.move_to_end(key)
            return
        del self.prob[key]
        self.prot[key] = None
        while len(self.prot) > self.cap:
            self.prob[self.prot.popitem(last=False)[0]] = None

    def touch(self, key: bytes) -> None:
        (self.prot if key in self.prot else self.prob).move_to_end(key)

    def allocate(self) -> bool:
        if len(self.data) < SLOTS:
            return True
        pinned = self.pinned()
        for seg in (self.prob, self.prot):
            for k in seg:
                if k not in pinned:
                    del seg[k]
                    del self.data[k]
                    self.evictions += 1
                    return True
        self.all_pinned += 1
        return False

    def put(self, key: bytes, payload: bytes) -> bool:
        self.expire()
        if key in self.data:
            self.touch(key)
            return True
        if not self.allocate():
            return False
        self.data[key] = payload
        self.prob[key] = None
        return True

    def get(self, key: bytes) -> bytes | None:
        if key not in self.data:
            return None
        self.hit(key)
        return self.data[key]

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
    """The tier and the model take the same steps and must agree after every one."""

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
            protected_fraction=PROTECTED,
            clock=lambda: self.model.now,
            pin_memory=False,
        )

    @rule(key=st.sampled_from(KEYS), payload=st.binary(max_size=SLOT))
    def put(self, key: bytes, payload: bytes) -> None:
        assert self.tier.put(key, payload) == self.model.put(key, payload)

    @rule(key=st.sampled_from(KEYS), payload=st.binary(min_size=1, max_size=SLOT))
    def reserve_commit(self, key: bytes, payload: bytes) -> None:
        view = self.tier.reserve(key)
        stored = self.model.put(key, payload)
        if view is None:
            # resident already (refreshed) or no slot: the model agrees on which
            assert self.tier.contains(key) == stored
            return
        assert stored
        view[: len(payload)].copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        self.tier.commit(key, len(payload))

    @rule(key=st.sampled_from(KEYS))
    def reserve_abort(self, key: bytes) -> None:
        view = self.tier.reserve(key)
        m = self.model
        m.expire()
        if key in m.data:
            m.touch(key)
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

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=4))
    def lookup_prefix(self, keys: list[bytes]) -> None:
        n = 0
        while n < len(keys) and self.model.get(keys[n]) is not None:
            n += 1
        assert self.tier.lookup_prefix(keys) == n

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
        assert {k for k in KEYS if tier.contains(k)} == set(m.data)
        s = tier.stats()
        assert s.free + s.used == SLOTS and s.reserved == 0 and s.quarantined == 0
        assert (s.used, s.probation, s.protected) == (len(m.data), len(m.prob), len(m.prot))
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
