"""Runs vLLM driver scripts in children forked from a process that imported vLLM once.

Importing vLLM costs a driver about 6 s of CPU before it builds an engine (most of a short
driver's run); every driver of a test session paid it again. This server (under .venv-vllm)
imports vLLM and kvtier's connector, then serves one request at a time on a unix socket: a JSON
line `{"argv", "env", "cwd", "stdout", "stderr"}` makes a forked child run `argv` as a script
would run (`__main__`, `sys.argv`, its own session, that environment, output to those files);
the server answers `{"pid": n}` at once and `{"status": code}` when the child is gone (a signal
is `-signum`, as `subprocess` reports it). Nothing has run an engine, a thread pool or a socket
in this process when it forks. Usage: forkserver.py SOCKET_PATH (prints `ready` once listening).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
import socket
import sys
import tempfile
import threading
import traceback
from typing import Any

PARENT_POLL_S = 1.0


def preload() -> None:
    """What every driver imports first, imported once here."""
    import vllm  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401
    from vllm.inputs import TokensPrompt  # noqa: F401

    import kvtier.vllm.connector  # noqa: F401


def run_child(req: dict[str, Any]) -> int:
    """In the forked child: become `argv[0]` run as a script; returns its exit code."""
    os.setsid()
    for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    tempfile.tempdir = None  # recomputed from this environment's TMPDIR
    script = req["argv"][0]
    sys.argv = list(req["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as the interpreter would, then exit 1
        traceback.print_exc()
        code = 1
    # what interpreter shutdown does: join non-daemon threads, then the atexit handlers
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def serve(path: str) -> None:
    """Accept requests until the socket is closed or the parent process is gone."""
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(4)
    listener.settimeout(PARENT_POLL_S)
    print("ready", flush=True)
    while os.getppid() == parent:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        with conn, conn.makefile("rwb", buffering=0) as stream:
            line = stream.readline()
            if not line:
                continue
            req = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                os._exit(run_child(req))
            try:
                stream.write(json.dumps({"pid": pid}).encode() + b"\n")
            finally:
                # reaped whatever the client does: a child is never left a zombie
                code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            # a client past its deadline may be gone: the next request is still served
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                stream.write(json.dumps({"status": code}).encode() + b"\n")


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: {sys.argv[0]} SOCKET_PATH")
    preload()
    serve(sys.argv[1])


if __name__ == "__main__":
    main()
