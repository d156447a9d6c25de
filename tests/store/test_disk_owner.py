"""Data at rest belongs to its owner: what the disk tier creates is private (0700 directories,
0600 files, whatever the umask), and at startup it refuses directories another user owns, can
write or has pointed elsewhere with a symlink, and never indexes record files it did not write."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.errors import StartupError
from kvtier.metrics import Metrics
from kvtier.store import record
from kvtier.store.disk import DiskTier

SIZE = 4096
RECORD = record.HEADER_BYTES + SIZE
CAP = 16 * RECORD
OTHER_UID = 12345
LOCK_NAME = "kvtier.lock"


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _record_path(directory: Path, key: bytes) -> Path:
    h = key.hex()
    return directory / h[:2] / f"{h}.kvr"


def _record_bytes(scratch: Path, namespace: bytes, key: bytes, payload: bytes) -> bytes:
    """A valid record file's bytes, as a disk tier of `namespace` writes them."""
    tier = DiskTier(scratch, CAP, namespace, Metrics(rank=0))
    try:
        assert tier.put(key, payload)
        return _record_path(tier.directory, key).read_bytes()
    finally:
        tier.close()


@pytest.fixture
def umask_0() -> Iterator[None]:
    """The most permissive umask: modes must come from kvtier, not from the umask."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def test_created_dirs_are_0700_and_files_0600_whatever_the_umask(
    tmp_path, namespace, metrics, make_key, make_payload, umask_0
):
    disk_dir = tmp_path / "a" / "b"  # two components kvtier creates
    tier = DiskTier(disk_dir, CAP, namespace, metrics)
    k = make_key(1)
    assert tier.put(k, make_payload(1, SIZE))
    path = _record_path(tier.directory, k)
    tier.close()
    dirs = [tmp_path / "a", disk_dir, tier.directory, path.parent]
    assert [oct(_mode(d)) for d in dirs] == [oct(0o700)] * 4
    assert oct(_mode(path)) == oct(0o600)
    assert oct(_mode(tier.directory / LOCK_NAME)) == oct(0o600)


def test_a_namespace_dir_of_ours_that_others_can_read_is_made_private(
    tmp_path, namespace, metrics, umask_0
):
    # what kvtier before this change left behind under a 022 umask
    ns_dir = tmp_path / namespace.hex()
    ns_dir.mkdir(mode=0o755)
    tier = DiskTier(tmp_path, CAP, namespace, metrics)
    tier.close()
    assert oct(_mode(ns_dir)) == oct(0o700)


def test_a_namespace_dir_owned_by_another_uid_is_refused(tmp_path, namespace, metrics):
    ns_dir = tmp_path / namespace.hex()
    ns_dir.mkdir(mode=0o700)
    os.chown(ns_dir, OTHER_UID, OTHER_UID)
    with pytest.raises(StartupError) as err:
        DiskTier(tmp_path, CAP, namespace, metrics)
    msg = str(err.value)
    assert str(ns_dir) in msg
    assert f"uid {OTHER_UID}" in msg and f"uid {os.geteuid()}" in msg
    assert f"chown {os.geteuid()} {ns_dir}" in msg and "disk_dir" in msg
    assert list(ns_dir.iterdir()) == []  # nothing written into it, not even a lock file


def test_a_group_writable_namespace_dir_is_refused(tmp_path, namespace, metrics):
    ns_dir = tmp_path / namespace.hex()
    ns_dir.mkdir()
    os.chmod(ns_dir, 0o770)
    with pytest.raises(StartupError) as err:
        DiskTier(tmp_path, CAP, namespace, metrics)
    msg = str(err.value)
    assert str(ns_dir) in msg and "mode 0770" in msg and "group" in msg
    assert f"chmod -R go-rwx {ns_dir}" in msg
    assert _mode(ns_dir) == 0o770 and list(ns_dir.iterdir()) == []


def test_a_symlinked_namespace_dir_is_refused_naming_its_target(tmp_path, namespace, metrics):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    disk_dir = tmp_path / "disk"
    disk_dir.mkdir(mode=0o700)
    (disk_dir / namespace.hex()).symlink_to(target)
    with pytest.raises(StartupError) as err:
        DiskTier(disk_dir, CAP, namespace, metrics)
    msg = str(err.value)
    assert str(disk_dir / namespace.hex()) in msg and "symlink" in msg and str(target) in msg
    assert list(target.iterdir()) == []


def test_a_disk_dir_another_user_controls_is_refused(tmp_path, namespace, metrics):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(StartupError, match=f"disk_dir {link} is a symlink to '{real}'"):
        DiskTier(link, CAP, namespace, metrics)

    os.chown(real, OTHER_UID, OTHER_UID)
    with pytest.raises(StartupError) as err:
        DiskTier(real, CAP, namespace, metrics)
    assert f"disk_dir {real} is owned by uid {OTHER_UID}" in str(err.value)

    os.chown(real, os.geteuid(), os.getegid())
    os.chmod(real, 0o777)
    with pytest.raises(StartupError, match=rf"disk_dir {real} has mode 0777"):
        DiskTier(real, CAP, namespace, metrics)
    assert list(real.iterdir()) == []


def test_a_shared_sticky_disk_dir_like_tmp_is_fine(tmp_path, namespace, metrics, umask_0):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    tier = DiskTier(shared, CAP, namespace, metrics)
    tier.close()
    assert oct(_mode(tier.directory)) == oct(0o700)
    assert oct(_mode(shared)) == oct(0o1777)  # not kvtier's to change


def test_a_symlinked_or_foreign_shard_dir_is_refused(tmp_path, namespace, metrics):
    tier = DiskTier(tmp_path, CAP, namespace, metrics)
    tier.close()
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    shard = tier.directory / "ab"
    shard.symlink_to(target)
    with pytest.raises(StartupError, match=f"{shard} is a symlink to '{target}'"):
        DiskTier(tmp_path, CAP, namespace, Metrics(rank=0))
    shard.unlink()
    shard.mkdir(mode=0o700)
    os.chown(shard, OTHER_UID, OTHER_UID)
    with pytest.raises(StartupError, match=f"{shard} is owned by uid {OTHER_UID}"):
        DiskTier(tmp_path, CAP, namespace, Metrics(rank=0))


def test_planted_record_files_are_not_indexed_and_are_counted(
    tmp_path, namespace, metrics, make_key, make_payload, caplog
):
    tier = DiskTier(tmp_path, CAP, namespace, metrics)
    assert tier.put(make_key(0), make_payload(0, SIZE))
    tier.close()
    # three valid records this process did not write: another user's, a group-writable one,
    # and a symlink to a record file outside the tier
    foreign, writable, linked = (_record_path(tier.directory, make_key(i)) for i in (1, 2, 3))
    for i, path in ((1, foreign), (2, writable)):
        path.parent.mkdir(mode=0o700, exist_ok=True)
        path.write_bytes(
            _record_bytes(tmp_path / "scratch", namespace, make_key(i), make_payload(i, SIZE))
        )
    os.chown(foreign, OTHER_UID, OTHER_UID)
    os.chmod(writable, 0o620)
    outside = tmp_path / "outside.kvr"
    outside.write_bytes(
        _record_bytes(tmp_path / "scratch", namespace, make_key(3), make_payload(3, SIZE))
    )
    linked.parent.mkdir(mode=0o700, exist_ok=True)
    linked.symlink_to(outside)

    m2 = Metrics(rank=0)
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        again = DiskTier(tmp_path, CAP, namespace, m2)
    try:
        assert again.scan.entries == 1 and again.scan.untrusted_files == 3
        assert again.residency_bytes() == RECORD
        assert m2.value("verify_failures_total", tier="disk", reason="untrusted_file") == 3
        assert [again.contains(make_key(i)) for i in range(4)] == [True, False, False, False]
        assert [again.get(make_key(i)) is None for i in range(4)] == [False, True, True, True]
        for path in (foreign, writable, linked):
            assert str(path) in caplog.text
        # a write of the key replaces the planted file with this process's own
        assert again.put(make_key(1), make_payload(1, SIZE))
        st = os.lstat(foreign)
        assert (st.st_uid, oct(stat.S_IMODE(st.st_mode))) == (os.geteuid(), oct(0o600))
    finally:
        again.close()
