"""Matched ON/OFF arms: one fresh `kvtier serve` subprocess per arm, the same workloads in it.

An arm starts its server (same flags, same HBM pool; only `--offload`/`--no-offload` differs),
waits for `/health` under a deadline, runs a warmup, then per workload: resets the HBM prefix
cache, scrapes `/metrics`, sends the stream, scrapes again once the counters stop moving, and
finally stops the server (SIGTERM, a deadline, then SIGKILL). `arm_order` alternates ON,OFF /
OFF,ON across repetitions so drift on a shared machine falls on both arms alike.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO

import httpx
from rich.console import Console

from kvtier.bench.analysis import (
    EXT_HITS,
    EXT_QUERIES,
    HBM_HITS,
    HBM_QUERIES,
    PROMPT_TOKENS,
    RETRIEVED,
    MetricSet,
)
from kvtier.bench.client import LoadResult, run_load, write_jsonl
from kvtier.bench.workload import RequestSpec
from kvtier.errors import StartupError

ON = "on"
OFF = "off"
ARMS = (ON, OFF)

Say = Callable[[str], None]
Clock = Callable[[], float]

_SETTLE_NAMES = (PROMPT_TOKENS, HBM_QUERIES, HBM_HITS, EXT_QUERIES, EXT_HITS, RETRIEVED)
_LOG_TAIL = 4000


@dataclass(frozen=True)
class ServerConfig:
    """How to start `kvtier serve` for both arms; only offload differs between them."""

    model_dir: Path
    tp: int
    hbm_blocks: int
    block_size: int = 16
    max_num_seqs: int = 8
    max_batched_tokens: int = 1024
    threads: int = 1
    host: str = "127.0.0.1"
    env: Mapping[str, str] = field(default_factory=dict)  # KVTIER_* and the like, over os.environ
    startup_timeout_s: float = 180.0
    stop_timeout_s: float = 30.0

    def argv(self, port: int, offload: bool) -> list[str]:
        """The server's command line (this interpreter, so the same venv serves)."""
        return [
            sys.executable, "-m", "kvtier.cli", "serve", str(self.model_dir),
            "--host", self.host, "--port", str(port),
            "--tp", str(self.tp),
            "--hbm-blocks", str(self.hbm_blocks),
            "--block-size", str(self.block_size),
            "--max-num-seqs", str(self.max_num_seqs),
            "--max-batched-tokens", str(self.max_batched_tokens),
            "--threads", str(self.threads),
            "--offload" if offload else "--no-offload",
        ]  # fmt: skip

    def environ(self) -> dict[str, str]:
        """The server's environment: ours, overlaid with `env`."""
        return {**os.environ, **self.env}


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """A server subprocess: started, waited for on `/health`, and always stopped on exit."""

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        base_url: str,
        log_path: str | Path,
        *,
        startup_timeout_s: float = 180.0,
        stop_timeout_s: float = 30.0,
        clock: Clock = time.monotonic,
    ) -> None:
        self.argv = list(argv)
        self.env = dict(env)
        self.base_url = base_url
        self.log_path = Path(log_path)
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.clock = clock
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self.startup_s: float | None = None

    def start(self) -> None:
        """Spawn the process (its output goes to `log_path`) and wait until it is healthy."""
        if self.proc is not None:
            raise RuntimeError(f"server {self.argv[:5]} was already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("wb")
        t0 = self.clock()
        # a process group of its own: TP workers die with it, never with our terminal's ^C
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            self.wait_ready()
        except BaseException:
            self.stop()  # a crashed, hung or interrupted start leaves no process and no open log
            raise
        self.startup_s = self.clock() - t0

    def wait_ready(self) -> None:
        """Poll `/health` until 200; a process that exits or a deadline raises StartupError."""
        assert self.proc is not None
        deadline = self.clock() + self.startup_timeout_s
        with httpx.Client(base_url=self.base_url, timeout=2.0) as client:
            while True:
                try:
                    if client.get("/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass  # not listening yet: the exit check below tells a crash apart
                try:
                    code = self.proc.wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    code = None
                if code is not None:
                    raise StartupError(
                        f"server exited with code {code} before /health answered; command: "
                        f"{' '.join(self.argv)}\n--- {self.log_path} (tail) ---\n{self.log_tail()}"
                    )
                if self.clock() > deadline:
                    raise StartupError(
                        f"server did not answer /health within {self.startup_timeout_s:g}s; "
                        f"command: {' '.join(self.argv)}\n--- {self.log_path} (tail) ---\n"
                        f"{self.log_tail()}"
                    )

    def stop(self) -> int | None:
        """SIGTERM the process group, wait `stop_timeout_s`, then SIGKILL; returns the exit code."""
        proc = self.proc
        if proc is None:
            return None
        code = proc.poll()
        if code is None:
            _signal_group(proc, signal.SIGTERM)
            try:
                code = proc.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                code = proc.wait(timeout=self.stop_timeout_s)
        if self._log is not None:
            self._log.close()
            self._log = None
        return code

    def log_tail(self, n: int = _LOG_TAIL) -> str:
        """The last `n` characters of the server's output."""
        if self._log is not None:
            self._log.flush()
        try:
            data = self.log_path.read_bytes()
        except OSError as exc:
            return f"(log unreadable: {exc})"
        return data[-n:].decode("utf-8", "replace")

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return  # already gone


# ----------------------------------------------------------------------------------------------
# one arm
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Workload:
    """A named request stream."""

    name: str
    specs: list[RequestSpec]


@dataclass(slots=True)
class Window:
    """One workload's load and the server counters scraped around it."""

    workload: str
    load: LoadResult
    before: MetricSet
    after: MetricSet
    records_path: Path | None = None

    @property
    def delta(self) -> MetricSet:
        """Counter deltas over the window."""
        return self.after.delta(self.before)


@dataclass(slots=True)
class ArmRun:
    """One arm of one repetition: its server's startup time and a window per workload."""

    arm: str
    rep: int
    offload: bool
    windows: dict[str, Window]
    startup_s: float
    exit_code: int | None
    log_path: Path


def arm_order(repeat: int) -> list[tuple[int, str]]:
    """(repetition, arm) in run order: ON,OFF then OFF,ON, alternating."""
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"repeat={repeat!r} must be an integer >= 1")
    out = []
    for rep in range(repeat):
        arms = ARMS if rep % 2 == 0 else ARMS[::-1]
        out += [(rep, arm) for arm in arms]
    return out


def run_arm(
    arm: str,
    rep: int,
    server: ServerConfig,
    workloads: Sequence[Workload],
    *,
    concurrency: int,
    out_dir: Path,
    warmup: Sequence[RequestSpec] = (),
    say: Say | None = None,
    progress: bool = True,
    console: Console | None = None,
    settle_timeout_s: float = 15.0,
) -> ArmRun:
    """Start a server for `arm`, run the warmup and every workload in it, stop it."""
    if arm not in ARMS:
        raise ValueError(f"arm={arm!r} must be one of {ARMS}")
    log = say or (lambda _m: None)
    offload = arm == ON
    port = free_port(server.host)
    base_url = f"http://{server.host}:{port}"
    log_path = out_dir / f"server-{arm}-rep{rep}.log"
    proc = ServerProcess(
        server.argv(port, offload),
        server.environ(),
        base_url,
        log_path,
        startup_timeout_s=server.startup_timeout_s,
        stop_timeout_s=server.stop_timeout_s,
    )
    flag = "--offload" if offload else "--no-offload"
    log(
        f"[{arm.upper()} rep {rep}] starting kvtier serve (tp={server.tp}, "
        f"hbm_blocks={server.hbm_blocks}, {flag})"
    )
    with proc:
        assert proc.startup_s is not None
        log(f"[{arm.upper()} rep {rep}] server healthy after {proc.startup_s:.1f}s on {base_url}")
        windows = asyncio.run(
            _drive(
                base_url,
                arm,
                rep,
                workloads,
                concurrency=concurrency,
                warmup=warmup,
                out_dir=out_dir,
                say=log,
                progress=progress,
                console=console,
                settle_timeout_s=settle_timeout_s,
            )
        )
        startup_s = proc.startup_s
    code = proc.proc.returncode if proc.proc is not None else None
    return ArmRun(arm, rep, offload, windows, startup_s, code, log_path)


async def _drive(
    base_url: str,
    arm: str,
    rep: int,
    workloads: Sequence[Workload],
    *,
    concurrency: int,
    warmup: Sequence[RequestSpec],
    out_dir: Path,
    say: Say,
    progress: bool,
    console: Console | None,
    settle_timeout_s: float,
) -> dict[str, Window]:
    tag = f"[{arm.upper()} rep {rep}]"
    async with httpx.AsyncClient(base_url=base_url, timeout=30.0) as http:
        if warmup:
            say(f"{tag} warmup: {len(warmup)} requests")
            res = await run_load(base_url, warmup, concurrency=concurrency, progress=False)
            bad = [r.error for r in res.records if not r.ok]
            if bad:
                raise RuntimeError(f"{tag} warmup requests failed: {bad[:3]}")
        windows: dict[str, Window] = {}
        for wl in workloads:
            resp = await http.post("/reset_prefix_cache")
            if resp.status_code != 200:
                raise RuntimeError(f"{tag} POST /reset_prefix_cache: HTTP {resp.status_code}")
            before = await settled_metrics(http, settle_timeout_s)
            load = await run_load(
                base_url,
                wl.specs,
                concurrency=concurrency,
                progress=progress,
                label=f"{arm.upper()} rep {rep} {wl.name}",
                console=console,
            )
            after = await settled_metrics(http, settle_timeout_s)
            path = write_jsonl(out_dir / f"{wl.name}-{arm}-rep{rep}.jsonl", load.records)
            done = sum(1 for r in load.records if r.ok)
            say(f"{tag} {wl.name}: {done}/{len(wl.specs)} requests in {load.duration_s:.1f}s")
            windows[wl.name] = Window(wl.name, load, before, after, path)
    return windows


async def scrape(http: httpx.AsyncClient) -> MetricSet:
    """`GET /metrics`, parsed."""
    resp = await http.get("/metrics")
    if resp.status_code != 200:
        raise RuntimeError(f"GET /metrics: HTTP {resp.status_code}")
    return MetricSet.parse(resp.text)


async def settled_metrics(
    http: httpx.AsyncClient,
    timeout_s: float,
    *,
    interval_s: float = 0.05,
    clock: Clock = time.monotonic,
) -> MetricSet:
    """Scrape until two scrapes in a row agree on the counters the identities use: the engine
    may still be folding the last step's rank reports into them when the last response ends."""
    deadline = clock() + timeout_s
    last = await scrape(http)
    while True:
        await asyncio.sleep(interval_s)
        cur = await scrape(http)
        if all(_family(cur, n) == _family(last, n) for n in _SETTLE_NAMES):
            return cur
        if clock() > deadline:
            raise RuntimeError(
                f"server counters still moving after {timeout_s:g}s on an idle server; "
                "the window's identities cannot be checked"
            )
        last = cur


def _family(m: MetricSet, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {k: v for (n, k), v in m.samples.items() if n == name}
