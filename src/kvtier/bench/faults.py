"""`kvtier bench faults`: the fault suite under load against the native engine.

Invariant 9 (degrade, never break) measured: for each fault a fresh engine (in-process
`EngineServer`; TP ranks are worker processes) with a memory tier of a few chunks, so that
replays read from the tier below it, serves three phases over its HTTP API:

* before: a seed pass of new prompts, the write-behind drained, the HBM prefix cache reset,
  then a replay of the same prompts (its external hits are the phase's hits);
* during: the same with the fault on;
* after: the same once the fault is cleared and the engine has noticed.

Every output is checked token for token against a run of the same prompts without offload.
A row reads "nothing lost" when every request sent completed and every output was right; hits
may drop during a fault (that is the price), and must come back after it.

Faults are injected where they happen in production: the shared store is a real `redis-server`
the bench starts, kills, restarts, stalls (DEBUG SLEEP) and corrupts from outside; disk-full,
an unreachable lookup server and a failing load lane are switched inside the ranks by a small
fault agent (a thread of the bench's connector, driven by flag files in a control directory).
A genuinely full filesystem is an 8 MiB tmpfs a filler file fills; HBM-pool pressure is a pool
that fits two tier loads, replayed all at once; a killed TP rank is a SIGKILL, and that row
passes on a clean failure (the engine names the rank and stops, nothing is served wrong); a
namespace collision is a second weight set with the same config.json and directory name on
the same disk tier; the sampling edge values are replays with temperature 1e-39 and the like.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis
import typer
from redis.backoff import NoBackoff
from redis.retry import Retry
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from kvtier import __version__
from kvtier.bench import fault_env
from kvtier.bench.client import LoadResult, run_load
from kvtier.bench.table import MISS, Report, Row, Target, report_console, write_json
from kvtier.bench.workload import RequestSpec
from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError, StartupError
from kvtier.lookup import LookupServer
from kvtier.native.config import EngineConfig
from kvtier.native.connector import ConnectorContext, ConnectorRole
from kvtier.native.engine import Engine
from kvtier.native.loader import load_model_config
from kvtier.native.offload import WorkerHalf, connector_spec
from kvtier.native.offload import build as build_kvtier
from kvtier.native.sampling import SamplingParams
from kvtier.native.server import EngineServer
from kvtier.store import record

log = logging.getLogger("kvtier")

DEFAULT_JSON = Path("runs/bench-faults.json")
CHUNK = 64
CHUNKS_PER_PROMPT = 4
PROMPT_LEN = CHUNKS_PER_PROMPT * CHUNK + 16  # whole chunks and a tail
MAX_TOKENS = 8
MEMORY_CHUNKS = 4  # per rank: far fewer than a phase writes, so replays read the lower tier
NUM_BLOCKS = 256
BREAKER_PROBE_S = 0.5
SLOW_SLEEP_S = 0.3  # each DEBUG SLEEP of the slow remote: 3x its 100 ms timeout
VOCAB_LOW = 3  # prompt token ids start above the special tokens
_SERVED_NAME = "kvtier-bench-faults"
_BASE_URL = "http://kvtier-bench-faults"
_REDIS_START_S = 10.0
_AGENT_POLL_S = 0.01
_ACK_TIMEOUT_S = 60.0
_RECOVER_TIMEOUT_S = 30.0
# a load (a phase's seed pass or replay) that takes this long on the tiny model is stuck (a
# wedged engine): its requests are lost, and so are those of every later phase
_LOAD_TIMEOUT_S = 120.0
PRESSURE_BLOCKS = 32  # two tier loads of CHUNKS_PER_PROMPT chunks fill this pool exactly

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class Fault:
    """One fault of the suite: what it breaks and which counters say what it cost."""

    name: str
    title: str
    lower: str  # the tier below memory the engine runs with: "remote" or "disk"
    # counters shown in the table: `ranks:` (summed over ranks), `scheduler:` (the engine's
    # view) or `engine:` (its stats), then `family` or `family{label=value,...}`
    why: tuple[str, ...]
    pool_blocks: int = NUM_BLOCKS  # the HBM pool of its engine
    min_tp: int = 1  # run at this TP size at least
    clean_failure: bool = False  # the fault ends the engine: pass = it ends cleanly


FAULTS: dict[str, Fault] = {
    f.name: f
    for f in (
        Fault(
            "remote_restart",
            "remote killed + restarted",
            "remote",
            ("ranks:store_failures{tier=remote}", "ranks:dropped_writes{tier=remote}"),
        ),
        Fault(
            "remote_slow",
            "remote slow (DEBUG SLEEP)",
            "remote",
            ("ranks:store_failures{tier=remote}", "ranks:dropped_writes{tier=remote}"),
        ),
        Fault(
            "remote_corrupt",
            "corrupted remote values",
            "remote",
            ("ranks:verify_failures{tier=remote}", "scheduler:load_failures"),
        ),
        Fault("disk_full", "disk full (ENOSPC)", "disk", ("ranks:store_failures{tier=disk}",)),
        Fault(
            "lookup_down",
            "a rank's lookup server unreachable",
            "disk",
            ("scheduler:lookup_timeouts", "scheduler:skipped_loads{reason=lookup_timeout}"),
        ),
        Fault("load_fail", "a load failing on one rank", "disk", ("scheduler:load_failures",)),
        Fault(
            "hbm_pressure",
            "HBM pool fits two loads, replays all at once",
            "disk",
            ("engine:num_preemptions", "scheduler:skipped_loads"),
            pool_blocks=PRESSURE_BLOCKS,
        ),
        Fault(
            "tp_rank_killed",
            "a TP rank killed (SIGKILL)",
            "disk",
            ("engine:error",),
            min_tp=2,
            clean_failure=True,
        ),
        Fault(
            "disk_tmpfs",
            "filesystem genuinely full (8 MiB tmpfs)",
            "disk",
            # a full filesystem shrinks the tier's budget and evicts (tier_full on ENOSPC)
            (
                "ranks:store_failures{tier=disk}",
                "ranks:tier_full{tier=disk}",
                "ranks:evictions{tier=disk}",
            ),
        ),
        Fault(
            "namespace_collision",
            "other weights, same config.json and dir name",
            "disk",
            ("scheduler:lookups",),
        ),
        Fault("sampling_edges", "sampling edge values (temperature 1e-39, ...)", "disk", ()),
    )
}


@dataclass(frozen=True, slots=True)
class Plan:
    """Sizes of one run (`FULL` or `QUICK`)."""

    prompts_per_phase: int
    concurrency: int
    tp: int


FULL = Plan(prompts_per_phase=8, concurrency=4, tp=2)
QUICK = Plan(prompts_per_phase=4, concurrency=4, tp=1)


# ----------------------------------------------------------------------------------------------
# the in-rank fault agent (runs in every TP rank, inside the connector's worker half)
# ----------------------------------------------------------------------------------------------

FLAG_DISK_FULL = "disk_full"
FLAG_LOOKUP_DOWN = "lookup_down"
FLAG_LOAD_FAIL = "load_fail"
_PROBE_KEY = bytes(record.KEY_BYTES)  # never a chunk key: a presence probe through the breaker


class FaultWorkerHalf(WorkerHalf):
    """kvtier's worker half plus a fault agent: flags in `ctl_dir` switch faults inside the
    rank, and `<kind>-<n>.req` files ask it to drain the write-behind (`flush`) or probe the
    lower tiers through their breakers (`probe`); it answers in `<kind>-<n>.rank<r>`."""

    def setup(self, ctl_dir: str, fail_rank: int, log_path: str, bench_pid: int) -> None:
        """Called once right after the class swap in `build_connector`."""
        if os.getpid() != bench_pid:
            # a TP worker process: its injected failures go to the bench's log, not the tty
            _log_to(Path(log_path).with_suffix(f".rank{self.rank}.log"))
        self.ctl_dir = Path(ctl_dir)
        self.fail_rank = fail_rank
        self.flags: frozenset[str] = frozenset()
        self.doomed: set[bytes] = set()
        self._stop = threading.Event()
        self._agent: threading.Thread | None = None

    def register_kv_caches(self, kv_caches: dict[str, Any], block_size: int) -> None:
        super().register_kv_caches(kv_caches, block_size)
        stack = self.worker.stack
        assert stack is not None
        read_into, read_view = stack.read_into, stack.read_view

        def fail_doomed(key: bytes) -> None:
            if key in self.doomed:
                self.doomed.discard(key)
                raise RuntimeError(f"injected: rank {self.rank}'s load lane failed mid-load")

        def faulty_read(key: bytes, dst: Any, *rest: Any) -> str | None:
            fail_doomed(key)
            return read_into(key, dst, *rest)

        def faulty_view(key: bytes) -> Any:
            fail_doomed(key)
            return read_view(key)

        # instance attributes shadow the methods for every caller (the load lane included; on
        # the CPU it scatters from a leased slot's view, else reads into device staging)
        stack.read_into = faulty_read  # type: ignore[method-assign]
        stack.read_view = faulty_view  # type: ignore[method-assign]
        for tier in stack.lower:
            if tier.name == "disk":
                write_temp = tier._write_temp  # type: ignore[attr-defined]

                def full_disk(path: Path, header: bytes, payload: Any, _w: Any = write_temp) -> Any:
                    if FLAG_DISK_FULL in self.flags:
                        raise OSError(errno.ENOSPC, "No space left on device (injected)", str(path))
                    return _w(path, header, payload)

                tier._write_temp = full_disk  # type: ignore[attr-defined]
        self._agent = threading.Thread(
            target=self._agent_loop, name=f"kvtier-fault-agent-{self.rank}", daemon=True
        )
        self._agent.start()

    def start_load_kv(self) -> None:
        if FLAG_LOAD_FAIL in self.flags and self.rank == self.fail_rank:
            # the second chunk: the first one is already in the KV blocks when the lane fails
            self.doomed.update(op.chunks[1].key for op in self._meta.loads if len(op.chunks) > 1)
        super().start_load_kv()

    def shutdown(self) -> None:
        self._stop.set()
        if self._agent is not None:
            self._agent.join(10.0)
        super().shutdown()

    # ---- the agent thread ----------------------------------------------------------------

    def _agent_loop(self) -> None:
        while not self._stop.wait(_AGENT_POLL_S):
            try:
                self._tick()
            except OSError:
                if self.ctl_dir.exists():
                    log.exception("kvtier bench: fault agent of rank %d stopped", self.rank)
                # else the bench removed the control directory: it is tearing down
                return

    def _tick(self) -> None:
        flags = frozenset(p.stem for p in self.ctl_dir.glob("*.flag"))
        if (FLAG_LOOKUP_DOWN in flags) != (FLAG_LOOKUP_DOWN in self.flags) and (
            self.rank == self.fail_rank
        ):
            self._lookup_server(up=FLAG_LOOKUP_DOWN not in flags)
        self.flags = flags
        for req in sorted(self.ctl_dir.glob("*.req")):
            ack = req.with_suffix(f".rank{self.rank}")
            if ack.exists():
                continue
            kind = req.stem.split("-", 1)[0]
            answer = self._answer(kind)
            tmp = ack.with_suffix(ack.suffix + ".tmp")
            tmp.write_text(json.dumps(answer), encoding="utf-8")
            os.replace(tmp, ack)

    def _answer(self, kind: str) -> dict[str, Any]:
        stack = self.worker.stack
        assert stack is not None
        if kind == "flush":
            return {"ok": stack.flush(_ACK_TIMEOUT_S / 2)}
        if kind == "probe":
            breakers = {}
            for tier in stack.lower:
                breaker = getattr(tier, "breaker", None)
                if breaker is None:
                    continue
                tier.contains(_PROBE_KEY)  # a real call: lets the breaker's probe through
                breakers[tier.name] = breaker.state.value
            return {"breakers": breakers}
        return {"error": f"unknown request {kind!r}"}

    def _lookup_server(self, *, up: bool) -> None:
        """Take this rank's lookup server away, or bring a new one up on the same endpoint."""
        w = self.worker
        if not up:
            if w.server is not None:
                w.server.close()
                w.server = None
            return
        if w.server is None and w.stack is not None and w.lookup_endpoint is not None:
            w.server = LookupServer(w.rank, w.stack, w.lookup_endpoint, w.metrics).start()


def build_connector(role: ConnectorRole, context: ConnectorContext, **args: Any) -> Any:
    """Connector factory for the bench's engines: kvtier, with a fault agent in every rank."""
    ctl_dir = args.pop("ctl_dir")
    fail_rank = args.pop("fail_rank")
    log_path = args.pop("log_path")
    bench_pid = args.pop("bench_pid")
    half = build_kvtier(role, context, **args)
    if role is ConnectorRole.WORKER:
        half.__class__ = FaultWorkerHalf
        half.setup(ctl_dir, fail_rank, log_path, bench_pid)
    return half


def _log_to(path: Path) -> logging.Handler:
    """Send the `kvtier` loggers of this process to `path` (and nowhere else); the handler."""
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("kvtier")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return handler


class Control:
    """The harness's end of the fault agents: flag files and request/answer files."""

    def __init__(self, ctl_dir: Path, world: int) -> None:
        self.dir = ctl_dir
        self.world = world
        self._seq = itertools.count()
        ctl_dir.mkdir(parents=True, exist_ok=True)

    def set(self, flag: str) -> None:
        """Switch `flag` on in every rank (its agent sees it within a poll)."""
        (self.dir / f"{flag}.flag").touch()

    def clear(self, flag: str) -> None:
        """Switch `flag` off."""
        (self.dir / f"{flag}.flag").unlink(missing_ok=True)

    def request(self, kind: str, timeout_s: float = _ACK_TIMEOUT_S) -> list[dict[str, Any]]:
        """Ask every rank's agent for `kind`; their answers, by rank."""
        stem = f"{kind}-{next(self._seq)}"
        req = self.dir / f"{stem}.req"
        req.touch()
        acks = [self.dir / f"{stem}.rank{r}" for r in range(self.world)]
        deadline = time.monotonic() + timeout_s
        try:
            while not all(a.exists() for a in acks):
                if time.monotonic() > deadline:
                    missing = [r for r, a in enumerate(acks) if not a.exists()]
                    raise RuntimeError(
                        f"fault agents of ranks {missing} did not answer {kind!r} "
                        f"within {timeout_s:g}s"
                    )
                time.sleep(_AGENT_POLL_S)  # a poll interval on files, not a synchronisation
            return [json.loads(a.read_text(encoding="utf-8")) for a in acks]
        finally:
            req.unlink(missing_ok=True)
            for a in acks:
                a.unlink(missing_ok=True)


# ----------------------------------------------------------------------------------------------
# the shared store
# ----------------------------------------------------------------------------------------------


class RedisProcess:
    """A throwaway `redis-server` on a free loopback port (no persistence, DEBUG enabled)."""

    def __init__(self, work_dir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise StartupError(
                "kvtier bench faults needs `redis-server` on PATH for the shared-tier faults; "
                "install it (apt-get install redis-server, or valkey-server as redis-server) "
                "or run only the disk and rank faults with --fault disk_full --fault "
                "lookup_down --fault load_fail"
            )
        self.binary = binary
        self.dir = work_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The server's URL."""
        return f"redis://127.0.0.1:{self.port}/0"

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
        """Start (on a new free port the first time, the same port afterwards); wait for PING."""
        if self.port == 0:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", 0))
                self.port = int(s.getsockname()[1])
        conf = self.dir / "redis.conf"
        conf.write_text(
            "\n".join(
                [
                    "bind 127.0.0.1",
                    f"port {self.port}",
                    f"dir {self.dir}",
                    'save ""',
                    "appendonly no",
                    "daemonize no",
                    f"logfile {self.dir / 'redis.log'}",
                    "enable-debug-command local",
                ]
            )
            + "\n",
            encoding="utf-8",
        )
        self.proc = subprocess.Popen(
            [self.binary, str(conf)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + _REDIS_START_S
        admin = self.client(timeout_s=0.2)
        try:
            while True:
                try:
                    if admin.ping():
                        return
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                    pass  # not listening yet
                try:
                    code = self.proc.wait(timeout=0.02)
                except subprocess.TimeoutExpired:
                    code = None
                if code is not None or time.monotonic() > deadline:
                    self.kill()
                    raise StartupError(
                        f"redis-server on port {self.port} did not start (exit code {code}); "
                        f"see {self.dir / 'redis.log'}"
                    )
        finally:
            admin.close()

    def kill(self) -> None:
        """SIGKILL the server (a crash); the port is kept for `start()`."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=_REDIS_START_S)
            self.proc = None

    def flushall(self) -> None:
        """Empty the store."""
        admin = self.client()
        try:
            admin.flushall()
        finally:
            admin.close()


class _Staller:
    """Keeps a redis-server slow: back-to-back `DEBUG SLEEP`s from its own connection."""

    def __init__(self, store: RedisProcess, sleep_s: float) -> None:
        self._admin = store.client(timeout_s=sleep_s + 5.0)
        self._sleep_s = sleep_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-redis-staller", daemon=True)
        self.sleeps = 0

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._admin.execute_command("DEBUG", "SLEEP", self._sleep_s)
            except redis.exceptions.RedisError:
                log.exception("kvtier bench: the redis staller stopped")
                return
            self.sleeps += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self._sleep_s + 10.0)
        self._admin.close()


def corrupt_remote(store: RedisProcess) -> int:
    """Flip one payload byte of every kvtier record in the store; returns how many."""
    admin = store.client()
    n = 0
    try:
        for rkey in admin.scan_iter(match="kvtier:*"):
            at = record.HEADER_BYTES + 100
            old = admin.getrange(rkey, at, at)
            if old:
                admin.setrange(rkey, at, bytes([old[0] ^ 0xFF]))
                n += 1
    finally:
        admin.close()
    return n


# ----------------------------------------------------------------------------------------------
# one fault
# ----------------------------------------------------------------------------------------------


@dataclass(slots=True)
class PhaseResult:
    """One phase: requests sent, completed, verified; the replay's external hit tokens."""

    sent: int = 0
    completed: int = 0
    verified: int = 0
    hit_tokens: int = 0
    errors: list[str] = field(default_factory=list)


@dataclass(slots=True)
class FaultResult:
    """A fault's three phases and the counters that say what it cost."""

    fault: str
    title: str
    phases: dict[str, PhaseResult]
    counters: dict[str, float]
    hit_tokens_possible: int
    seconds: float
    engine_error: str = ""  # why the engine stopped serving ("" while it serves)
    clean_failure: bool = False  # the row's point is a clean failure, not nothing lost
    ranks_left: int = 0  # TP rank processes still running after the run

    @property
    def sent(self) -> int:
        return sum(p.sent for p in self.phases.values())

    @property
    def completed(self) -> int:
        return sum(p.completed for p in self.phases.values())

    @property
    def verified(self) -> int:
        return sum(p.verified for p in self.phases.values())

    @property
    def nothing_lost(self) -> bool:
        """Every request sent completed and every output was right."""
        return self.completed == self.sent and self.verified == self.completed

    @property
    def ended_cleanly(self) -> bool:
        """The engine stopped with an error naming a TP rank and its exit code, left no rank
        running, and served nothing wrong (every completed output right)."""
        named = "TP rank" in self.engine_error and "exited with code" in self.engine_error
        return named and self.ranks_left == 0 and self.verified == self.completed

    @property
    def passed(self) -> bool:
        """The row's verdict: a clean failure, or nothing lost."""
        return self.ended_cleanly if self.clean_failure else self.nothing_lost


class _Run:
    """One fault against one fresh engine: inject, clear and recover around three phases."""

    def __init__(
        self,
        fault: Fault,
        *,
        model_dir: Path,
        tp: int,
        plan: Plan,
        prompts: dict[str, list[list[int]]],
        reference: dict[tuple[int, ...], list[int]],
        work: Path,
        store: RedisProcess | None,
        say: Progress,
        log_path: Path,
        disk_dir: Path | None = None,
    ) -> None:
        self.fault = fault
        self.tp = tp
        self.plan = plan
        self.prompts = prompts
        self.reference = reference
        self.store = store
        self.say = say
        self.ctl = Control(work / "ctl", tp)
        self._staller: _Staller | None = None
        self.tmpfs: fault_env.Tmpfs | None = None
        disk_bytes = None
        if fault.name == "disk_tmpfs":
            self.tmpfs = fault_env.Tmpfs(work / "tmpfs")
            disk_dir = self.tmpfs.path / "disk"
            # within the filesystem, so the tier's own budget never evicts: a full
            # filesystem is what stops its writes
            disk_bytes = self.tmpfs.size * 3 // 4 // tp
        cfg = _kvtier_config(fault, model_dir, tp, work, store, disk_dir, disk_bytes)
        spec = connector_spec(cfg, model_dir, run_dir=work / "run")
        factory = (
            f"{__name__}:build_connector",
            {
                **spec.args,
                "ctl_dir": str(self.ctl.dir),
                "fail_rank": tp - 1,
                "log_path": str(log_path),
                "bench_pid": os.getpid(),
            },
        )
        try:
            engine = Engine(model_dir, _engine_config(tp, fault.pool_blocks), factory)
        except BaseException:
            self._unmount()
            raise
        try:
            self.server = EngineServer(engine, model_name=_SERVED_NAME).start()
        except BaseException:
            engine.close()
            self._unmount()
            raise
        self._last_stats: dict[str, float] = {}
        self.stuck: str | None = None  # set when a load got no answer in time

    def close(self) -> None:
        if self._staller is not None:
            self._staller.stop()
            self._staller = None
        try:
            self.server.close()
        finally:
            self._unmount()

    def _unmount(self) -> None:
        if self.tmpfs is not None:
            self.tmpfs.close()
            self.tmpfs = None

    @property
    def fatal(self) -> str | None:
        """Why the engine stopped serving (a failed step, a dead rank, stuck), or None."""
        return self.server.loop.fatal or self.stuck

    def _within_deadline(self, coro: Any, tag: str, n: int, result: PhaseResult) -> Any:
        """`coro`'s result, or None (its `n` requests lost) once the engine is stuck."""
        if self.stuck is not None:
            coro.close()
        else:
            try:
                return asyncio.run(asyncio.wait_for(coro, _LOAD_TIMEOUT_S))
            except TimeoutError:
                self.stuck = f"{tag}: no answer within {_LOAD_TIMEOUT_S:g} s (the engine is stuck)"
        result.sent += n
        result.errors.append(self.stuck)
        return None

    # ---- the three phases ----------------------------------------------------------------

    def run(self) -> FaultResult:
        t0 = time.monotonic()
        phases = {"before": self._phase("before")}
        self.say(f"[{self.fault.name}] fault on")
        self._inject()
        phases["during"] = self._phase("during", between=self._between)
        if not self.fault.clean_failure:
            self.say(f"[{self.fault.name}] fault cleared")
            self._clear()
            self._recover()
            phases["after"] = self._phase("after")
        return self.result(phases, t0)

    def result(self, phases: dict[str, PhaseResult], t0: float) -> FaultResult:
        """The run's row data once its phases are done."""
        possible = self.plan.prompts_per_phase * CHUNKS_PER_PROMPT * CHUNK
        procs = getattr(self.server.engine.executor, "procs", [])
        return FaultResult(
            self.fault.name,
            self.fault.title,
            phases,
            self._counters(),
            possible,
            round(time.monotonic() - t0, 2),
            engine_error=self.fatal or "",
            clean_failure=self.fault.clean_failure,
            ranks_left=sum(1 for p in procs if p.poll() is None),
        )

    def _phase(self, phase: str, between: Callable[[], None] | None = None) -> PhaseResult:
        """Seed, drain, reset HBM, replay; a dead engine only has its requests refused."""
        prompts = self.prompts[phase]
        result = PhaseResult()
        self._load(prompts, f"{phase}-seed", result)
        self._idle()
        if self.fatal is None:
            self.ctl.request("flush")
        if between is not None:
            between()
        self._engine_call(lambda e: e.reset_prefix_cache())
        hits0 = self._stats()["external_prefix_cache_hits"]
        self.replay(prompts, f"{phase}-replay", result, during=phase == "during")
        result.hit_tokens = int(self._stats()["external_prefix_cache_hits"] - hits0)
        self.say(
            f"[{self.fault.name}] {phase}: {result.verified}/{result.sent} verified, "
            f"{result.hit_tokens} hit tokens"
        )
        return result

    def replay(
        self, prompts: list[list[int]], tag: str, result: PhaseResult, *, during: bool = False
    ) -> None:
        """The replay of a phase (the fault's own shape of it while the fault is on), drained."""
        if during and self.fault.name == "sampling_edges":
            self._load_edges(prompts, tag, result)
        elif during and self.fault.name == "hbm_pressure":
            self._load(prompts, tag, result, concurrency=len(prompts))  # all at once
        else:
            self._load(prompts, tag, result)
        self._idle()

    def _load(
        self,
        prompts: list[list[int]],
        tag: str,
        result: PhaseResult,
        concurrency: int | None = None,
    ) -> None:
        specs = [RequestSpec(i, tag, tuple(p), MAX_TOKENS) for i, p in enumerate(prompts)]
        transport = httpx.ASGITransport(app=self.server.app)  # no timeouts: a deadline below
        coro = run_load(
            _BASE_URL,
            specs,
            concurrency=concurrency or self.plan.concurrency,
            model=_SERVED_NAME,
            progress=False,
            transport=transport,
        )
        load: LoadResult | None = self._within_deadline(coro, tag, len(specs), result)
        if load is None:
            return
        for rec, spec in zip(load.records, specs, strict=True):
            result.sent += 1
            if not rec.ok:
                result.errors.append(rec.error or "incomplete")
                continue
            result.completed += 1
            if rec.output_ids == self.reference[spec.prompt]:
                result.verified += 1
            else:
                result.errors.append(f"{tag} request {spec.index}: output differs from reference")

    def _load_edges(self, prompts: list[list[int]], tag: str, result: PhaseResult) -> None:
        """Each prompt once per edge sampling setting, all expected to equal greedy."""

        async def send() -> list[tuple[list[int], list[int] | None, str]]:
            transport = httpx.ASGITransport(app=self.server.app)
            async with httpx.AsyncClient(transport=transport, base_url=_BASE_URL) as client:
                out = []
                for prompt, sampling in itertools.product(prompts, fault_env.EDGE_SAMPLING):
                    ids, why = await fault_env.edge_completion(
                        client, prompt, MAX_TOKENS, sampling, _SERVED_NAME
                    )
                    out.append((prompt, ids, why))
                return out

        n = len(prompts) * len(fault_env.EDGE_SAMPLING)
        answers = self._within_deadline(send(), tag, n, result)
        for prompt, ids, why in answers or ():
            result.sent += 1
            if ids is None:
                result.errors.append(f"{tag}: {why}")
                continue
            result.completed += 1
            if ids == self.reference[tuple(prompt)]:
                result.verified += 1
            else:
                result.errors.append(f"{tag}: output differs from the greedy reference")

    # ---- fault hooks -------------------------------------------------------------------------

    def _inject(self) -> None:
        name = self.fault.name
        if name == "remote_restart":
            self._store().kill()
        elif name == "remote_slow":
            self._staller = _Staller(self._store(), SLOW_SLEEP_S)
            self._staller.start()
        elif name == "disk_full":
            self.ctl.set(FLAG_DISK_FULL)
        elif name == "lookup_down":
            self.ctl.set(FLAG_LOOKUP_DOWN)
            # the agents act within a poll; a probe answers once every rank took its flag
            self.ctl.request("probe")
        elif name == "load_fail":
            self.ctl.set(FLAG_LOAD_FAIL)
            self.ctl.request("probe")
        elif name == "tp_rank_killed":
            victim = self.server.engine.executor.pids[-1]  # type: ignore[union-attr]
            os.kill(victim, signal.SIGKILL)
            self.say(f"[{self.fault.name}] killed TP rank {self.tp - 1} (pid {victim})")
        elif name == "disk_tmpfs" and self.tmpfs is not None:
            n = self.tmpfs.fill()
            self.say(f"[{self.fault.name}] a filler took the last {n >> 10} KiB of the tmpfs")

    def _between(self) -> None:
        """Between the during-phase's seed pass and its replay."""
        if self.fault.name == "remote_corrupt":
            n = corrupt_remote(self._store())
            self.say(f"[{self.fault.name}] corrupted {n} records in the store")

    def _clear(self) -> None:
        name = self.fault.name
        if name == "remote_restart":
            self._store().start()
        elif name == "remote_slow" and self._staller is not None:
            self._staller.stop()
            self._staller = None
        elif name == "disk_tmpfs" and self.tmpfs is not None:
            self.tmpfs.unfill()
        for flag in (FLAG_DISK_FULL, FLAG_LOOKUP_DOWN, FLAG_LOAD_FAIL):
            self.ctl.clear(flag)
        if self.fatal is None:
            self.ctl.request("probe")

    def _recover(self) -> None:
        """Wait until the engine noticed the fault is gone (breakers closed, ranks answer)."""
        if self.fatal is not None:
            return  # nothing to recover: the after phase's requests are refused
        deadline = time.monotonic() + _RECOVER_TIMEOUT_S
        while True:
            answers = self.ctl.request("probe")
            closed = all(s == "closed" for a in answers for s in a["breakers"].values())
            ranks = self._engine_call(lambda e: e.connector.client.ping(500))
            if closed and all(ranks.values()):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"[{self.fault.name}] the engine did not recover within "
                    f"{_RECOVER_TIMEOUT_S:g}s: breakers {answers}, lookup ranks {ranks}"
                )
            time.sleep(BREAKER_PROBE_S / 5)  # the breaker lets a probe through every probe_s

    # ---- engine access -------------------------------------------------------------------

    def _engine_call(self, fn: Callable[[Engine], Any]) -> Any:
        if self.fatal is not None:
            return None
        return self.server.loop.call(fn).result(timeout=_ACK_TIMEOUT_S)

    def _stats(self) -> dict[str, float]:
        """The engine's stats; once it stopped serving, the last ones it gave."""
        stats = self._engine_call(lambda e: e.stats())
        if stats is not None:
            self._last_stats = stats
        return self._last_stats or {"external_prefix_cache_hits": 0.0}

    def _idle(self) -> None:
        if self.fatal is None and not self.server.loop.wait_idle(_ACK_TIMEOUT_S):
            if self.fatal is None:
                raise RuntimeError(f"[{self.fault.name}] the engine did not drain")

    def _store(self) -> RedisProcess:
        if self.store is None:
            raise ConfigError(f"fault {self.fault.name!r} needs the bench's redis-server")
        return self.store

    def _counters(self) -> dict[str, float]:
        """Every failure counter that moved, summed over ranks (`family{label=value}`)."""
        wanted = {
            "evictions",
            "lookups",
            "store_failures",
            "dropped_writes",
            "verify_failures",
            "lookup_timeouts",
            "skipped_loads",
            "load_failures",
            "save_failures",
        }
        out: dict[str, float] = {}
        engine = self.server.engine
        for fam in engine.connector.collector.collect():
            for s in fam.samples:
                name = s.name.removeprefix("kvtier_").removesuffix("_total")
                if name not in wanted or not s.name.endswith("_total") or s.value == 0:
                    continue
                # the scheduler's load/lookup counters are the engine-wide view; ranks add
                # their own reasons for load failures, so both are kept apart by the key
                labels = ",".join(
                    f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("rank",)
                )
                where = "scheduler" if s.labels.get("rank") == "scheduler" else "ranks"
                key = f"{name}{{{labels}}}" if labels else name
                out[f"{where}:{key}"] = out.get(f"{where}:{key}", 0.0) + s.value
        for name in ("num_preemptions", "external_load_failures"):
            value = self._stats().get(name, 0.0)
            if value:
                out[f"engine:{name}"] = value
        if self.fatal is not None:
            out["engine:error"] = 1.0
        return out


def _engine_config(tp: int, num_blocks: int = NUM_BLOCKS) -> EngineConfig:
    return EngineConfig(num_threads=1, tensor_parallel_size=tp, num_blocks=num_blocks)


def _kvtier_config(
    fault: Fault,
    model_dir: Path,
    tp: int,
    work: Path,
    store: RedisProcess | None,
    disk_dir: Path | None = None,
    disk_bytes: int | None = None,
) -> KVTierConfig:
    mcfg = load_model_config(model_dir)
    # float32 KV (the engine's dtype), K and V of every layer, this rank's share of the heads
    chunk_bytes = CHUNK * 2 * mcfg.num_layers * (mcfg.num_kv_heads // tp) * mcfg.head_dim * 4
    cfg: dict[str, Any] = {
        "chunk_size": CHUNK,
        "memory_bytes": MEMORY_CHUNKS * chunk_bytes,
        "load_gate": False,
        "breaker_failures": 3,
        "breaker_probe_s": BREAKER_PROBE_S,
        "lookup_dir": str(work),
    }
    if fault.lower == "remote":
        if store is None:
            raise ConfigError(f"fault {fault.name!r} needs the bench's redis-server")
        cfg["remote_url"] = store.url
    else:
        cfg["disk_dir"] = str(disk_dir or work / "disk")
        cfg["disk_bytes"] = disk_bytes or 256 * chunk_bytes
    return KVTierConfig(**cfg)


# ----------------------------------------------------------------------------------------------
# the suite
# ----------------------------------------------------------------------------------------------


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB_LOW, 2048) for _ in range(PROMPT_LEN)] for _ in range(n)]


def _reference(
    model_dir: Path, tp: int, prompts: Sequence[list[int]]
) -> dict[tuple[int, ...], list[int]]:
    """Greedy outputs of `prompts` on an engine of the same TP without offload."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with Engine(model_dir, _engine_config(tp)) as eng:
        outs = eng.generate(list(prompts), params)
    return {tuple(p): o.output_token_ids for p, o in zip(prompts, outs, strict=True)}


@contextmanager
def _logging_to(path: Path) -> Iterator[None]:
    """The `kvtier` loggers of this process write to `path` only, for the duration."""
    logger = logging.getLogger("kvtier")
    saved = (logger.level, logger.propagate)
    handler = _log_to(path)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        handler.close()
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


@contextmanager
def _workdir() -> Iterator[Path]:
    # short and private: lookup ipc sockets live under it
    path = Path(tempfile.mkdtemp(prefix="kvf-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def run(
    quick: bool = False,
    json_path: str | Path | None = None,
    *,
    faults: Sequence[str] | None = None,
    tp: int | None = None,
    model_dir: str | Path | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Run the fault suite, write the JSON report to `json_path` and return it.

    `faults` picks a subset of `FAULTS` (default: all, in order); `tp` overrides the plan's TP
    size (2, or 1 with `quick`); `model_dir` defaults to a tiny float32 model built in a temp
    directory. A lost request is reported in its row (`pass: false`), never raised.
    """
    out = Path(DEFAULT_JSON if json_path is None else json_path)
    if out.is_dir():
        raise ValueError(
            f"--json {str(out)!r} is a directory; pass a file path such as {out}/x.json"
        )
    names = list(FAULTS) if not faults else list(faults)
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        raise ConfigError(f"unknown faults {unknown}; pick from {list(FAULTS)}")
    plan = QUICK if quick else FULL
    world = plan.tp if tp is None else tp
    if world < 1:
        raise ConfigError(f"tp={world} must be >= 1")
    say = progress or (lambda _msg: None)
    report = Report("faults", "kvtier bench faults" + (" (quick)" if quick else ""))
    t0 = time.monotonic()
    out.parent.mkdir(parents=True, exist_ok=True)
    log_path = out.with_suffix(".log")
    say(f"engine logs (injected failures log tracebacks): {log_path}")
    with _workdir() as work, _logging_to(log_path):
        # first: a missing redis-server fails the run before anything is built
        needs_store = any(FAULTS[n].lower == "remote" for n in names)
        store = RedisProcess(work / "redis") if needs_store else None
        model = Path(model_dir) if model_dir is not None else _tiny_model(work / "model")
        k = plan.prompts_per_phase
        prompts = {
            n: {ph: _prompts(1000 * i + j, k) for j, ph in enumerate(("before", "during", "after"))}
            for i, n in enumerate(names)
        }
        every = [p for per in prompts.values() for ps in per.values() for p in ps]
        say(f"reference: {len(every)} prompts without offload (tp={world})")
        reference = _reference(model, world, every)
        results: list[FaultResult] = []
        try:
            if store is not None:
                store.start()
                say(f"redis-server on {store.url}")
            for i, name in enumerate(names):
                fault = FAULTS[name]
                if store is not None:
                    if store.proc is None:
                        store.start()
                    store.flushall()
                fault_tp = max(world, fault.min_tp)
                say(f"[{name}] {fault.title}: engine tp={fault_tp}, memory + {fault.lower}")
                args: dict[str, Any] = {
                    "tp": fault_tp, "plan": plan, "prompts": prompts[name], "store": store,
                    "say": say, "log_path": log_path,
                }  # fmt: skip
                if name == "namespace_collision":
                    results.append(_run_collision(fault, model, reference, work / f"f{i}", args))
                    continue
                fw = work / f"f{i}"
                run_ = _Run(fault, model_dir=model, reference=reference, work=fw, **args)
                try:
                    results.append(run_.run())
                finally:
                    run_.close()
        finally:
            if store is not None:
                store.kill()
    for res in results:
        _add_row(report, res)
    report.meta = {
        "kvtier": __version__,
        "quick": quick,
        "plan": {**asdict(plan), "tp": world},
        "prompt_tokens": PROMPT_LEN,
        "chunk_size": CHUNK,
        "memory_chunks_per_rank": MEMORY_CHUNKS,
        "max_tokens": MAX_TOKENS,
        "elapsed_s": round(time.monotonic() - t0, 2),
    }
    report.footnotes.append(
        "hits = external prefix-cache hit tokens of each phase's replay; verified = greedy "
        "token ids equal a run of the same prompts without offload"
    )
    doc = report.to_json()
    write_json(out, doc)
    say(f"wrote {out}")
    return doc


def _run_collision(
    fault: Fault,
    model: Path,
    reference: dict[tuple[int, ...], list[int]],
    work: Path,
    args: dict[str, Any],
) -> FaultResult:
    """Weights A fill a disk tier; weights B, under the same config.json and directory name,
    then replay A's prompts on that tier: every output must be B's own, and B may hit only what
    B stored."""
    t0 = time.monotonic()
    disk = work / "disk"
    first = _Run(fault, model_dir=model, reference=reference, work=work / "a", disk_dir=disk,
                 **args)  # fmt: skip
    try:
        phases = {"before": first._phase("before")}
    finally:
        first.close()
    other = fault_env.other_weights(model, work / "weights-b")
    prompts = args["prompts"]
    ref_b = _reference(other, args["tp"], [*prompts["before"], *prompts["after"]])
    args["say"](f"[{fault.name}] second weight set at {other}, same config.json and name")
    second = _Run(fault, model_dir=other, reference=ref_b, work=work / "b", disk_dir=disk, **args)
    try:
        during = PhaseResult()
        hits0 = second._stats()["external_prefix_cache_hits"]
        second.replay(prompts["before"], "during-replay", during)
        during.hit_tokens = int(second._stats()["external_prefix_cache_hits"] - hits0)
        if all(ref_b[tuple(p)] == reference[tuple(p)] for p in prompts["before"]):
            # the check cannot tell the two models apart: it proves nothing
            during.verified = 0
            during.errors.append("the second weight set gives the first one's outputs")
        phases["during"] = during
        phases["after"] = second._phase("after")
        return second.result(phases, t0)
    finally:
        second.close()


def _tiny_model(path: Path) -> Path:
    from kvtier.native.modelgen import init_model

    return init_model(path, dtype="float32")


def _add_row(report: Report, res: FaultResult) -> None:
    why = {
        k: v for k, v in res.counters.items() if any(_matches(k, w) for w in FAULTS[res.fault].why)
    }
    detail: dict[str, float | int | str] = {
        "fault": res.fault,
        "title": res.title,
        "sent": res.sent,
        "completed": res.completed,
        "verified": res.verified,
        "nothing_lost": "yes" if res.nothing_lost else "no",
        "hits_before": res.phases["before"].hit_tokens,
        "hits_during": res.phases["during"].hit_tokens,
        "hits_after": res.phases["after"].hit_tokens if "after" in res.phases else 0,
        "outcome": "clean failure" if res.clean_failure else "nothing lost",
        "ended_cleanly": "yes" if res.ended_cleanly else "no",
        "engine_error": res.engine_error[:500],
        "ranks_left": res.ranks_left,
        "hit_tokens_possible": res.hit_tokens_possible,
        "why": ", ".join(f"{_short(k)}={v:g}" for k, v in sorted(why.items())) or "—",
        "seconds": res.seconds,
        "errors": "; ".join(e for p in res.phases.values() for e in p.errors)[:2000],
    }
    for key, value in sorted(res.counters.items()):
        detail[f"counter:{key}"] = value
    if res.clean_failure:
        # the engine cannot serve on: what counts is how it stopped
        row = Row(
            id=res.fault,
            label=f"{res.title}: ended cleanly",
            value=1.0 if res.ended_cleanly else 0.0,
            unit="clean",
            target=Target("value", ">=", 1.0),
            detail=detail,
        )
    else:
        row = Row(
            id=res.fault,
            label=f"{res.title}: verified / sent",
            value=float(res.verified),
            unit="requests",
            raw=float(res.sent),
            target=Target("ratio", ">=", 1.0),
            detail=detail,
        )
    report.add(row)


def _short(counter: str) -> str:
    """`where:family{k=v,...}` as `family(v,...)`, for the table."""
    name = counter.partition(":")[2]
    family, _, labels = name.partition("{")
    values = [kv.partition("=")[2] for kv in labels.rstrip("}").split(",") if kv]
    return f"{family}({','.join(values)})" if values else family


def _matches(counter: str, pattern: str) -> bool:
    """Whether counter `where:family{labels}` is where and of the family `pattern` names, and
    carries its labels."""
    where, _, name = counter.partition(":")
    want_where, _, want_name = pattern.partition(":")
    family, _, labels = name.partition("{")
    want_family, _, want = want_name.partition("{")
    if (where, family) != (want_where, want_family):
        return False
    have = set(labels.rstrip("}").split(",")) if labels else set()
    return all(w in have for w in want.rstrip("}").split(",") if w)


# ----------------------------------------------------------------------------------------------
# output
# ----------------------------------------------------------------------------------------------


def render(doc: dict[str, Any]) -> Group:
    """The fault table: per fault, requests sent/completed/verified, hits per phase, why."""
    table = Table(title=str(doc.get("title", "kvtier bench faults")), title_justify="left")
    # compact headers so the table stays readable in an 80-column terminal or CI log
    table.add_column("fault", ratio=3, min_width=11)
    for col in ("sent", "done", "ok", "hits\nbefore", "hits\nduring", "hits\nafter"):
        table.add_column(col, justify="right", no_wrap=True)
    table.add_column("metrics say", ratio=4, overflow="fold", min_width=10)
    table.add_column("result", ratio=1, min_width=7)
    lost = 0
    for row in doc["rows"]:
        d = row["detail"]
        ok = row["pass"]
        lost += 0 if ok else 1
        table.add_row(
            str(d["title"]),
            str(d["sent"]),
            str(d["completed"]),
            str(d["verified"]),
            str(d["hits_before"]),
            str(d["hits_during"]),
            str(d["hits_after"]),
            str(d["why"]).replace(", ", "\n"),
            _verdict(d, bool(ok)),
        )
    parts: list[Table | Text] = [table]
    for i, note in enumerate(doc.get("footnotes", []), start=1):
        parts.append(Text(f"[{i}] {note}", style="dim"))
    summary = f"as intended: {len(doc['rows']) - lost} of {len(doc['rows'])} faults"
    parts.append(Text(summary, style="bold green" if lost == 0 else "bold red"))
    return Group(*parts)


def _verdict(d: dict[str, Any], ok: bool) -> Text:
    if d.get("outcome") == "clean failure":
        if ok:
            return Text("clean failure", style="bold green")
        return Text(f"{MISS}: did not end cleanly", style="bold red")
    if ok:
        return Text("nothing lost", style="bold green")
    return Text(f"{MISS}: {d['sent'] - d['verified']} lost", style="bold red")


def bench_faults_command(
    quick: bool = typer.Option(False, "--quick", help="Fewer requests, TP=1 (under ~90 s)."),
    json_path: Path | None = typer.Option(
        None, "--json", help="Where to write the JSON results (default: runs/bench-faults.json)."
    ),
    tp: int | None = typer.Option(
        None, "--tp", help="Tensor-parallel size of every engine (default: 2; with --quick, 1)."
    ),
    fault: list[str] | None = typer.Option(
        None, "--fault", help=f"Run only this fault (repeatable): {', '.join(FAULTS)}."
    ),
    model_dir: Path | None = typer.Option(
        None, "--model-dir", help="Model to serve (default: a tiny float32 model, built per run)."
    ),
) -> None:
    """Faults under load on the native engine: every request completes, right; hits recover."""
    console = report_console()
    progress = Console(stderr=True)
    try:
        doc = run(
            quick=quick,
            json_path=json_path,
            faults=fault,
            tp=tp,
            model_dir=model_dir,
            progress=lambda msg: progress.print(f"[dim]{msg}[/dim]"),
        )
    except (ConfigError, StartupError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(code=2) from None
    console.print(render(doc))
    if not all(row["pass"] for row in doc["rows"]):
        raise typer.Exit(code=1)
