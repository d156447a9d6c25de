"""The test side of tests/vllm/forkserver.py: run a driver script in a child forked from a
server that imported vLLM once (one server per interpreter and import-time environment,
started on first use, stopped when the test process exits)."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path

SERVER = Path(__file__).resolve().parent / "forkserver.py"
START_TIMEOUT_S = 180.0
# read by vLLM when an engine starts, never at import: a driver may set them per run
RUNTIME_ONLY = frozenset({"VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND"})


class ForkServer:
    """One forkserver.py process and its socket."""

    def __init__(self, python: str, env: dict[str, str], cwd: Path) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="kvtier-fork-"))
        self.socket_path = str(self._dir / "fork.sock")
        self.cwd = cwd
        with open(self._dir / "server.log", "wb") as log:
            self.proc = subprocess.Popen(
                [python, str(SERVER), self.socket_path],
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,
            )
        assert self.proc.stdout is not None
        ready = _readline(self.proc, START_TIMEOUT_S)
        if ready.strip() != b"ready":
            self.close()
            log = (self._dir / "server.log").read_text(errors="replace")[-6000:]
            raise RuntimeError(f"{SERVER} did not start (said {ready!r}):\n{log}")

    def run(self, argv: list[str], env: dict[str, str], timeout_s: float) -> tuple[int, str, str]:
        """Run `argv` (a script and its arguments) in a fresh child; (exit code, out, err).
        Past `timeout_s` the child's session is killed and TimeoutError raised."""
        out_dir = Path(tempfile.mkdtemp(prefix="run-", dir=self._dir))
        out, err = out_dir / "stdout", out_dir / "stderr"
        req = {"argv": argv, "env": env, "cwd": str(self.cwd), "stdout": str(out),
               "stderr": str(err)}  # fmt: skip
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(self.socket_path)
            s.settimeout(timeout_s)
            stream = s.makefile("rwb", buffering=0)
            stream.write(json.dumps(req).encode() + b"\n")
            pid = int(json.loads(stream.readline())["pid"])
            try:
                code = int(json.loads(stream.readline())["status"])
            except TimeoutError:
                _kill_session(pid)
                s.settimeout(30.0)
                stream.readline()  # the server reaped it
                raise TimeoutError(_read(err)) from None
        return code, _read(out), _read(err)

    def close(self) -> None:
        """Stop the server (its children are gone by then: each run waits for its own)."""
        if self.proc.poll() is None:
            _kill_session(self.proc.pid)
            self.proc.wait(timeout=30)
        shutil.rmtree(self._dir, ignore_errors=True)


def _readline(proc: subprocess.Popen[bytes], timeout_s: float) -> bytes:
    import selectors

    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            return b""
    return proc.stdout.readline()


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        return


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


_SERVERS: dict[tuple[str, frozenset[tuple[str, str]]], ForkServer] = {}


def server_for(python: str, env: dict[str, str], cwd: Path) -> ForkServer:
    """The server for this interpreter and the import-time part of `env` (started once)."""
    base = {k: v for k, v in env.items() if k not in RUNTIME_ONLY}
    key = (python, frozenset(base.items()))
    if key not in _SERVERS:
        _SERVERS[key] = ForkServer(python, base, cwd)
    return _SERVERS[key]


@atexit.register
def _close_all() -> None:
    for server in _SERVERS.values():
        server.close()
    _SERVERS.clear()
