"""One fault of the fault suite against one fresh engine: the sizes every run shares, what
a fault is, the three phases (before, during, after) around its injection, clearing and
recovery, and each phase's requests checked token for token against a reference without
offload.

Why one module over 500 lines: `FaultRun` is one engine's life under one fault, and its hooks
(inject, clear, recover) read the phase state; what injects is `tests.faults.inject`.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import secrets
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvtier.bench.client import LoadResult, run_load
from kvtier.bench.workload import RequestSpec
from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.native.config import EngineConfig
from kvtier.native.engine import Engine
from kvtier.native.loader import load_model_config
from kvtier.native.offload import connector_spec
from kvtier.native.sampling import SamplingParams
from kvtier.native.server import EngineServer
from tests.faults import fault_env
from tests.faults.inject import (
    ACK_TIMEOUT_S,
    FLAG_DISK_FULL,
    FLAG_LOAD_FAIL,
    FLAG_LOOKUP_DOWN,
    Control,
    Staller,
    corrupt_remote,
)
from tests.redis_local import RedisServer, wait_for

CHUNK = 64
CHUNKS_PER_PROMPT = 4
PROMPT_LEN = CHUNKS_PER_PROMPT * CHUNK + 16  # whole chunks and a tail
MAX_TOKENS = 8
MEMORY_CHUNKS = 4  # per rank: far fewer than a phase writes, so replays read the lower tier
NUM_BLOCKS = 256
BREAKER_PROBE_S = 0.5
SLOW_SLEEP_S = 0.3  # each DEBUG SLEEP of the slow remote: 3x its 100 ms timeout
VOCAB_LOW = 3  # prompt token ids start above the special tokens
_SERVED_NAME = "kvtier-faults"
_BASE_URL = "http://kvtier-faults"
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


@dataclass(frozen=True, slots=True)
class Plan:
    """Sizes of one run (`FULL` or `QUICK`)."""

    prompts_per_phase: int
    concurrency: int
    tp: int


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


class FaultRun:
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
        store: RedisServer | None,
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
        self._staller: Staller | None = None
        self.tmpfs: fault_env.Tmpfs | None = None
        disk_bytes = None
        if fault.name == "disk_tmpfs":
            self.tmpfs = fault_env.Tmpfs(work / "tmpfs")
            disk_dir = self.tmpfs.path / "disk"
            # within the filesystem, so the tier's own budget never evicts: a full
            # filesystem is what stops its writes
            disk_bytes = self.tmpfs.size * 3 // 4 // tp
        cfg = kvtier_config(fault, model_dir, tp, work, store, disk_dir, disk_bytes)
        spec = connector_spec(cfg, model_dir, run_dir=work / "run")
        factory = (
            "tests.faults.inject:build_connector",
            {
                **spec.args,
                "ctl_dir": str(self.ctl.dir),
                "fail_rank": tp - 1,
                "log_path": str(log_path),
                "bench_pid": os.getpid(),
            },
        )
        try:
            engine = Engine(model_dir, engine_config(tp, fault.pool_blocks), factory)
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
        """Why the engine stopped serving (a failed step, a dead rank, stuck), or None. A dead
        rank counts at once: the loop notices it only at its next wake-up, while the server's
        health check already refuses requests, so a drained engine may not have failed yet."""
        loop = self.server.loop
        return loop.fatal or loop.dead_rank() or self.stuck

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
        phases = {"before": self.phase("before")}
        self.say(f"[{self.fault.name}] fault on")
        self._inject()
        phases["during"] = self.phase("during", between=self._between)
        if not self.fault.clean_failure:
            self.say(f"[{self.fault.name}] fault cleared")
            self._clear()
            self._recover()
            phases["after"] = self.phase("after")
        return self.result(phases, t0)

    def result(self, phases: dict[str, PhaseResult], t0: float) -> FaultResult:
        """The run's row data once its phases are done."""
        possible = self.plan.prompts_per_phase * CHUNKS_PER_PROMPT * CHUNK
        procs = getattr(self.server.engine.executor, "procs", [])
        if self.fault.clean_failure:
            # the idle engine loop notices the dead rank at its next wake-up and only then fails
            # and stops the survivors; the row reads the engine after that, not a moment before
            loop = self.server.loop
            wait_for(
                lambda: loop.fatal is not None and all(p.poll() is not None for p in procs),
                _LOAD_TIMEOUT_S,
                f"[{self.fault.name}] the engine failing and stopping its surviving ranks",
            )
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

    def phase(self, phase: str, between: Callable[[], None] | None = None) -> PhaseResult:
        """Seed, drain, reset HBM, replay; a dead engine only has its requests refused."""
        prompts = self.prompts[phase]
        result = PhaseResult()
        self._load(prompts, f"{phase}-seed", result)
        self._idle()
        if self.fatal is None:
            self.ctl.request("flush", give_up=lambda: self.fatal)
        if between is not None:
            between()
        self._engine_call(lambda e: e.reset_prefix_cache())
        hits0 = self.stats()["external_prefix_cache_hits"]
        self.replay(prompts, f"{phase}-replay", result, during=phase == "during")
        result.hit_tokens = int(self.stats()["external_prefix_cache_hits"] - hits0)
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
            self._staller = Staller(self._store(), SLOW_SLEEP_S)
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
        return self.server.loop.call(fn).result(timeout=ACK_TIMEOUT_S)

    def stats(self) -> dict[str, float]:
        """The engine's stats; once it stopped serving, the last ones it gave."""
        stats = self._engine_call(lambda e: e.stats())
        if stats is not None:
            self._last_stats = stats
        return self._last_stats or {"external_prefix_cache_hits": 0.0}

    def _idle(self) -> None:
        if self.fatal is None and not self.server.loop.wait_idle(ACK_TIMEOUT_S):
            if self.fatal is None:
                raise RuntimeError(f"[{self.fault.name}] the engine did not drain")

    def _store(self) -> RedisServer:
        if self.store is None:
            raise ConfigError(f"fault {self.fault.name!r} needs the suite's redis-server")
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
            value = self.stats().get(name, 0.0)
            if value:
                out[f"engine:{name}"] = value
        if self.fatal is not None:
            out["engine:error"] = 1.0
        return out


def engine_config(tp: int, num_blocks: int = NUM_BLOCKS) -> EngineConfig:
    """The suite's engine: one thread per rank, `num_blocks` HBM blocks."""
    return EngineConfig(num_threads=1, tensor_parallel_size=tp, num_blocks=num_blocks)


def kvtier_config(
    fault: Fault,
    model_dir: Path,
    tp: int,
    work: Path,
    store: RedisServer | None,
    disk_dir: Path | None = None,
    disk_bytes: int | None = None,
) -> KVTierConfig:
    """A memory tier of `MEMORY_CHUNKS` chunks per rank over the fault's lower tier."""
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
            raise ConfigError(f"fault {fault.name!r} needs the suite's redis-server")
        cfg["remote_url"] = store.url
        # a throwaway store of this suite run: a key of this run authenticates its records
        cfg["record_key"] = secrets.token_hex(32)
    else:
        cfg["disk_dir"] = str(disk_dir or work / "disk")
        cfg["disk_bytes"] = disk_bytes or 256 * chunk_bytes
    return KVTierConfig(**cfg)


def prompts_for(seed: int, n: int) -> list[list[int]]:
    """`n` seeded prompts of `PROMPT_LEN` token ids."""
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB_LOW, 2048) for _ in range(PROMPT_LEN)] for _ in range(n)]


def greedy_reference(
    model_dir: Path, tp: int, prompts: Sequence[list[int]]
) -> dict[tuple[int, ...], list[int]]:
    """Greedy outputs of `prompts` on an engine of the same TP without offload."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with Engine(model_dir, engine_config(tp)) as eng:
        outs = eng.generate(list(prompts), params)
    return {tuple(p): o.output_token_ids for p, o in zip(prompts, outs, strict=True)}
