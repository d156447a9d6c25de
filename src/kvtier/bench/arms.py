"""Matched arms: one fresh server subprocess per arm (or an endpoint already running), the same
request stream in each.

`kvtier bench e2e`'s arms (`run_arm`) start `kvtier serve` (same flags, same HBM pool; only
`--offload`/`--no-offload` differs), wait for `/health` under a deadline, run a warmup, then per
workload: reset the HBM prefix cache, scrape `/metrics`, send the stream, scrape again once the
counters stop moving, and finally stop the server (SIGTERM, a deadline, then SIGKILL).
`arm_order` alternates ON,OFF / OFF,ON across repetitions so drift on a shared machine falls on
both arms alike; with `again` it runs OFF twice in a row (OFF_AGAIN, an A/A pair), whose ratio is
what the machine alone moves a ratio by.

Generic arms (`ArmSpec`, `run_endpoint_arm`) run any server command (`{port}` and `{host}` are
filled in) or use a URL, and also sample `/metrics` every few seconds during the load (tier
residency and the hit counters, with timestamps). `pool_mismatches` checks that the arms'
commands pin the same HBM pool.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Protocol, TypeVar

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
    sample,
)
from kvtier.bench.client import LoadOptions, LoadResult, run_load, write_jsonl
from kvtier.bench.workload import RequestSpec
from kvtier.errors import ConfigError, StartupError

ON = "on"
OFF = "off"
ARMS = (ON, OFF)
# OFF once more, right after OFF: the A/A pair that measures the machine's own noise
OFF_AGAIN = "off_again"

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

    def argv(self, port: int | str, offload: bool) -> list[str]:
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
        health_path: str = "/health",
    ) -> None:
        self.health_path = health_path
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
        """Poll the health path until 200; an exit or a deadline raises StartupError."""
        assert self.proc is not None
        deadline = self.clock() + self.startup_timeout_s
        with httpx.Client(base_url=self.base_url, timeout=2.0) as client:
            while True:
                try:
                    if client.get(self.health_path).status_code == 200:
                        return
                except httpx.TransportError:
                    pass  # not listening yet: the exit check below tells a crash apart
                try:
                    code = self.proc.wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    code = None
                if code is not None:
                    raise StartupError(
                        f"server exited with code {code} before {self.health_path} answered; "
                        "command: "
                        f"{' '.join(self.argv)}\n--- {self.log_path} (tail) ---\n{self.log_tail()}"
                    )
                if self.clock() > deadline:
                    raise StartupError(
                        f"server did not answer {self.health_path} within "
                        f"{self.startup_timeout_s:g}s; "
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

    def to_json(self) -> dict[str, Any]:
        """Startup, exit, log and where each window's records went."""
        return {
            "arm": self.arm,
            "rep": self.rep,
            "startup_s": round(self.startup_s, 2),
            "exit_code": self.exit_code,
            "log": str(self.log_path),
            "records": {w.workload: str(w.records_path) for w in self.windows.values()},
        }


def _quiet(_message: str) -> None:
    """Say nothing."""


def arm_order(repeat: int, *, again: bool = False) -> list[tuple[int, str]]:
    """(repetition, arm) in run order: ON,OFF then OFF,ON, alternating; with `again`,
    ON,OFF,OFF_AGAIN then reversed (ON stays next to OFF, OFF_AGAIN next to OFF)."""
    return alternate((*ARMS, OFF_AGAIN) if again else ARMS, repeat)


@dataclass(frozen=True, slots=True)
class Drive:
    """How every arm's windows are driven: the workloads, their concurrency and warmup, where
    the records go, progress, and how long the counters may take to settle."""

    workloads: Sequence[Workload]
    concurrency: int
    out_dir: Path
    warmup: Sequence[RequestSpec] = ()
    say: Say = _quiet
    progress: bool = True
    console: Console | None = None
    settle_timeout_s: float = 15.0

    def serve(
        self,
        arm: str,
        rep: int,
        argv: tuple[int, Sequence[str]],
        environ: Mapping[str, str],
        server: Served,
        *,
        shown: str,
        what: str,
        reset: Callable[[httpx.AsyncClient, str], Awaitable[None]],
        model: str | None = None,
    ) -> tuple[dict[str, Window], float, int | None, Path]:
        """Start the server (`argv`: its port and command), drive the warmup and every window
        (`shown` names the arm in logs), stop it; returns the windows, the startup seconds,
        the exit code and the server's log."""
        port, command = argv
        log_path = self.out_dir / f"server-{arm}-rep{rep}.log"
        windows, startup_s, code = serve_and_drive(
            port,
            command,
            environ,
            server,
            log_path,
            tag=f"[{shown} rep {rep}]",
            what=what,
            say=self.say,
            drive=lambda base_url: drive_windows(
                base_url,
                arm,
                rep,
                self.workloads,
                shown=shown,
                reset=reset,
                model=model,
                concurrency=self.concurrency,
                warmup=self.warmup,
                out_dir=self.out_dir,
                say=self.say,
                progress=self.progress,
                console=self.console,
                settle_timeout_s=self.settle_timeout_s,
            ),
        )
        return windows, startup_s, code, log_path


def run_arm(arm: str, rep: int, server: ServerConfig, drive: Drive) -> ArmRun:
    """Start a server for `arm`, run the warmup and every workload in it, stop it."""
    if arm not in (*ARMS, OFF_AGAIN):
        raise ValueError(f"arm={arm!r} must be one of {(*ARMS, OFF_AGAIN)}")
    offload = arm == ON
    flag = "--offload" if offload else "--no-offload"
    port = free_port(server.host)
    windows, startup_s, code, log_path = drive.serve(
        arm,
        rep,
        (port, server.argv(port, offload)),
        server.environ(),
        server,
        shown=arm.upper(),
        what=f"kvtier serve (tp={server.tp}, hbm_blocks={server.hbm_blocks}, {flag})",
        reset=_post_reset,
    )
    return ArmRun(arm, rep, offload, windows, startup_s, code, log_path)


_T = TypeVar("_T")


class Served(Protocol):
    """Where and how patiently an arm's server is started and stopped."""

    host: str
    startup_timeout_s: float
    stop_timeout_s: float


@dataclass(frozen=True, slots=True)
class Serving:
    """A `Served` of plain values (a generic arm's server)."""

    host: str
    startup_timeout_s: float
    stop_timeout_s: float


def serve_and_drive(
    port: int,
    argv: Sequence[str],
    environ: Mapping[str, str],
    server: Served,
    log_path: Path,
    *,
    tag: str,
    what: str,
    say: Say,
    drive: Callable[[str], Coroutine[Any, Any, _T]],
    base_url: str | None = None,
    health_path: str = "/health",
) -> tuple[_T, float, int | None]:
    """Start a server (`argv`, listening on `port`, reached at `base_url` when given), run
    `drive(base_url)` once `health_path` answers, stop it; returns the drive's result, the
    startup seconds and the server's exit code."""
    base_url = base_url or f"http://{server.host}:{port}"
    proc = ServerProcess(
        argv,
        environ,
        base_url,
        log_path,
        startup_timeout_s=server.startup_timeout_s,
        stop_timeout_s=server.stop_timeout_s,
        health_path=health_path,
    )
    say(f"{tag} starting {what}")
    with proc:
        assert proc.startup_s is not None
        say(f"{tag} server healthy after {proc.startup_s:.1f}s on {base_url}")
        result = asyncio.run(drive(base_url))
        startup_s = proc.startup_s
    code = proc.proc.returncode if proc.proc is not None else None
    return result, startup_s, code


async def _post_reset(http: httpx.AsyncClient, tag: str) -> None:
    resp = await http.post("/reset_prefix_cache")
    if resp.status_code != 200:
        raise RuntimeError(f"{tag} POST /reset_prefix_cache: HTTP {resp.status_code}")


async def drive_windows(
    base_url: str,
    arm: str,
    rep: int,
    workloads: Sequence[Workload],
    *,
    shown: str,
    reset: Callable[[httpx.AsyncClient, str], Awaitable[None]],
    concurrency: int,
    warmup: Sequence[RequestSpec],
    out_dir: Path,
    say: Say,
    progress: bool,
    console: Console | None,
    settle_timeout_s: float,
    model: str | None = None,
) -> dict[str, Window]:
    """Run the warmup, then each workload as a window: `reset(http, tag)` the prefix cache,
    scrape settled counters around the load, write its records; `shown` names the arm in logs."""
    tag = f"[{shown} rep {rep}]"
    async with httpx.AsyncClient(base_url=base_url, timeout=30.0) as http:
        await warm_up(base_url, warmup, tag, say, concurrency=concurrency, model=model)
        windows: dict[str, Window] = {}
        for wl in workloads:
            await reset(http, tag)
            before = await settled_metrics(http, settle_timeout_s)
            load = await run_load(
                base_url,
                wl.specs,
                concurrency=concurrency,
                model=model,
                progress=progress,
                label=f"{shown} rep {rep} {wl.name}",
                console=console,
            )
            after = await settled_metrics(http, settle_timeout_s)
            path = write_jsonl(out_dir / f"{wl.name}-{arm}-rep{rep}.jsonl", load.records)
            done = sum(1 for r in load.records if r.ok)
            say(f"{tag} {wl.name}: {done}/{len(wl.specs)} requests in {load.duration_s:.1f}s")
            windows[wl.name] = Window(wl.name, load, before, after, path)
    return windows


async def warm_up(
    base_url: str, warmup: Sequence[RequestSpec], tag: str, say: Say, **load: Any
) -> None:
    """Send `warmup` (`run_load`'s `load` arguments, no progress bar); a failed one raises."""
    if not warmup:
        return
    say(f"{tag} warmup: {len(warmup)} requests")
    res = await run_load(base_url, warmup, progress=False, **load)
    bad = [r.error for r in res.records if not r.ok]
    if bad:
        raise RuntimeError(f"{tag} warmup requests failed: {bad[:3]}")


class MetricsUnavailable(RuntimeError):
    """The server has no Prometheus `/metrics` (HTTP 404/405): the run is client-side only."""


async def scrape(http: httpx.AsyncClient) -> MetricSet:
    """`GET /metrics`, parsed."""
    resp = await http.get("/metrics")
    if resp.status_code in (404, 405):
        raise MetricsUnavailable(f"GET /metrics: HTTP {resp.status_code}")
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


# ----------------------------------------------------------------------------------------------
# generic arms: any server command, or an endpoint already running
# ----------------------------------------------------------------------------------------------

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
# Flags that size or shape the HBM pool (kvtier serve's and vLLM's): equal in every arm.
POOL_FLAGS = (
    "--hbm-blocks",
    "--num-gpu-blocks-override",
    "--kv-cache-memory-bytes",
    "--gpu-memory-utilization",
    "--block-size",
)
_TP_FLAGS = ("--tp", "--tensor-parallel-size", "-tp")


@dataclass(frozen=True)
class ArmSpec:
    """One arm: a server command (`{port}`/`{host}` filled in at start) or, with no command,
    the URL of an endpoint already running. `offload` is known for kvtier's own ON/OFF arms."""

    name: str
    argv: tuple[str, ...] = ()
    url: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    offload: bool | None = None

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ConfigError(
                f"arm name {self.name!r} must be letters, digits, '_', '.' or '-' (it names files)"
            )
        if not self.argv and not self.url:
            raise ConfigError(f"arm {self.name!r} needs a server command or a URL")

    def command(self, host: str, port: int) -> list[str]:
        """The command with `{host}` and `{port}` filled in."""
        return [a.replace("{port}", str(port)).replace("{host}", host) for a in self.argv]

    def flag(self, *names: str) -> str | None:
        """The value of the first of `names` in the command (`--f v` or `--f=v`), if any."""
        return flag_value(self.argv, *names)

    def to_json(self) -> dict[str, Any]:
        """Name, command, URL and offload (the environment is left out: it may hold secrets)."""
        return {
            "name": self.name,
            "argv": list(self.argv),
            "command": shlex.join(self.argv) if self.argv else None,
            "url": self.url,
            "offload": self.offload,
            "env_keys": sorted(self.env),
        }


def parse_arm(text: str) -> ArmSpec:
    """`NAME=command ...` (as `--arm` takes it) as an ArmSpec; the command is split like a shell
    would (quotes kept together)."""
    name, sep, command = text.partition("=")
    if not sep or not name.strip() or not command.strip():
        raise ConfigError(
            f"--arm {text!r} must look like NAME='command ...', e.g. "
            "on='kvtier serve MODEL --port {port} --offload'"
        )
    try:
        argv = tuple(shlex.split(command))
    except ValueError as exc:
        raise ConfigError(f"--arm {name}: cannot split its command ({exc})") from None
    return ArmSpec(name.strip(), argv)


def flag_value(argv: Sequence[str], *names: str) -> str | None:
    """The value of the first flag of `names` present in `argv` (`--f v` or `--f=v`)."""
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(name + "="):
                return arg[len(name) + 1 :]
    return None


def pool_mismatches(arms: Sequence[ArmSpec]) -> list[str]:
    """For each HBM-pool flag that some arm's command sets, a line naming each arm's value when
    they differ (an arm that leaves it out runs the server's default); [] when all agree."""
    commanded = [a for a in arms if a.argv]
    out = []
    for flag in POOL_FLAGS:
        values = {a.name: a.flag(flag) for a in commanded}
        if any(v is not None for v in values.values()) and len(set(values.values())) > 1:
            shown = ", ".join(
                f"{k}={v if v is not None else '(default)'}" for k, v in values.items()
            )
            out.append(f"{flag}: {shown}")
    return out


def alternate(names: Sequence[str], repeat: int) -> list[tuple[int, str]]:
    """(repetition, arm) in run order: the arms in order, then reversed, alternating."""
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"repeat={repeat!r} must be an integer >= 1")
    if not names or len(set(names)) != len(names):
        raise ValueError(f"arm names {list(names)} must be unique and at least one")
    out = []
    for rep in range(repeat):
        order = list(names) if rep % 2 == 0 else list(names)[::-1]
        out += [(rep, name) for name in order]
    return out


@dataclass(slots=True)
class EndpointRun:
    """One arm of one repetition against an endpoint: its load, the counters scraped around it
    (None without `/metrics`), the periodic samples and where it was all written."""

    arm: str
    rep: int
    base_url: str
    model: str | None
    load: LoadResult
    before: MetricSet | None
    after: MetricSet | None
    samples: list[dict[str, Any]]
    startup_s: float | None
    exit_code: int | None
    log_path: Path | None
    records_path: Path
    scrapes_path: Path
    sample_errors: int = 0

    @property
    def delta(self) -> MetricSet | None:
        """Counter deltas over the load (None without `/metrics`)."""
        return None if self.before is None or self.after is None else self.after.delta(self.before)


def run_endpoint_arm(
    arm: ArmSpec,
    rep: int,
    specs: Sequence[RequestSpec],
    *,
    options: LoadOptions,
    out_dir: Path,
    warmup: Sequence[RequestSpec] = (),
    reset_path: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    health_path: str = "/health",
    startup_timeout_s: float = 600.0,
    stop_timeout_s: float = 30.0,
    settle_timeout_s: float = 15.0,
    scrape_interval_s: float = 2.0,
    say: Say | None = None,
    progress: bool = True,
    console: Console | None = None,
) -> EndpointRun:
    """Start the arm's server (or use its URL), run the warmup, scrape, send `specs` while
    sampling `/metrics`, scrape again on the drained server, stop the server, and write the
    records (`records/ARM-repN.jsonl`) and scrapes (`scrapes/ARM-repN.json`) under `out_dir`."""
    log = say or (lambda _m: None)
    tag = f"[{arm.name} rep {rep}]"

    def drive(base_url: str) -> Coroutine[Any, Any, EndpointRun]:
        return _drive_endpoint(
            arm, rep, base_url, specs, options, out_dir, warmup, reset_path,
            settle_timeout_s, scrape_interval_s, log, progress, console,
        )  # fmt: skip

    if not arm.argv:
        assert arm.url is not None
        log(f"{tag} endpoint {arm.url}")
        return _written(asyncio.run(drive(arm.url)), out_dir, arm)
    use_port = free_port(host) if any("{port}" in a for a in arm.argv) else port
    argv = arm.command(host, use_port)
    log_path = out_dir / "logs" / f"{arm.name}-rep{rep}.log"
    run, startup_s, code = serve_and_drive(
        use_port,
        argv,
        {**os.environ, **arm.env},
        Serving(host, startup_timeout_s, stop_timeout_s),
        log_path,
        tag=tag,
        what=shlex.join(argv),
        say=log,
        drive=drive,
        base_url=arm.url,
        health_path=health_path,
    )
    run.startup_s, run.exit_code, run.log_path = startup_s, code, log_path
    return _written(run, out_dir, arm)


async def discover_model(http: httpx.AsyncClient) -> str | None:
    """The first model id `GET /v1/models` lists, or None when the server does not say."""
    try:
        resp = await http.get("/v1/models")
        if resp.status_code != 200:
            return None
        data = resp.json().get("data") or []
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    first = data[0] if data and isinstance(data[0], dict) else {}
    model = first.get("id")
    return model if isinstance(model, str) else None


async def _drive_endpoint(
    arm: ArmSpec,
    rep: int,
    base_url: str,
    specs: Sequence[RequestSpec],
    options: LoadOptions,
    out_dir: Path,
    warmup: Sequence[RequestSpec],
    reset_path: str | None,
    settle_timeout_s: float,
    scrape_interval_s: float,
    say: Say,
    progress: bool,
    console: Console | None,
) -> EndpointRun:
    tag = f"[{arm.name} rep {rep}]"
    clock = time.perf_counter
    headers = dict(options.headers)
    async with httpx.AsyncClient(base_url=base_url, timeout=30.0, headers=headers) as http:
        model = options.model or await discover_model(http)
        common: dict[str, Any] = {
            "model": model,
            "timeout_s": options.timeout_s,
            "headers": headers,
            "require_token_ids": options.require_token_ids,
        }
        await warm_up(base_url, warmup, tag, say, concurrency=options.concurrency or 4, **common)
        if reset_path:
            resp = await http.post(reset_path)
            if resp.status_code != 200:
                raise RuntimeError(
                    f"{tag} POST {reset_path}: HTTP {resp.status_code}; vLLM serves it only in "
                    "dev mode (VLLM_SERVER_DEV_MODE=1), or drop --reset"
                )
        try:
            before: MetricSet | None = await settled_metrics(http, settle_timeout_s)
        except MetricsUnavailable:
            say(f"{tag} no /metrics on {base_url}: client-side numbers only")
            before = None
        samples: list[dict[str, Any]] = []
        errors = [0]
        load = await _sampled(
            http,
            scrape_interval_s if before is not None else None,
            clock,
            samples,
            errors,
            run_load(
                base_url,
                specs,
                concurrency=options.concurrency,
                open_loop=options.open_loop,
                duration_s=options.duration_s,
                history=options.history,
                progress=progress,
                label=f"{arm.name} rep {rep}",
                console=console,
                clock=clock,
                **common,
            ),
        )
        after = await settled_metrics(http, settle_timeout_s) if before is not None else None
        if before is not None and after is not None:
            # the settled scrapes bound the series: counters at the load's start and end
            samples.insert(0, sample(before, load.started))
            samples.append(sample(after, clock()))
    done = sum(1 for r in load.records if r.ok)
    say(
        f"{tag} {done}/{len(load.records)} requests completed in {load.duration_s:.1f}s"
        + (f" ({load.unsent} not sent: the duration ran out)" if load.unsent else "")
    )
    if options.duration_s is not None and not load.unsent:
        say(
            f"{tag} the stream ran out before --duration {options.duration_s:g}s; "
            "pass a larger --requests (or more conversations) to fill it"
        )
    name = f"{arm.name}-rep{rep}"
    return EndpointRun(
        arm=arm.name,
        rep=rep,
        base_url=base_url,
        model=model,
        load=load,
        before=before,
        after=after,
        samples=samples,
        startup_s=None,
        exit_code=None,
        log_path=None,
        records_path=out_dir / "records" / f"{name}.jsonl",
        scrapes_path=out_dir / "scrapes" / f"{name}.json",
        sample_errors=errors[0],
    )


async def _sampled(
    http: httpx.AsyncClient,
    interval_s: float | None,
    clock: Clock,
    samples: list[dict[str, Any]],
    errors: list[int],
    load: Awaitable[LoadResult],
) -> LoadResult:
    """Await `load` while scraping `/metrics` into `samples` every `interval_s` (None: no
    scrapes, the server has no `/metrics`)."""
    stop = asyncio.Event()
    sampler = (
        asyncio.create_task(_sample_loop(http, stop, interval_s, clock, samples, errors))
        if interval_s is not None
        else None
    )
    try:
        return await load
    finally:
        stop.set()
        if sampler is not None:
            await sampler


async def _sample_loop(
    http: httpx.AsyncClient,
    stop: asyncio.Event,
    interval_s: float,
    clock: Clock,
    out: list[dict[str, Any]],
    errors: list[int],
) -> None:
    """Scrape every `interval_s` until `stop` is set; a failed scrape is counted, not fatal."""
    while not stop.is_set():
        try:
            ms = await scrape(http)
        except MetricsUnavailable:
            return
        except (httpx.HTTPError, RuntimeError, ValueError):
            errors[0] += 1  # a busy server may miss one scrape; the series just has a gap
        else:
            out.append(sample(ms, clock()))
        try:
            await asyncio.wait_for(stop.wait(), timeout=interval_s)
        except TimeoutError:
            continue


def _written(run: EndpointRun, out_dir: Path, arm: ArmSpec) -> EndpointRun:
    """Write the run's records and scrapes; returns the run."""
    write_jsonl(run.records_path, run.load.records)
    doc = {
        "arm": run.arm,
        "rep": run.rep,
        "base_url": run.base_url,
        "model": run.model,
        "argv": list(arm.argv),
        "offload": arm.offload,
        "started": run.load.started,
        "finished": run.load.finished,
        "unsent": run.load.unsent,
        "stopped_by": run.load.stopped_by,
        "startup_s": run.startup_s,
        "exit_code": run.exit_code,
        "log": None if run.log_path is None else str(run.log_path.relative_to(out_dir)),
        "before": None if run.before is None else run.before.to_json(),
        "after": None if run.after is None else run.after.to_json(),
        "samples": run.samples,
        "sample_errors": run.sample_errors,
    }
    run.scrapes_path.parent.mkdir(parents=True, exist_ok=True)
    run.scrapes_path.write_text(json.dumps(doc, allow_nan=False) + "\n", encoding="utf-8")
    return run
