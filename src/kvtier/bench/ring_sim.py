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
import threading
import time
from collections.abc import Callable
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
ARMS = (("kept", True), ("drained", False))


@dataclass
class RingTimes:
    """Per operation (save, load) and arm (kept, drained), one value a repetition: the burst's
    time (the modelled engine's on the simulated device, wall time on a real one), its idle
    time per step boundary and its idle stretches (simulated device only), and the lanes' CPU
    per chunk."""

    seconds: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    idle_s: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    gaps: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # idle stretches
    lane_us: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    def median(self, table: str, what: str, arm: str) -> float:
        """The median of `table`'s (seconds, idle_s, lane_us) values for `what` and `arm`."""
        return statistics.median(getattr(self, table)[what][arm])


def measure_ring(
    make_ops: Callable[[], DeviceOps],
    device: torch.device,
    reps: int,
    say: Callable[[str], None],
    model: KVModel = SIM_MODEL,
) -> RingTimes:
    """The bursts of `run_ring` through workers on `make_ops()`'s device (one per arm, KV on
    `device`), `reps` repetitions after one warm-up, arms interleaved."""
    n = model.chunk_bytes
    k = CHUNK // BLOCK
    chunks = STEPS * PER_STEP
    blocks = 2 * k * chunks  # the saved chunks, then the loads' targets
    say(f"datapath: burst of {STEPS} steps x {PER_STEP} chunks on {device}, ring kept vs drained")
    arms: dict[str, tuple[OffloadWorker, DeviceOps]] = {}
    out = RingTimes()
    try:
        for arm, persistent in ARMS:
            ops = make_ops()
            views = kv_views(model, "BLHNC", blocks, device)
            config = KVTierConfig(chunk_size=CHUNK, memory_bytes=n * (2 * chunks + 4),
                                  load_gate=False, persistent_ring=persistent)  # fmt: skip
            w = bench_worker(config, f"bench-ring-{arm}", ops)
            arms[arm] = (w, ops)
            w.register_kv_caches(KVCacheDescription(views, blocks, BLOCK, "BLHNC"))
        keys = Keys("ring")
        seq = itertools.count()

        def burst(arm: str, what: str) -> float:
            w, ops = arms[arm]
            assert w.stack is not None and w._path is not None
            sim = ops if isinstance(ops, SimOps) else None
            lane: WorkLane = w._path.save_lane if what == "save" else w._path.load_lane
            refs = [ChunkRef(keys.next(), list(range(c * k, (c + 1) * k))) for c in range(chunks)]
            if what == "load":  # what the burst loads, saved and settled first
                w.wait_for_save(
                    OffloadMeta(saves=[SaveOp(f"sv{next(seq)}", "b", refs, CHUNK * chunks)])
                )
                settled(w)
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
            t0 = time.perf_counter()
            gate.set()
            settled(w)
            wall = time.perf_counter() - t0
            spent = (cpu("kvtier_lane_cpu_seconds_total", labels) or 0.0) - cpu0
            out.lane_us.setdefault(what, {}).setdefault(arm, []).append(spent / chunks * 1e6)
            w.stack.forget([r.key for r in refs])  # room for the next burst, no eviction
            if sim is None:
                return wall
            busy = sim.stats.engine_busy_s - busy0
            gaps = sim.stats.engine_idle_s - idle0
            out.idle_s.setdefault(what, {}).setdefault(arm, []).append(gaps / (STEPS - 1))
            stretches = sim.stats.engine_gaps - gaps0
            out.gaps.setdefault(what, {}).setdefault(arm, []).append(float(stretches))
            return busy + gaps

        for what in ("save", "load"):
            out.seconds[what] = interleave(
                {arm: (lambda a=arm, x=what: burst(a, x)) for arm, _ in ARMS}, 1, reps + 1
            )
            for table in (out.idle_s, out.gaps, out.lane_us):  # the warm-up is not counted
                for arm, values in table.get(what, {}).items():
                    table[what][arm] = values[1:]
    finally:
        for w, ops in arms.values():
            w.close()
            if isinstance(ops, SimOps):
                ops.close()
    return out


def run_ring(report: Report, reps: int, say: Callable[[str], None]) -> None:
    """Add `datapath.sim.ring.save` and `.load`: a burst's engine time with the ring kept
    across jobs over the same with it drained at each job's end."""
    model = SIM_MODEL
    gbps = model.chunk_bytes / COPY_S / 1e9
    got = measure_ring(
        lambda: SimOps(CopyModel(gbps=gbps, latency_us=SIM_LATENCY_US)),
        torch.device("cpu"), reps, say, model,
    )  # fmt: skip
    for what in ("save", "load"):
        kept, drained = (got.median("seconds", what, arm) for arm in ("kept", "drained"))
        detail = {
            f"{name}_{arm}": round(got.median(table, what, arm) * scale, places)
            for arm, _ in ARMS
            for name, table, scale, places in (
                ("idle_ms_per_step", "idle_s", 1e3, 3),
                ("lane_cpu_us_per_chunk", "lane_us", 1.0, 1),
            )
        }
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
                detail=detail,
            )
        )
