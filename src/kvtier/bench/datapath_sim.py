"""`kvtier bench tier --device sim`: the offload worker's real save and load paths on the
simulated device (`kvtier.offload.simdevice`), as a fraction of the modelled copy engine's
bandwidth, pipelined (`transfer_depth` 2) next to the serial design (`transfer_depth` 1) on the
same model in the same run.

Each row moves 64 chunks in one step (one SaveOp; one asynchronous LoadOp) through one modelled
copy engine of 25 or 50 GB/s. The kernels (gather, scatter) run on this host's cores at its
memcpy speed, where a GPU runs them at HBM speed, tens of times the link's: the model's times
are stretched (`time_scale`, in each row) until one chunk's modelled copy takes 4x what this
host takes to copy its bytes, so the rows measure how well the pipeline keeps the engine busy,
not this host's memcpy. `scripts/gpu-check.sh` measures the same paths on a real GPU.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable

import torch
from prometheus_client import CollectorRegistry

from kvtier.bench.datapath import BLOCK, CHUNK, KVModel, kv_views
from kvtier.bench.table import Report, Row, Target
from kvtier.bench.tier_common import Keys
from kvtier.config import KVTierConfig
from kvtier.metrics import Metrics
from kvtier.offload.device import DeviceOps
from kvtier.offload.messages import ChunkRef, LoadOp, OffloadMeta, SaveOp
from kvtier.offload.pages import KVCacheDescription
from kvtier.offload.simdevice import CopyModel, SimOps
from kvtier.offload.worker import OffloadWorker

SIM_GBPS = (25.0, 50.0)
SIM_CHUNKS = 64
SIM_TARGET = 0.85
SIM_LATENCY_US = 5.0
# one rank of Llama-3.1-8B at TP8: 4 MiB chunks (64 of them fit this host twice over)
SIM_MODEL = KVModel("Llama-3.1-8B (GQA, TP8)", 32, 1, 2 * 128 * 2, torch.bfloat16)
# a chunk's modelled copy takes this many times what this host takes to copy its bytes
_STRETCH = 4.0
_IDLE_S = 300.0
DESIGNS = ((1, "serial"), (2, "pipeline"))


def run_sim(report: Report, reps: int, say: Callable[[str], None]) -> None:
    """Add the simulated device's rows: save and load fractions per model and design."""
    model = SIM_MODEL
    n = model.chunk_bytes
    # the simulated streams are threads of this process: torch's own intra-op threads would
    # spin and compete with them for the cores (a GPU runs kernels on its own SMs)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _run(report, reps, say, model, n)
    finally:
        torch.set_num_threads(threads)


def _run(report: Report, reps: int, say: Callable[[str], None], model: KVModel, n: int) -> None:
    host_s = _host_copy_seconds(n)
    marker = report.note(
        f"simulated device: {SIM_CHUNKS} chunks of {model.name} ({n >> 20} MiB, BLHNC) per "
        "step through OffloadWorker's real save and load paths; one modelled copy engine, "
        f"{SIM_LATENCY_US:.0f} us a copy; fraction = bytes / wall time / the engine's "
        f"bandwidth; the model's times are stretched so one chunk's copy takes {_STRETCH:.0f}x "
        f"this host's memcpy of it ({host_s * 1e3:.2f} ms); median of {reps} steps"
    )
    for gbps in SIM_GBPS:
        scale = max(1.0, _STRETCH * host_s / (n / (gbps * 1e9)))
        for depth, design in DESIGNS:
            say(f"datapath: simulated {gbps:.0f} GB/s engine, {design} (depth {depth})")
            save, load, detail = _measure(model, gbps, scale, depth, reps)
            for what, got in (("save", save), ("load", load)):
                report.add(
                    Row(
                        f"datapath.sim.{gbps:.0f}gbps.{what}.{design}",
                        f"{model.name}: {what} of {SIM_CHUNKS} chunks, {design} "
                        f"(transfer_depth {depth}), {gbps:.0f} GB/s modelled {marker}",
                        got,
                        "ratio",
                        target=Target("value", ">=", SIM_TARGET) if depth > 1 else None,
                        detail={"time_scale": round(scale, 2), **detail[what]},
                    )
                )


def _host_copy_seconds(nbytes: int) -> float:
    """This host's time to copy `nbytes` from memory not in its caches (a KV pool and an arena
    are far larger than any cache), median over 16 buffers in turn."""
    count = 16
    a = torch.ones(count * nbytes, dtype=torch.uint8)
    b = torch.ones(count * nbytes, dtype=torch.uint8)
    times = []
    for i in range(count):
        t0 = time.perf_counter()
        b[i * nbytes : (i + 1) * nbytes].copy_(a[i * nbytes : (i + 1) * nbytes])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _measure(
    model: KVModel, gbps: float, scale: float, depth: int, reps: int
) -> tuple[float, float, dict[str, dict[str, float]]]:
    ops = SimOps(CopyModel(gbps=gbps, latency_us=SIM_LATENCY_US, engines=1, time_scale=scale))
    k = CHUNK // BLOCK
    num_blocks = k * SIM_CHUNKS
    views = kv_views(model, "BLHNC", num_blocks, torch.device("cpu"))
    n = model.chunk_bytes
    config = KVTierConfig(
        chunk_size=CHUNK,
        # every step's chunks stay resident: no step's save evicts what the next load reads
        memory_bytes=n * (SIM_CHUNKS * (reps + 2) + 4),
        load_gate=False,
        transfer_depth=depth,
    )
    worker = bench_worker(config, "bench-datapath-sim", ops)
    link_bps = gbps * 1e9 / scale  # the modelled engine's bandwidth, in stretched time
    fractions: dict[str, list[float]] = {"save": [], "load": []}
    keys = Keys(f"datapath-sim-{gbps}-{depth}")
    ids = itertools.count()
    blocks = [list(range(c * k, (c + 1) * k)) for c in range(SIM_CHUNKS)]
    try:
        worker.register_kv_caches(KVCacheDescription(views, num_blocks, BLOCK, "BLHNC"))
        assert worker.stack is not None
        for rep in range(reps + 1):  # the first step warms the arena's pages: not counted
            refs = [ChunkRef(keys.next(), b) for b in blocks]
            op = SaveOp(f"sv{next(ids)}", "bench", refs, CHUNK * SIM_CHUNKS)
            t0 = time.perf_counter()
            worker.wait_for_save(OffloadMeta(saves=[op]))
            settled(worker)
            save_s = time.perf_counter() - t0
            lease = f"bench-sim-{next(ids)}"
            if worker.stack.lookup([r.key for r in refs], lease) != SIM_CHUNKS:
                raise RuntimeError("the saved chunks left the memory tier during the bench")
            load = LoadOp(f"ld{lease}", "bench", lease, refs, CHUNK * SIM_CHUNKS)
            t0 = time.perf_counter()
            worker.start_load_kv(OffloadMeta(loads=[load]))
            settled(worker)
            load_s = time.perf_counter() - t0
            if rep:
                fractions["save"].append(n * SIM_CHUNKS / save_s / link_bps)
                fractions["load"].append(n * SIM_CHUNKS / load_s / link_bps)
    finally:
        worker.close()
        ops.close()
    detail = {
        what: {
            "min": round(min(v), 3),
            "max": round(max(v), 3),
            "peak_in_flight": float(ops.stats.peak_in_flight),
            "samples": float(len(v)),
        }
        for what, v in fractions.items()
    }
    return statistics.median(fractions["save"]), statistics.median(fractions["load"]), detail


def bench_worker(config: KVTierConfig, model_id: str, ops: DeviceOps) -> OffloadWorker:
    """A world-1 worker on `ops` with metrics of its own and no lookup server: a bench's arm."""
    return OffloadWorker(
        config,
        rank=0,
        world=1,
        model_id=model_id,
        metrics=Metrics(0, registry=CollectorRegistry()),
        lookup_endpoint=None,
        ops=ops,
    )


def settled(worker: OffloadWorker) -> None:
    """Wait until `worker` has nothing in flight; raise if that takes too long or an op it
    reports failed (a bench must not time a failure)."""
    if not worker.wait_idle(_IDLE_S):
        raise RuntimeError(f"the worker did not finish a transfer within {_IDLE_S} s")
    failed = [r for r in worker.take_report().results if not r.ok]
    if failed:
        raise RuntimeError(f"a bench transfer failed: {failed[0].reason}")
