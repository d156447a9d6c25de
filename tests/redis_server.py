"""A throwaway `redis-server` for tests: temp dir, loopback port or unix socket, optional AUTH.

Readiness is a PING answered within a deadline (never a blind sleep); `kill()` and `restart()`
let a test take the server away and bring it back on the same address.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

_INSTALL_HINT = "install it with `apt-get install redis-server` (Debian/Ubuntu)"
_START_DEADLINE_S = 10.0
_PORT_ATTEMPTS = 5


class RedisServerError(RuntimeError):
    """The test redis-server could not be found or started."""


def find_redis_server() -> str:
    """Path of `redis-server` on PATH; raises RedisServerError naming the install command."""
    path = shutil.which("redis-server")
    if path is None:
        raise RedisServerError(f"redis-server is not on PATH; {_INSTALL_HINT}")
    return path


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One `redis-server` process on 127.0.0.1:<free port> or a unix socket in a temp dir.

    `password` sets `requirepass` (the default user); `acl_user` adds an ACL user with every
    permission and `acl_password`. `debug=True` enables DEBUG from local clients (DEBUG SLEEP).
    """

    def __init__(
        self,
        *,
        password: str | None = None,
        acl_user: str | None = None,
        acl_password: str | None = None,
        unix: bool = False,
        debug: bool = False,
    ) -> None:
        if (acl_user is None) != (acl_password is None):
            raise ValueError("give acl_user and acl_password together, or neither")
        self._binary = find_redis_server()
        self.password = password
        self.acl_user = acl_user
        self.acl_password = acl_password
        self.unix = unix
        self.debug = debug
        self._dir = Path(tempfile.mkdtemp(prefix="kvtier-redis-"))
        self.socket_path = self._dir / "redis.sock"
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    # ---- addresses -----------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The server's URL without credentials."""
        if self.unix:
            return f"unix://{self.socket_path}"
        return f"redis://127.0.0.1:{self.port}/0"

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
            self._launch()
            return self
        last: RedisServerError | None = None
        # the free port can be taken by someone else between probing and binding
        for _ in range(_PORT_ATTEMPTS):
            self.port = _free_port()
            try:
                self._launch()
                return self
            except RedisServerError as e:
                last = e
        self.port = 0
        raise RedisServerError(f"redis-server failed {_PORT_ATTEMPTS} times: {last}")

    def kill(self) -> None:
        """SIGKILL the server (a crash); the address is kept for `restart()`."""
        proc = self._proc
        if proc is None:
            return
        proc.kill()
        proc.wait(timeout=_START_DEADLINE_S)
        self._proc = None

    def restart(self) -> RedisServer:
        """Start again on the same port or socket (empty: the test server keeps no data)."""
        self.kill()
        return self.start()

    def stop(self) -> None:
        """Stop the server and remove its directory."""
        proc = self._proc
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=_START_DEADLINE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=_START_DEADLINE_S)
            self._proc = None
        shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def running(self) -> bool:
        """True while the process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ---- internals -----------------------------------------------------------------------

    def _config(self) -> str:
        lines = [
            "bind 127.0.0.1",
            f"port {0 if self.unix else self.port}",
            f"dir {self._dir}",
            'save ""',
            "appendonly no",
            "daemonize no",
            f"logfile {self._dir / 'redis.log'}",
        ]
        if self.unix:
            lines += [f"unixsocket {self.socket_path}", "unixsocketperm 700"]
        if self.password is not None:
            lines.append(f"requirepass {self.password}")
        if self.acl_user is not None:
            lines.append(f"user {self.acl_user} on >{self.acl_password} ~* &* +@all")
        if self.debug:
            lines.append("enable-debug-command local")
        return "\n".join(lines) + "\n"

    def _launch(self) -> None:
        conf = self._dir / "redis.conf"
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
                proc.wait(timeout=_START_DEADLINE_S)
            self._proc = None
            raise

    def _wait_ready(self, proc: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + _START_DEADLINE_S
        client = self.client(timeout_s=0.2)
        try:
            while True:
                try:
                    ready = bool(client.ping())
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                    ready = False  # not listening yet (or still loading)
                if ready:
                    return
                if time.monotonic() >= deadline:
                    raise RedisServerError(
                        f"redis-server at {self.url} did not answer PING within "
                        f"{_START_DEADLINE_S}s; see {self._dir / 'redis.log'}"
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
        log = self._dir / "redis.log"
        try:
            lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(lines[-3:])
