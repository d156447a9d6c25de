"""Namespace directories nobody used for disk_gc_days (old model revisions, other TP sizes) are
removed at startup, oldest first, each logged; a recent one, one a live process holds and
anything in disk_dir that is not a kvtier namespace stay untouched."""

from __future__ import annotations

import fcntl
import logging
import os
import time
from pathlib import Path

import kvtier.store.disk as disk_module
from kvtier.metrics import Metrics
from kvtier.store import record
from kvtier.store.disk import DiskTier
from kvtier.store.secret import GENERATED_NAME

SIZE = 4096
RECORD = record.HEADER_BYTES + SIZE
CAP = 16 * RECORD
DAY = 86400.0


def _ns(i: int) -> bytes:
    return bytes([i]) * 16


def _used(disk_dir: Path, namespace: bytes, records: int, make_key, make_payload) -> Path:
    """A namespace directory a tier used and closed, holding `records` records."""
    tier = DiskTier(disk_dir, CAP, namespace, Metrics(rank=0))
    for i in range(records):
        assert tier.put(make_key(i), make_payload(i, SIZE))
    tier.close()
    return tier.directory


def _age(path: Path, days: float) -> None:
    """Set every mtime in the tree under `path` (path included, links not followed) to `days`
    ago."""
    t = time.time() - days * DAY
    for root, dirs, files in os.walk(path, topdown=False):
        for name in dirs + files:
            os.utime(os.path.join(root, name), (t, t), follow_symlinks=False)
    os.utime(path, (t, t), follow_symlinks=False)


def _tree_bytes(path: Path) -> int:
    return sum(p.lstat().st_size for p in path.rglob("*") if not p.is_dir())


def test_gc_removes_old_kvtier_namespaces_oldest_first_and_nothing_else(
    tmp_path, metrics, make_key, make_payload, caplog
):
    disk = tmp_path / "disk"
    oldest = _used(disk, _ns(1), 3, make_key, make_payload)
    old = _used(disk, _ns(2), 1, make_key, make_payload)
    recent = _used(disk, _ns(3), 1, make_key, make_payload)
    held = _used(disk, _ns(4), 1, make_key, make_payload)
    holder = DiskTier(disk, CAP, _ns(4), Metrics(rank=0))  # a live process's namespace
    # an own_dir variant nobody holds any more
    first = DiskTier(disk, CAP, _ns(5), Metrics(rank=0))
    variant = DiskTier(disk, CAP, _ns(5), Metrics(rank=0), conflict="own_dir")
    variant.close()
    first.close()
    # not kvtier's: a namespace-shaped directory without kvtier's lock file, other names,
    # a file, and a namespace-shaped symlink to an old kvtier namespace outside disk_dir
    foreign = disk / ("ab" * 16)
    foreign.mkdir()
    (foreign / "data").write_bytes(b"x")
    (disk / "models").mkdir()
    (disk / ("cd" * 16)).write_bytes(b"a file")
    outside = _used(tmp_path / "outside", _ns(6), 1, make_key, make_payload)
    (disk / _ns(6).hex()).symlink_to(outside)
    for path, days in ((oldest, 90), (old, 40), (recent, 5), (held, 400),
                       (variant.directory, 60), (foreign, 400), (disk / "models", 400),
                       (disk / ("cd" * 16), 400), (outside, 400),
                       (disk / _ns(6).hex(), 400)):  # fmt: skip
        _age(path, days)
    sizes = {p: _tree_bytes(p) for p in (oldest, old, variant.directory)}

    with caplog.at_level(logging.INFO, logger="kvtier"):
        tier = DiskTier(disk, CAP, _ns(7), metrics)  # disk_gc_days defaults to 30
    try:
        removed = [(c.path, c.bytes, round(c.age_days)) for c in tier.collected]
        assert removed == [
            (oldest, sizes[oldest], 90),
            (variant.directory, sizes[variant.directory], 60),
            (old, sizes[old], 40),
        ]
        assert sizes[oldest] >= 3 * RECORD
        for path, size, days in removed:
            assert not os.path.lexists(path)
            assert f"removed {path} ({size} bytes, unused for {days}" in caplog.text
        assert sorted(p.name for p in disk.iterdir()) == sorted(
            [_ns(i).hex() for i in (3, 4, 6, 7)]
            + [_ns(5).hex(), "ab" * 16, "cd" * 16, "models", GENERATED_NAME]
        )
        assert (foreign / "data").read_bytes() == b"x"
        assert len(list(outside.rglob("*.kvr"))) == 1
        assert holder.lookup_prefix([make_key(0)]) == 1
    finally:
        tier.close()
        holder.close()


def test_a_namespace_used_again_is_not_old(tmp_path, metrics, make_key, make_payload):
    disk = tmp_path / "disk"
    ns_dir = _used(disk, _ns(1), 1, make_key, make_payload)
    _age(ns_dir, 40)
    # a start that only reads marks it used
    reader = DiskTier(disk, CAP, _ns(1), Metrics(rank=0))
    assert reader.get(make_key(0)) is not None
    reader.close()
    tier = DiskTier(disk, CAP, _ns(2), metrics)
    tier.close()
    assert tier.collected == () and (ns_dir / f"{make_key(0).hex()[:2]}").is_dir()


def test_disk_gc_days_0_never_removes(tmp_path, metrics, make_key, make_payload):
    disk = tmp_path / "disk"
    ns_dir = _used(disk, _ns(1), 1, make_key, make_payload)
    _age(ns_dir, 4000)
    tier = DiskTier(disk, CAP, _ns(2), metrics, gc_days=0)
    tier.close()
    assert tier.collected == () and ns_dir.is_dir()
    tier = DiskTier(disk, CAP, _ns(2), metrics, gc_days=4001)
    tier.close()
    assert tier.collected == () and ns_dir.is_dir()
    tier = DiskTier(disk, CAP, _ns(2), metrics, gc_days=3999)
    tier.close()
    assert [c.path for c in tier.collected] == [ns_dir] and not ns_dir.exists()


def test_gc_never_locks_a_recent_namespace(
    tmp_path, metrics, make_key, make_payload, monkeypatch
):
    # the other ranks of a server starting claim their recent directories right now: a GC
    # that took their lock even for a moment would make them refuse to start
    disk = tmp_path / "disk"
    recent = _used(disk, _ns(1), 1, make_key, make_payload)
    old = _used(disk, _ns(2), 1, make_key, make_payload)
    _age(old, 40)
    locked: list[str] = []
    real_flock = fcntl.flock

    def flock(fd: int, op: int) -> None:
        locked.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    tier = DiskTier(disk, CAP, _ns(3), metrics)
    tier.close()
    assert [c.path for c in tier.collected] == [old]
    # each lock file, and each directory itself (a deleted lock file must not free it)
    assert sorted(locked) == sorted(
        p for d in (old, disk / _ns(3).hex()) for p in (str(d / "kvtier.lock"), str(d))
    )
    assert recent.is_dir()


def test_a_tier_that_only_reads_keeps_marking_its_directory_used(
    tmp_path, metrics, make_key, make_payload, monkeypatch
):
    # a server up for longer than disk_gc_days that only reads: if it then dies, its lock
    # file's mtime, not its start, is what other processes' GC ages the directory by
    disk = tmp_path / "disk"
    ns_dir = _used(disk, _ns(1), 1, make_key, make_payload)
    tier = DiskTier(disk, CAP, _ns(1), metrics)
    try:
        _age(ns_dir, 40)
        lock_file = ns_dir / "kvtier.lock"
        aged = lock_file.stat().st_mtime
        monkeypatch.setattr(disk_module, "_TOUCH_EVERY_S", 0.0)
        assert tier.get(make_key(0)) is not None
        assert lock_file.stat().st_mtime > aged + 39 * DAY
    finally:
        tier.close()
