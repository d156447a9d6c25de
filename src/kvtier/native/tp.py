"""Tensor parallelism over worker processes (torch.distributed: gloo on CPU, NCCL on CUDA).

The engine process keeps the scheduler; each rank is a fresh interpreter (started with
`subprocess`, so the caller's `__main__` is never re-imported) running a `ModelRunner` with its
share of the KV heads, its KV cache and its worker-side connector. Messages cross a socket pair
framed by `multiprocessing.connection.Connection` (`send_bytes`/`recv_bytes`) as msgspec bytes,
never pickled. A dead or failing rank is reported as `WorkerError` within a poll interval,
never as a hang.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

import msgspec
import torch

from kvtier.native.config import EngineConfig
from kvtier.native.connector import ConnectorSpec
from kvtier.native.loader import load_model_config
from kvtier.native.runner import ModelRunner, StepInput, StepResult, device_for, encode

_POLL_S = 0.05
_WORKER_CMD = (
    "import sys\n"
    "from multiprocessing.connection import Connection\n"
    "from kvtier.native.tp import worker_main\n"
    "worker_main(Connection(int(sys.argv[1])))\n"
)


class WorkerError(RuntimeError):
    """A TP worker died, failed, or did not answer in time."""


class WorkerInit(msgspec.Struct):
    """What a worker process needs to build its rank."""

    model_dir: str
    config: dict[str, Any]
    rank: int
    world: int
    dist_init: str
    connector: ConnectorSpec
    log_level: int = logging.WARNING  # the engine process's level for the "kvtier" loggers


class Ready(msgspec.Struct, tag="ready"):
    """The rank loaded its shard and registered its KV cache."""

    rank: int
    kv_cache_shape: list[int]


class Failed(msgspec.Struct, tag="failed"):
    """The rank raised; `error` is its traceback."""

    rank: int
    error: str


class Shutdown(msgspec.Struct, tag="shutdown"):
    """Stop the worker loop."""


_to_worker = msgspec.msgpack.Decoder(StepInput | Shutdown)
_to_engine = msgspec.msgpack.Decoder(Ready | StepResult | Failed)


def _all_reduce(t: torch.Tensor) -> torch.Tensor:
    torch.distributed.all_reduce(t)
    return t


def worker_main(conn: Connection) -> None:
    """Body of a TP worker process: build the rank from the first message, then serve steps."""
    runner: ModelRunner | None = None
    rank = -1
    try:
        init = msgspec.msgpack.decode(conn.recv_bytes(), type=WorkerInit)
        rank = init.rank
        _configure_logging(init.log_level)
        config = EngineConfig(**init.config)
        # ranks share the cores; oversubscribed OpenMP threads only slow every rank down
        torch.set_num_threads(config.num_threads or 1)
        if config.is_cuda:
            torch.cuda.set_device(device_for(config, rank))
        backend = "nccl" if config.is_cuda else "gloo"
        # gloo binds to the hostname's address unless told otherwise; loopback always works
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        torch.distributed.init_process_group(
            backend, init_method=f"file://{init.dist_init}", rank=rank, world_size=init.world
        )
        mcfg = load_model_config(init.model_dir)
        runner = ModelRunner(
            init.model_dir, config, mcfg, init.connector, rank=rank, all_reduce=_all_reduce
        )
        conn.send_bytes(encode(Ready(rank, list(runner.kv_cache.shape))))
        while True:
            msg = _to_worker.decode(conn.recv_bytes())
            if isinstance(msg, Shutdown):
                break
            conn.send_bytes(encode(runner.execute(msg)))
    except EOFError:
        return  # the engine went away: nothing left to answer
    except BaseException:
        _try_send(conn, encode(Failed(rank, traceback.format_exc())))
        raise
    finally:
        if runner is not None:
            runner.shutdown()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _configure_logging(level: int) -> None:
    """A fresh interpreter logs nothing below WARNING: give "kvtier" the engine's level and a
    handler on the stderr the rank shares with the engine process, so per-rank lines (the
    `kvtier[rank r/N]: Retrieved ...` histogram) land in the server's log."""
    lg = logging.getLogger("kvtier")
    lg.setLevel(level)
    if not lg.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(process)d]: %(message)s")
        )
        lg.addHandler(handler)
        lg.propagate = False


def _try_send(conn: Connection, data: bytes) -> None:
    try:
        conn.send_bytes(data)
    except OSError:
        return  # the engine is gone; the exit code tells the story


class MultiprocExecutor:
    """Starts one process per rank and runs each step on all of them."""

    def __init__(
        self,
        model_dir: str,
        config: EngineConfig,
        connector: ConnectorSpec,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.world = config.tensor_parallel_size
        self.config = config
        self.clock = clock
        self._tmp = tempfile.mkdtemp(prefix="kvtier-tp-")
        self._broken = False
        self.procs: list[subprocess.Popen[bytes]] = []
        self.conns: list[Connection] = []
        # the engine's import path, so connectors importable here (tests too) import there
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        try:
            for rank in range(self.world):
                parent, child = socket.socketpair()
                fd = child.fileno()
                proc = subprocess.Popen(
                    # -P: `python -c` would put the working directory first on the import
                    # path, and a module planted there (/tmp, a shared project) would run in
                    # every rank, with its KV cache and lookup key
                    [sys.executable, "-P", "-c", _WORKER_CMD, str(fd)],
                    pass_fds=(fd,),
                    stdin=subprocess.DEVNULL,
                    env=env,
                )
                child.close()
                conn = Connection(parent.detach())
                self.procs.append(proc)
                self.conns.append(conn)
                init = WorkerInit(
                    str(model_dir), config.to_dict(), rank, self.world,
                    os.path.join(self._tmp, "dist_init"), connector,
                    logging.getLogger("kvtier").getEffectiveLevel(),
                )  # fmt: skip
                conn.send_bytes(encode(init))
            ready = self._gather(config.startup_timeout_s, "start up")
            self.kv_cache_shapes = [m.kv_cache_shape for m in ready]  # type: ignore[union-attr]
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        """Process ids of the ranks, rank order."""
        return [p.pid for p in self.procs]

    def execute(self, step: StepInput) -> list[StepResult]:
        """Send the step to every rank and collect every rank's result."""
        if self._broken:
            raise WorkerError("a TP rank failed earlier; close the engine and start a new one")
        data = encode(step)
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(data)
            except OSError as e:
                raise self._dead(rank, f"could not be sent step {step.step_id} ({e})") from None
        results = self._gather(self.config.step_timeout_s, f"run step {step.step_id}")
        return results  # type: ignore[return-value]

    def _gather(self, timeout_s: float, what: str) -> list[Ready | StepResult]:
        deadline = self.clock() + timeout_s
        results: list[Any] = [None] * self.world
        pending = set(range(self.world))
        while pending:
            for rank in sorted(pending):
                conn = self.conns[rank]
                if conn.poll():
                    try:
                        msg = _to_engine.decode(conn.recv_bytes())
                    except (EOFError, OSError):
                        raise self._dead(rank, f"closed its pipe while asked to {what}") from None
                    if isinstance(msg, Failed):
                        raise self._dead(rank, f"failed to {what}:\n{msg.error}")
                    results[rank] = msg
                    pending.discard(rank)
                elif self.procs[rank].poll() is not None:
                    raise self._dead(rank, f"died while asked to {what}")
            if not pending:
                break
            if self.clock() > deadline:
                raise WorkerError(
                    f"TP ranks {sorted(pending)} did not {what} within {timeout_s:.0f} s; "
                    "raise EngineConfig.step_timeout_s/startup_timeout_s if they are just slow"
                )
            # a dead rank's socket end closes, which wakes this wait too
            wait([self.conns[r] for r in pending], _POLL_S)
        return results

    def check_ranks(self) -> None:
        """Raise `WorkerError` when a rank has exited, between steps too; like a failed step
        it stops the survivors, which would wait for good in a collective with the dead one."""
        for rank, proc in enumerate(self.procs):
            if proc.poll() is not None:
                raise self._dead(rank, "exited between steps")

    def _dead(self, rank: int, what: str) -> WorkerError:
        self._broken = True
        # a rank that closed its pipe or failed is on its way out: let it be reaped
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.procs[rank].wait(timeout=1.0)
        # a peer of a dead rank fails too (its collective breaks): name the dead ones first
        dead = [(r, p.pid, p.returncode) for r, p in enumerate(self.procs) if p.poll() is not None]
        lines = [f"TP rank {r} (pid {pid}) exited with code {code}" for r, pid, code in dead]
        if rank not in {r for r, _, _ in dead}:
            lines.append(f"TP rank {rank} (pid {self.procs[rank].pid}) {what}")
        elif "\n" in what:
            lines.append(f"TP rank {rank} {what}")
        stopped = self._stop_survivors()
        if stopped:
            lines.append(f"stopped the surviving ranks {stopped}")
        return WorkerError(
            "; ".join(lines) + ". The engine cannot continue; close it and start a new one."
        )

    def _stop_survivors(self) -> list[int]:
        """End (and reap) every rank still running: after a peer died each one waits in a
        collective that never completes, so none may be left behind as a zombie."""
        alive = [r for r, p in enumerate(self.procs) if p.poll() is None]
        for r in alive:
            self.procs[r].terminate()
        for r in alive:
            try:
                self.procs[r].wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                self.procs[r].kill()
                self.procs[r].wait(timeout=10.0)
        return alive

    def close(self) -> None:
        """Ask every rank to stop, then make sure each is gone."""
        for conn in self.conns:
            _try_send(conn, encode(Shutdown()))
        # after a failure the survivors may sit in a collective that never completes
        deadline = time.monotonic() + (0.0 if self._broken else 10.0)
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()  # stuck (e.g. in a collective whose peer died)
                proc.wait(timeout=10.0)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []
        shutil.rmtree(self._tmp, ignore_errors=True)
