"""Retention on a rank: retained chunks outlive eviction until their deadline, the budget bounds
them, the table survives a restart of the disk tier, and prefetch and forget reach every tier
(a real redis-server for the shared store). Deadlines run on a controllable clock."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.keys import state_key
from kvtier.metrics import Metrics
from kvtier.store.disk import DiskTier
from kvtier.store.memory import MemoryTier
from kvtier.store.record import HEADER_BYTES
from kvtier.store.remote import RemoteTier
from kvtier.store.retention import RETENTION_FILE, RetentionTable
from kvtier.store.stack import TierStack
from tests.record_key import codec_for_tests
from tests.redis_local import RedisServer

from .conftest import FakeClock, key_of, payload_of

SIZE = 1024


def _memory(namespace: bytes, metrics: Metrics, slots: int) -> MemoryTier:
    return MemoryTier(SIZE, slots * SIZE, namespace, metrics, pin_memory=False)


def _disk(root: Path, namespace: bytes, metrics: Metrics, records: int) -> DiskTier:
    return DiskTier(root, records * (SIZE + HEADER_BYTES), namespace, metrics)


def _three_tiers(
    root: Path, namespace: bytes, metrics: Metrics, server: RedisServer
) -> tuple[TierStack, DiskTier, RemoteTier]:
    """Memory over disk over a real Redis, 8 chunks each, retention on."""
    disk = _disk(root, namespace, metrics, 8)
    remote = RemoteTier(server.url, namespace, metrics, codec=codec_for_tests(namespace))
    stack = TierStack(_memory(namespace, metrics, 8), [disk, remote], metrics, retention_limit=8)
    return stack, disk, remote


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


def test_a_deadline_passes_on_the_clock_and_the_limit_keeps_a_prefix_whole():
    clock = FakeClock()
    table = RetentionTable(3, clock)
    a, b, c, d = (key_of(i) for i in range(4))
    assert table.retain([a, b], clock() + 10) == 2
    # past the limit the deepest keys are refused; the leading ones are kept
    assert table.retain([c, d], clock() + 5) == 1
    assert [table.holds(k) for k in (a, b, c, d)] == [True, True, True, False]
    clock.advance(6)
    assert [table.holds(k) for k in (a, b, c)] == [True, True, False]
    # a later deadline is kept when a shorter one is asked again
    assert table.retain([a], clock() + 1) == 1
    clock.advance(3)
    assert table.holds(a) and table.holds(b)
    clock.advance(2)
    assert not table.holds(a) and len(table.live()) == 0
    assert table.retain([d], clock() + 1) == 1  # expired entries made room


def test_memory_never_evicts_a_retained_chunk_until_its_deadline(
    namespace: bytes, metrics: Metrics
):
    clock = FakeClock()
    s = TierStack(_memory(namespace, metrics, 2), [], metrics, retention_limit=8, clock=clock)
    try:
        a, b, c, d = (key_of(i) for i in range(4))
        assert s.put(a, payload_of(0, SIZE)) and s.put(b, payload_of(1, SIZE))
        assert s.admin("retain", [a], clock() + 60) == 1
        # a is the least recently used, yet b goes
        assert s.put(c, payload_of(2, SIZE))
        assert s.memory.contains(a) and not s.memory.contains(b)
        # with every slot retained nothing more fits: a save fails, the retained chunks stay
        assert s.admin("retain", [c], clock() + 60) == 1
        assert s.put(d, payload_of(3, SIZE)) is False
        assert s.memory.contains(a) and s.memory.contains(c)
        clock.advance(61)
        assert s.put(d, payload_of(3, SIZE))
        assert s.memory.contains(d)
        # release ends retention at once
        assert s.admin("retain", [d], clock() + 60) == 1
        assert s.admin("release", [d], 0.0) == 1
        assert not s.retention.holds(d)
    finally:
        s.close()


def test_disk_keeps_retained_records_and_the_table_survives_a_restart(
    tmp_path: Path, namespace: bytes, metrics: Metrics
):
    clock = FakeClock(start=2_000_000_000.0)
    a, b, c = (key_of(i) for i in range(3))
    disk = _disk(tmp_path, namespace, metrics, 2)
    s = TierStack(_memory(namespace, metrics, 4), [disk], metrics, retention_limit=8, clock=clock)
    try:
        assert disk.put(a, payload_of(0, SIZE)) and disk.put(b, payload_of(1, SIZE))
        assert s.admin("retain", [a], clock() + 3600) == 1
        assert disk.put(c, payload_of(2, SIZE))  # evicts b, never a
        assert disk.contains(a) and not disk.contains(b)
    finally:
        s.close()
    saved = json.loads((disk.directory / RETENTION_FILE).read_text())
    assert list(saved["until"]) == [a.hex()]

    disk2 = _disk(tmp_path, namespace, Metrics(rank=0), 2)
    assert disk2.scan.ignored_files == 0  # the table beside the shards is no stranger
    s2 = TierStack(
        _memory(namespace, metrics, 4), [disk2], metrics, retention_limit=8, clock=clock
    )
    try:
        assert s2.retention.holds(a)
        assert disk2.put(b, payload_of(1, SIZE))  # evicts c, the unretained one
        assert disk2.contains(a) and not disk2.contains(c)
    finally:
        s2.close()


def test_a_retention_file_others_could_write_is_not_believed(
    tmp_path: Path, namespace: bytes, metrics: Metrics
):
    clock = FakeClock(start=2_000_000_000.0)
    disk = _disk(tmp_path, namespace, metrics, 2)
    path = disk.directory / RETENTION_FILE
    path.write_text(json.dumps({"version": 1, "until": {key_of(0).hex(): clock() + 99}}))
    os.chmod(path, 0o666)
    s = TierStack(_memory(namespace, metrics, 2), [disk], metrics, retention_limit=8, clock=clock)
    try:
        assert not s.retention.holds(key_of(0))
    finally:
        s.close()
    # garbage in a private file is ignored too, never raised
    path.unlink()
    path.write_text('{"until": {"zz": "soon", "' + "ab" * 16 + '": 1e30}}')
    os.chmod(path, 0o600)
    disk3 = _disk(tmp_path, namespace, Metrics(rank=0), 2)
    table = RetentionTable(1, clock)
    assert table.load(disk3.directory / RETENTION_FILE) == 1  # the one valid entry
    disk3.close()


def test_prefetch_brings_a_session_up_from_disk_and_the_shared_store(
    tmp_path: Path, namespace: bytes, metrics: Metrics, redis_server: RedisServer
):
    s, disk, remote = _three_tiers(tmp_path, namespace, metrics, redis_server)
    try:
        keys = [key_of(100 + i) for i in range(4)]
        assert disk.put(keys[0], payload_of(0, SIZE)) and disk.put(keys[1], payload_of(1, SIZE))
        assert remote.put(keys[2], payload_of(2, SIZE))
        # keys[3] is nowhere: prefetch stops there; the reads run off the lookup thread
        assert s.admin("prefetch", keys, 0.0) == 3
        assert s.wait_prefetched(1, timeout_s=10.0)
        for i in range(3):
            assert s.memory.get(keys[i]) == payload_of(i, SIZE)
        assert not s.memory.contains(keys[3])
        assert metrics.value("prefetched_chunks_total") == 3
        assert s.admin("prefetch", keys, 0.0) == 0  # already up
        assert s.wait_prefetched(2, timeout_s=10.0)
        assert metrics.value("prefetched_chunks_total") == 3
    finally:
        s.close()


def test_forget_deletes_from_memory_disk_and_the_shared_store(
    tmp_path: Path, namespace: bytes, metrics: Metrics, redis_server: RedisServer
):
    s, disk, remote = _three_tiers(tmp_path, namespace, metrics, redis_server)
    try:
        keys = [key_of(200 + i) for i in range(3)]
        other = key_of(299)
        for i, k in enumerate([*keys, other]):
            assert s.put(k, payload_of(i, SIZE))
        assert s.flush(10.0)
        assert s.admin("retain", keys, 4e9) == 3
        assert all(remote.contains(k) and disk.contains(k) for k in keys)
        assert s.admin("forget", [*keys, key_of(298)], 0.0) == 3
        for k in keys:
            assert not s.memory.contains(k) and not disk.contains(k) and not remote.contains(k)
            assert not s.retention.holds(k)
            assert s.lookup([k]) == 0
        assert redis_server.client().exists(remote.redis_key(keys[0])) == 0
        # the rest of the tier is untouched
        assert s.memory.contains(other) and disk.contains(other) and remote.contains(other)
    finally:
        s.close()


def test_retention_extends_the_shared_stores_ttl_and_a_retained_put_lives_as_long(
    namespace: bytes, metrics: Metrics, redis_server: RedisServer
):
    import time

    remote = RemoteTier(
        redis_server.url, namespace, metrics, ttl_s=60, codec=codec_for_tests(namespace)
    )
    s = TierStack(_memory(namespace, metrics, 4), [remote], metrics, retention_limit=8)
    admin = redis_server.client()
    try:
        a, b = key_of(300), key_of(301)
        assert remote.put(a, payload_of(0, SIZE))
        assert 0 < admin.ttl(remote.redis_key(a)) <= 60
        until = time.time() + 3600
        assert s.admin("retain", [a, b], until) == 2
        assert 3000 < admin.ttl(remote.redis_key(a)) <= 3600
        # b is written after the hint: its record lives as long as the retention too
        assert remote.put(b, payload_of(1, SIZE))
        assert 3000 < admin.ttl(remote.redis_key(b)) <= 3600
    finally:
        s.close()


def test_prefetch_and_forget_of_a_hybrid_rank_carry_each_boundary_state_whole(
    tmp_path: Path, namespace: bytes, metrics: Metrics
):
    """A hybrid rank's boundary state is a record of its own (`state_key(chunk, part)`, part
    0 the leaf): prefetch brings every part of a state the disk holds up with its chunk (a
    hit ends at a boundary whose state is in memory, or the restore reads it from disk), a
    boundary with a part missing stays below, and forget deletes the states from every tier."""
    disk = _disk(tmp_path / "disk", namespace, metrics, 16)
    s = TierStack(_memory(namespace, metrics, 16), [disk], metrics, state_parts=2)
    try:
        keys = [key_of(300 + i) for i in range(3)]
        whole = [state_key(keys[1], j) for j in range(2)]
        torn = state_key(keys[2], 0)  # its part 1 is gone
        for i, k in enumerate([*keys, *whole, torn]):
            assert disk.put(k, payload_of(i, SIZE))
        assert s.admin("prefetch", keys, 0.0) == 3
        assert s.wait_prefetched(1, timeout_s=10.0)
        assert [s.memory.get(k) for k in whole] == [payload_of(3, SIZE), payload_of(4, SIZE)]
        assert not s.memory.contains(torn) and not s.memory.contains(state_key(keys[0], 0))
        assert s.admin("forget", keys, 0.0) == 3
        assert not any(t.contains(k) for t in (s.memory, disk) for k in [*keys, *whole, torn])
    finally:
        s.close()


def test_retained_chunks_past_memorys_share_leave_room_for_unretained_saves(
    tmp_path: Path, namespace: bytes, metrics: Metrics
):
    """The rank's limit is the budget's share of its largest tier (disk here, 50 chunks), so
    retained chunks could fill a 4-slot memory tier, and every save failed, unretained and
    retained alike (writes go through memory first), until their deadlines (a review found
    it). Memory keeps retained chunks within the budget's share of its own slots; past it they
    are evicted as ordinary chunks, and the disk tier still keeps them."""
    clock = FakeClock(start=2_000_000_000.0)
    keys = [key_of(i) for i in range(8)]
    disk = _disk(tmp_path, namespace, metrics, 100)
    s = TierStack(
        _memory(namespace, metrics, 4), [disk], metrics,
        retention_limit=50, retention_share=0.5, clock=clock,
    )  # fmt: skip
    try:
        for i, k in enumerate(keys[:4]):
            assert s.put(k, payload_of(i, SIZE))
        assert s.flush(10.0)
        assert s.admin("retain", keys[:4], clock() + 3600) == 4
        assert s.put(keys[4], payload_of(4, SIZE))  # failed: every slot held a retained chunk
        assert s.flush(10.0)
        resident = [k for k in keys[:5] if s.memory.contains(k)]
        assert keys[4] in resident and len(resident) == 4
        # within its share (2 of 4 slots) memory keeps retained chunks as before
        for i, k in enumerate(keys[5:8], start=5):
            assert s.put(k, payload_of(i, SIZE))
            assert s.flush(10.0)  # a chunk the write-behind is copying down is not a victim
        assert sum(s.memory.contains(k) for k in keys[:4]) == 2
        # and every retained chunk is still held whole below
        assert all(disk.get(k) == payload_of(i, SIZE) for i, k in enumerate(keys[:4]))
    finally:
        s.close()


def test_a_prefetch_racing_close_starts_no_thread_over_closed_tiers(
    tmp_path: Path, namespace: bytes, metrics: Metrics, monkeypatch: pytest.MonkeyPatch
):
    """A prefetch checked the tiers, then the stack closed (a shutdown), then the prefetch
    started its thread: an idle thread over closed tiers, for good. Found by a review."""
    import threading

    disk = _disk(tmp_path, namespace, metrics, 8)
    s = TierStack(_memory(namespace, metrics, 8), [disk], metrics, retention_limit=8)
    keys = [key_of(300 + i) for i in range(2)]
    assert disk.put(keys[0], payload_of(0, SIZE))
    real = disk.contains_many

    def closing_meanwhile(ks: object) -> list[bool]:
        held = real(ks)  # type: ignore[arg-type]
        s.close()  # the shutdown lands between the check and the thread's start
        return held

    monkeypatch.setattr(disk, "contains_many", closing_meanwhile)
    assert s.admin("prefetch", keys, 0.0) == 0
    assert not [t for t in threading.enumerate() if t.name == "kvtier-prefetch" and
                t.is_alive() and getattr(t, "_target", None) == s._prefetch_loop]  # fmt: skip
    assert s._prefetcher is None
