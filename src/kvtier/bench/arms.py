"""Matched arms: one fresh server subprocess per arm (or an endpoint already running), the same
request stream in each.

`Drive.run` starts an arm's server, waits for its health path under a deadline, runs a warmup,
then per workload resets the HBM prefix cache, scrapes `/metrics` settled, sends the stream
(sampling `/metrics` every few seconds when asked) and scrapes again once the counters stop
moving; finally it stops the server (SIGTERM, a deadline, then SIGKILL). `bench e2e` runs
`kvtier serve` ON and OFF (`run_arm`, order from `arm_order`); `bench run` runs any server
command or URL (`ArmSpec`, `run_endpoint_arm`).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Protocol

import httpx
from rich.console import Console

from kvtier.bench.analysis import sample
from kvtier.bench.client import Clock, LoadOptions, LoadResult, run_load, write_jsonl
from kvtier.bench.ports import free_port
from kvtier.bench.workload import RequestSpec
from kvtier.errors import ConfigError, StartupError
from kvtier.scrape import (
    EXT_HITS,
    EXT_QUERIES,
    HBM_HITS,
    HBM_QUERIES,
    PROMPT_TOKENS,
    RETRIEVED,
    MetricSet,
)

ON = "on"
OFF = "off"
ARMS = (ON, OFF)
# OFF once more, right after OFF: the A/A pair that measures the machine's own noise
OFF_AGAIN = "off_again"

Say = Callable[[str], None]
# resets the server's HBM prefix cache before a window; the second argument names the arm
Reset = Callable[[httpx.AsyncClient, str], Awaitable[None]]

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

    def process(self, log_path: Path, offload: bool = True) -> ServerProcess:
        """The server on a free port, not started yet."""
        port = free_port(self.host)
        return ServerProcess(
            self.argv(port, offload),
            self.environ(),
            f"http://{self.host}:{port}",
            log_path,
            startup_timeout_s=self.startup_timeout_s,
            stop_timeout_s=self.stop_timeout_s,
        )


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
        self.exit_code: int | None = None

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
                    why = f"exited with code {code} before {self.health_path} answered"
                elif self.clock() > deadline:
                    why = f"did not answer {self.health_path} within {self.startup_timeout_s:g}s"
                else:
                    continue
                raise StartupError(
                    f"server {why}; command: {' '.join(self.argv)}\n"
                    f"--- {self.log_path} (tail) ---\n{self.log_tail()}"
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
        self.exit_code = code
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


@dataclass(frozen=True, slots=True)
class Workload:
    """A named request stream."""

    name: str
    specs: list[RequestSpec]


@dataclass(slots=True)
class Window:
    """One workload's load, the server counters scraped around it (None without `/metrics`)
    and the periodic samples taken during it."""

    workload: str
    load: LoadResult
    before: MetricSet | None
    after: MetricSet | None
    records_path: Path | None = None
    samples: list[dict[str, Any]] = field(default_factory=list)
    sample_errors: int = 0

    @property
    def delta(self) -> MetricSet:
        """Counter deltas over the window."""
        if self.before is None or self.after is None:
            raise RuntimeError(f"window {self.workload} has no /metrics scrapes")
        return self.after.delta(self.before)


@dataclass(slots=True)
class ArmRun:
    """One arm of one repetition: its server's startup time and a window per workload."""

    arm: str
    rep: int
    offload: bool | None
    windows: dict[str, Window]
    startup_s: float | None
    exit_code: int | None
    log_path: Path | None
    model: str | None = None
    facts: dict[str, Any] = field(default_factory=dict)  # the host's own, for to_json

    def to_json(self) -> dict[str, Any]:
        """Startup, exit, log, where each window's records went and the host's facts."""
        return {
            "arm": self.arm,
            "rep": self.rep,
            "startup_s": None if self.startup_s is None else round(self.startup_s, 2),
            "exit_code": self.exit_code,
            "log": str(self.log_path),
            "records": {w.workload: str(w.records_path) for w in self.windows.values()},
            **self.facts,
        }


def _quiet(_message: str) -> None:
    """Say nothing."""


def arm_order(repeat: int, *, again: bool = False) -> list[tuple[int, str]]:
    """(repetition, arm) in run order: ON,OFF then OFF,ON, alternating; with `again`,
    ON,OFF,OFF_AGAIN then reversed (ON stays next to OFF, OFF_AGAIN next to OFF)."""
    return alternate((*ARMS, OFF_AGAIN) if again else ARMS, repeat)


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


def post_reset(path: str, hint: str = "") -> Reset:
    """A `Reset` that POSTs `path` once; any answer but 200 raises (`hint` says why)."""

    async def reset(http: httpx.AsyncClient, tag: str) -> None:
        resp = await http.post(path)
        if resp.status_code != 200:
            raise RuntimeError(f"{tag} POST {path}: HTTP {resp.status_code}{hint}")

    return reset


class LoadEngine(Protocol):
    """What sends a window's requests in place of kvtier's client (`--load vllm-bench`)."""

    async def __call__(
        self,
        base_url: str,
        specs: Sequence[RequestSpec],
        *,
        concurrency: int | None,
        open_loop: bool,
        model: str | None,
        progress: bool,
        label: str,
        console: Console | None,
    ) -> LoadResult: ...


@dataclass(frozen=True, slots=True)
class Drive:
    """How every arm's windows are driven; `records` is each window's records file under
    `out_dir`, formatted with the workload, arm and repetition."""

    workloads: Sequence[Workload]
    out_dir: Path
    options: LoadOptions
    warmup: Sequence[RequestSpec] = ()
    reset: Reset | None = None
    say: Say = _quiet
    progress: bool = True
    console: Console | None = None
    settle_timeout_s: float = 15.0
    sample_every_s: float | None = None
    records: str = "{workload}-{arm}-rep{rep}.jsonl"
    # another load engine (`vllm_load.VLLMBenchLoad`); None sends with kvtier's client
    engine: LoadEngine | None = None

    def run(
        self,
        arm: str,
        rep: int,
        offload: bool | None,
        server: ServerProcess | str,
        *,
        shown: str | None = None,
        what: str = "",
    ) -> ArmRun:
        """Start `server` (`what` says what it is), drive the warmup and every window, stop it;
        a URL instead of a server is an endpoint already running. `shown` names the arm in
        logs and progress bars."""
        shown = shown or arm
        tag = f"[{shown} rep {rep}]"
        if isinstance(server, str):
            self.say(f"{tag} endpoint {server}")
            model, windows = asyncio.run(self._windows(server, arm, rep, shown))
            return ArmRun(arm, rep, offload, windows, None, None, None, model)
        self.say(f"{tag} starting {what}")
        with server:
            assert server.startup_s is not None
            self.say(f"{tag} server healthy after {server.startup_s:.1f}s on {server.base_url}")
            model, windows = asyncio.run(self._windows(server.base_url, arm, rep, shown))
        startup_s, code = server.startup_s, server.exit_code
        return ArmRun(arm, rep, offload, windows, startup_s, code, server.log_path, model)

    async def _windows(
        self, base_url: str, arm: str, rep: int, shown: str
    ) -> tuple[str | None, dict[str, Window]]:
        tag = f"[{shown} rep {rep}]"
        o = self.options
        async with httpx.AsyncClient(base_url=base_url, timeout=30.0, headers=o.headers) as http:
            model = o.model or await discover_model(http)
            common: dict[str, Any] = {
                "model": model,
                "timeout_s": o.timeout_s,
                "headers": dict(o.headers),
                "require_token_ids": o.require_token_ids,
            }
            if self.warmup:
                self.say(f"{tag} warmup: {len(self.warmup)} requests")
                res = await self._send(base_url, self.warmup, o.concurrency or 4, False, common)
                if bad := [r.error for r in res.records if not r.ok]:
                    raise RuntimeError(f"{tag} warmup requests failed: {bad[:3]}")
            windows = {}
            for wl in self.workloads:
                if self.reset is not None:
                    await self.reset(http, tag)
                label = f"{shown} rep {rep} {wl.name}"
                window = await self._window(http, base_url, wl, tag, label, common)
                path = self.out_dir / self.records.format(workload=wl.name, arm=arm, rep=rep)
                window.records_path = write_jsonl(path, window.load.records)
                windows[wl.name] = window
        return model, windows

    async def _window(
        self,
        http: httpx.AsyncClient,
        base_url: str,
        wl: Workload,
        tag: str,
        label: str,
        common: dict[str, Any],
    ) -> Window:
        """Settled counters, the load (sampled), settled counters again."""
        o = self.options
        try:
            before: MetricSet | None = await settled_metrics(http, self.settle_timeout_s)
        except MetricsUnavailable:
            self.say(f"{tag} no /metrics on {base_url}: client-side numbers only")
            before = None
        every = None if before is None else self.sample_every_s
        samples: list[dict[str, Any]] = []
        stop = asyncio.Event()
        sampler = (
            None if every is None else asyncio.create_task(_sample(http, stop, every, samples))
        )
        try:
            load = await self._send(
                base_url, wl.specs, o.concurrency, o.open_loop, common, label, self.progress
            )
        finally:
            stop.set()
            errors = 0 if sampler is None else await sampler
        after = None if before is None else await settled_metrics(http, self.settle_timeout_s)
        if every is not None and before is not None and after is not None:
            # the settled scrapes bound the series: counters at the load's start and end
            samples.insert(0, sample(before, load.started))
            samples.append(sample(after, time.perf_counter()))
        done = sum(1 for r in load.records if r.ok)
        self.say(
            f"{tag} {wl.name}: {done}/{len(load.records)} requests completed in "
            f"{load.duration_s:.1f}s"
            + (f" ({load.unsent} not sent: the duration ran out)" if load.unsent else "")
        )
        if o.duration_s is not None and not load.unsent:
            self.say(
                f"{tag} the stream ran out before --duration {o.duration_s:g}s; "
                "pass a larger --requests (or more conversations) to fill it"
            )
        return Window(wl.name, load, before, after, None, samples, errors)

    async def _send(
        self,
        base_url: str,
        specs: Sequence[RequestSpec],
        concurrency: int | None,
        open_loop: bool,
        common: dict[str, Any],
        label: str = "warmup",
        progress: bool = False,
    ) -> LoadResult:
        """One load through the engine: kvtier's client, or `engine` (which sends independent
        requests, without a duration cap or extra headers)."""
        shown = {"progress": progress, "label": label, "console": self.console}
        if self.engine is None:
            o = self.options
            return await run_load(
                base_url,
                specs,
                concurrency=concurrency,
                open_loop=open_loop,
                duration_s=o.duration_s,
                history=o.history,
                **shown,
                **common,
            )
        kw = {"concurrency": concurrency, "open_loop": open_loop, "model": common["model"]}
        return await self.engine(base_url, specs, **kw, **shown)


def run_arm(arm: str, rep: int, server: ServerConfig, drive: Drive) -> ArmRun:
    """Start a server for `arm`, run the warmup and every workload in it, stop it."""
    if arm not in (*ARMS, OFF_AGAIN):
        raise ValueError(f"arm={arm!r} must be one of {(*ARMS, OFF_AGAIN)}")
    offload = arm == ON
    flag = "--offload" if offload else "--no-offload"
    proc = server.process(drive.out_dir / f"server-{arm}-rep{rep}.log", offload)
    what = f"kvtier serve (tp={server.tp}, hbm_blocks={server.hbm_blocks}, {flag})"
    return drive.run(arm, rep, offload, proc, shown=arm.upper(), what=what)


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


async def _sample(
    http: httpx.AsyncClient, stop: asyncio.Event, interval_s: float, out: list[dict[str, Any]]
) -> int:
    """Scrape into `out` every `interval_s` until `stop` is set; returns the failed scrapes
    (counted, not fatal)."""
    errors = 0
    while not stop.is_set():
        try:
            ms = await scrape(http)
        except MetricsUnavailable:
            return errors
        except (httpx.HTTPError, RuntimeError, ValueError):
            errors += 1  # a busy server may miss one scrape; the series just has a gap
        else:
            out.append(sample(ms, time.perf_counter()))
        try:
            await asyncio.wait_for(stop.wait(), timeout=interval_s)
        except TimeoutError:
            continue
    return errors


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


_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
# Flags that size or shape the HBM pool (kvtier serve's and vLLM's): equal in every arm.
POOL_FLAGS = (
    "--hbm-blocks",
    "--num-gpu-blocks-override",
    "--kv-cache-memory-bytes",
    "--gpu-memory-utilization",
    "--block-size",
)


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


def run_endpoint_arm(
    arm: ArmSpec,
    rep: int,
    drive: Drive,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    health_path: str = "/health",
    startup_timeout_s: float = 600.0,
    stop_timeout_s: float = 30.0,
) -> ArmRun:
    """`drive.run` on the arm's server (or its URL), its one window's counters, samples and
    server facts written to `scrapes/ARM-repN.json` under `drive.out_dir`."""
    out_dir = drive.out_dir
    server: ServerProcess | str
    if arm.argv:
        use_port = free_port(host) if any("{port}" in a for a in arm.argv) else port
        argv = arm.command(host, use_port)
        server = ServerProcess(
            argv,
            {**os.environ, **arm.env},
            arm.url or f"http://{host}:{use_port}",
            out_dir / "logs" / f"{arm.name}-rep{rep}.log",
            startup_timeout_s=startup_timeout_s,
            stop_timeout_s=stop_timeout_s,
            health_path=health_path,
        )
        base_url, what = server.base_url, shlex.join(argv)
    else:
        assert arm.url is not None
        server = base_url = arm.url
        what = ""
    run = drive.run(arm.name, rep, arm.offload, server, what=what)
    (window,) = run.windows.values()
    load = window.load
    doc = {
        "arm": arm.name,
        "rep": rep,
        "base_url": base_url,
        "model": run.model,
        "argv": list(arm.argv),
        "offload": arm.offload,
        "started": load.started,
        "finished": load.finished,
        "unsent": load.unsent,
        "stopped_by": load.stopped_by,
        "startup_s": run.startup_s,
        "exit_code": run.exit_code,
        "log": None if run.log_path is None else str(run.log_path.relative_to(out_dir)),
        "before": None if window.before is None else window.before.to_json(),
        "after": None if window.after is None else window.after.to_json(),
        "samples": window.samples,
        "sample_errors": window.sample_errors,
    }
    path = out_dir / "scrapes" / f"{arm.name}-rep{rep}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, allow_nan=False) + "\n", encoding="utf-8")
    return run
