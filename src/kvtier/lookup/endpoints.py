"""Where rank lookup servers listen: ipc sockets in a private run directory, or loopback tcp.

One run directory per engine replica keeps replicas apart: two replicas that shared a socket
path would read each other's hits (the failure mode of a socket path shared across DP replicas).
The run directory also holds the engine's lookup key (`lookup/keyfile.py`), over either
transport: an endpoint names the directory its key lives in (an ipc socket's own directory, or
the run dir a `LookupEndpoint` carries).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import stat
import tempfile
from pathlib import Path
from typing import Final

from kvtier.errors import ConfigError, StartupError

log = logging.getLogger("kvtier")

# sun_path is 108 bytes on Linux, including the terminating NUL.
IPC_PATH_MAX: Final = 107
TRANSPORTS: Final = ("ipc", "tcp")


def make_run_dir(prefix: str = "kvtier-", base: str | Path | None = None) -> Path:
    """Create a private (mode 0o700) run directory under `base`, `$XDG_RUNTIME_DIR` or /tmp."""
    if base is None:
        xdg = os.environ.get("XDG_RUNTIME_DIR")
        base = xdg if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK) else "/tmp"
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    # mkdtemp already uses 0o700; chmod makes the mode exact whatever the umask or platform.
    path.chmod(0o700)
    return path


class LookupEndpoint(str):
    """A zmq endpoint string that also names the run directory holding its engine's key.

    It is the endpoint everywhere a string is (zmq, logs, comparisons); servers and clients
    read `key_dir` to find the key, so a tcp endpoint derived for one engine carries that
    engine's key with it through code that only passes endpoints along.
    """

    key_dir: Path | None

    def __new__(cls, endpoint: str, key_dir: str | Path | None = None) -> LookupEndpoint:
        self = super().__new__(cls, endpoint)
        self.key_dir = None if key_dir is None else Path(key_dir).absolute()
        return self


def key_dir_of(endpoint: str) -> Path:
    """The run directory holding the key of `endpoint`'s engine; ConfigError when it names none
    (a tcp endpoint built without the engine's run dir)."""
    key_dir = getattr(endpoint, "key_dir", None)
    if key_dir is not None:
        return Path(key_dir)
    transport, address = parse_endpoint(endpoint)
    if transport == "ipc":
        return Path(address).parent
    raise ConfigError(
        f"lookup endpoint {endpoint!r} names no run dir holding its engine's key; build it with "
        "endpoint_for(rank, transport='tcp', run_dir=<the engine's run dir>, base_port=...) "
        "or pass the key (kvtier.lookup.engine_key(run_dir)) as key="
    )


def endpoint_for(
    rank: int,
    *,
    transport: str = "ipc",
    run_dir: str | Path | None = None,
    host: str = "127.0.0.1",
    base_port: int | None = None,
    allow_remote_bind: bool = False,
) -> str:
    """The zmq endpoint of `rank`'s lookup server: `ipc://<run_dir>/lookup-rank<r>.sock` or
    `tcp://<host>:<base_port + rank>`; tcp is loopback-only unless `allow_remote_bind`. With
    `run_dir`, the endpoint carries it (`LookupEndpoint.key_dir`): the engine's key lives there,
    whatever the transport; `run_dir` is only read when a server or client takes the key."""
    if not isinstance(rank, int) or rank < 0:
        raise ConfigError(f"lookup rank={rank!r} must be an int >= 0")
    if transport == "ipc":
        if run_dir is None:
            raise ConfigError(
                "ipc lookup endpoints need run_dir: create one with make_run_dir() and pass the "
                "same directory to the scheduler and every rank"
            )
        run = Path(run_dir)
        check_private_dir(run)
        path = str(run.absolute() / f"lookup-rank{rank}.sock")
        check_ipc_path(path)
        return LookupEndpoint(f"ipc://{path}", run)
    if transport == "tcp":
        if base_port is None:
            raise ConfigError(
                "lookup_transport='tcp' needs a base port: set lookup_base_port (rank r's lookup "
                "server listens on lookup_base_port + r), e.g. 15500"
            )
        port = base_port + rank
        if not 0 < port < 65536:
            raise ConfigError(
                f"lookup tcp port {port} (base_port={base_port} + rank={rank}) is outside 1..65535"
            )
        check_tcp_host(host, allow_remote_bind)
        shown = f"[{host}]" if ":" in host else host
        return LookupEndpoint(f"tcp://{shown}:{port}", run_dir)
    raise ConfigError(f"lookup transport={transport!r} is not one of {TRANSPORTS}")


def check_private_dir(run: Path) -> None:
    """Raise ConfigError unless `run` is an existing directory we own with no group/other bits."""
    try:
        st = run.stat()
    except FileNotFoundError:
        raise ConfigError(
            f"lookup run_dir {str(run)!r} does not exist; create it with make_run_dir()"
        ) from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"lookup run_dir {str(run)!r} is not a directory")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077 or st.st_uid != os.getuid():
        raise ConfigError(
            f"lookup run_dir {str(run)!r} has mode {oct(mode)} (owner uid {st.st_uid}); lookup "
            f"sockets must live in a private directory of uid {os.getuid()} with mode 0o700: "
            "use make_run_dir() or chmod 700 it"
        )


def check_ipc_path(path: str) -> None:
    """Raise ConfigError if the ipc socket path does not fit in a unix socket address."""
    n = len(os.fsencode(path))
    if n > IPC_PATH_MAX:
        raise ConfigError(
            f"ipc socket path {path!r} is {n} bytes, over the {IPC_PATH_MAX}-byte limit of unix "
            "socket paths; use a shorter run_dir (make_run_dir(base='/tmp'))"
        )


def check_tcp_host(host: str, allow_remote_bind: bool) -> None:
    """Raise ConfigError for a non-loopback host unless allowed; warn when allowed."""
    if is_loopback(host):
        return
    if not allow_remote_bind:
        raise ConfigError(
            f"lookup tcp host {host!r} is not a loopback address; lookup servers bind "
            "127.0.0.1 unless allow_remote_bind=True"
        )
    log.warning(
        "kvtier: lookup endpoint on non-loopback host %s (allow_remote_bind=True): frames "
        "without the engine's key are refused, but anyone who can reach it can make the rank "
        "check their MACs",
        host,
    )


def is_loopback(host: str) -> bool:
    """True for `localhost` and loopback IP literals (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def parse_endpoint(endpoint: str) -> tuple[str, str]:
    """Split `ipc://path` or `tcp://host:port` into (transport, address); ConfigError otherwise."""
    transport, sep, address = endpoint.partition("://")
    if not sep or transport not in TRANSPORTS or not address:
        raise ConfigError(
            f"lookup endpoint {endpoint!r} is not ipc://<path> or tcp://<host>:<port>; "
            "build it with endpoint_for()"
        )
    return transport, address


def tcp_host(address: str) -> str:
    """The host part of a tcp address `host:port` or `[v6]:port`."""
    host, _, _ = address.rpartition(":")
    return host.strip("[]")


def ipc_served(path: str) -> bool:
    """True while a listener accepts connections on the ipc socket `path`."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (FileNotFoundError, ConnectionRefusedError):
        return False
    finally:
        probe.close()
    return True


def ensure_ipc_free(path: str) -> None:
    """Raise StartupError if a live server already listens on `path`.

    zmq unlinks an existing ipc socket file when binding, so without this check a second server
    would silently take the address from a live one. A stale file (dead server) is fine.
    """
    if not ipc_served(path):
        return
    raise StartupError(
        f"lookup endpoint ipc://{path} is already served by a live process; each rank of each "
        "replica needs its own endpoint (one run_dir per replica)"
    )
