"""`kvtier bench tier --device sim`, across steps: a burst of steps, each step's saves (or
asynchronous loads) one lane job, queued while the lane is busy as a busy server's steps queue
them, through the worker's real paths on the simulated device. One worker keeps its transfer
ring across jobs (`persistent_ring`, the default), the other drains it at each job's end (the
design before); repetitions interleaved in one run.

Between two steps the drained ring leaves the copy engine idle while the lane thread wakes from
the last copy, commits or unpins, reports, and takes and issues the next job: host time, which
the modelled engine counts as idle. The rows give the burst's time on the engine (busy + idle,
modelled) kept over drained, and each arm's idle time per step boundary.
"""

from __future__ import annotations

import itertools
import statistics
import threading
from collections.abc import Callable

import torch
from prometheus_client import CollectorRegistry

from kvtier.bench.datapath import BLOCK, CHUNK, kv_views
from kvtier.bench.datapath_sim import SIM_LATENCY_US, SIM_MODEL, settled
from kvtier.bench.table import Report, Row
from kvtier.bench.tier_common import Keys, interleave
from kvtier.config import KVTierConfig
from kvtier.metrics import Metrics
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


def run_ring(report: Report, reps: int, say: Callable[[str], None]) -> None:
    """Add `datapath.sim.ring.save` and `.load`: a burst's engine time with the ring kept
    across jobs over the same with it drained at each job's end."""
    model = SIM_MODEL
    n = model.chunk_bytes
    k = CHUNK // BLOCK
    chunks = STEPS * PER_STEP
    blocks = 2 * k * chunks  # the saved chunks, then the loads' targets
    say(f"datapath: simulated burst of {STEPS} steps x {PER_STEP} chunks, ring kept vs drained")
    arms: dict[str, tuple[OffloadWorker, SimOps]] = {}
    try:
        for arm, persistent in ARMS:
            ops = SimOps(CopyModel(gbps=n / COPY_S / 1e9, latency_us=SIM_LATENCY_US))
            views = kv_views(model, "BLHNC", blocks, torch.device("cpu"))
            w = OffloadWorker(
                KVTierConfig(
                    chunk_size=CHUNK,
                    memory_bytes=n * (2 * chunks + 4),
                    load_gate=False,
                    persistent_ring=persistent,
                ),  # fmt: skip
                rank=0,
                world=1,
                model_id=f"bench-ring-{arm}",
                metrics=Metrics(0, registry=CollectorRegistry()),
                lookup_endpoint=None,
                ops=ops,
            )
            arms[arm] = (w, ops)
            w.register_kv_caches(KVCacheDescription(views, blocks, BLOCK, "BLHNC"))
        keys = Keys("ring-sim")
        seq = itertools.count()
        idle: dict[str, dict[str, list[float]]] = {"save": {}, "load": {}}
        # the lane threads' CPU per chunk: Python holding the GIL beside the forward's (the
        # copies themselves are the simulated engine's threads')
        lane_us: dict[str, dict[str, list[float]]] = {"save": {}, "load": {}}

        def burst(arm: str, what: str) -> float:
            w, ops = arms[arm]
            assert w.stack is not None and w._path is not None
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
            busy0, idle0 = ops.stats.engine_busy_s, ops.stats.engine_idle_s
            cpu = w.metrics.registry.get_sample_value
            labels = {"rank": "0", "lane": what}
            cpu0 = cpu("kvtier_lane_cpu_seconds_total", labels) or 0.0
            ops.forget_idle()
            gate.set()
            settled(w)
            spent = (cpu("kvtier_lane_cpu_seconds_total", labels) or 0.0) - cpu0
            lane_us[what].setdefault(arm, []).append(spent / chunks * 1e6)
            w.stack.forget([r.key for r in refs])  # room for the next burst, no eviction
            busy = ops.stats.engine_busy_s - busy0
            gaps = ops.stats.engine_idle_s - idle0
            idle[what].setdefault(arm, []).append(gaps / (STEPS - 1))
            return busy + gaps

        times = {
            what: interleave(
                {arm: (lambda a=arm, x=what: burst(a, x)) for arm, _ in ARMS}, 1, reps + 1
            )  # fmt: skip
            for what in ("save", "load")
        }
    finally:
        for w, ops in arms.values():
            w.close()
            ops.close()
    for what, got in times.items():
        kept, drained = statistics.median(got["kept"]), statistics.median(got["drained"])
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
                detail={
                    **{
                        f"idle_ms_per_step_{arm}": round(statistics.median(v) * 1e3, 3)
                        for arm, v in idle[what].items()
                    },
                    **{
                        f"lane_cpu_us_per_chunk_{arm}": round(statistics.median(v), 1)
                        for arm, v in lane_us[what].items()
                    },
                },
            )
        )
