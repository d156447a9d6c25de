"""`kvtier bench tier --device sim`, across steps: a burst of steps, each step's saves (or
asynchronous loads) one lane job, queued while the lane is busy as a busy server's steps queue
them, through the worker's real paths on the simulated device. One worker keeps its transfer
ring across jobs (`persistent_ring`, the default), the other drains it at each job's end (the
design before); repetitions interleaved in one run.

Between two steps the drained ring leaves the copy engine idle while the lane thread wakes from
the last copy, commits or unpins, reports, and takes and issues the next job: host time, which
the modelled engine counts as idle. The rows give the burst's time on the engine (busy + idle,
modelled) kept over drained, and each arm's idle time per step boundary. `measure_ring` runs the
same bursts on a real device, timed by the wall clock (`scripts/gpu-check.sh`'s ring rows).
"""

from __future__ import annotations

import itertools
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvtier.bench.datapath import BLOCK, CHUNK, KVModel, kv_views
from kvtier.bench.datapath_sim import SIM_LATENCY_US, SIM_MODEL, bench_worker, settled
from kvtier.bench.table import Report, Row
from kvtier.bench.tier_common import Keys, interleave
from kvtier.config import KVTierConfig
from kvtier.offload.device import DeviceOps
from kvtier.offload.lane import WorkLane
from kvtier.offload.messages import ChunkRef, LoadOp, OffloadMeta, SaveOp
from kvtier.offload.pages import KVCacheDescription
from kvtier.offload.simdevice import CopyModel, SimOps
from kvtier.offload.worker import OffloadWorker

STEPS = 16  # steps in a burst
PER_STEP = 2  # chunks a step moves
COPY_S = 0.004  # one chunk's modelled copy
_HOLD_S = 60.0
# a unit of the busy forward's Python: tens of microseconds, so its count is a fine-grained rate
_UNIT = 400
_ALONE_S = 0.1  # the window the forward's rate alone is measured in, per repetition


@dataclass(frozen=True)
class Arm:
    """One worker of the comparison: whether it keeps its ring across jobs, whether a busy
    forward runs beside its bursts, and the process's GIL switch interval during them (None:
    left as it is)."""

    name: str
    persistent: bool = True
    forward: bool = False
    switch_ms: float | None = None


ARMS = (Arm("kept"), Arm("drained", persistent=False))
# the interpreter's default switch interval and kvtier's `gil_switch_ms`, under a forward that
# runs Python without pause, beside the same burst with no forward
_KVTIER_MS = KVTierConfig().gil_switch_ms
GIL_ARMS = (
    Arm("alone"),
    Arm("busy_5ms", forward=True, switch_ms=5.0),
    Arm(f"busy_{_KVTIER_MS:g}ms", forward=True, switch_ms=_KVTIER_MS),
)


class BusyForward:
    """A thread that runs Python without pause, the worst case of a forward's host side
    (vLLM's scheduling and input preparation): the GIL is released only when the interpreter
    forces a switch. `units` counts its work; it runs only while `running` is set."""

    def __init__(self) -> None:
        self.units = 0
        self.running = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="busy-forward", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while self.running.wait() and not self._stop:
            x = 0
            for i in range(_UNIT):
                x += i * i
            self.units += 1

    def rate(self, seconds: float) -> float:
        """Units a second over a window of `seconds` with nothing else to do."""
        u0, t0 = self.units, time.perf_counter()
        self.running.set()
        threading.Event().wait(seconds)  # a measuring window, not a synchronisation
        self.running.clear()
        return (self.units - u0) / (time.perf_counter() - t0)

    def close(self) -> None:
        """Stop the thread (it finishes its unit)."""
        self._stop = True
        self.running.set()
        self._thread.join(timeout=5.0)


@dataclass
class RingTimes:
    """Per operation (save, load) and arm, one value a repetition: the burst's time (the
    modelled engine's on the simulated device, wall time on a real one), its idle time per step
    boundary and its idle stretches (simulated device only), the lanes' CPU per chunk, and the
    busy forward's slowdown during the burst (arms with a forward)."""

    seconds: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    idle_s: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    gaps: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # idle stretches
    lane_us: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    slowdown: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # forward, 0-1

    def median(self, table: str, what: str, arm: str) -> float:
        """The median of `table`'s (seconds, idle_s, lane_us, ...) values for `what`, `arm`."""
        return statistics.median(getattr(self, table)[what][arm])


def measure_ring(
    make_ops: Callable[[], DeviceOps],
    device: torch.device,
    reps: int,
    say: Callable[[str], None],
    model: KVModel = SIM_MODEL,
    arms: Sequence[Arm] = ARMS,
) -> RingTimes:
    """The bursts of `run_ring` through one worker per arm on `make_ops()`'s device (KV on
    `device`), `reps` repetitions after one warm-up, arms interleaved."""
    n = model.chunk_bytes
    k = CHUNK // BLOCK
    chunks = STEPS * PER_STEP
    blocks = 2 * k * chunks  # the saved chunks, then the loads' targets
    names = ", ".join(a.name for a in arms)
    say(f"datapath: burst of {STEPS} steps x {PER_STEP} chunks on {device}, arms {names}")
    workers: dict[str, tuple[OffloadWorker, DeviceOps]] = {}
    out = RingTimes()
    forward = BusyForward() if any(a.forward for a in arms) else None
    try:
        for arm in arms:
            ops = make_ops()
            views = kv_views(model, "BLHNC", blocks, device)
            # gil_switch_ms 0: the arm sets the process's interval itself, around its bursts
            config = KVTierConfig(chunk_size=CHUNK, memory_bytes=n * (2 * chunks + 4),
                                  load_gate=False, persistent_ring=arm.persistent,
                                  gil_switch_ms=0)  # fmt: skip
            w = bench_worker(config, f"bench-ring-{arm.name}", ops)
            workers[arm.name] = (w, ops)
            w.register_kv_caches(KVCacheDescription(views, blocks, BLOCK, "BLHNC"))
        keys = Keys("ring")
        seq = itertools.count()

        def burst(arm: Arm, what: str) -> float:
            w, ops = workers[arm.name]
            assert w.stack is not None and w._path is not None
            sim = ops if isinstance(ops, SimOps) else None
            busy = forward if arm.forward else None
            lane: WorkLane = w._path.save_lane if what == "save" else w._path.load_lane
            refs = [ChunkRef(keys.next(), list(range(c * k, (c + 1) * k))) for c in range(chunks)]
            if what == "load":  # what the burst loads, saved and settled first
                w.wait_for_save(
                    OffloadMeta(saves=[SaveOp(f"sv{next(seq)}", "b", refs, CHUNK * chunks)])
                )
                settled(w)
            alone = busy.rate(_ALONE_S) if busy is not None else 0.0
            gate = threading.Event()
            lane.submit(lambda _lane: gate.wait(_HOLD_S))
            for s in range(STEPS):
                part = refs[s * PER_STEP : (s + 1) * PER_STEP]
                i = next(seq)
                if what == "save":
                    meta = OffloadMeta(saves=[SaveOp(f"sv{i}", f"b{i}", part, CHUNK * PER_STEP)])
                    w.wait_for_save(meta)
                else:
                    if w.stack.lookup([r.key for r in part], f"lk{i}") != PER_STEP:
                        raise RuntimeError("the saved chunks left the memory tier during the bench")
                    dst = [ChunkRef(r.key, [b + k * chunks for b in r.block_ids]) for r in part]
                    op = LoadOp(f"ld{i}", f"b{i}", f"lk{i}", dst, CHUNK * PER_STEP, sync=False)
                    w.start_load_kv(OffloadMeta(loads=[op]))
            cpu = w.metrics.registry.get_sample_value
            labels = {"rank": "0", "lane": what}
            cpu0 = cpu("kvtier_lane_cpu_seconds_total", labels) or 0.0
            busy0, idle0, gaps0 = (
                (sim.stats.engine_busy_s, sim.stats.engine_idle_s, sim.stats.engine_gaps)
                if sim
                else (0.0, 0.0, 0)
            )
            if sim is not None:
                sim.forget_idle()
            before = sys.getswitchinterval()
            if arm.switch_ms is not None:
                sys.setswitchinterval(arm.switch_ms / 1000.0)
            try:
                u0 = busy.units if busy is not None else 0
                t0 = time.perf_counter()
                if busy is not None:
                    busy.running.set()
                gate.set()
                settled(w)
                wall = time.perf_counter() - t0
                if busy is not None:
                    busy.running.clear()
                    during = (busy.units - u0) / wall
                    slow = 1.0 - during / alone if alone > 0 else 0.0
                    out.slowdown.setdefault(what, {}).setdefault(arm.name, []).append(slow)
            finally:
                if busy is not None:
                    busy.running.clear()
                sys.setswitchinterval(before)
            spent = (cpu("kvtier_lane_cpu_seconds_total", labels) or 0.0) - cpu0
            out.lane_us.setdefault(what, {}).setdefault(arm.name, []).append(spent / chunks * 1e6)
            w.stack.forget([r.key for r in refs])  # room for the next burst, no eviction
            if sim is None:
                return wall
            engine = sim.stats.engine_busy_s - busy0
            gaps = sim.stats.engine_idle_s - idle0
            out.idle_s.setdefault(what, {}).setdefault(arm.name, []).append(gaps / (STEPS - 1))
            stretches = sim.stats.engine_gaps - gaps0
            out.gaps.setdefault(what, {}).setdefault(arm.name, []).append(float(stretches))
            return engine + gaps

        for what in ("save", "load"):
            out.seconds[what] = interleave(
                {arm.name: (lambda a=arm, x=what: burst(a, x)) for arm in arms}, 1, reps + 1
            )
            for table in (out.idle_s, out.gaps, out.lane_us, out.slowdown):
                for name, values in table.get(what, {}).items():
                    table[what][name] = values[1:]  # the warm-up is not counted
    finally:
        if forward is not None:
            forward.close()
        for w, ops in workers.values():
            w.close()
            if isinstance(ops, SimOps):
                ops.close()
    return out


def _sim_ops(model: KVModel) -> Callable[[], DeviceOps]:
    gbps = model.chunk_bytes / COPY_S / 1e9
    return lambda: SimOps(CopyModel(gbps=gbps, latency_us=SIM_LATENCY_US))


def _detail(got: RingTimes, what: str, arms: Sequence[str]) -> dict[str, float]:
    """Each arm's idle per step boundary, lanes' CPU per chunk and (with a forward) slowdown."""
    out = {}
    for arm in arms:
        for name, table, scale, places in (
            ("idle_ms_per_step", "idle_s", 1e3, 3),
            ("lane_cpu_us_per_chunk", "lane_us", 1.0, 1),
            ("forward_slowdown_pct", "slowdown", 100.0, 1),
        ):
            if arm in getattr(got, table).get(what, {}):
                out[f"{name}_{arm}"] = round(got.median(table, what, arm) * scale, places)
    return out


def run_ring(report: Report, reps: int, say: Callable[[str], None]) -> None:
    """Add `datapath.sim.ring.save` and `.load`: a burst's engine time with the ring kept
    across jobs over the same with it drained at each job's end."""
    model = SIM_MODEL
    got = measure_ring(_sim_ops(model), torch.device("cpu"), reps, say, model)
    for what in ("save", "load"):
        kept, drained = (got.median("seconds", what, arm) for arm in ("kept", "drained"))
        report.add(
            Row(
                f"datapath.sim.ring.{what}",
                f"{model.name}: a burst of {STEPS} steps' {what}s ({PER_STEP} chunks each, one "
                f"lane job a step, {COPY_S * 1e3:.0f} ms a chunk on the modelled engine): the "
                "engine's time, transfer ring kept across jobs vs drained at each job's end "
                f"(simulated device), median of {reps}",
                kept * 1e3,
                "ms",
                raw=drained * 1e3,
                detail=_detail(got, what, ("kept", "drained")),
            )
        )


def run_gil(report: Report, reps: int, say: Callable[[str], None]) -> None:
    """Add `datapath.sim.gil.save` and `.load`: the same bursts beside a forward thread that
    runs Python without pause, at kvtier's GIL switch interval (`gil_switch_ms`) over the
    interpreter's 5 ms; the detail has the burst alone and the forward's slowdown per arm."""
    model = SIM_MODEL
    got = measure_ring(_sim_ops(model), torch.device("cpu"), reps, say, model, GIL_ARMS)
    names = [a.name for a in GIL_ARMS]
    for what in ("save", "load"):
        alone, slow, fast = (got.median("seconds", what, arm) for arm in names)
        report.add(
            Row(
                f"datapath.sim.gil.{what}",
                f"{model.name}: the same burst of {what}s beside a forward thread running Python "
                f"without pause: the engine's time at a GIL switch interval of {_KVTIER_MS:g} ms "
                f"(gil_switch_ms) vs the interpreter's 5 ms (simulated device), median of {reps}",
                fast * 1e3,
                "ms",
                raw=slow * 1e3,
                detail={"alone_ms": round(alone * 1e3, 2), **_detail(got, what, names)},
            )
        )
