"""TierStack over a real MemoryTier and DiskTier: prefix lookup across tiers, leases, verified
reads with fall-through and promotion, bounded write-behind that sheds instead of blocking."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch

from kvtier.metrics import Metrics
from kvtier.store.base import TierBase
from kvtier.store.disk import DiskTier
from kvtier.store.memory import MemoryTier
from kvtier.store.record import HEADER_BYTES
from kvtier.store.stack import TierStack
from tests.redis_local import wait_for

Key = Callable[[int], bytes]
Payload = Callable[[int, int], bytes]

SIZE = 2048
WAIT_S = 10.0


class BlockingTier(TierBase):
    """A lower tier whose put() waits on `gate`, so a test controls when write-behind drains."""

    name = "blocking"

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.stored: dict[bytes, bytes] = {}
        self.batches: list[int] = []

    def contains(self, key: bytes) -> bool:
        return key in self.stored

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        self.batches.append(len(keys))
        return [k in self.stored for k in keys]

    def get(self, key: bytes) -> bytes | None:
        return self.stored.get(key)

    def put(self, key: bytes, payload: bytes | memoryview, parent: bytes = b"") -> bool:
        self.entered.set()
        if not self.gate.wait(WAIT_S):
            raise AssertionError("test never opened the gate")
        self.stored[key] = bytes(payload)
        return True

    def lease(self, lease_id: str, keys: Sequence[bytes], counted: bool = True) -> int:
        return sum(k in self.stored for k in keys)

    def release(self, lease_id: str) -> None:
        return None

    def delete(self, key: bytes) -> bool:
        return self.stored.pop(key, None) is not None

    def residency_bytes(self) -> int:
        return sum(map(len, self.stored.values()))

    def close(self) -> None:
        return None


class BrokenTier(BlockingTier):
    """A lower tier whose put() raises, as a buggy backend would."""

    name = "broken"

    def put(self, key: bytes, payload: bytes | memoryview, parent: bytes = b"") -> bool:
        raise RuntimeError("backend exploded")


def _memory(namespace: bytes, metrics: Metrics, slots: int, clock=None) -> MemoryTier:
    extra = {} if clock is None else {"clock": clock}
    return MemoryTier(SIZE, slots * SIZE, namespace, metrics, pin_memory=False, **extra)


@pytest.fixture
def disk(tmp_path: Path, namespace: bytes, metrics: Metrics) -> DiskTier:
    return DiskTier(tmp_path, 64 * (SIZE + HEADER_BYTES), namespace, metrics)


@pytest.fixture
def stack(namespace: bytes, metrics: Metrics, disk: DiskTier) -> Iterator[TierStack]:
    s = TierStack(_memory(namespace, metrics, 8), [disk], metrics, queue_depth=16)
    yield s
    s.close()


def _dst() -> torch.Tensor:
    return torch.zeros(SIZE, dtype=torch.uint8)


def test_tiers_lists_names_top_down(stack: TierStack):
    assert stack.tiers == ["memory", "disk"]


def test_lookup_counts_longest_prefix_across_tiers(
    stack: TierStack, disk: DiskTier, metrics: Metrics, make_key: Key, make_payload: Payload
):
    keys = [make_key(i) for i in range(4)]
    assert stack.memory.put(keys[0], make_payload(0, SIZE))
    assert disk.put(keys[1], make_payload(1, SIZE))
    assert stack.memory.put(keys[3], make_payload(3, SIZE))

    assert stack.lookup(keys, None) == 2
    assert stack.lookup(keys, "req-1") == 2
    assert stack.lookup(keys[2:], None) == 0
    assert stack.lookup([], "req-empty") == 0
    assert [stack.holder(k) for k in keys] == ["memory", "disk", None, "memory"]
    # lookups are counted by the lookup server, not here
    assert metrics.value("lookups_total") == 0
    assert metrics.value("lookup_hit_tokens_total") == 0


def test_lower_tier_hit_is_promoted_to_memory(
    stack: TierStack, disk: DiskTier, metrics: Metrics, make_key: Key, make_payload: Payload
):
    k, data = make_key(1), make_payload(1, SIZE)
    assert disk.put(k, data)
    assert not stack.memory.contains(k)

    dst = _dst()
    assert stack.read_into(k, dst) == "disk"
    assert bytes(dst.numpy()) == data
    assert stack.memory.contains(k)
    assert metrics.value("tier_hits_total", tier="disk") == 1

    dst2 = _dst()
    assert stack.read_into(k, dst2) == "memory"
    assert bytes(dst2.numpy()) == data
    assert metrics.value("tier_hits_total", tier="memory") == 1

    assert stack.read_into(make_key(99), _dst()) is None
    assert metrics.total("tier_hits_total") == 2


def test_read_into_fills_a_shaped_tensor(stack: TierStack, make_key: Key, make_payload: Payload):
    k, data = make_key(2), make_payload(2, SIZE)
    assert stack.put(k, data)
    dst = torch.zeros(SIZE // 4, dtype=torch.float32)
    assert stack.read_into(k, dst) == "memory"
    assert bytes(dst.view(torch.uint8).numpy()) == data


def test_write_behind_lands_on_disk(
    stack: TierStack, disk: DiskTier, metrics: Metrics, make_key: Key, make_payload: Payload
):
    for i in range(5):
        assert stack.put(make_key(i), make_payload(i, SIZE))
    assert stack.flush(WAIT_S)
    assert stack.pending_writes() == 0
    for i in range(5):
        assert disk.contains(make_key(i))
        assert bytes(disk.get(make_key(i)) or b"") == make_payload(i, SIZE)
    assert metrics.value("queue_depth", queue="write_behind") == 0
    assert metrics.total("dropped_writes_total") == 0
    # the write-behind pin on each memory slot was released again, uncounted: the lease
    # metrics count lookups only
    assert stack.memory.stats().leases == 0
    assert metrics.value("lease_releases_total") == 0


def test_reserve_commit_writes_behind(
    stack: TierStack, disk: DiskTier, make_key: Key, make_payload: Payload
):
    k, data = make_key(7), make_payload(7, SIZE)
    slot = stack.reserve(k)
    assert slot is not None
    slot.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    stack.commit(k)
    assert stack.flush(WAIT_S)
    assert bytes(disk.get(k) or b"") == data

    k2 = make_key(8)
    assert stack.reserve(k2) is not None
    stack.abort(k2)
    assert not stack.memory.contains(k2)


def test_full_queue_drops_and_counts_without_blocking(
    namespace: bytes, metrics: Metrics, make_key: Key, make_payload: Payload
):
    slow = BlockingTier()
    s = TierStack(_memory(namespace, metrics, 8), [slow], metrics, queue_depth=1)
    try:
        assert s.put(make_key(0), make_payload(0, SIZE))
        assert slow.entered.wait(WAIT_S)  # the writer holds job 0 inside the blocked put
        assert s.put(make_key(1), make_payload(1, SIZE))  # fills the one queue slot
        assert metrics.value("queue_depth", queue="write_behind") == 1

        returned: list[bool] = []
        caller = threading.Thread(target=lambda: returned.append(s.put(make_key(2), b"x" * SIZE)))
        caller.start()
        caller.join(WAIT_S)
        assert not caller.is_alive(), "put blocked on a full write-behind queue"
        assert returned == [True]  # memory took it; only the lower-tier copy was shed
        assert metrics.value("dropped_writes_total", tier="blocking", reason="queue_full") == 1
        assert not s.flush(0.01)  # still blocked: flush reports it instead of hanging

        slow.gate.set()
        assert s.flush(WAIT_S)
        assert sorted(slow.stored) == sorted([make_key(0), make_key(1)])
        assert slow.stored[make_key(1)] == make_payload(1, SIZE)
        assert s.memory.contains(make_key(2))
        # every write-behind pin (including the shed one) went back
        assert s.memory.stats().leases == 0
        assert metrics.value("lease_releases_total") == 0
        assert s.memory.stats().used == 3
    finally:
        slow.gate.set()
        s.close()


def test_a_save_waits_for_the_write_behind_to_unpin_a_slot(
    namespace: bytes, metrics: Metrics, make_key: Key, make_payload: Payload
):
    """A memory tier full of chunks still being written below: `reserve` waits for the writer
    instead of failing (CI lost every save of a test this way: a starved writer, a 1 MiB
    memory tier, no chunk reached the disk), and gets the slot the finished write unpinned."""
    slow = BlockingTier()
    s = TierStack(_memory(namespace, metrics, 2), [slow], metrics, write_wait_s=WAIT_S)
    try:
        assert s.put(make_key(0), make_payload(0, SIZE))
        assert s.put(make_key(1), make_payload(1, SIZE))
        assert slow.entered.wait(WAIT_S)  # both slots pinned: one in the put, one queued
        got: list[torch.Tensor | None] = []
        saver = threading.Thread(target=lambda: got.append(s.reserve(make_key(2))))
        saver.start()
        # the first try found every slot pinned (counted once); the saver now waits
        wait_for(
            lambda: metrics.value("store_failures_total", tier="memory", reason="all_pinned") == 1,
            WAIT_S,
            "the save's first try",
        )
        assert saver.is_alive() and not got, "reserve gave up instead of waiting for a write"
        slow.gate.set()
        saver.join(WAIT_S)
        assert len(got) == 1 and got[0] is not None
        got[0].copy_(torch.frombuffer(bytearray(make_payload(2, SIZE)), dtype=torch.uint8))
        s.commit(make_key(2))
        assert s.flush(WAIT_S)
        assert slow.stored[make_key(2)] == make_payload(2, SIZE)
        assert metrics.value("slot_waits_total", outcome="slot") == 1
        # the retries are not counted again as failures
        assert metrics.value("store_failures_total", tier="memory", reason="all_pinned") == 1
    finally:
        slow.gate.set()
        s.close()


def test_a_write_finishing_right_after_a_failed_try_is_not_missed(
    namespace: bytes, metrics: Metrics, make_key: Key, make_payload: Payload
):
    """The last pending write finishes between the failed try and the check for pending
    writes: nothing is pending any more, yet the slot it unpinned is taken, not given up."""
    slow = BlockingTier()
    s = TierStack(_memory(namespace, metrics, 1), [slow], metrics, write_wait_s=WAIT_S)
    memory_reserve = s.memory.reserve

    def reserve_then_finish_the_write(*args, **kwargs):
        slot = memory_reserve(*args, **kwargs)
        if slot is None and not slow.gate.is_set():
            slow.gate.set()
            assert s.flush(WAIT_S)  # the write finished: nothing pending, its slot unpinned
        return slot

    try:
        assert s.put(make_key(0), make_payload(0, SIZE))
        assert slow.entered.wait(WAIT_S)
        s.memory.reserve = reserve_then_finish_the_write  # type: ignore[method-assign]
        assert s.reserve(make_key(1)) is not None
        assert metrics.value("slot_waits_total", outcome="slot") == 1
    finally:
        slow.gate.set()
        s.close()


def test_a_slot_wait_is_bounded_and_skipped_when_no_write_is_pending(
    namespace: bytes, metrics: Metrics, make_key: Key, make_payload: Payload
):
    """The wait ends after `write_wait_s` (counted `none`); slots pinned by lookups while no
    write is pending are not waited for; close() ends a wait at once."""
    slow = BlockingTier()
    s = TierStack(_memory(namespace, metrics, 2), [slow], metrics, write_wait_s=0.05)
    try:
        assert s.put(make_key(0), make_payload(0, SIZE))
        assert s.put(make_key(1), make_payload(1, SIZE))
        assert slow.entered.wait(WAIT_S)
        assert s.reserve(make_key(2)) is None
        assert metrics.value("slot_waits_total", outcome="none") == 1
        slow.gate.set()
        assert s.flush(WAIT_S)
        # pinned by a lookup's lease, nothing below left to write: no wait, nothing counted
        assert s.lookup([make_key(0), make_key(1)], "lookup-1") == 2
        assert s.reserve(make_key(3)) is None
        assert metrics.total("slot_waits_total") == 1
    finally:
        slow.gate.set()
        s.close()

    blocked, fresh = BlockingTier(), Metrics(rank=0)
    s = TierStack(_memory(namespace, fresh, 1), [blocked], fresh, write_wait_s=6 * WAIT_S)
    got: list[torch.Tensor | None] = []
    closer = threading.Thread(target=lambda: s.close(timeout_s=0.05))
    try:
        assert s.put(make_key(5), make_payload(5, SIZE))
        assert blocked.entered.wait(WAIT_S)
        saver = threading.Thread(target=lambda: got.append(s.reserve(make_key(6))))
        saver.start()
        wait_for(lambda: fresh.total("store_failures_total") == 1, WAIT_S, "the first try")
        closer.start()
        saver.join(WAIT_S)
        assert not saver.is_alive() and got == [None]  # the close woke it, well before 60 s
    finally:
        blocked.gate.set()
        closer.join(WAIT_S)


def test_slow_tier_outliving_the_lease_still_writes_correct_bytes(
    tmp_path: Path,
    namespace: bytes,
    metrics: Metrics,
    clock,
    make_key: Key,
    make_payload: Payload,
):
    slow = BlockingTier()
    disk = DiskTier(tmp_path, 16 * (SIZE + HEADER_BYTES), namespace, metrics)
    s = TierStack(_memory(namespace, metrics, 4, clock), [slow, disk], metrics)
    try:
        k, data = make_key(0), make_payload(0, SIZE)
        assert s.put(k, data)
        assert slow.entered.wait(WAIT_S)
        clock.advance(31.0)  # the write-behind lease outlives its 30 s deadline meanwhile
        assert s.memory.expire_leases() == 1
        slow.gate.set()
        assert s.flush(WAIT_S)
        assert slow.stored[k] == data
        assert bytes(disk.get(k) or b"") == data  # re-leased before the disk write
        assert metrics.value("lease_expiries_total") == 0  # internal pins are uncounted
        assert metrics.total("dropped_writes_total") == 0
        assert metrics.total("store_failures_total") == 0
    finally:
        slow.gate.set()
        s.close()


def test_memory_verification_failure_falls_through_to_disk(
    stack: TierStack, disk: DiskTier, metrics: Metrics, make_key: Key, make_payload: Payload
):
    k, data = make_key(3), make_payload(3, SIZE)
    slot = stack.reserve(k)
    assert slot is not None
    slot.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    stack.commit(k)
    assert stack.flush(WAIT_S)
    assert disk.contains(k)

    slot[10] ^= 0xFF  # rot the memory copy behind the tier's back
    dst = _dst()
    assert stack.read_into(k, dst) == "disk"
    assert bytes(dst.numpy()) == data
    assert metrics.value("verify_failures_total", tier="memory", reason="checksum_mismatch") == 1
    assert metrics.value("tier_hits_total", tier="disk") == 1
    # the good copy was promoted back, so the next read is a memory hit again
    assert stack.read_into(k, _dst()) == "memory"


def test_corrupt_disk_record_is_a_miss(
    stack: TierStack, disk: DiskTier, metrics: Metrics, make_key: Key, make_payload: Payload
):
    k = make_key(4)
    assert disk.put(k, make_payload(4, SIZE))
    h = k.hex()
    path = disk.directory / h[:2] / f"{h}.kvr"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x01
    path.write_bytes(bytes(raw))
    dst = _dst()
    assert stack.read_into(k, dst) is None
    assert not dst.any()  # not a byte of a bad record reached the destination
    assert metrics.value("verify_failures_total", tier="disk", reason="tag_mismatch") == 1
    assert not stack.memory.contains(k)


def test_lookup_leases_prevent_eviction_until_released(
    namespace: bytes, metrics: Metrics, clock, make_key: Key, make_payload: Payload
):
    memory = _memory(namespace, metrics, 2, clock)
    s = TierStack(memory, [], metrics)
    try:
        a, b, c = make_key(0), make_key(1), make_key(2)
        assert s.put(a, make_payload(0, SIZE)) and s.put(b, make_payload(1, SIZE))
        assert s.lookup([a, b, c], "req-1") == 2

        assert s.put(c, make_payload(2, SIZE)) is False
        assert metrics.value("store_failures_total", tier="memory", reason="all_pinned") == 1
        assert memory.contains(a) and memory.contains(b)

        s.release("req-1")
        assert metrics.value("lease_releases_total") == 1
        assert s.put(c, make_payload(2, SIZE))
        assert memory.contains(c)

        s.release("req-1")  # a second release is a counted no-op
        assert metrics.value("lease_double_releases_total") == 1
        assert metrics.value("lease_releases_total") == 1
    finally:
        s.close()


def test_lookup_leases_disk_chunks_where_they_live(
    tmp_path: Path, namespace: bytes, metrics: Metrics, make_key: Key, make_payload: Payload
):
    record = SIZE + HEADER_BYTES
    disk = DiskTier(tmp_path, 2 * record, namespace, metrics)
    s = TierStack(_memory(namespace, metrics, 4), [disk], metrics)
    try:
        a, b, c = make_key(0), make_key(1), make_key(2)
        assert disk.put(a, make_payload(0, SIZE)) and disk.put(b, make_payload(1, SIZE))
        assert s.lookup([a, b], "req-1") == 2

        assert disk.put(c, make_payload(2, SIZE)) is False  # both disk chunks are leased
        assert disk.contains(a) and disk.contains(b)

        s.release("req-1")
        assert disk.put(c, make_payload(2, SIZE))
        assert disk.contains(c)
    finally:
        s.close()


def test_lookup_without_lease_pins_nothing(
    namespace: bytes, metrics: Metrics, make_key: Key, make_payload: Payload
):
    memory = _memory(namespace, metrics, 1)
    s = TierStack(memory, [], metrics)
    try:
        assert s.put(make_key(0), make_payload(0, SIZE))
        assert s.lookup([make_key(0)], None) == 1
        assert s.put(make_key(1), make_payload(1, SIZE))  # evicts chunk 0: nothing pinned it
        assert not memory.contains(make_key(0))
        assert metrics.value("evictions_total", tier="memory") == 1
    finally:
        s.close()


def test_broken_lower_tier_does_not_stop_write_behind(
    tmp_path: Path, namespace: bytes, metrics: Metrics, make_key: Key, make_payload: Payload
):
    disk = DiskTier(tmp_path, 16 * (SIZE + HEADER_BYTES), namespace, metrics)
    s = TierStack(_memory(namespace, metrics, 4), [BrokenTier(), disk], metrics)
    try:
        for i in range(3):
            assert s.put(make_key(i), make_payload(i, SIZE))
        assert s.flush(WAIT_S)
        assert metrics.value("store_failures_total", tier="broken", reason="error") == 3
        assert all(disk.contains(make_key(i)) for i in range(3))
    finally:
        s.close()


def test_close_drains_queued_writes(
    tmp_path: Path, namespace: bytes, metrics: Metrics, make_key: Key, make_payload: Payload
):
    disk = DiskTier(tmp_path, 16 * (SIZE + HEADER_BYTES), namespace, metrics)
    s = TierStack(_memory(namespace, metrics, 8), [disk], metrics)
    for i in range(6):
        assert s.put(make_key(i), make_payload(i, SIZE))
    s.close()
    # a fresh disk tier on the same directory sees every chunk written before close returned
    reopened = DiskTier(tmp_path, 16 * (SIZE + HEADER_BYTES), namespace, Metrics(rank=0))
    assert reopened.lookup_prefix([make_key(i) for i in range(6)]) == 6
    with pytest.raises(RuntimeError, match="closed"):
        s.put(make_key(9), make_payload(9, SIZE))


def test_bad_arguments_raise_clear_errors(namespace: bytes, metrics: Metrics, disk: DiskTier):
    memory = _memory(namespace, metrics, 2)
    with pytest.raises(ValueError, match="queue_depth"):
        TierStack(memory, [disk], metrics, queue_depth=0)
    with pytest.raises(ValueError, match="distinct"):
        TierStack(memory, [disk, disk], metrics)
    with pytest.raises(ValueError, match="Metrics"):
        TierStack(memory, [disk])
    for wait in (-1.0, float("nan"), 1e297):
        with pytest.raises(ValueError, match="write_wait_s"):
            TierStack(memory, [disk], metrics, write_wait_s=wait)
    s = TierStack(memory, [], metrics)
    with pytest.raises(ValueError, match="contiguous"):
        s.read_into(bytes(16), torch.zeros(SIZE * 2, dtype=torch.uint8)[::2])
    s.close()


def test_lower_tier_presence_is_asked_in_one_batch(
    namespace: bytes, metrics: Metrics, make_key: Key, make_payload: Payload
):
    # a remote tier answers a whole key list in one round trip, not one per chunk
    remote = BlockingTier()
    keys = [make_key(i) for i in range(8)]
    for i, k in enumerate(keys[:6]):
        remote.stored[k] = make_payload(i, SIZE)
    s = TierStack(_memory(namespace, metrics, 4), [remote], metrics)
    try:
        assert s.put(keys[0], make_payload(0, SIZE))  # chunk 0 in memory too (behind: ungated)
        assert s.lookup(keys, "req") == 6
        assert remote.batches == [7]  # keys 1..7 asked once
    finally:
        remote.gate.set()
        s.close()


# ---- chains ----------------------------------------------------------------------------------


def test_a_leased_lookup_touches_the_run_in_every_tier_a_probe_does_not(
    namespace: bytes, metrics: Metrics, tmp_path: Path, make_key: Key, make_payload: Payload
):
    disk = DiskTier(tmp_path, 3 * (SIZE + HEADER_BYTES), namespace, metrics)
    stack = TierStack(_memory(namespace, metrics, 3), [disk], metrics, queue_depth=16)
    try:
        run = [make_key(i) for i in range(2)]
        later = make_key(9)
        for k in (*run, later):
            assert stack.put(k, make_payload(0, SIZE))
        assert stack.flush(WAIT_S)
        assert stack.lookup(run, None) == 2  # a probe: no reference
        assert stack.memory.stats().frequent == 0
        assert stack.lookup(run, "req-1") == 2
        stack.release("req-1")
        # the run is referenced in both tiers: a new chunk evicts `later`, seen once, instead
        assert stack.put(make_key(10), make_payload(0, SIZE))
        assert stack.flush(WAIT_S)
        for tier in (stack.memory, disk):
            assert tier.contains(run[0]) and tier.contains(run[1]) and not tier.contains(later)
    finally:
        stack.close()


def test_parents_travel_with_commits_promotions_and_write_behind(
    stack: TierStack, disk: DiskTier, make_key: Key, make_payload: Payload
):
    head, tail = make_key(0), make_key(1)
    for key, parent in ((tail, head), (head, b"")):  # deepest first
        view = stack.reserve(key, parent)
        assert view is not None
        view.copy_(torch.frombuffer(bytearray(make_payload(0, SIZE)), dtype=torch.uint8))
        stack.commit(key)
    assert stack.flush(WAIT_S)
    assert stack.memory.parent_of(tail) == head
    assert disk._policy.parent_of(tail) == head
    promoted = make_key(2)
    assert disk.put(promoted, make_payload(2, SIZE))
    assert stack.read_into(promoted, _dst(), parent=tail) == "disk"
    assert stack.memory.parent_of(promoted) == tail


def test_a_leased_lookup_pins_exactly_its_run_across_tiers(
    tmp_path: Path, namespace: bytes, metrics: Metrics, make_key: Key, make_payload: Payload
):
    # the memory run is leased in one step, the rest chunk by chunk where each lives: a chunk
    # resident past the first miss is not part of the run and stays evictable
    disk = DiskTier(tmp_path, 4 * (SIZE + HEADER_BYTES), namespace, metrics)
    memory = _memory(namespace, metrics, 8)
    s = TierStack(memory, [disk], metrics)
    try:
        a, b, c, d, gap, e = (make_key(i) for i in range(6))
        for i, k in enumerate((a, b, d, e)):
            assert memory.put(k, make_payload(i, SIZE))
        assert disk.put(c, make_payload(9, SIZE))
        run = s.lookup_run([a, b, c, d, gap, e], "req-1")
        assert (run.chunks, run.tier) == (4, "disk")
        # each chunk's own tier, for the load-or-recompute choice: the disk chunk is a run
        assert run.runs == (("memory", 2), ("disk", 1), ("memory", 1))
        assert s.lookup_run([a, b, c, d, gap, e]).runs == run.runs  # a probe says the same
        assert [memory.is_leased(k) for k in (a, b, d, e)] == [True, True, True, False]
        s.release("req-1")
        assert not any(memory.is_leased(k) for k in (a, b, d))
        assert metrics.value("lease_releases_total") == 1
    finally:
        s.close()
