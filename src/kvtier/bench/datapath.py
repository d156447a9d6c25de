"""`kvtier bench tier --device cuda|cpu|sim`: save and load GB/s through the offload worker's real
path (lanes, device staging, codec, memory tier), next to a raw pinned `copy_` of the same bytes
in the same run, and the host time a step's saves hold `wait_for_save`.

KV caches are laid out as vLLM 0.32 would: the cross-layer layout kvtier asks for on CUDA
(BLHNC, one page per block for all layers) and LBHNC on the CPU (what vLLM's CPU attention
reads), 16-token blocks, 256-token chunks, one rank of Llama-3.1-8B (GQA) and DeepSeek-V3 (MLA).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from prometheus_client import CollectorRegistry

from kvtier.bench.table import Report, Row, Target
from kvtier.bench.tier_common import Keys, gbps_row, interleave
from kvtier.config import KVTierConfig
from kvtier.metrics import Metrics
from kvtier.offload.messages import ChunkRef, LoadOp, OffloadMeta, SaveOp
from kvtier.offload.pages import KVCacheDescription
from kvtier.offload.worker import OffloadWorker

BLOCK = 16
CHUNK = 256
CHUNKS_IN_POOL = 4
STEP_SAVES = 4  # chunks one step hands to wait_for_save
GPU_RATIO_TARGET = 0.8
CPU_RATIO_TARGET = 0.85
WAIT_FOR_SAVE_MS_TARGET = 1.0
_IDLE_S = 60.0


@dataclass(frozen=True, slots=True)
class KVModel:
    """One rank's KV geometry: layers x heads x content bytes per token (K‖V or latent)."""

    name: str
    layers: int
    heads: int
    content_bytes: int
    dtype: torch.dtype

    @property
    def chunk_bytes(self) -> int:
        return self.layers * self.heads * self.content_bytes * CHUNK


MODELS = (
    KVModel("Llama-3.1-8B (GQA, TP1)", 32, 8, 2 * 128 * 2, torch.bfloat16),
    KVModel("DeepSeek-V3 (MLA 576)", 61, 1, 576 * 2, torch.bfloat16),
)


def kv_views(
    model: KVModel, layout: str, num_blocks: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """Per-layer `[B, H, N, C]` views of one allocation in `layout` (BLHNC or LBHNC)."""
    shape = (model.heads, BLOCK, model.content_bytes)
    if layout == "BLHNC":
        cache = torch.zeros(num_blocks, model.layers, *shape, dtype=torch.uint8, device=device)
        layer = [cache[:, i] for i in range(model.layers)]
    else:
        cache = torch.zeros(model.layers, num_blocks, *shape, dtype=torch.uint8, device=device)
        layer = [cache[i] for i in range(model.layers)]
    cache.random_(0, 256)
    return {f"model.layers.{i}.self_attn.attn": v.view(model.dtype) for i, v in enumerate(layer)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_datapath(report: Report, device_name: str, reps: int, warmup: int, say: Callable) -> None:
    """Add the device rows to `report` (save, load and raw copies per model; wait_for_save);
    the simulated device has its own (`kvtier.bench.datapath_sim`)."""
    device = torch.device(device_name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device_name}: this torch build sees no CUDA device")
    layout = "BLHNC" if device.type == "cuda" else "LBHNC"
    target = GPU_RATIO_TARGET if device.type == "cuda" else CPU_RATIO_TARGET
    ratio = Target("ratio", ">=", target)
    note = report.note(
        f"through OffloadWorker on {device} ({layout}, {BLOCK}-token blocks, {CHUNK}-token "
        "chunks): save = wait_for_save -> save lane gathers the chunk on the device, one copy "
        "to its memory-tier slot, commit; load = load lane reads the slot into device staging "
        "(in place on the CPU), scatters; raw = one copy_ of the same bytes between a "
        "contiguous device buffer and a pinned host buffer; interleaved, median"
    )
    for model in MODELS:
        say(f"datapath: {model.name} on {device}, {reps} rounds")
        save, load, raw_d2h, raw_h2d, submit = _measure(model, layout, device, reps, warmup)
        n = model.chunk_bytes
        tag = f"datapath.{device.type}.{model.name.split(' ')[0].lower()}"
        gbps_row(report, f"{tag}.save", f"{model.name}: save {note}", n, save, raw_d2h, ratio)
        gbps_row(report, f"{tag}.load", f"{model.name}: load", n, load, raw_h2d, ratio)
        report.add(
            Row(
                f"{tag}.wait_for_save",
                f"{model.name}: host time in wait_for_save, {STEP_SAVES} chunks per step",
                float(np.percentile(submit, 99)) * 1e3,
                "ms",
                target=Target("value", "<=", WAIT_FOR_SAVE_MS_TARGET),
                detail={
                    "p50_ms": float(np.median(submit)) * 1e3,
                    "samples": len(submit),
                    "stat": "p99",
                },
            )
        )


def _measure(
    model: KVModel, layout: str, device: torch.device, reps: int, warmup: int
) -> tuple[list[float], list[float], list[float], list[float], list[float]]:
    k = CHUNK // BLOCK
    num_blocks = k * CHUNKS_IN_POOL
    views = kv_views(model, layout, num_blocks, device)
    n = model.chunk_bytes
    config = KVTierConfig(chunk_size=CHUNK, memory_bytes=n * (STEP_SAVES * 2 + 4), load_gate=False)
    worker = OffloadWorker(
        config,
        rank=0,
        world=1,
        model_id="bench-datapath",
        metrics=Metrics(0, registry=CollectorRegistry()),
        lookup_endpoint=None,
    )
    worker.register_kv_caches(KVCacheDescription(views, num_blocks, BLOCK, layout))
    assert worker.stack is not None
    pin = device.type == "cuda"
    # the raw copies rotate over as many buffers as the real path touches (pool, tier slots), so
    # neither side finds its bytes in a cache the other side just warmed
    hosts = itertools.cycle(
        [torch.zeros(n, dtype=torch.uint8, pin_memory=pin) for _ in range(CHUNKS_IN_POOL)]
    )
    devs = itertools.cycle(
        [torch.zeros(n, dtype=torch.uint8, device=device) for _ in range(CHUNKS_IN_POOL)]
    )
    keys = Keys(f"datapath-{model.name}")
    blocks = itertools.cycle([list(range(c * k, (c + 1) * k)) for c in range(CHUNKS_IN_POOL)])
    ops = itertools.count()
    # touch every slot of the tier first (saves then evict, as in service), so no timed copy
    # pays the first-touch page faults of a fresh arena
    for _ in range(worker.stack.memory.num_slots):
        _save_and_wait(worker, [ChunkRef(keys.next(), next(blocks))], next(ops))
    resident = keys.next()
    _save_and_wait(worker, [ChunkRef(resident, next(blocks))], next(ops))

    def raw(to_host: bool) -> float:
        host, dev = next(hosts), next(devs)
        dst, src = (host, dev) if to_host else (dev, host)
        t = time.perf_counter()
        dst.copy_(src, non_blocking=pin)
        _sync(device)
        return time.perf_counter() - t

    def save() -> float:
        t = time.perf_counter()
        _save_and_wait(worker, [ChunkRef(keys.next(), next(blocks))], next(ops))
        return time.perf_counter() - t

    def load() -> float:
        lease = f"bench-lease-{next(ops)}"
        if worker.stack.lookup([resident], lease) != 1:  # type: ignore[union-attr]
            raise RuntimeError("the resident chunk left the memory tier during the bench")
        op = LoadOp(f"ld{lease}", "bench", lease, [ChunkRef(resident, next(blocks))], CHUNK)
        t = time.perf_counter()
        worker.start_load_kv(OffloadMeta(loads=[op]))
        _wait(worker)
        return time.perf_counter() - t

    submit: list[float] = []

    def step() -> float:
        refs = [ChunkRef(keys.next(), next(blocks)) for _ in range(STEP_SAVES)]
        op = SaveOp(f"sv{next(ops)}", "bench", refs, CHUNK * STEP_SAVES)
        t = time.perf_counter()
        worker.wait_for_save(OffloadMeta(saves=[op]))
        submit.append(time.perf_counter() - t)
        _wait(worker)
        return 0.0

    try:
        times = interleave(
            {
                "save": save,
                "load": load,
                "d2h": lambda: raw(True),
                "h2d": lambda: raw(False),
                "step": step,
            },
            warmup,
            warmup + reps,
        )
    finally:
        worker.close()
    return times["save"], times["load"], times["d2h"], times["h2d"], submit[warmup:]


def _save_and_wait(worker: OffloadWorker, refs: list[ChunkRef], op: int) -> None:
    worker.wait_for_save(OffloadMeta(saves=[SaveOp(f"sv{op}", "bench", refs, CHUNK)]))
    _wait(worker)


def _wait(worker: OffloadWorker) -> None:
    if not worker.wait_idle(_IDLE_S):
        raise RuntimeError(f"the worker did not finish a transfer within {_IDLE_S} s")
    report = worker.take_report()
    failed = [r for r in report.results if not r.ok]
    if failed:
        raise RuntimeError(f"a bench transfer failed: {failed[0].reason}")
