"""The disk tier when its directory is shared or disturbed: other processes on the same host
(engines, followers, whoever deletes or truncates files), crashes mid-write, a filesystem that
fills up, refuses writes or reports errors late, and a corrupted retention table beside the
records. Every test checks bytes, files on disk and counters, never timing."""

from __future__ import annotations

import errno
import os
import selectors
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import kvtier.store.disk as disk_module
from kvtier.config import KVTierConfig
from kvtier.errors import StartupError
from kvtier.metrics import Metrics
from kvtier.store import record
from kvtier.store.disk import DiskTier
from kvtier.store.factory import build_stack
from kvtier.store.memory import MemoryTier
from kvtier.store.retention import RETENTION_FILE
from kvtier.store.stack import TierStack

from .conftest import FakeClock, key_of, payload_of

REPO = Path(__file__).resolve().parents[2]
SIZE = 4096
RECORD = record.HEADER_BYTES + SIZE
WAIT_S = 60.0


def _record_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*.kvr") if p.is_file())


def _bytes_on_disk(directory: Path) -> int:
    """Bytes of every regular file under a namespace directory but the lock and retention table:
    what the tier's budget is about (records, and any temp file it left behind)."""
    skip = {"kvtier.lock", RETENTION_FILE}
    return sum(
        p.lstat().st_size for p in directory.rglob("*") if p.is_file() and p.name not in skip
    )


def _stack(root: Path, namespace: bytes, metrics: Metrics, records: int, **kw) -> TierStack:
    memory = MemoryTier(SIZE, 4 * SIZE, namespace, metrics, pin_memory=False)
    disk = DiskTier(root, records * RECORD, namespace, metrics)
    return TierStack(memory, [disk], metrics, **kw)


def _flushed(stack: TierStack) -> None:
    assert stack.flush(WAIT_S), "write-behind did not drain"


def _read_line(proc: subprocess.Popen, buf: bytearray) -> str:
    """The child's next stdout line, under a deadline."""
    assert proc.stdout is not None
    deadline = time.monotonic() + WAIT_S
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            assert left > 0, f"child {proc.pid} said nothing in {WAIT_S}s"
            if sel.select(left):
                chunk = os.read(proc.stdout.fileno(), 4096)
                assert chunk, f"child exited {proc.wait(WAIT_S)}: {bytes(buf)!r}"
                buf += chunk
    line, _, rest = bytes(buf).partition(b"\n")
    buf[:] = rest
    return line.decode()


def _child(script: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        bufsize=0,
    )


# ---- crash mid-write ---------------------------------------------------------------------

_CRASH_MID_WRITE = """
import os, sys
from kvtier.metrics import Metrics
from kvtier.store.disk import DiskTier
from tests.store.conftest import key_of, payload_of
disk_dir, ns_hex, cap, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
tier = DiskTier(disk_dir, cap, bytes.fromhex(ns_hex), Metrics(rank=0))
for i in range(3):
    assert tier.put(key_of(i), payload_of(i, size))
real_write = os.write
calls = [0]
def write(fd, data):
    calls[0] += 1
    if calls[0] == 2:  # the header went out; half the payload, then stop for the kill
        real_write(fd, bytes(data)[: len(data) // 2])
        print("mid-write", flush=True)
        sys.stdin.read()  # never returns: the parent kills us here
    return real_write(fd, data)
os.write = write
print("ready", flush=True)
tier.put(key_of(3), payload_of(3, size))
print("finished", flush=True)
"""


def test_an_engine_killed_mid_write_leaves_nothing_servable_and_a_restart_sweeps_it(
    tmp_path: Path, namespace: bytes, metrics: Metrics
):
    cap = 8 * RECORD
    proc = _child(_CRASH_MID_WRITE, str(tmp_path), namespace.hex(), str(cap), str(SIZE))
    buf = bytearray()
    try:
        assert _read_line(proc, buf) == "ready"
        assert _read_line(proc, buf) == "mid-write"
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(WAIT_S) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(WAIT_S)
    ns_dir = tmp_path / namespace.hex()
    temps = list(ns_dir.rglob("*.tmp"))
    assert len(temps) == 1 and temps[0].stat().st_size < RECORD  # the torn write is there

    tier = DiskTier(tmp_path, cap, namespace, metrics)  # the lock died with the child
    try:
        assert tier.scan.stale_temps_removed == 1 and tier.scan.entries == 3
        assert not list(ns_dir.rglob("*.tmp"))
        assert not tier.contains(key_of(3)) and tier.get(key_of(3)) is None
        for i in range(3):
            assert bytes(tier.get(key_of(i)) or b"") == payload_of(i, SIZE)
        assert tier.residency_bytes() == 3 * RECORD == _bytes_on_disk(ns_dir)
        assert metrics.value("tier_residency_bytes", tier="disk") == 3 * RECORD
        # the key the crash cut short is stored again whole
        assert tier.put(key_of(3), payload_of(3, SIZE))
        assert bytes(tier.get(key_of(3)) or b"") == payload_of(3, SIZE)
    finally:
        tier.close()


# ---- two engines on one disk_dir ---------------------------------------------------------

_CHURN = """
import sys
from kvtier.metrics import Metrics
from kvtier.store.disk import DiskTier
from tests.store.conftest import key_of, payload_of
disk_dir, ns_hex, cap, size, conflict, base = sys.argv[1:]
cap, size, base = int(cap), int(size), int(base)
tier = DiskTier(disk_dir, cap, bytes.fromhex(ns_hex), Metrics(rank=0), conflict=conflict,
                gc_days=1)
print("ready", tier.directory, flush=True)
sys.stdin.readline()  # every engine started: churn together
worst = 0
for i in range(base, base + 120):
    assert tier.put(key_of(i), payload_of(i, size), parent=key_of(i - 1) if i % 4 else b"")
    worst = max(worst, tier.residency_bytes())
    if i % 3 == 0 and i > base:
        got = tier.get(key_of(i - 1))
        assert got is None or bytes(got) == payload_of(i - 1, size)
print("done", worst, flush=True)
sys.stdin.readline()
tier.close()
"""


def test_engines_sharing_a_disk_dir_churn_within_their_own_budgets_and_never_mix_records(
    tmp_path: Path, namespace: bytes, other_namespace: bytes
):
    """Three engines at once on one disk_dir: two of one namespace (the second in its own_dir)
    and one of another namespace. Each stays under its own disk_bytes on disk, and every record
    left afterwards verifies as the bytes its own engine wrote."""
    cap = 6 * RECORD
    engines = [
        (namespace, "own_dir", 0),
        (namespace, "own_dir", 1000),
        (other_namespace, "refuse", 2000),
    ]
    procs = []
    bufs = []
    dirs = []
    try:
        for ns, conflict, base in engines:
            p = _child(_CHURN, str(tmp_path), ns.hex(), str(cap), str(SIZE), conflict, str(base))
            procs.append(p)
            bufs.append(bytearray())
            line = _read_line(p, bufs[-1])
            assert line.startswith("ready "), line
            dirs.append(Path(line.split(" ", 1)[1]))
        assert len(set(dirs)) == 3  # the second engine of `namespace` got a directory of its own
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(b"go\n")
        for p, buf in zip(procs, bufs, strict=True):
            line = _read_line(p, buf)
            assert line.startswith("done "), line
            assert int(line.split()[1]) <= cap
        # while all three still hold their directories: each within its own budget
        for d in dirs:
            assert 0 < _bytes_on_disk(d) <= cap
            assert not list(d.rglob("*.tmp"))
    finally:
        for p in procs:
            if p.poll() is None:
                assert p.stdin is not None
                p.stdin.close()
                p.wait(WAIT_S)
    # every record left verifies under its own directory's engine and holds that engine's bytes
    for d, (ns, _, base) in zip(dirs, engines, strict=True):
        held = {f.name[:32] for f in _record_files(d)}
        assert held
        wanted = {key_of(i).hex(): i for i in range(base, base + 120)}
        assert held <= set(wanted)  # nothing of another engine's keys in this directory
        m = Metrics(rank=0)
        tier = DiskTier(tmp_path, cap, ns, m)  # the first free one: the directory above or `d`
        try:
            if tier.directory == d:
                for h in held:
                    i = wanted[h]
                    assert bytes(tier.get(key_of(i)) or b"") == payload_of(i, SIZE)
                assert m.value("verify_failures_total", tier="disk", reason="tag_mismatch") == 0
        finally:
            tier.close()


def test_a_second_engine_is_refused_even_after_the_lock_file_was_deleted(
    tmp_path: Path, namespace: bytes, metrics: Metrics
):
    """Something that cleans old files (systemd-tmpfiles under /tmp or /var/tmp, a cron job, an
    operator) deletes the running engine's kvtier.lock: its mtime moves only at start, close
    and hourly reads. A second engine of the namespace must still be refused: two live owners
    of one directory each fill it to disk_bytes and delete each other's records."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.store.disk_holder", str(tmp_path), namespace.hex(),
         "refuse"],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
    )  # fmt: skip
    buf = bytearray()
    second = None
    try:
        line = _read_line(proc, buf)
        assert line.startswith("ready "), line
        ns_dir = Path(line.split(" ", 2)[2])
        assert proc.stdin is not None
        proc.stdin.write(f"put {key_of(0).hex()}\n".encode())
        assert _read_line(proc, buf) == "ok"
        (ns_dir / "kvtier.lock").unlink()
        try:
            second = DiskTier(tmp_path, 1 << 20, namespace, metrics)
        except StartupError:
            return  # refused: the first engine still owns its directory
        assert second.directory != ns_dir, (
            f"a second live owner of {ns_dir} (the first, pid {proc.pid}, still runs)"
        )
    finally:
        if second is not None:
            second.close()
        if proc.poll() is None:
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(WAIT_S)


def test_a_follower_forgets_the_records_its_owner_evicted(
    tmp_path: Path, namespace: bytes, metrics: Metrics
):
    """A replicated layout: rank 0 owns the directory and evicts; another rank follows it. The
    follower must not keep claiming (and indexing, without bound) records the owner removed."""
    cap = 4 * RECORD
    owner = DiskTier(tmp_path, cap, namespace, metrics)
    follower = DiskTier(tmp_path, cap, namespace, Metrics(rank=1), follower=True)
    try:
        keys = [key_of(i) for i in range(40)]
        for i, k in enumerate(keys):
            assert owner.put(k, payload_of(i, SIZE))
            # the follower's rank looks the new chunk up, as every rank of a lookup does
            assert follower.contains(k)
        assert len(owner) == 4 and _bytes_on_disk(owner.directory) <= cap
        # the owner evicted keys[0] long ago: the follower still claims it, so a lookup on
        # that rank counts (and leases) a chunk whose load can only fail
        assert not follower.contains(keys[0]), "follower claims a record the owner evicted"
        assert follower.lease("lk1", keys[:1]) == 0
        # and its index (memory) and residency gauge grow with every key it ever saw
        assert len(follower) <= 4
        assert follower.residency_bytes() <= cap
    finally:
        follower.close()
        owner.close()


def test_the_follower_of_an_own_dir_engine_reads_its_owners_directory(
    tmp_path: Path, namespace: bytes
):
    """Two engines of one replicated model on one host with disk_conflict=own_dir: the second
    engine's rank 0 writes `<namespace>.1`; its other ranks must read there too, not in the
    directory of the first engine."""
    first_owner = DiskTier(tmp_path, 8 * RECORD, namespace, Metrics(rank=0), engine="/run/a")
    second_owner = DiskTier(tmp_path, 8 * RECORD, namespace, Metrics(rank=0), conflict="own_dir",
                            engine="/run/b")  # fmt: skip
    # built as the registry builds a follower rank of the second engine (same settings; its
    # engine named by the lookup run dir every rank of it shares)
    second_follower = DiskTier(
        tmp_path, 8 * RECORD, namespace, Metrics(rank=1), follower=True, conflict="own_dir",
        engine="/run/b",
    )  # fmt: skip
    try:
        assert second_owner.directory == tmp_path / f"{namespace.hex()}.1"
        mine, theirs = key_of(1), key_of(2)
        assert second_owner.put(mine, payload_of(1, SIZE))
        assert first_owner.put(theirs, payload_of(2, SIZE))
        assert second_follower.directory == second_owner.directory, (
            f"follower reads {second_follower.directory}, its owner writes {second_owner.directory}"
        )
        assert second_follower.contains(mine)
        assert not second_follower.contains(theirs)
    finally:
        second_follower.close()
        second_owner.close()
        first_owner.close()


# ---- files disturbed between index and read ----------------------------------------------


def test_a_record_truncated_after_its_lookup_is_a_counted_miss_and_no_byte_is_copied(
    tmp_path: Path, namespace: bytes, metrics: Metrics
):
    stack = _stack(tmp_path, namespace, metrics, 8)
    disk = stack.lower[0]
    try:
        k = key_of(7)
        assert disk.put(k, payload_of(7, SIZE))  # on disk only
        assert stack.lookup([k], lease_id="lk") == 1
        # another process truncates the leased record to half
        path = next(iter(_record_files(disk.directory)))
        os.truncate(path, RECORD // 2)
        dst = torch.full((SIZE,), 0xAB, dtype=torch.uint8)
        assert stack.read_into(k, dst) is None
        assert bool((dst == 0xAB).all())  # not one byte of the torn record reached dst
        assert metrics.value("verify_failures_total", tier="disk", reason="length_mismatch") == 1
        stack.release("lk")
        assert stack.lookup([k], lease_id="lk2") == 0 and not path.exists()
        assert disk.residency_bytes() == 0 == _bytes_on_disk(disk.directory)
    finally:
        stack.close()


def test_an_eviction_racing_a_read_is_a_miss_not_a_bad_record(
    tmp_path: Path, namespace: bytes, metrics: Metrics, monkeypatch: pytest.MonkeyPatch
):
    """A prefetch reads a chunk nobody leased while the write-behind evicts it: a plain miss.
    Counting it as a verify failure makes `kvtier doctor` report corrupted bytes (FAIL)."""
    tier = DiskTier(tmp_path, RECORD, namespace, metrics)  # room for one record
    a, b = key_of(0), key_of(1)
    assert tier.put(a, payload_of(0, SIZE))
    real_read = disk_module._read_file

    def read_while_evicted(path: Path, size: int):
        # the read took the size under the lock and let go; the write-behind runs now
        assert tier.put(b, payload_of(1, SIZE))  # evicts a
        return real_read(path, size)

    monkeypatch.setattr(disk_module, "_read_file", read_while_evicted)
    assert tier.get(a) is None
    monkeypatch.setattr(disk_module, "_read_file", real_read)
    assert bytes(tier.get(b) or b"") == payload_of(1, SIZE)
    assert metrics.value("evictions_total", tier="disk") == 1
    assert metrics.value("verify_failures_total", tier="disk", reason="missing") == 0
    tier.close()


def test_a_record_stored_again_while_a_read_of_it_failed_is_kept(
    tmp_path: Path, namespace: bytes, metrics: Metrics, monkeypatch: pytest.MonkeyPatch
):
    """A read finds the file gone (evicted), and before it reports the miss the write-behind
    stores the chunk again: the fresh record must stay, as its put() said."""
    tier = DiskTier(tmp_path, RECORD, namespace, metrics)  # room for one record
    a, b = key_of(0), key_of(1)
    assert tier.put(a, payload_of(0, SIZE))
    real_read = disk_module._read_file

    def read_across_evict_and_restore(path: Path, size: int):
        assert tier.put(b, payload_of(1, SIZE))  # evicts a
        try:
            return real_read(path, size)  # FileNotFoundError
        finally:
            assert tier.put(a, payload_of(0, SIZE))  # a is back (evicts b)

    monkeypatch.setattr(disk_module, "_read_file", read_across_evict_and_restore)
    assert tier.get(a) is None
    monkeypatch.setattr(disk_module, "_read_file", real_read)
    assert tier.contains(a), "the record stored last was dropped by the failed read"
    assert bytes(tier.get(a) or b"") == payload_of(0, SIZE)
    assert tier.residency_bytes() == _bytes_on_disk(tier.directory) == RECORD
    tier.close()


# ---- a full, read-only or failing filesystem -----------------------------------------------


@pytest.mark.parametrize("where", ["write", "replace", "mkdir"])
def test_enospc_behind_the_stack_is_counted_never_raised_and_never_leaves_a_partial_record(
    tmp_path: Path,
    namespace: bytes,
    metrics: Metrics,
    monkeypatch: pytest.MonkeyPatch,
    where: str,
):
    stack = _stack(tmp_path, namespace, metrics, 8)
    disk = stack.lower[0]
    try:
        assert stack.put(key_of(0), payload_of(0, SIZE))
        _flushed(stack)
        assert disk.contains(key_of(0))

        def no_space(*args, **kwargs):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        real_write = os.write
        if where == "write":
            calls = [0]

            def write(fd, data):  # the header lands, the payload does not
                calls[0] += 1
                if calls[0] % 2 == 0:
                    no_space()
                return real_write(fd, data)

            monkeypatch.setattr(os, "write", write)
        elif where == "replace":
            monkeypatch.setattr(os, "replace", no_space)
        else:
            monkeypatch.setattr(disk_module, "make_private_dir", no_space)
        for i in range(1, 4):
            assert stack.put(key_of(i), payload_of(i, SIZE))  # memory takes it: no exception
        _flushed(stack)
        monkeypatch.undo()
        assert metrics.value("store_failures_total", tier="disk", reason="enospc") == 3
        assert metrics.value("store_failures_total", tier="disk", reason="error") == 0
        for i in range(1, 4):
            assert not disk.contains(key_of(i)) and disk.get(key_of(i)) is None
        assert not list(disk.directory.rglob("*.tmp"))
        assert _record_files(disk.directory) == [
            disk.directory / key_of(0).hex()[:2] / f"{key_of(0).hex()}.kvr"
        ]
        assert disk.residency_bytes() == RECORD == _bytes_on_disk(disk.directory)
        # memory still serves what the disk could not take
        dst = torch.zeros(SIZE, dtype=torch.uint8)
        assert stack.read_into(key_of(3), dst) == "memory"
        assert bytes(dst.numpy()) == payload_of(3, SIZE)
        # the filesystem recovers: the next write lands whole
        assert stack.put(key_of(4), payload_of(4, SIZE))
        _flushed(stack)
        assert bytes(disk.get(key_of(4)) or b"") == payload_of(4, SIZE)
    finally:
        stack.close()


def test_a_write_error_reported_at_close_leaves_no_temp_file_behind(
    tmp_path: Path, namespace: bytes, metrics: Metrics, monkeypatch: pytest.MonkeyPatch
):
    """NFS, FUSE and quota'd filesystems report a full disk when the file is closed (deferred
    writeback): the write is lost and counted, and its temp file must go like any failed
    write's, or every such write leaves a whole chunk on disk outside the budget."""
    cap = 4 * RECORD
    tier = DiskTier(tmp_path, cap, namespace, metrics)
    temp_fds: set[int] = set()
    real_create = disk_module._create_private
    real_close = os.close

    def create(path: Path) -> int:
        fd = real_create(path)
        temp_fds.add(fd)
        return fd

    def close(fd: int) -> None:
        real_close(fd)  # Linux frees the descriptor even when close reports an error
        if fd in temp_fds:
            temp_fds.discard(fd)
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    monkeypatch.setattr(disk_module, "_create_private", create)
    monkeypatch.setattr(os, "close", close)
    for i in range(12):
        assert tier.put(key_of(i), payload_of(i, SIZE)) is False
    monkeypatch.undo()
    assert metrics.value("store_failures_total", tier="disk", reason="enospc") == 12
    assert tier.residency_bytes() == 0
    leftovers = list(tier.directory.rglob("*.tmp"))
    assert not leftovers, f"{len(leftovers)} temp files left, {_bytes_on_disk(tier.directory)} B"
    assert _bytes_on_disk(tier.directory) <= cap
    tier.close()


def test_a_read_only_directory_degrades_to_reads_and_counts_every_lost_write(
    tmp_path: Path, namespace: bytes, metrics: Metrics, monkeypatch: pytest.MonkeyPatch
):
    """The filesystem goes read-only under a running engine (EROFS; chmod would not stop root):
    records already there keep being served, every write is a counted io_error and nothing is
    raised into the caller or left half-written; a restart on it is a clear startup error."""
    stack = _stack(tmp_path, namespace, metrics, 8)
    disk = stack.lower[0]
    try:
        assert stack.put(key_of(0), payload_of(0, SIZE))
        _flushed(stack)
        real_open = os.open

        def ro_open(path, flags, *args, **kwargs):
            if flags & (os.O_CREAT | os.O_WRONLY | os.O_RDWR):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            return real_open(path, flags, *args, **kwargs)

        def ro_mkdir(path, mode=0o777, *, dir_fd=None):
            # as Linux answers on a read-only mount: EEXIST first, EROFS for a new entry
            try:
                os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path)) from None
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path))

        monkeypatch.setattr(os, "open", ro_open)
        monkeypatch.setattr(os, "mkdir", ro_mkdir)
        for i in range(1, 4):
            assert stack.put(key_of(i), payload_of(i, SIZE))
        _flushed(stack)
        assert metrics.value("store_failures_total", tier="disk", reason="io_error") == 3
        assert not any(disk.contains(key_of(i)) for i in range(1, 4))
        # the memory tier lost key 0 to newer chunks; the disk still serves it, verified
        dst = torch.zeros(SIZE, dtype=torch.uint8)
        assert stack.read_into(key_of(0), dst) in ("memory", "disk")
        assert bytes(dst.numpy()) == payload_of(0, SIZE)
        assert bytes(disk.get(key_of(0)) or b"") == payload_of(0, SIZE)
        stack.close()
        # a restart on the read-only filesystem: a StartupError naming disk_dir, not a crash
        config = KVTierConfig(
            memory_bytes=4 * SIZE, disk_bytes=8 * RECORD, disk_dir=str(tmp_path),
            record_key="k" * 40,
        )  # fmt: skip
        with pytest.raises(StartupError, match="disk_dir"):
            build_stack(config, namespace, SIZE, Metrics(rank=0))
        monkeypatch.undo()
        assert _record_files(disk.directory) and not list(tmp_path.rglob("*.tmp"))
    finally:
        stack.close()


# ---- restarts over an existing directory -------------------------------------------------


def test_restarts_over_a_disturbed_directory_keep_the_files_on_disk_within_the_budget(
    tmp_path: Path, namespace: bytes
):
    """Five runs over one directory, each with another budget, each finding what the last left
    plus damage done meanwhile (a torn temp file, a truncated record): at every
    point the record bytes on disk equal the tier's count and stay under its disk_bytes, and
    nothing damaged is ever served."""
    budgets = [10, 4, 7, 3, 6]
    n = 0
    for run, records in enumerate(budgets):
        cap = records * RECORD
        m = Metrics(rank=0)
        tier = DiskTier(tmp_path, cap, namespace, m)
        try:
            ns_dir = tier.directory
            assert _bytes_on_disk(ns_dir) == tier.residency_bytes() <= cap
            for _ in range(9):
                parent = key_of(n - 1) if n % 3 else b""
                assert tier.put(key_of(n), payload_of(n, SIZE), parent=parent)
                assert _bytes_on_disk(ns_dir) == tier.residency_bytes() <= cap
                n += 1
            served = 0
            for i in range(n):
                got = tier.get(key_of(i))
                if got is not None:
                    assert bytes(got) == payload_of(i, SIZE)
                    served += 1
            assert served == len(tier) and _bytes_on_disk(ns_dir) == tier.residency_bytes()
        finally:
            tier.close()
        # meanwhile, between runs: damage
        files = _record_files(ns_dir)
        if files:
            os.truncate(files[0], RECORD // 3)
        shard = ns_dir / "ee"
        shard.mkdir(mode=0o700, exist_ok=True)
        (shard / f"{'ee' * 16}.4242.{run}.tmp").write_bytes(b"x" * RECORD)


@pytest.mark.parametrize("who", ["owner restart", "follower"])
def test_an_empty_record_file_is_a_miss_not_a_crash(
    tmp_path: Path, namespace: bytes, metrics: Metrics, who: str
):
    """Records are written without fsync on purpose ("a torn write after power loss reads as a
    miss"); after a power cut XFS and ext4 leave a renamed file with no data: zero bytes. That
    file must be a miss, not a tier that cannot start (or a follower whose lookup raises)."""
    cap = 8 * RECORD
    owner = DiskTier(tmp_path, cap, namespace, metrics)
    good, torn = key_of(1), key_of(2)
    assert owner.put(good, payload_of(1, SIZE))
    if who == "owner restart":
        assert owner.put(torn, payload_of(2, SIZE))
        owner.close()
        os.truncate(owner.directory / torn.hex()[:2] / f"{torn.hex()}.kvr", 0)
        tier = DiskTier(tmp_path, cap, namespace, metrics)  # the restart after the power cut
    else:
        tier = DiskTier(tmp_path, cap, namespace, Metrics(rank=1), follower=True)
        path = owner.directory / torn.hex()[:2] / f"{torn.hex()}.kvr"
        path.parent.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)  # what the owner's rename left after the cut
    try:
        assert tier.get(torn) is None
        assert bytes(tier.get(good) or b"") == payload_of(1, SIZE)
        assert tier.lookup_prefix([good]) == 1
    finally:
        tier.close()
        owner.close()


# ---- the retention table beside the records -----------------------------------------------


def _retention_file(tmp_path: Path, namespace: bytes, text: str | bytes) -> Path:
    disk = DiskTier(tmp_path, 4 * RECORD, namespace, Metrics(rank=0))
    path = disk.directory / RETENTION_FILE
    disk.close()
    data = text.encode() if isinstance(text, str) else text
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(
            '{"version": 1, "until": {"' + key_of(0).hex() + '": 1' + "0" * 400 + "}}",
            id="int-no-float-holds",
        ),
        pytest.param("[" * 100_000, id="nested-deep"),
    ],
)
def test_a_corrupted_retention_file_is_ignored_and_the_rank_starts(
    tmp_path: Path, namespace: bytes, metrics: Metrics, content: str
):
    """RetentionTable.load promises: "anything malformed is logged and ignored, never raised".
    A rank whose table file was corrupted must still build its tiers."""
    _retention_file(tmp_path, namespace, content)
    clock = FakeClock(start=2_000_000_000.0)
    stack = _stack(tmp_path, namespace, metrics, 4, retention_limit=8, clock=clock)
    try:
        assert not stack.retention.holds(key_of(0))
        assert stack.put(key_of(0), payload_of(0, SIZE))
    finally:
        stack.close()


def test_a_huge_or_binary_retention_file_is_ignored_without_reading_it(
    tmp_path: Path, namespace: bytes, metrics: Metrics, monkeypatch: pytest.MonkeyPatch
):
    path = _retention_file(tmp_path, namespace, b"")
    os.truncate(path, 1 << 40)  # sparse: 1 TiB that costs nothing on disk
    real_read_bytes = Path.read_bytes
    read: list[Path] = []

    def read_bytes(self: Path) -> bytes:
        read.append(self)
        return real_read_bytes(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    clock = FakeClock(start=2_000_000_000.0)
    stack = _stack(tmp_path, namespace, metrics, 4, retention_limit=8, clock=clock)
    try:
        assert len(stack.retention) == 0 and path not in read
    finally:
        stack.close()
    # close() replaced it with the (empty) live table, written whole
    assert path.stat().st_size < 100
    # binary garbage, then a table another run saved: the garbage is ignored, the table kept
    path.write_bytes(os.urandom(4096))
    stack = _stack(tmp_path, namespace, metrics, 4, retention_limit=8, clock=clock)
    try:
        assert len(stack.retention) == 0
        assert stack.admin("retain", [key_of(5)], clock() + 60) == 1
    finally:
        stack.close()
    assert not list(path.parent.glob(".retention.json.*"))  # no temp file left beside it
    stack = _stack(tmp_path, namespace, metrics, 4, retention_limit=8, clock=clock)
    try:
        assert stack.retention.holds(key_of(5))
    finally:
        stack.close()


def test_a_follower_started_before_its_owner_waits_for_the_directory_the_owner_takes(
    tmp_path: Path, namespace: bytes
):
    """The ranks of an engine start together: a follower rank may look before its owner rank
    locked a directory. Under own_dir it waits (bounded) for the directory whose lock names
    its engine, not the first one another engine holds."""
    other = DiskTier(tmp_path, 8 * RECORD, namespace, Metrics(rank=0), engine="/run/a")
    got: list[DiskTier] = []
    follower = threading.Thread(target=lambda: got.append(DiskTier(
        tmp_path, 8 * RECORD, namespace, Metrics(rank=1), follower=True, conflict="own_dir",
        engine="/run/b",
    )))  # fmt: skip
    follower.start()
    owner = DiskTier(tmp_path, 8 * RECORD, namespace, Metrics(rank=0), conflict="own_dir",
                     engine="/run/b")  # fmt: skip
    follower.join(30.0)
    try:
        assert got and got[0].directory == owner.directory == tmp_path / f"{namespace.hex()}.1"
    finally:
        for t in (*got, owner, other):
            t.close()


def test_the_stack_names_its_engine_in_the_disk_lock(tmp_path: Path, namespace: bytes):
    """What a follower matches: the owner's lock names the engine replica build_stack got."""
    config = KVTierConfig(memory_bytes=8 * SIZE, disk_bytes=8 * RECORD, disk_dir=str(tmp_path),
                          chunk_size=16)  # fmt: skip
    stack = build_stack(config, namespace, SIZE, Metrics(rank=0), engine="/run/replica-7")
    try:
        disk = stack.lower[0]
        lines = (disk.directory / "kvtier.lock").read_text().splitlines()
        assert lines == [str(os.getpid()), "engine /run/replica-7"]
    finally:
        stack.close()
