"""Where one vLLM engine's lookup sockets live, derived identically by its scheduler and workers.

vLLM gives every process of an engine the same `kv_transfer_config.engine_id` (workers even
re-broadcast TP rank 0's), so the directory name is a digest of it plus the DP rank: identical
within one engine replica, distinct across replicas and engines. The directory also holds the
replica's lookup key (`kvtier.lookup.keyfile`, over ipc and tcp alike), which goes with it.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.lookup.endpoints import check_private_dir
from kvtier.lookup.keyfile import KEY_FILE
from kvtier.offload.wiring import OffloadSpec
from kvtier.topology import Topology

__all__ = ["lookup_base_port", "offload_spec", "remove_if_empty", "run_dir_for", "sweep_stale"]

log = logging.getLogger("kvtier")


def _base_dir(lookup_dir: str | None) -> Path:
    if lookup_dir is not None:
        base = Path(lookup_dir)
        if not base.is_dir():
            raise ConfigError(
                f"lookup_dir={lookup_dir!r} is not an existing directory; create it or unset "
                "lookup_dir to use $XDG_RUNTIME_DIR or /tmp"
            )
        return base
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK):
        return Path(xdg)
    return Path("/tmp")


def _prefix() -> str:
    return f"kvtier-{os.getuid()}-"


def run_dir_for(engine_id: str, dp_rank: int, lookup_dir: str | None = None) -> Path:
    """The private (0o700) run directory of one engine replica, created if missing.

    Raises ConfigError when the path exists but is not a private directory of this user.
    """
    if not engine_id:
        raise ConfigError(
            "kv_transfer_config.engine_id is empty; vLLM sets a uuid by default, so leave it "
            "unset or give every engine its own id"
        )
    digest = hashlib.blake2b(engine_id.encode(), digest_size=8).hexdigest()
    path = _base_dir(lookup_dir) / f"{_prefix()}{digest}-dp{dp_rank}"
    # the other role of this engine may have made it first; it must still be ours and private
    path.mkdir(mode=0o700, exist_ok=True)
    if path.is_symlink():
        raise ConfigError(
            f"lookup run dir {str(path)!r} is a symlink; remove it (kvtier creates a private "
            "directory there itself)"
        )
    check_private_dir(path)
    return path


def remove_if_empty(path: Path) -> None:
    """Remove the run directory, and the lookup key in it, once the last socket in it is gone
    (either role may be last; every process read the key when it started)."""
    try:
        entries = [e.name for e in path.iterdir()]
    except FileNotFoundError:
        return  # the other role removed it
    if entries == [KEY_FILE]:
        (path / KEY_FILE).unlink(missing_ok=True)
    try:
        path.rmdir()
    except OSError as e:
        # ENOTEMPTY: the other role still has a socket there and removes the dir itself
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
            raise
        log.debug("kvtier: run dir %s left in place (%s)", path, e.strerror)


def _live(sock: Path) -> bool:
    """Whether a process still accepts connections on the unix socket `sock`."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(sock))
    except (FileNotFoundError, ConnectionRefusedError):
        return False
    except OSError:
        return True  # cannot tell (permissions, ...): never delete what may be live
    finally:
        probe.close()
    return True


def sweep_stale(
    lookup_dir: str | None,
    keep: Path,
    min_age_s: float = 60.0,
    clock: Callable[[], float] = time.time,
) -> list[Path]:
    """Remove this user's run directories left by engines that are gone.

    vLLM often ends its workers with SIGTERM/SIGKILL, so their sockets outlive them. A directory
    goes only when it is older than `min_age_s`, holds nothing but sockets and the engine's
    lookup key, has at least one socket (an engine still starting, or one on tcp, has none)
    and every one refuses connections.
    """
    removed: list[Path] = []
    for d in sorted(_base_dir(lookup_dir).glob(f"{_prefix()}*-dp*")):
        try:
            if d == keep or d.is_symlink() or not d.is_dir():
                continue
            st = d.stat()
            entries = list(d.iterdir())
        except FileNotFoundError:
            continue  # another engine's sweep took it meanwhile
        if st.st_uid != os.getuid() or clock() - st.st_mtime < min_age_s:
            continue
        socks = [e for e in entries if e.suffix == ".sock" and e.is_socket()]
        others = [e for e in entries if e not in socks and e.name != KEY_FILE]
        if not socks or others or any(_live(e) for e in socks):
            continue
        for e in socks:
            e.unlink(missing_ok=True)
        remove_if_empty(d)
        removed.append(d)
    return removed


def lookup_base_port(config: KVTierConfig, vllm_config: Any, dp_rank: int, world: int) -> int:
    """First tcp lookup port of this DP replica: `lookup_base_port`, else vLLM's `kv_port`,
    plus `world` ports per replica before it."""
    base = config.lookup_base_port
    if base is None:
        base = int(vllm_config.kv_transfer_config.kv_port)
    return base + dp_rank * world


def offload_spec(
    config: KVTierConfig, vllm_config: Any, topo: Topology, run_dir: Path, model_id: str
) -> OffloadSpec:
    """The spec the scheduler and every worker of this engine replica are built from: the same
    lookup endpoints, ipc sockets in `run_dir` or tcp from `lookup_base_port`."""
    base_port = lookup_base_port(config, vllm_config, topo.dp_rank, topo.world)
    return OffloadSpec.derive(config, model_id, topo, run_dir=run_dir, base_port=base_port)
