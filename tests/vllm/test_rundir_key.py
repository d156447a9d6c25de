"""The lookup key goes with its engine's run directory: the last role out removes both, and
the sweep of dead engines takes a run dir whose only other entry is the key."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.lookup import KEY_FILE, engine_key
from kvtier.vllm.rundir import remove_if_empty, run_dir_for, sweep_stale


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A base dir short enough for unix socket paths (pytest's tmp_path often is not)."""
    path = Path(tempfile.mkdtemp(prefix="kvt-", dir="/tmp"))
    yield path
    shutil.rmtree(path)


def _dead_socket(path: Path) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()  # the file stays; connecting to it is refused


def test_the_last_role_out_removes_the_key_with_the_run_dir(short_dir: Path) -> None:
    d = run_dir_for("engine-a", 0, str(short_dir))
    key = engine_key(d)
    (d / "lookup-rank0.sock").touch()
    remove_if_empty(d)  # the scheduler goes first: a rank's socket is still there
    assert (d / KEY_FILE).is_file() and engine_key(d) == key
    (d / "lookup-rank0.sock").unlink()
    remove_if_empty(d)  # the rank goes last
    assert not d.exists()
    remove_if_empty(d)  # and the other role finds it gone


def test_a_tcp_engines_run_dir_holds_only_the_key_and_goes_at_shutdown(short_dir: Path) -> None:
    d = run_dir_for("engine-tcp", 0, str(short_dir))
    engine_key(d)
    remove_if_empty(d)
    assert not d.exists()


def test_sweep_takes_a_dead_engines_key_but_not_a_live_or_starting_ones(short_dir: Path) -> None:
    base = str(short_dir)
    mine = run_dir_for("me", 0, base)
    dead = run_dir_for("crashed", 0, base)
    engine_key(dead)
    _dead_socket(dead / "lookup-rank0.sock")
    starting = run_dir_for("starting", 0, base)  # its key written, no socket bound yet
    engine_key(starting)
    live = run_dir_for("serving", 0, base)
    engine_key(live)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(live / "lookup-rank0.sock"))
    listener.listen(1)
    old = time.time() - 3600
    try:
        for d in (mine, dead, starting, live):
            os.utime(d, (old, old))
        assert sweep_stale(base, keep=mine) == [dead]
    finally:
        listener.close()
    assert not dead.exists()
    assert all((d / KEY_FILE).is_file() for d in (starting, live))
