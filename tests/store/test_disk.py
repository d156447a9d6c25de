"""DiskTier: verified record files, atomic writes, restart reuse, chain-aware eviction by bytes,
budgets the filesystem can hold, and a full filesystem that evicts instead of freezing."""

from __future__ import annotations

import errno
import os
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier.config import KVTierConfig
from kvtier.errors import StartupError
from kvtier.metrics import Metrics
from kvtier.store import record
from kvtier.store.disk import DiskTier
from kvtier.store.factory import build_stack

Key = Callable[[int], bytes]
Payload = Callable[[int, int], bytes]

SIZE = 4096
RECORD = record.HEADER_BYTES + SIZE


def _files(tier: DiskTier) -> list[Path]:
    """Every file under the tier's directory but its lock file."""
    return sorted(
        p for p in tier.directory.rglob("*") if p.is_file() and p.name != "kvtier.lock"
    )


def _record_path(tier: DiskTier, key: bytes) -> Path:
    h = key.hex()
    return tier.directory / h[:2] / f"{h}.kvr"


def test_round_trip_bytes(tmp_path, namespace, metrics, make_key: Key, make_payload: Payload):
    tier = DiskTier(tmp_path, 10 * RECORD, namespace, metrics)
    k, data = make_key(1), make_payload(1, SIZE)
    assert tier.get(k) is None
    assert tier.put(k, data) is True
    assert tier.contains(k)
    got = tier.get(k)
    assert got is not None and bytes(got) == data
    assert tier.residency_bytes() == RECORD
    assert metrics.value("tier_residency_bytes", tier="disk") == RECORD
    assert metrics.value("tier_capacity_bytes", tier="disk") == 10 * RECORD
    # the file on disk is exactly one record under the namespaced, sharded path
    path = _record_path(tier, k)
    assert path.parent.parent == tmp_path / namespace.hex()
    assert path.read_bytes() == tier.codec.encode(k, data)
    assert _files(tier) == [path]  # no temp file left behind


def test_put_accepts_memoryview_and_repeat_put_is_a_noop(
    tmp_path, namespace, metrics, make_key: Key, make_payload: Payload
):
    tier = DiskTier(tmp_path, 10 * RECORD, namespace, metrics)
    k, data = make_key(2), make_payload(2, SIZE)
    assert tier.put(k, memoryview(bytearray(data)))
    mtime = _record_path(tier, k).stat().st_mtime_ns
    assert tier.put(k, data)
    assert _record_path(tier, k).stat().st_mtime_ns == mtime
    assert tier.residency_bytes() == RECORD
    assert bytes(tier.get(k) or b"") == data


def test_corrupted_record_reads_as_miss_and_is_counted(
    tmp_path, namespace, metrics, make_key: Key, make_payload: Payload
):
    tier = DiskTier(tmp_path, 10 * RECORD, namespace, metrics)
    k = make_key(3)
    assert tier.put(k, make_payload(3, SIZE))
    path = _record_path(tier, k)
    raw = bytearray(path.read_bytes())
    raw[record.HEADER_BYTES + 100] ^= 0xFF
    path.write_bytes(bytes(raw))

    assert tier.get(k) is None
    assert metrics.value("verify_failures_total", tier="disk", reason="tag_mismatch") == 1
    assert not path.exists() and not tier.contains(k)
    assert tier.residency_bytes() == 0
    assert tier.get(k) is None  # now a plain miss, not a second failure
    assert metrics.total("verify_failures_total") == 1


def test_truncated_record_reads_as_miss_and_is_counted(
    tmp_path, namespace, metrics, make_key: Key, make_payload: Payload
):
    tier = DiskTier(tmp_path, 10 * RECORD, namespace, metrics)
    k = make_key(4)
    assert tier.put(k, make_payload(4, SIZE))
    path = _record_path(tier, k)
    path.write_bytes(path.read_bytes()[: RECORD - 1])

    assert tier.get(k) is None
    assert metrics.value("verify_failures_total", tier="disk", reason="length_mismatch") == 1
    assert not path.exists()


def test_record_under_wrong_key_is_rejected(
    tmp_path, namespace, metrics, make_key: Key, make_payload: Payload
):
    tier = DiskTier(tmp_path, 10 * RECORD, namespace, metrics)
    a, b = make_key(5), make_key(6)
    assert tier.put(a, make_payload(5, SIZE))
    assert tier.put(b, make_payload(6, SIZE))
    # a file copied over another key's name must not serve the other key's bytes
    _record_path(tier, b).write_bytes(_record_path(tier, a).read_bytes())
    assert tier.get(b) is None
    assert metrics.value("verify_failures_total", tier="disk", reason="key_mismatch") == 1
    assert bytes(tier.get(a) or b"") == make_payload(5, SIZE)


def test_file_deleted_behind_our_back_is_a_counted_miss(
    tmp_path, namespace, metrics, make_key: Key, make_payload: Payload
):
    tier = DiskTier(tmp_path, 10 * RECORD, namespace, metrics)
    k = make_key(7)
    assert tier.put(k, make_payload(7, SIZE))
    _record_path(tier, k).unlink()
    assert tier.get(k) is None
    assert metrics.value("verify_failures_total", tier="disk", reason="missing") == 1
    assert not tier.contains(k) and tier.residency_bytes() == 0


def test_restart_reuses_entries_and_serves_identical_bytes(
    tmp_path, namespace, metrics, make_key: Key, make_payload: Payload
):
    first = DiskTier(tmp_path, 10 * RECORD, namespace, metrics)
    for i in range(4):
        assert first.put(make_key(i), make_payload(i, SIZE))
    first.close()

    # debris a crash can leave: a half-written temp file and stray files
    shard = _record_path(first, make_key(0)).parent
    (shard / f"{make_key(0).hex()}.123.456.tmp").write_bytes(b"half a record")
    (shard / "notes.txt").write_text("not a record")
    (first.directory / "zz").mkdir()

    second = DiskTier(tmp_path, 10 * RECORD, namespace, Metrics(rank=0))
    assert second.scan.entries == 4
    assert second.scan.bytes == 4 * RECORD
    assert second.scan.stale_temps_removed == 1
    assert second.scan.ignored_files == 2
    assert not list(tmp_path.rglob("*.tmp"))
    assert second.residency_bytes() == 4 * RECORD
    assert second.lookup_prefix([make_key(i) for i in range(6)]) == 4
    for i in range(4):
        assert bytes(second.get(make_key(i)) or b"") == make_payload(i, SIZE)


def test_restart_with_smaller_cap_evicts_oldest_first(
    tmp_path, namespace, metrics, make_key: Key, make_payload: Payload
):
    first = DiskTier(tmp_path, 10 * RECORD, namespace, metrics)
    for i in range(4):
        assert first.put(make_key(i), make_payload(i, SIZE))
        # mtime orders the index at restart; make it strictly increasing without sleeping
        os.utime(_record_path(first, make_key(i)), ns=(i * 10**9, i * 10**9))
    first.close()

    m2 = Metrics(rank=0)
    second = DiskTier(tmp_path, 2 * RECORD, namespace, m2)
    assert [second.contains(make_key(i)) for i in range(4)] == [False, False, True, True]
    assert m2.value("evictions_total", tier="disk") == 2
    assert len(_files(second)) == 2


def test_eviction_by_bytes_follows_lookups_and_respects_max_bytes(
    tmp_path, namespace, metrics, make_key: Key, make_payload: Payload
):
    tier = DiskTier(tmp_path, 3 * RECORD, namespace, metrics)
    for i in range(3):
        assert tier.put(make_key(i), make_payload(i, SIZE))
    assert tier.get(make_key(1)) is not None  # a read is no reference: 0 is still the oldest
    tier.touch([make_key(0)])  # a lookup used 0: 1 is now the oldest
    assert tier.put(make_key(3), make_payload(3, SIZE))

    assert [tier.contains(make_key(i)) for i in range(4)] == [True, False, True, True]
    assert not _record_path(tier, make_key(1)).exists()
    assert tier.residency_bytes() == 3 * RECORD <= 3 * RECORD
    assert sum(p.stat().st_size for p in _files(tier)) == 3 * RECORD
    assert metrics.value("evictions_total", tier="disk") == 1

    # a bigger record makes room for itself by evicting as many as it needs, those seen once
    # first: 0, used by a lookup, stays
    big = 2 * SIZE
    assert tier.put(make_key(9), make_payload(9, big))
    assert tier.residency_bytes() <= 3 * RECORD
    assert tier.contains(make_key(9)) and tier.contains(make_key(0))
    assert metrics.value("evictions_total", tier="disk") == 3


def test_leased_keys_are_not_evicted_until_released(
    tmp_path, namespace, metrics, clock, make_key: Key, make_payload: Payload
):
    tier = DiskTier(tmp_path, 2 * RECORD, namespace, metrics, lease_ttl_s=5.0, clock=clock)
    a, b, c, d = (make_key(i) for i in range(4))
    assert tier.put(a, make_payload(0, SIZE))
    assert tier.put(b, make_payload(1, SIZE))
    assert tier.lease("req-1", [a, c, b]) == 1  # leading held count; a and b pinned, c not

    assert tier.put(c, make_payload(2, SIZE)) is False
    assert metrics.value("store_failures_total", tier="disk", reason="full") == 1
    assert tier.contains(a) and tier.contains(b) and not tier.contains(c)

    tier.release("req-1")
    assert metrics.value("lease_releases_total") == 1
    assert tier.put(c, make_payload(2, SIZE))
    assert tier.contains(c) and not tier.contains(a)

    # a lease that is never released stops protecting at its deadline
    assert tier.lease("req-2", [b, c]) == 2
    assert tier.put(d, make_payload(3, SIZE)) is False
    clock.advance(5.0)
    assert tier.put(d, make_payload(3, SIZE))
    assert metrics.value("lease_expiries_total") == 1


def test_record_larger_than_the_tier_is_refused(tmp_path, namespace, metrics, make_key: Key):
    tier = DiskTier(tmp_path, RECORD, namespace, metrics)
    assert tier.put(make_key(0), bytes(SIZE + 1)) is False
    assert metrics.value("store_failures_total", tier="disk", reason="too_large") == 1
    assert _files(tier) == []


def test_a_parent_is_evicted_after_its_children(
    tmp_path, namespace, metrics, make_key: Key, make_payload: Payload
):
    tier = DiskTier(tmp_path, 3 * RECORD, namespace, metrics)
    head, mid, tail, other = (make_key(i) for i in range(4))
    # deepest first, as the write-behind of a save delivers them
    for key, parent in ((tail, mid), (mid, head), (head, b"")):
        assert tier.put(key, make_payload(0, SIZE), parent=parent)
    assert tier.put(other, make_payload(3, SIZE))
    assert [tier.contains(k) for k in (head, mid, tail, other)] == [True, True, False, True]
    # re-storing the leaf never makes its room by evicting its own parent, the oldest leaf
    assert tier.put(tail, make_payload(2, SIZE), parent=mid)
    assert [tier.contains(k) for k in (head, mid, tail, other)] == [True, True, True, False]


@pytest.mark.parametrize(("err", "reason"), [(errno.EIO, "io_error")])
def test_failed_write_is_counted_and_survived(
    tmp_path, namespace, metrics, monkeypatch, err, reason, make_key: Key, make_payload: Payload
):
    tier = DiskTier(tmp_path, 10 * RECORD, namespace, metrics)
    assert tier.put(make_key(0), make_payload(0, SIZE))
    real_write = os.write
    calls = {"n": 0}

    def failing_write(fd: int, data) -> int:
        # let the header through, then fail mid-record like a disk filling up
        calls["n"] += 1
        if calls["n"] > 1:
            raise OSError(err, os.strerror(err))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", failing_write)
    assert tier.put(make_key(1), make_payload(1, SIZE)) is False
    assert metrics.value("store_failures_total", tier="disk", reason=reason) == 1
    assert not tier.contains(make_key(1))
    assert not list(tmp_path.rglob("*.tmp"))
    assert tier.residency_bytes() == RECORD
    # the tier keeps serving reads while the disk is full
    assert bytes(tier.get(make_key(0)) or b"") == make_payload(0, SIZE)

    monkeypatch.setattr(os, "write", real_write)
    assert tier.put(make_key(1), make_payload(1, SIZE))
    assert bytes(tier.get(make_key(1)) or b"") == make_payload(1, SIZE)
    assert tier.residency_bytes() == 2 * RECORD


def test_failed_rename_cleans_temp_file(
    tmp_path, namespace, metrics, monkeypatch, make_key: Key, make_payload: Payload
):
    tier = DiskTier(tmp_path, 10 * RECORD, namespace, metrics)

    def failing_replace(src, dst) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", failing_replace)
    assert tier.put(make_key(0), make_payload(0, SIZE)) is False
    assert metrics.value("store_failures_total", tier="disk", reason="enospc") == 1
    assert _files(tier) == []
    assert tier.residency_bytes() == 0


def test_namespaces_in_one_directory_stay_apart(
    tmp_path, namespace, other_namespace, metrics, make_key: Key, make_payload: Payload
):
    mine = DiskTier(tmp_path, 10 * RECORD, namespace, metrics)
    theirs = DiskTier(tmp_path, 10 * RECORD, other_namespace, metrics)
    k = make_key(0)
    assert mine.put(k, make_payload(0, SIZE))
    assert not theirs.contains(k) and theirs.get(k) is None
    assert theirs.put(k, make_payload(1, SIZE))
    assert bytes(mine.get(k) or b"") == make_payload(0, SIZE)
    assert bytes(theirs.get(k) or b"") == make_payload(1, SIZE)

    # a record planted under the other namespace's directory is rejected, not served
    theirs.close()  # one live tier per namespace directory: the restart below takes it over
    planted = _record_path(theirs, make_key(5))
    planted.parent.mkdir(exist_ok=True)
    planted.write_bytes(mine.codec.encode(make_key(5), make_payload(5, SIZE)))
    m2 = Metrics(rank=0)
    restarted = DiskTier(tmp_path, 10 * RECORD, other_namespace, m2)
    assert restarted.contains(make_key(5))
    assert restarted.get(make_key(5)) is None
    assert m2.value("verify_failures_total", tier="disk", reason="namespace_mismatch") == 1


def test_concurrent_writers_and_readers_keep_the_cap(
    tmp_path, namespace, metrics, make_key: Key, make_payload: Payload
):
    cap = 8 * RECORD
    tier = DiskTier(tmp_path, cap, namespace, metrics)
    errors: list[str] = []

    def writer(base: int) -> None:
        for i in range(base, base + 40):
            if not tier.put(make_key(i), make_payload(i, SIZE)):
                errors.append(f"put {i} failed")

    def reader() -> None:
        for i in range(120):
            got = tier.get(make_key(i % 80))
            if got is not None and bytes(got) != make_payload(i % 80, SIZE):
                errors.append(f"wrong bytes for {i % 80}")

    threads = [threading.Thread(target=writer, args=(b,)) for b in (0, 40)]
    threads.append(threading.Thread(target=reader))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert errors == []
    assert tier.residency_bytes() <= cap
    assert (
        sum(p.stat().st_size for p in _files(tier)) == tier.residency_bytes() == len(tier) * RECORD
    )
    assert metrics.value("verify_failures_total", tier="disk") == 0


def test_bad_arguments_raise_clear_errors(tmp_path, namespace, metrics):
    with pytest.raises(ValueError, match="max_bytes"):
        DiskTier(tmp_path, 0, namespace, metrics)
    with pytest.raises(ValueError, match="namespace must be 16 bytes"):
        DiskTier(tmp_path, 100, b"short", metrics)
    tier = DiskTier(tmp_path, 10 * RECORD, namespace, metrics)
    with pytest.raises(ValueError, match="chunk key must be 16 bytes"):
        tier.put(b"k", b"x")
    tier.close()
    with pytest.raises(RuntimeError, match="closed"):
        tier.get(bytes(16))


# ---- budgets the filesystem can hold, and a full filesystem ----------------------------------

FS_BYTES = 4 << 20
BIG = 64 << 10  # payload of the small-filesystem tests
BIG_RECORD = record.HEADER_BYTES + BIG


def _emulate_small_fs(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    """Where no tmpfs can be mounted: writes under `root` fail with ENOSPC past FS_BYTES and
    statvfs reports that size, as a 4 MiB filesystem would."""
    real_write, real_statvfs = os.write, os.statvfs

    def used() -> int:
        return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())

    def write(fd: int, data) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(root)):
            if used() + memoryview(data).nbytes > FS_BYTES:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    def statvfs(path):
        st = real_statvfs(path)
        if not str(path).startswith(str(root)):
            return st
        free = max(0, FS_BYTES - used()) // 4096
        blocks = FS_BYTES // 4096
        return os.statvfs_result((4096, 4096, blocks, free, free, *tuple(st)[5:]))

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "statvfs", statvfs)


@pytest.fixture
def small_fs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A 4 MiB filesystem: a real tmpfs where this process may mount one (root), else the
    emulation above."""
    root = tmp_path / "small-fs"
    root.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES}", "tmpfs", str(root)]
    try:
        subprocess.run(mount, check=True, capture_output=True, timeout=30)
    except (OSError, subprocess.CalledProcessError):
        _emulate_small_fs(monkeypatch, root)
        yield root
        return
    try:
        yield root
    finally:
        subprocess.run(["umount", str(root)], check=True, timeout=30)


def test_a_budget_larger_than_the_filesystem_is_a_startup_error(small_fs, namespace, metrics):
    with pytest.raises(StartupError) as err:
        DiskTier(small_fs, 64 << 20, namespace, metrics)
    msg = str(err.value)
    assert f"disk_bytes={64 << 20}" in msg and repr(str(small_fs)) in msg
    assert "set disk_bytes to at most" in msg
    # a budget the filesystem can hold starts
    DiskTier(small_fs, FS_BYTES // 2, namespace, metrics).close()


def test_a_budget_below_one_chunk_is_a_startup_error(tmp_path, namespace, metrics):
    slot = 4096
    config = KVTierConfig(memory_bytes=4 * slot, disk_bytes=100, disk_dir=str(tmp_path))
    want = rf"disk_bytes=100 .* one chunk record of {slot + record.HEADER_BYTES} bytes"
    with pytest.raises(StartupError, match=want):
        build_stack(config, namespace, slot, metrics)
    config = KVTierConfig(
        memory_bytes=4 * slot, disk_bytes=slot + record.HEADER_BYTES, disk_dir=str(tmp_path)
    )
    build_stack(config, namespace, slot, metrics).close()


def test_a_full_filesystem_evicts_and_keeps_storing(
    small_fs, namespace, metrics, make_key: Key, make_payload: Payload
):
    budget = 3 * FS_BYTES // 4
    tier = DiskTier(small_fs, budget, namespace, metrics)
    # something else fills half the filesystem after the tier started
    (small_fs / "other.bin").write_bytes(bytes(FS_BYTES // 2))
    # ten prompts of four chunks, each chain written deepest-first as a save delivers it
    keys = [make_key(i) for i in range(40)]
    for head in range(0, len(keys), 4):
        for i in range(head + 3, head - 1, -1):
            parent = keys[i - 1] if i > head else b""
            assert tier.put(keys[i], make_payload(i, BIG), parent=parent)
    assert metrics.value("tier_full_total", tier="disk") >= 1
    assert metrics.value("store_failures_total", tier="disk", reason="enospc") == 0
    # the budget came down to what the filesystem held, and the gauge says so
    assert tier.budget_bytes < budget
    assert metrics.value("tier_capacity_bytes", tier="disk") == tier.budget_bytes
    assert tier.residency_bytes() <= tier.budget_bytes
    assert metrics.value("evictions_total", tier="disk") >= 1
    held = [i for i, k in enumerate(keys) if tier.contains(k)]
    assert held and set(range(36, 40)) <= set(held)  # the newest prompt, whole
    for i in held:
        # prefix-closed: every chunk held has its predecessor held
        assert i % 4 == 0 or i - 1 in held
        assert bytes(tier.get(keys[i]) or b"") == make_payload(i, BIG)
    assert not list(small_fs.rglob("*.tmp"))
    # the other files go: the budget follows the room back up, never past disk_bytes
    lowered = tier.budget_bytes
    (small_fs / "other.bin").unlink()
    assert tier.put(make_key(99), make_payload(99, BIG))
    assert lowered < tier.budget_bytes <= budget
    assert metrics.value("tier_capacity_bytes", tier="disk") == tier.budget_bytes
    tier.close()


def test_an_enospc_the_filesystem_does_not_explain_evicts_nothing(
    tmp_path, namespace, metrics, monkeypatch, make_key: Key, make_payload: Payload
):
    # a quota or an injected error: the filesystem has room, so evicting would buy nothing
    tier = DiskTier(tmp_path, 10 * RECORD, namespace, metrics)
    assert tier.put(make_key(0), make_payload(0, SIZE))

    def failing_write(fd: int, data) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", failing_write)
    assert tier.put(make_key(1), make_payload(1, SIZE)) is False
    assert metrics.value("store_failures_total", tier="disk", reason="enospc") == 1
    assert metrics.value("tier_full_total", tier="disk") == 0
    assert tier.contains(make_key(0)) and tier.budget_bytes == 10 * RECORD
