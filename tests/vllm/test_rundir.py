"""The per-engine lookup run directory: the same for both roles of one engine, distinct across
engines and DP replicas, private, and refused when someone else could reach it."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.vllm.rundir import remove_if_empty, run_dir_for, sweep_stale


def test_same_engine_same_dir_other_engine_or_replica_other_dir(tmp_path: Path) -> None:
    a = run_dir_for("engine-a", 0, str(tmp_path))
    assert run_dir_for("engine-a", 0, str(tmp_path)) == a  # the other role derives the same
    assert run_dir_for("engine-b", 0, str(tmp_path)) != a
    assert run_dir_for("engine-a", 1, str(tmp_path)) != a
    assert a.parent == tmp_path and a.is_dir()
    assert stat.S_IMODE(a.stat().st_mode) == 0o700


def test_dir_others_can_reach_is_refused(tmp_path: Path) -> None:
    d = run_dir_for("engine-a", 0, str(tmp_path))
    d.chmod(0o755)
    with pytest.raises(ConfigError, match="0o755"):
        run_dir_for("engine-a", 0, str(tmp_path))


def test_symlinked_dir_is_refused(tmp_path: Path) -> None:
    d = run_dir_for("engine-a", 0, str(tmp_path))
    d.rmdir()
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    os.symlink(target, d)
    with pytest.raises(ConfigError, match="symlink"):
        run_dir_for("engine-a", 0, str(tmp_path))


def test_missing_lookup_dir_and_empty_engine_id_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="lookup_dir"):
        run_dir_for("engine-a", 0, str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="engine_id"):
        run_dir_for("", 0, str(tmp_path))


def test_remove_if_empty_leaves_a_dir_with_sockets(tmp_path: Path) -> None:
    d = run_dir_for("engine-a", 0, str(tmp_path))
    (d / "lookup-rank1.sock").touch()
    remove_if_empty(d)
    assert d.is_dir()
    (d / "lookup-rank1.sock").unlink()
    remove_if_empty(d)
    assert not d.exists()
    remove_if_empty(d)  # the other role already removed it


def _dead_socket(path: Path) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()  # the file stays; connecting to it is refused


def _age(path: Path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A base dir short enough for unix socket paths (pytest's tmp_path often is not)."""
    path = Path(tempfile.mkdtemp(prefix="kvt-", dir="/tmp"))
    yield path
    shutil.rmtree(path)


def test_sweep_removes_only_dead_old_run_dirs(short_dir: Path) -> None:
    base = str(short_dir)
    mine = run_dir_for("me", 0, base)
    dead = run_dir_for("crashed", 0, base)
    _dead_socket(dead / "lookup-rank0.sock")
    _dead_socket(dead / "lookup-rank1.sock")
    young = run_dir_for("just-died", 0, base)
    _dead_socket(young / "lookup-rank0.sock")
    starting = run_dir_for("starting", 0, base)  # no socket bound yet
    other = run_dir_for("with-a-file", 0, base)
    _dead_socket(other / "lookup-rank0.sock")
    (other / "notes.txt").write_text("not ours to delete")
    live = run_dir_for("serving", 0, base)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(live / "lookup-rank0.sock"))
    listener.listen(1)
    _dead_socket(live / "lookup-rank1.sock")  # one dead rank does not make the engine dead
    try:
        for d in (mine, dead, starting, other, live):
            _age(d, 3600)
        assert sweep_stale(base, keep=mine) == [dead]
    finally:
        listener.close()
    assert not dead.exists()
    assert all(d.is_dir() for d in (mine, young, starting, other, live))


def test_lookup_base_port_is_the_config_key_else_vllms_kv_port_per_replica() -> None:
    from types import SimpleNamespace

    from kvtier.config import KVTierConfig
    from kvtier.vllm.rundir import lookup_base_port

    vc = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_port=14579))
    assert lookup_base_port(KVTierConfig(), vc, dp_rank=0, world=2) == 14579
    assert lookup_base_port(KVTierConfig(), vc, dp_rank=1, world=2) == 14581
    cfg = KVTierConfig(lookup_transport="tcp", lookup_base_port=15500)
    assert lookup_base_port(cfg, vc, dp_rank=1, world=4) == 15504
