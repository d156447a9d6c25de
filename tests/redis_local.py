"""Throwaway Valkey/Redis on loopback for the tests (and the stores they give `kvtier bench
tier`): one server (TCP or a unix socket, optional AUTH and ACL user, DEBUG on request), or a
Redis Cluster of masters and replicas (`redis-server --cluster-enabled yes` + `redis-cli
--cluster create`).

Readiness is always a condition met within a deadline (PING answered, `cluster_state:ok` on
every node, all nodes agreeing on the slot owners), never a blind sleep.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvtier.bench.ports import ephemeral_range, free_port
from kvtier.errors import StartupError

_START_S = 15.0
_PORT_ATTEMPTS = 5
_INSTALL = "install it with `apt-get install redis-server` (Debian/Ubuntu; brings redis-cli)"
# a remote tier's reads and writes in the tests that do not test timeouts: a 2-core host running
# the suite beside its servers misses the 100 ms default now and then
LOADED_TIMEOUT_MS = 1000


def loaded_timeouts(kwargs: dict[str, object]) -> dict[str, object]:
    """A remote tier's keyword arguments with `LOADED_TIMEOUT_MS` for reads and writes, unless
    the test gives its own `timeout_ms` (a test about timeouts)."""
    if "timeout_ms" in kwargs:
        return kwargs
    return {"write_timeout_ms": LOADED_TIMEOUT_MS, **kwargs, "timeout_ms": LOADED_TIMEOUT_MS}


class RedisServerError(StartupError):
    """A local redis-server (or redis-cli) could not be found or started."""


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RedisServerError(f"{name} is not on PATH; {_INSTALL}")
    return path


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port(cluster: bool) -> int:
    """A free loopback port outside the kernel's ephemeral range (an outgoing connection cannot
    take it before the server binds it); for a cluster node also its bus port (port + 10000)."""
    if not cluster:
        return free_port()
    low, high = ephemeral_range()
    ours = [p for p in range(10000, 55536) if not (low <= p <= high or low <= p + 10000 <= high)]
    # a host whose ephemeral range leaves no pair outside it: any pair, as before
    pool = ours or range(10000, 55536)
    for port in random.sample(pool, min(200, len(pool))):
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise RedisServerError("no free loopback port pair (port, port + 10000) for a cluster node")


def _hold_port(port: int) -> socket.socket | None:
    """A socket bound to `port` without listening (None when someone took it already)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("127.0.0.1", port))
    except OSError:
        s.close()
        return None
    return s


def wait_for(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll `check` until true; StartupError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise StartupError(f"{what} did not happen within {timeout_s:.0f}s")
        time.sleep(0.02)


class RedisServer:
    """One `redis-server` on 127.0.0.1:<free port>, or on a unix socket, in its own directory
    (`root`, or a fresh temp directory), without persistence.

    `password` sets `requirepass` (the default user); `acl_user` adds an ACL user with every
    permission and `acl_password`; `debug` enables DEBUG from local clients (DEBUG SLEEP);
    `cluster` makes it a cluster node. `kill()` and `restart()` take the server away and bring
    it back, empty, on the same address; `stop()` also removes its directory.
    """

    def __init__(
        self,
        root: Path | None = None,
        *,
        password: str | None = None,
        acl_user: str | None = None,
        acl_password: str | None = None,
        unix: bool = False,
        debug: bool = False,
        cluster: bool = False,
        node_timeout_ms: int = 1000,
    ) -> None:
        if (acl_user is None) != (acl_password is None):
            raise ValueError("give acl_user and acl_password together, or neither")
        if cluster and unix:
            raise ValueError("a cluster node listens on TCP; drop unix=True")
        self._binary = _binary("redis-server")
        self.password = password
        self.acl_user = acl_user
        self.acl_password = acl_password
        self.unix = unix
        self.debug = debug
        self.cluster = cluster
        self.node_timeout_ms = node_timeout_ms
        if root is None:
            self.dir = Path(tempfile.mkdtemp(prefix="kvtier-redis-"))
        else:
            self.dir = root
            root.mkdir(parents=True, exist_ok=True)
        self.socket_path = self.dir / "redis.sock"
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        # holds a killed server's port (bound, not listening: connections are refused, as by
        # a dead server) so no other process takes it before restart()
        self._placeholders: list[socket.socket] = []

    # ---- addresses -----------------------------------------------------------------------

    @property
    def addr(self) -> str:
        """`127.0.0.1:<port>`, the node's name in shard and topology terms."""
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """The server's URL without credentials."""
        if self.unix:
            return f"unix://{self.socket_path}"
        return f"redis://{self.addr}/0"

    def client(self, timeout_s: float = 5.0) -> redis.Redis:
        """An admin client authenticated as the default user (for setup and inspection).

        It never retries, so a timeout surfaces at once instead of hiding behind back-off."""
        kwargs: dict[str, object] = {
            "password": self.password,
            "socket_timeout": timeout_s,
            "socket_connect_timeout": timeout_s,
            "retry": Retry(NoBackoff(), 0),
        }
        if self.unix:
            return redis.Redis(unix_socket_path=str(self.socket_path), **kwargs)
        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> RedisServer:
        """Start on a free port (or the socket) and wait for PING; keeps the port on restart."""
        if self._proc is not None:
            raise RedisServerError("redis-server is already running; stop() or kill() it first")
        if self.unix or self.port:
            self._release_port()
            self._launch()
            return self
        last: RedisServerError | None = None
        # the free port can be taken by someone else between probing and binding
        for _ in range(_PORT_ATTEMPTS):
            self.port = _free_port(self.cluster)
            try:
                self._launch()
                return self
            except RedisServerError as e:
                last = e
        self.port = 0
        raise RedisServerError(f"redis-server failed {_PORT_ATTEMPTS} times: {last}")

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The server stopped (SIGSTOP) for the block: the kernel still accepts its connections
        and their data, nothing answers, for exactly as long as the block runs. A timed DEBUG
        SLEEP ends on its own, and a loaded host can run a test's requests past it."""
        if self._proc is None:
            raise RuntimeError("paused(): the server is not running")
        pid = self._proc.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the server (a crash); the address is kept for `restart()`."""
        proc = self._proc
        if proc is None:
            return
        proc.kill()
        proc.wait(timeout=_START_S)
        self._proc = None
        if not self.unix:
            ports = (self.port, self.port + 10000) if self.cluster else (self.port,)
            self._placeholders = [h for h in map(_hold_port, ports) if h is not None]

    def restart(self) -> RedisServer:
        """Start again on the same port or socket (empty: the server keeps no data)."""
        self.kill()
        return self.start()

    def stop(self) -> None:
        """Stop the server and remove its directory."""
        proc = self._proc
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=_START_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=_START_S)
            self._proc = None
        self._release_port()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _release_port(self) -> None:
        for held in self._placeholders:
            held.close()
        self._placeholders = []

    def flushall(self) -> None:
        """Empty the store."""
        admin = self.client()
        try:
            admin.flushall()
        finally:
            admin.close()

    @property
    def running(self) -> bool:
        """True while the process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # ---- internals -----------------------------------------------------------------------

    def _config(self) -> str:
        lines = [
            "bind 127.0.0.1",
            f"port {0 if self.unix else self.port}",
            f"dir {self.dir}",
            'save ""',
            "appendonly no",
            "daemonize no",
            f"logfile {self.dir / 'redis.log'}",
        ]
        if self.unix:
            lines += [f"unixsocket {self.socket_path}", "unixsocketperm 700"]
        if self.password is not None:
            lines.append(f"requirepass {self.password}")
        if self.acl_user is not None:
            lines.append(f"user {self.acl_user} on >{self.acl_password} ~* &* +@all")
        if self.debug:
            lines.append("enable-debug-command local")
        if self.cluster:
            lines += [
                "cluster-enabled yes",
                f"cluster-config-file {self.dir / 'nodes.conf'}",
                f"cluster-node-timeout {self.node_timeout_ms}",
                # a cache: while one shard fails over, the others keep serving their slots
                "cluster-require-full-coverage no",
            ]
        return "\n".join(lines) + "\n"

    def _launch(self) -> None:
        conf = self.dir / "redis.conf"
        conf.write_text(self._config(), encoding="utf-8")
        proc = subprocess.Popen(
            [self._binary, str(conf)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._proc = proc
        try:
            self._wait_ready(proc)
        except RedisServerError:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=_START_S)
            self._proc = None
            raise

    def _wait_ready(self, proc: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + _START_S
        client = self.client(timeout_s=0.2)
        try:
            while True:
                try:
                    # our process, not another server that took the port while ours failed to
                    # bind it (a test talking to someone else's store would flush its data)
                    ready = client.info("server").get("process_id") == proc.pid
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                    ready = False  # not listening yet (or still loading)
                if ready:
                    return
                if time.monotonic() >= deadline:
                    raise RedisServerError(
                        f"redis-server at {self.url} did not answer PING within "
                        f"{_START_S:g}s; see {self.dir / 'redis.log'}"
                    )
                # waiting on the process doubles as the pause and notices an early exit
                try:
                    code = proc.wait(timeout=0.02)
                except subprocess.TimeoutExpired:
                    continue
                raise RedisServerError(
                    f"redis-server at {self.url} exited with code {code} during start-up: "
                    f"{self._log_tail()}"
                )
        finally:
            client.close()

    def _log_tail(self) -> str:
        try:
            lines = (self.dir / "redis.log").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no log)"
        return " | ".join(lines.splitlines()[-3:])


class LocalCluster:
    """`masters` masters with `replicas` replicas each; `url` is `redis+cluster://` over every
    master as a seed. A context manager that stops every node and removes them on exit."""

    def __init__(self, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 1000) -> None:
        if masters < 3:
            raise ValueError(f"masters={masters}: redis-cli builds a cluster of 3 masters or more")
        self._cli = _binary("redis-cli")
        self._root = Path(tempfile.mkdtemp(prefix="kvtier-cluster-"))
        self.nodes = [
            RedisServer(
                self._root / f"node{i}", cluster=True, debug=True, node_timeout_ms=node_timeout_ms
            )
            for i in range(masters * (1 + replicas))
        ]
        self._masters = masters
        self._replicas = replicas

    @property
    def url(self) -> str:
        """`redis+cluster://` with the first three nodes as seeds."""
        return "redis+cluster://" + ",".join(n.addr for n in self.nodes[:3])

    def __enter__(self) -> LocalCluster:
        try:
            for node in self.nodes:
                node.start()
            subprocess.run(
                [
                    self._cli,
                    "--cluster",
                    "create",
                    *(n.addr for n in self.nodes),
                    "--cluster-replicas",
                    str(self._replicas),
                    "--cluster-yes",
                ],
                check=True,
                capture_output=True,
                timeout=60,
            )
            self.wait_healthy(replicated=True)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        for node in self.nodes:
            node.kill()
        shutil.rmtree(self._root, ignore_errors=True)

    # ---- topology ------------------------------------------------------------------------

    def node(self, addr: str) -> RedisServer:
        """The node at `addr` (`127.0.0.1:<port>`)."""
        return next(n for n in self.nodes if n.addr == addr)

    def live(self) -> list[RedisServer]:
        """Nodes whose process runs."""
        return [n for n in self.nodes if n.running]

    def slot_owners(self, via: RedisServer | None = None) -> dict[int, str]:
        """slot -> master address, as `via` (default: the first live node) sees it."""
        node = via or self.live()[0]
        admin = node.client()
        try:
            ranges = admin.execute_command("CLUSTER", "SLOTS")
        finally:
            admin.close()
        owners: dict[int, str] = {}
        for r in ranges:
            host = r[2][0].decode() if isinstance(r[2][0], bytes) else r[2][0]
            for slot in range(int(r[0]), int(r[1]) + 1):
                owners[slot] = f"{host}:{int(r[2][1])}"
        return owners

    def masters(self) -> list[str]:
        """Addresses of the masters that own slots now, sorted."""
        return sorted(set(self.slot_owners().values()))

    def replicas_of(self, master: str) -> list[str]:
        """Live replicas of `master`."""
        out = []
        for n in self.live():
            admin = n.client()
            try:
                info = admin.info("replication")
            finally:
                admin.close()
            if info.get("role") == "slave":
                if f"{info['master_host']}:{info['master_port']}" == master:
                    out.append(n.addr)
        return out

    def wait_healthy(self, timeout_s: float = 30.0, *, replicated: bool = False) -> None:
        """Until every live node says `cluster_state:ok`, all 16384 slots are covered and every
        live node names the same owners; with `replicated`, also until every slot range lists
        its replicas (clients learn replicas from that list when they map the cluster)."""

        def healthy() -> bool:
            views = []
            for n in self.live():
                admin = n.client()
                try:
                    if admin.cluster("info").get("cluster_state") != "ok":
                        return False
                    ranges = admin.execute_command("CLUSTER", "SLOTS")
                finally:
                    admin.close()
                if replicated and any(len(r) < 3 + self._replicas for r in ranges):
                    return False
                views.append(self.slot_owners(n))
            return len(views[0]) == 16384 and all(v == views[0] for v in views)

        wait_for(healthy, timeout_s, "the cluster becoming healthy")

    def sync_replicas(self) -> None:
        """WAIT on every master until its replicas acknowledged every write so far."""
        for master in self.masters():
            admin = self.node(master).client()
            try:
                admin.execute_command("WAIT", self._replicas, 5000)
            finally:
                admin.close()

    def fail_master(self, master: str, timeout_s: float = 30.0) -> str:
        """Kill `master` and wait until a replica took its slots; the new owner's address."""
        slots = [s for s, owner in self.slot_owners().items() if owner == master]
        self.node(master).kill()

        def promoted() -> bool:
            try:
                owner = self.slot_owners().get(slots[0])
            except redis.exceptions.RedisError:
                return False
            return owner not in (None, master)

        wait_for(promoted, timeout_s, f"a replica of {master} being promoted")
        self.wait_healthy(timeout_s)
        return self.slot_owners()[slots[0]]

    def migrate_slot(self, slot: int, target: str, *, finish: bool = True) -> list[bytes]:
        """Move `slot` and its keys to master `target` (MIGRATING/IMPORTING, MIGRATE, SETSLOT
        NODE). With `finish=False` it stops halfway: half the keys moved, the slot still owned
        by its source (ASK redirects). The keys that moved."""
        source = self.slot_owners()[slot]
        src, dst = self.node(source).client(), self.node(target).client()
        try:
            src_id = src.execute_command("CLUSTER", "MYID")
            dst_id = dst.execute_command("CLUSTER", "MYID")
            dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
            src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
            keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1_000_000)
            moving = keys if finish else keys[: len(keys) // 2]
            host, port = target.split(":")
            if moving:
                src.execute_command("MIGRATE", host, port, "", 0, 5000, "KEYS", *moving)
            if finish:
                # masters are told; replicas learn the new owner by gossip
                for master in self.masters():
                    admin = self.node(master).client()
                    try:
                        admin.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
                    finally:
                        admin.close()
        finally:
            src.close()
            dst.close()
        return list(moving)

    def finish_migration(self, slot: int, target: str) -> None:
        """Complete a migration `migrate_slot(..., finish=False)` began."""
        self.migrate_slot(slot, target, finish=True)
