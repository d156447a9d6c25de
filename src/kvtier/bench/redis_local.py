"""Throwaway Valkey/Redis on loopback for benches and tests: one server, or a Redis Cluster of
masters and replicas (`redis-server --cluster-enabled yes` + `redis-cli --cluster create`).

Readiness is always a condition met within a deadline (PING answered, `cluster_state:ok` on
every node, all nodes agreeing on the slot owners), never a blind sleep.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvtier.errors import StartupError

_START_S = 15.0
_INSTALL = "install it with `apt-get install redis-server` (Debian/Ubuntu; brings redis-cli)"


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise StartupError(f"{name} is not on PATH; {_INSTALL}")
    return path


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port(cluster: bool) -> int:
    """A free loopback port; for a cluster node also its bus port (port + 10000 <= 65535)."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not cluster:
            return port
        # the kernel hands out high ports; fold them into the range whose bus port exists
        port = 20000 + port % 30000
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise StartupError("no free loopback port pair (port, port + 10000) for a cluster node")


def wait_for(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll `check` until true; StartupError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise StartupError(f"{what} did not happen within {timeout_s:.0f}s")
        time.sleep(0.02)


class RedisNode:
    """One `redis-server` on 127.0.0.1:<free port> in its own directory (no persistence)."""

    def __init__(self, root: Path, *, cluster: bool = False, node_timeout_ms: int = 1000) -> None:
        self._binary = _binary("redis-server")
        self.port = _free_port(cluster)
        self.dir = root / str(self.port)
        self.dir.mkdir(parents=True)
        self.cluster = cluster
        self.node_timeout_ms = node_timeout_ms
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def addr(self) -> str:
        """`127.0.0.1:<port>`, the node's name in shard and topology terms."""
        return f"127.0.0.1:{self.port}"

    def client(self, timeout_s: float = 5.0) -> redis.Redis:
        """An admin client that never retries."""
        return redis.Redis(
            host="127.0.0.1",
            port=self.port,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
        )

    def start(self) -> None:
        """Launch and wait for PING."""
        lines = [
            "bind 127.0.0.1",
            f"port {self.port}",
            f"dir {self.dir}",
            'save ""',
            "appendonly no",
            "daemonize no",
            f"logfile {self.dir / 'redis.log'}",
            "enable-debug-command local",
        ]
        if self.cluster:
            lines += [
                "cluster-enabled yes",
                f"cluster-config-file {self.dir / 'nodes.conf'}",
                f"cluster-node-timeout {self.node_timeout_ms}",
                # a cache: while one shard fails over, the others keep serving their slots
                "cluster-require-full-coverage no",
            ]
        conf = self.dir / "redis.conf"
        conf.write_text("\n".join(lines) + "\n", encoding="utf-8")
        self.proc = subprocess.Popen(
            [self._binary, str(conf)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        admin = self.client(timeout_s=0.2)
        try:
            wait_for(lambda: self._pings(admin), _START_S, f"redis-server {self.addr} answering")
        finally:
            admin.close()

    def _pings(self, admin: redis.Redis) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise StartupError(
                f"redis-server {self.addr} exited with code {self.proc.returncode}; see "
                f"{self.dir / 'redis.log'}"
            )
        try:
            return bool(admin.ping())
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            return False

    def kill(self) -> None:
        """SIGKILL (a crash)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=_START_S)
            self.proc = None

    @property
    def running(self) -> bool:
        """True while the process is alive."""
        return self.proc is not None and self.proc.poll() is None


class LocalRedis:
    """One server (`url` is `redis://`); a context manager that removes everything on exit."""

    def __init__(self) -> None:
        self._root = Path(tempfile.mkdtemp(prefix="kvtier-redis-"))
        self.node = RedisNode(self._root)

    @property
    def url(self) -> str:
        """The server's URL."""
        return f"redis://{self.node.addr}/0"

    def __enter__(self) -> LocalRedis:
        self.node.start()
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.node.kill()
        shutil.rmtree(self._root, ignore_errors=True)


class LocalCluster:
    """`masters` masters with `replicas` replicas each; `url` is `redis+cluster://` over every
    master as a seed. A context manager that stops every node and removes them on exit."""

    def __init__(self, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 1000) -> None:
        if masters < 3:
            raise ValueError(f"masters={masters}: redis-cli builds a cluster of 3 masters or more")
        self._cli = _binary("redis-cli")
        self._root = Path(tempfile.mkdtemp(prefix="kvtier-cluster-"))
        self.nodes = [
            RedisNode(self._root, cluster=True, node_timeout_ms=node_timeout_ms)
            for _ in range(masters * (1 + replicas))
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

    def node(self, addr: str) -> RedisNode:
        """The node at `addr` (`127.0.0.1:<port>`)."""
        return next(n for n in self.nodes if n.addr == addr)

    def live(self) -> list[RedisNode]:
        """Nodes whose process runs."""
        return [n for n in self.nodes if n.running]

    def slot_owners(self, via: RedisNode | None = None) -> dict[int, str]:
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
