"""`kvtier bench tier --device sim`, layer by layer: a synchronous restore through the worker's
real load path on the simulated device, followed by a modelled forward (one compute kernel per
layer, each after that layer's `wait_for_layer_load`), with the wave plan and without it, in
the same run, repetitions interleaved.

The restore is a step's batch: 4 prompts of 4 chunks, each a sync load of its own, one chunk of
each on fragmented block ids (the scatter kernel's path), as a batch restored after some churn
of the engine's block allocator is. The forward's compute equals the transfer's time, the case
where overlap matters most: joined before the forward the restore takes transfer + compute; in
waves (a quarter of the layers each) the forward starts after the first wave and ends about a
quarter of the transfer after the last one lands, 0.625 of that sum. A GPU's restore rows
(`scripts/gpu-check.sh`) run the same plan through the native engine.
"""

from __future__ import annotations

import itertools
import statistics
import threading
from collections.abc import Callable

import torch

from kvtier.bench.datapath import BLOCK, CHUNK, kv_views
from kvtier.bench.datapath_sim import SIM_LATENCY_US, SIM_MODEL, bench_worker, settled
from kvtier.bench.table import Report, Row, Target
from kvtier.bench.tier_common import Keys, interleave
from kvtier.config import KVTierConfig
from kvtier.offload.messages import ChunkRef, LoadOp, OffloadMeta, SaveOp
from kvtier.offload.pages import KVCacheDescription
from kvtier.offload.simdevice import CopyModel, SimOps
from kvtier.offload.worker import OffloadWorker

CHUNKS = 16
PROMPTS = 4  # sync loads in the step, CHUNKS / PROMPTS chunks each, the last one fragmented
TRANSFER_S = 0.24  # the restore's modelled time on the link
LAYERWISE_TARGET = 0.8  # waves over joined: 0.625 ideal, 1.0 no overlap at all


def run_layerwise(report: Report, reps: int, say: Callable[[str], None]) -> None:
    """Add `datapath.sim.layerwise.restore`: the restore-and-forward time in waves over the
    same with one join before the forward."""
    model = SIM_MODEL
    n = model.chunk_bytes
    gbps = n * CHUNKS / TRANSFER_S / 1e9
    ops = SimOps(CopyModel(gbps=gbps, latency_us=SIM_LATENCY_US))
    k = CHUNK // BLOCK
    # the saved chunks, the restore's contiguous targets, its fragmented ones (every other id)
    blocks = 2 * k * CHUNKS + 2 * k * PROMPTS
    views = kv_views(model, "LBNHC", blocks, torch.device("cpu"))
    names = list(views)
    layer_s = TRANSFER_S / len(names)
    say(f"datapath: simulated layer-by-layer restore, {CHUNKS} chunks of {model.name}")
    workers: dict[str, OffloadWorker] = {}
    try:
        for arm in ("waves", "joined"):
            w = workers[arm] = bench_worker(
                KVTierConfig(chunk_size=CHUNK, memory_bytes=n * (CHUNKS + 4), load_gate=False),
                f"bench-layerwise-{arm}",
                ops,
            )
            w.register_kv_caches(KVCacheDescription(views, blocks, BLOCK, "LBNHC"))
            if arm == "waves" and not w.enable_layer_waves(names):
                raise RuntimeError("the simulated LBNHC layout got no wave plan")
        keys = Keys("layerwise-sim")
        refs = [ChunkRef(keys.next(), list(range(c * k, (c + 1) * k))) for c in range(CHUNKS)]
        for w in workers.values():
            w.wait_for_save(OffloadMeta(saves=[SaveOp("sv", "bench", refs, CHUNK * CHUNKS)]))
            settled(w)
        seq = itertools.count()

        def restore(w: OffloadWorker) -> float:
            assert w.stack is not None
            loads = _prompt_loads(refs, f"lw-{next(seq)}", k)
            for op in loads:
                if w.stack.lookup([c.key for c in op.chunks], op.lookup_id) != len(op.chunks):
                    raise RuntimeError("the saved chunks left the memory tier during the bench")
            start = ops.compute.record()
            start.wait()
            w.start_load_kv(OffloadMeta(loads=loads))
            for name in names:
                w.wait_for_layer_load(name)
                # the layer's modelled compute on the compute stream (device time, not a wait
                # of the host's)
                ops.run_on_compute(lambda: threading.Event().wait(layer_s))
            end = ops.compute.record()
            end.wait()
            w.wait_for_save(OffloadMeta())
            ops.synchronize()
            settled(w)
            return end.t_done - start.t_done

        times = interleave(
            {arm: (lambda w=w: restore(w)) for arm, w in workers.items()}, 1, reps + 1
        )
    finally:
        for w in workers.values():
            w.close()
        ops.close()
    waves, joined = statistics.median(times["waves"]), statistics.median(times["joined"])
    report.add(
        Row(
            "datapath.sim.layerwise.restore",
            f"{model.name}: sync restore of {PROMPTS} prompts x {CHUNKS // PROMPTS} chunks (one "
            "of each on fragmented block ids) and a forward whose compute equals the transfer, "
            "in waves vs joined before the forward (simulated device; 0.625 is full overlap), "
            f"median of {reps}",
            waves * 1e3,
            "ms",
            raw=joined * 1e3,
            target=Target("ratio", "<=", LAYERWISE_TARGET),
            detail={"transfer_ms": TRANSFER_S * 1e3, "compute_ms": TRANSFER_S * 1e3},
        )
    )



def _prompt_loads(refs: list[ChunkRef], lease: str, k: int) -> list[LoadOp]:
    """The step's sync loads, one a prompt under a lease of its own (`lease`-p): each prompt's
    chunks on consecutive block ids after the saved ones, its last chunk on every other id of
    a region past them."""
    per = CHUNKS // PROMPTS
    spread = 2 * k * CHUNKS
    loads = []
    for p in range(PROMPTS):
        dst = []
        for c in range(p * per, (p + 1) * per):
            if c == (p + 1) * per - 1:
                ids = [spread + 2 * k * p + 2 * i for i in range(k)]
            else:
                ids = [b + k * CHUNKS for b in refs[c].block_ids]
            dst.append(ChunkRef(refs[c].key, ids))
        lk = f"{lease}-{p}"
        loads.append(LoadOp(f"ld-{lk}", f"bench-{p}", lk, dst, CHUNK * per, sync=True))
    return loads
