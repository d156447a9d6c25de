"""One live process per disk namespace directory: a second process (another server, a vLLM
data-parallel replica) is refused naming the holder's pid, or with disk_conflict=own_dir gets a
directory of its own; the lock goes with the holder's death and with close(), and a forked
child never keeps it."""

from __future__ import annotations

import fcntl
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.errors import StartupError
from kvtier.metrics import Metrics
from kvtier.store import disk_lock
from kvtier.store.disk import DiskTier
from kvtier.store.secret import GENERATED_NAME
from tests.store.disk_holder import TIER_BYTES, payload_of

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 60.0
LOCK_NAME = "kvtier.lock"


class Holder:
    """tests/store/disk_holder.py in a child process, spoken to line by line with deadlines."""

    def __init__(self, disk_dir: Path, namespace: bytes, conflict: str = "refuse") -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.store.disk_holder", str(disk_dir), namespace.hex(),
             conflict],
            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
        )  # fmt: skip
        self._buf = b""
        first = self.line()
        assert first.startswith("ready "), first
        _, pid, directory = first.split(" ", 2)
        self.pid = int(pid)
        self.directory = Path(directory)

    def line(self) -> str:
        """The child's next output line; fails the test at the deadline or on its exit."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + WAIT_S
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while b"\n" not in self._buf:
                left = deadline - time.monotonic()
                assert left > 0, f"holder pid {self.proc.pid} said nothing in {WAIT_S}s"
                if sel.select(left):
                    chunk = os.read(self.proc.stdout.fileno(), 4096)
                    assert chunk, f"holder exited {self.proc.wait(WAIT_S)}: {self._buf!r}"
                    self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def ask(self, cmd: str, key: bytes) -> bool:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{cmd} {key.hex()}\n".encode())
        return self.line() == "ok"

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        assert self.proc.wait(WAIT_S) == -signal.SIGKILL

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(WAIT_S)


@pytest.fixture
def holders() -> Iterator[list[Holder]]:
    """Holders started by a test; each stopped at its end, however it ends."""
    started: list[Holder] = []
    yield started
    for h in started:
        if h.proc.poll() is None:
            h.proc.kill()
            h.proc.wait(WAIT_S)


def test_a_second_process_on_the_namespace_is_refused_naming_the_holders_pid(
    tmp_path: Path, namespace: bytes, metrics: Metrics, holders: list[Holder]
) -> None:
    holder = Holder(tmp_path, namespace)
    holders.append(holder)
    assert holder.directory == tmp_path / namespace.hex()
    assert (holder.directory / LOCK_NAME).read_text().split() == [str(holder.pid)]

    with pytest.raises(StartupError) as err:
        DiskTier(tmp_path, TIER_BYTES, namespace, metrics)
    msg = str(err.value)
    assert f"pid {holder.pid}" in msg and str(holder.directory) in msg
    assert "disk_conflict: own_dir" in msg and "disk_dir" in msg
    # the refused start changed nothing of the holder's
    assert holder.ask("put", b"a" * 16) and holder.ask("get", b"a" * 16)
    assert (holder.directory / LOCK_NAME).read_text().split() == [str(holder.pid)]


def test_own_dir_gives_the_second_process_its_own_directory_and_both_serve(
    tmp_path: Path, namespace: bytes, metrics: Metrics, holders: list[Holder]
) -> None:
    holder = Holder(tmp_path, namespace)
    holders.append(holder)
    a, b = b"a" * 16, b"b" * 16
    assert holder.ask("put", a)
    # a write of the holder's in flight: the second start must neither delete nor index it
    in_flight = holder.directory / "aa" / f"{'aa' * 16}.{holder.pid}.1.tmp"
    in_flight.parent.mkdir(mode=0o700, exist_ok=True)
    in_flight.write_bytes(b"half a record")

    mine = DiskTier(tmp_path, TIER_BYTES, namespace, metrics, conflict="own_dir")
    try:
        assert mine.directory == tmp_path / f"{namespace.hex()}.1"
        assert (mine.directory / LOCK_NAME).read_text().split() == [str(os.getpid())]
        assert mine.scan.entries == 0 and mine.scan.stale_temps_removed == 0
        assert in_flight.read_bytes() == b"half a record"
        # both serve, each from its own directory
        assert mine.put(b, payload_of(b)) and bytes(mine.get(b) or b"") == payload_of(b)
        assert holder.ask("get", a) and not holder.ask("get", b)
        assert not mine.contains(a)
        assert holder.ask("put", b) and holder.ask("get", b)
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            GENERATED_NAME,  # the disk tier's own record key, one per disk_dir
            namespace.hex(),
            f"{namespace.hex()}.1",
        ]
        # a third with own_dir takes the next free one
        third = DiskTier(tmp_path, TIER_BYTES, namespace, Metrics(rank=0), conflict="own_dir")
        assert third.directory == tmp_path / f"{namespace.hex()}.2"
        third.close()
    finally:
        mine.close()
    holder.stop()
    assert holder.proc.returncode == 0


def test_the_lock_is_free_once_the_holder_is_killed(
    tmp_path: Path, namespace: bytes, metrics: Metrics, holders: list[Holder]
) -> None:
    holder = Holder(tmp_path, namespace)
    holders.append(holder)
    assert holder.ask("put", b"a" * 16)
    holder.kill()

    tier = DiskTier(tmp_path, TIER_BYTES, namespace, metrics)
    try:
        assert tier.directory == tmp_path / namespace.hex()
        assert (tier.directory / LOCK_NAME).read_text().split() == [str(os.getpid())]
        # the dead holder's record is this process's now
        assert bytes(tier.get(b"a" * 16) or b"") == payload_of(b"a" * 16)
    finally:
        tier.close()


def test_close_releases_the_lock_and_a_forked_child_never_keeps_it(
    tmp_path: Path, namespace: bytes, metrics: Metrics
) -> None:
    tier = DiskTier(tmp_path, TIER_BYTES, namespace, metrics)
    with pytest.raises(StartupError, match=f"pid {os.getpid()}"):
        DiskTier(tmp_path, TIER_BYTES, namespace, Metrics(rank=0))
    # a child forked while the tier is open (a worker pool, a compile helper) lives on
    r, w = os.pipe()
    up_r, up_w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(w)
        os.write(up_w, b"u")  # fork has returned here: the at-fork hooks have run
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    os.close(up_w)
    try:
        assert os.read(up_r, 1) == b"u"
        tier.close()
        again = DiskTier(tmp_path, TIER_BYTES, namespace, Metrics(rank=0))
        assert again.directory == tmp_path / namespace.hex()
        again.close()
    finally:
        os.write(w, b"x")
        os.close(w)
        os.close(up_r)
        assert os.waitpid(child, 0)[1] == 0


def test_a_follower_reads_the_owners_directory_without_its_lock(
    tmp_path: Path, namespace: bytes, metrics: Metrics
) -> None:
    owner = DiskTier(tmp_path, TIER_BYTES, namespace, metrics)
    in_flight = owner.directory / "aa" / f"{'aa' * 16}.99.1.tmp"
    in_flight.parent.mkdir(mode=0o700)
    in_flight.write_bytes(b"half a record")
    follower = DiskTier(tmp_path, TIER_BYTES, namespace, Metrics(rank=1), follower=True)
    try:
        # the owner's write in flight is not the follower's to clean up
        assert in_flight.read_bytes() == b"half a record"
        assert follower.scan.stale_temps_removed == 0
        assert owner.put(b"a" * 16, payload_of(b"a" * 16))
        assert bytes(follower.get(b"a" * 16) or b"") == payload_of(b"a" * 16)
    finally:
        follower.close()
        owner.close()


def test_a_bad_conflict_value_is_a_clear_error(tmp_path: Path, namespace: bytes, metrics) -> None:
    with pytest.raises(ValueError, match=r"conflict='share' .* 'refuse' or 'own_dir'"):
        DiskTier(tmp_path, TIER_BYTES, namespace, metrics, conflict="share")
    assert list(tmp_path.iterdir()) == []


# ---- a lock held for a moment: another process's GC, or a claimer still writing its pid -----


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    assert proc.wait(WAIT_S) == 0
    return proc.pid


def _hold(lock_file: Path, pid: int) -> int:
    """Hold `lock_file`'s lock as another process's GC would (a separate open file), with
    `pid` written in it as its last owner left it."""
    lock_file.write_text(f"{pid}\n")
    fd = os.open(lock_file, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def test_a_lock_held_by_no_live_pid_is_waited_for_then_refused_naming_it(
    tmp_path: Path, namespace: bytes, metrics: Metrics, monkeypatch: pytest.MonkeyPatch
) -> None:
    DiskTier(tmp_path, TIER_BYTES, namespace, metrics).close()
    lock_file = tmp_path / namespace.hex() / LOCK_NAME
    dead = _dead_pid()
    gc_fd = _hold(lock_file, dead)
    waits: list[float] = []

    def gc_done(s: float) -> None:
        waits.append(s)
        os.close(gc_fd)  # the GC saw it was recent and let go

    monkeypatch.setattr(disk_lock, "_sleep", gc_done)
    tier = DiskTier(tmp_path, TIER_BYTES, namespace, Metrics(rank=0))
    assert len(waits) == 1 and tier.directory == tmp_path / namespace.hex()
    assert lock_file.read_text().split() == [str(os.getpid())]
    tier.close()

    # a holder that never lets go and wrote no live pid: refused once the wait is over
    gc_fd = _hold(lock_file, dead)
    clock = [0.0]
    monkeypatch.setattr(disk_lock, "_now", lambda: clock[0])
    monkeypatch.setattr(disk_lock, "_sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    try:
        with pytest.raises(StartupError, match=f"pid {dead}, which is no process here"):
            DiskTier(tmp_path, TIER_BYTES, namespace, Metrics(rank=0))
        assert clock[0] >= disk_lock._TRANSIENT_WAIT_S
    finally:
        os.close(gc_fd)


def test_a_directory_another_gc_removes_while_locking_is_made_again(
    tmp_path: Path, namespace: bytes, metrics: Metrics, monkeypatch: pytest.MonkeyPatch
) -> None:
    DiskTier(tmp_path, TIER_BYTES, namespace, metrics).close()
    ns_dir = tmp_path / namespace.hex()
    gc_fd = _hold(ns_dir / LOCK_NAME, _dead_pid())

    def gc_removes_it(s: float) -> None:
        # as disk_gc does: the lock file last, the directory, then the lock goes
        (ns_dir / LOCK_NAME).unlink()
        ns_dir.rmdir()
        os.close(gc_fd)

    monkeypatch.setattr(disk_lock, "_sleep", gc_removes_it)
    tier = DiskTier(tmp_path, TIER_BYTES, namespace, Metrics(rank=0))
    try:
        assert tier.directory == ns_dir and ns_dir.is_dir()
        assert (ns_dir / LOCK_NAME).read_text().split() == [str(os.getpid())]
        assert tier.put(b"a" * 16, payload_of(b"a" * 16))
    finally:
        tier.close()
    # the lock this tier held was on the linked file: the next start takes it at once
    monkeypatch.setattr(disk_lock, "_sleep", lambda s: pytest.fail("waited on a free lock"))
    DiskTier(tmp_path, TIER_BYTES, namespace, Metrics(rank=0)).close()
