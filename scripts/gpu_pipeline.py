"""The transfer pipeline on a real device, for `scripts/gpu_check.py`:

- save and load of one step's 64 chunks through OffloadWorker, in GB/s, against raw pinned
  `cudaMemcpyAsync` copies of the same bytes chunk by chunk on one side stream (target 0.8x);
- CPU seconds of the copy lanes' threads per GB moved (a spinning wait shows as ~1 s/GB and
  more; blocking events keep it to the host's own work);
- the forward's step time (a fixed matmul loop on the compute stream) with offload off, and on
  with a save burst queued after every step's forward (target: within 10%).
"""

from __future__ import annotations

import statistics
import time

import torch
from prometheus_client import CollectorRegistry

from kvtier.bench.datapath import BLOCK, CHUNK, MODELS, kv_views
from kvtier.bench.tier import _Keys
from kvtier.config import KVTierConfig
from kvtier.metrics import Metrics
from kvtier.offload.messages import ChunkRef, LoadOp, OffloadMeta, SaveOp
from kvtier.offload.pages import KVCacheDescription
from kvtier.offload.worker import OffloadWorker

Row = tuple[str, str, bool | None]
RAW_RATIO_TARGET = 0.8
STEP_SLOWDOWN_LIMIT = 1.10
_REPS = 3
_IDLE_S = 120.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pipeline_rows(device_name: str) -> list[Row]:
    """The rows above; on the CPU the same paths run with 8 chunks (no pinned copies)."""
    device = torch.device(device_name)
    cuda = device.type == "cuda"
    model = MODELS[0]
    chunks = 64 if cuda else 8
    k = CHUNK // BLOCK
    nb = k * chunks
    n = model.chunk_bytes
    layout = "BLHNC" if cuda else "LBHNC"
    views = kv_views(model, layout, nb, device)
    metrics = Metrics(0, registry=CollectorRegistry())
    worker = OffloadWorker(
        # every round's chunks stay resident (a round's save must not evict what its load reads)
        KVTierConfig(
            chunk_size=CHUNK, memory_bytes=n * (chunks * (_REPS + 2) + 4), load_gate=False
        ),
        rank=0,
        world=1,
        model_id="gpu-check-pipeline",
        metrics=metrics,
        lookup_endpoint=None,
    )
    worker.register_kv_caches(KVCacheDescription(views, nb, BLOCK, layout))
    try:
        return _measure(worker, metrics, device, model.name, chunks, n)
    finally:
        worker.close()


def _measure(
    worker: OffloadWorker,
    metrics: Metrics,
    device: torch.device,
    name: str,
    chunks: int,
    n: int,
) -> list[Row]:
    cuda = device.type == "cuda"
    assert worker.stack is not None
    k = CHUNK // BLOCK
    blocks = [list(range(c * k, (c + 1) * k)) for c in range(chunks)]
    keys = _Keys("gpu-check-pipeline")
    host = torch.empty(chunks * n, dtype=torch.uint8, pin_memory=cuda)
    dev = torch.empty(chunks * n, dtype=torch.uint8, device=device)
    side = torch.cuda.Stream(device) if cuda else None

    def raw(to_host: bool) -> float:
        _sync(device)
        t0 = time.perf_counter()
        ctx = torch.cuda.stream(side) if side is not None else _null()
        with ctx:
            for c in range(chunks):
                h, d = host[c * n : (c + 1) * n], dev[c * n : (c + 1) * n]
                (h if to_host else d).copy_(d if to_host else h, non_blocking=cuda)
        _sync(device)
        return time.perf_counter() - t0

    def save() -> tuple[float, list[ChunkRef]]:
        refs = [ChunkRef(keys.next(), b) for b in blocks]
        _sync(device)
        t0 = time.perf_counter()
        worker.wait_for_save(OffloadMeta(saves=[SaveOp(keys.next().hex(), "g", refs, 0)]))
        _wait(worker)
        return time.perf_counter() - t0, refs

    def load(refs: list[ChunkRef]) -> float:
        lease = keys.next().hex()
        assert worker.stack is not None
        if worker.stack.lookup([r.key for r in refs], lease) != len(refs):
            raise RuntimeError("saved chunks left the memory tier during the check")
        _sync(device)
        t0 = time.perf_counter()
        worker.start_load_kv(OffloadMeta(loads=[LoadOp(lease, "g", lease, refs, 0)]))
        _wait(worker)
        return time.perf_counter() - t0

    cpu0 = {lane: metrics.value("lane_cpu_seconds_total", lane=lane) for lane in ("save", "load")}
    times: dict[str, list[float]] = {"save": [], "load": [], "d2h": [], "h2d": []}
    for rep in range(_REPS + 1):
        s, refs = save()
        ld = load(refs)
        d2h, h2d = raw(True), raw(False)
        if rep:  # the first round warms the arena and the allocator
            for key, v in (("save", s), ("load", ld), ("d2h", d2h), ("h2d", h2d)):
                times[key].append(v)
    moved_gb = chunks * n * (_REPS + 1) / 1e9
    cpu = {
        lane: (metrics.value("lane_cpu_seconds_total", lane=lane) - cpu0[lane]) / moved_gb
        for lane in ("save", "load")
    }
    med = {key: statistics.median(v) for key, v in times.items()}
    gb = chunks * n / 1e9
    rows: list[Row] = []
    for what, raw_key in (("save", "d2h"), ("load", "h2d")):
        ratio = med[raw_key] / med[what]
        rows.append(
            (
                f"pipeline: {what} of {chunks} chunks ({name})",
                f"{gb / med[what]:.1f} GB/s, {ratio:.2f}x raw pinned copies "
                f"({gb / med[raw_key]:.1f} GB/s)",
                ratio >= RAW_RATIO_TARGET if cuda else None,
            )
        )
    rows.append(
        (
            "pipeline: copy lanes' CPU time per GB moved",
            f"save {cpu['save']:.3f} s/GB, load {cpu['load']:.3f} s/GB",
            None,
        )
    )
    if cuda:
        rows.append(_step_time(worker, device, blocks, keys))
    return rows


def _step_time(
    worker: OffloadWorker, device: torch.device, blocks: list[list[int]], keys: _Keys
) -> Row:
    """The forward's step time with offload off, and on under a save burst after each step."""
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)

    def forward() -> None:
        x = a
        for _ in range(16):
            x = x @ a
        torch.cuda.current_stream(device).synchronize()

    def steps(burst: bool) -> float:
        out = []
        for _ in range(10):
            t0 = time.perf_counter()
            forward()
            if burst:
                refs = [ChunkRef(keys.next(), b) for b in blocks[:16]]
                op = SaveOp(keys.next().hex(), "g", refs, 0)
                worker.wait_for_save(OffloadMeta(saves=[op]))
            out.append(time.perf_counter() - t0)
        _wait(worker)
        return statistics.median(out)

    forward()
    off = steps(False)
    on = steps(True)
    return (
        "pipeline: step time, offload on (16-chunk save burst per step) vs off",
        f"{on * 1e3:.2f} ms vs {off * 1e3:.2f} ms ({(on / off - 1) * 100:+.1f}%)",
        on <= off * STEP_SLOWDOWN_LIMIT,
    )


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _wait(worker: OffloadWorker) -> None:
    if not worker.wait_idle(_IDLE_S):
        raise RuntimeError(f"the worker did not finish within {_IDLE_S} s")
    failed = [r for r in worker.take_report().results if not r.ok]
    if failed:
        raise RuntimeError(f"a transfer failed: {failed[0].reason}")
