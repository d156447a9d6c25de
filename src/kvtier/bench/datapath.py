"""`kvtier bench tier --device cuda|cpu`: save and load through the offload worker's real path
(lanes, device staging, codec, memory tier) at the sizes a host's step hands it, next to raw
pinned copies of the same bytes in the same run; a one-chunk load's latency; the host time a
step's saves hold `wait_for_save`; and (on a GPU) the forward's step time under a save burst.

KV caches are laid out as vLLM 0.32 would: the cross-layer layout kvtier asks for on CUDA
(BLHNC, one page per block for all layers), vLLM's CUDA default LBNHC (one strided run per
layer) and LBHNC on the CPU (what vLLM's CPU attention reads), 16-token blocks, 256-token
chunks, one rank of Llama-3.1-8B (GQA) and DeepSeek-V3 (MLA). `scripts/gpu_check.py` prints
these same rows: the bench and the GPU check measure the same bytes.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
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
# chunks one step saves or loads: an 8192-token prefill step of Llama-3.1-8B is 32 chunks;
# a CPU host's steps are short, and 64 chunks of 8B KV (2 GiB) would not fit a test machine
STEP_CHUNKS = {"cuda": (4, 16, 64), "cpu": (4, 16)}
STEP_SAVES = 4  # chunks one step hands to wait_for_save in the wait_for_save row
GPU_RATIO_TARGET = 0.8
WAIT_FOR_SAVE_MS_TARGET = 1.0
# its p99 is judged from this many steps: with fewer, the p99 is the slowest step or next to
# it, so one scheduling hiccup of a shared machine decides it (30 steps: the max); the full
# run measures this many, the quick one (3 steps) shows its p99 UNDETERMINED
WAIT_FOR_SAVE_MIN_SAMPLES = 100
# the forward's step time with a save burst queued after each step, against none (CUDA only:
# on the CPU the copy lanes and the forward share the cores, which is the host's choice)
FORWARD_SLOWDOWN_TARGET = 1.10
FORWARD_LAYOUTS = ("BLHNC", "LBNHC")
LATENCY_REPS = {"quick": 10, "full": 50}
_IDLE_S = 120.0


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

    @property
    def tag(self) -> str:
        return self.name.split(" ")[0].lower()


MODELS = (
    KVModel("Llama-3.1-8B (GQA, TP1)", 32, 8, 2 * 128 * 2, torch.bfloat16),
    KVModel("DeepSeek-V3 (MLA 576)", 61, 1, 576 * 2, torch.bfloat16),
)


def resolve_device(name: str) -> torch.device:
    """`cpu`, `cuda` (= cuda:0) or `cuda:N` as a device; ValueError naming the fix for anything
    else, and for CUDA where this torch build sees no such device."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a device; use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name!r}: use cpu, cuda or cuda:N (or sim)")
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: this torch build sees no CUDA device")
        if device.index >= torch.cuda.device_count():
            raise ValueError(
                f"--device {name}: this machine has {torch.cuda.device_count()} CUDA devices"
            )
    return device


def kv_views(
    model: KVModel, layout: str, num_blocks: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """Per-layer views of one allocation in `layout`: BLHNC (blocks outermost, one page per
    block for all layers), LBHNC or LBNHC (layers outermost; per layer `[B, H, N, C]` or
    `[B, N, H, C]`, either way one strided run of a block's bytes per layer)."""
    if layout == "BLHNC":
        shape: tuple[int, ...] = (model.heads, BLOCK, model.content_bytes)
        cache = torch.zeros(num_blocks, model.layers, *shape, dtype=torch.uint8, device=device)
        layer = [cache[:, i] for i in range(model.layers)]
    elif layout in ("LBHNC", "LBNHC"):
        inner = (model.heads, BLOCK) if layout == "LBHNC" else (BLOCK, model.heads)
        shape = (*inner, model.content_bytes)
        cache = torch.zeros(model.layers, num_blocks, *shape, dtype=torch.uint8, device=device)
        layer = [cache[i] for i in range(model.layers)]
    else:
        raise ValueError(f"layout {layout!r}: use BLHNC, LBHNC or LBNHC")
    cache.random_(0, 256)
    return {f"model.layers.{i}.self_attn.attn": v.view(model.dtype) for i, v in enumerate(layer)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_datapath(
    report: Report, device_name: str, reps: int, warmup: int, say: Callable, quick: bool = False
) -> None:
    """Add the device rows to `report`; the simulated device has its own
    (`kvtier.bench.datapath_sim`)."""
    device = resolve_device(device_name)
    cuda = device.type == "cuda"
    layout = "BLHNC" if cuda else "LBHNC"
    # on the CPU the ratio is shown, not judged: a lane copies on its own thread (the forward
    # owns the other cores) while raw copy_ takes every core, so a healthy Llama row measured
    # 0.82-0.86 alone (the old 0.85 target missed 5 of 6 full runs) and 0.58-0.87 beside two
    # CPU hogs; raw on one thread swung 0.73-1.23. The target is a GPU's copy engine's
    ratio = Target("ratio", ">=", GPU_RATIO_TARGET) if cuda else None
    steps = STEP_CHUNKS[device.type]
    note = report.note(
        f"through OffloadWorker on {device} ({layout}, {BLOCK}-token blocks, {CHUNK}-token "
        "chunks), N chunks per step as one SaveOp or LoadOp, fresh keys each round: save = "
        "wait_for_save -> save lane gathers each chunk on the device, one copy to its "
        "memory-tier slot, commit; load = load lane reads the slots into device staging (in "
        "place on the CPU), scatters; raw = N chunk-sized copy_ calls between a contiguous "
        "device buffer and pinned host memory on one side stream; interleaved, median; the "
        "lanes' CPU per GB is in the detail"
        + (
            ""
            if cuda
            else "; on the CPU measured, not judged: a lane copies on one thread, raw copy_ "
            "on every core (the target is a GPU's)"
        )
    )
    lat = report.note(
        "one chunk loaded as its own LoadOp: from start_load_kv to the landed report "
        "(lane wake, copy, scatter, event, commit); raw = one copy_ of the chunk, median"
    )
    for model in MODELS:
        say(f"datapath: {model.name} on {device}, {steps} chunks per step, {reps} rounds")
        tag = f"datapath.{device.type}.{model.tag}"
        with _rig(model, layout, device, max(steps)) as rig:
            for n in steps:
                t = rig.steps(n, reps, warmup)
                nbytes = n * model.chunk_bytes
                cpu = {k: v / (nbytes * (reps + warmup) / 1e9) for k, v in t.lane_cpu_s.items()}
                for what, raw in (("save", t.d2h), ("load", t.h2d)):
                    shown = f"{model.name}: {what}, {n} chunks per step"
                    row = gbps_row(report, f"{tag}.{what}.{n}chunks",
                                   f"{shown} {note}" if (what, n) == ("save", steps[0]) else shown,
                                   nbytes, getattr(t, what), raw, ratio)  # fmt: skip
                    row.detail["lane_cpu_s_per_gb"] = cpu[what]
            wait_reps = reps if quick else max(reps, WAIT_FOR_SAVE_MIN_SAMPLES)
            submit = rig.submit_times(STEP_SAVES, wait_reps, warmup)
            report.add(wait_for_save_row(tag, model.name, submit))
            loads, raws = rig.latency(LATENCY_REPS["quick" if quick else "full"], warmup)
            report.add(
                Row(
                    f"{tag}.load_latency",
                    f"{model.name}: one-chunk load, issue to landed, p50 {lat}",
                    float(np.median(loads)) * 1e3,
                    "ms",
                    detail={
                        "p99_ms": float(np.percentile(loads, 99)) * 1e3,
                        "raw_copy_p50_ms": float(np.median(raws)) * 1e3,
                        "samples": len(loads),
                        "stat": "p50",
                    },
                )
            )
    if cuda:
        for layout_name in FORWARD_LAYOUTS:
            say(f"datapath: forward under a save burst, {layout_name}")
            forward_row(report, device, layout_name, reps=max(6, reps // 3))


@dataclass(frozen=True, slots=True)
class StepTimes:
    """Seconds per round of one step size: the path's save and load, the raw copies, and the
    lanes' CPU seconds over every round (warmup included)."""

    save: list[float]
    load: list[float]
    d2h: list[float]
    h2d: list[float]
    lane_cpu_s: dict[str, float]


class _Rig:
    """One worker over one model's KV pool on the device, with raw buffers of the same size."""

    def __init__(self, model: KVModel, layout: str, device: torch.device, max_chunks: int):
        self.model, self.device = model, device
        self.cuda = device.type == "cuda"
        self.k = CHUNK // BLOCK
        self.max_chunks = max_chunks
        num_blocks = self.k * max_chunks
        n = model.chunk_bytes
        self.metrics = Metrics(0, registry=CollectorRegistry())
        # room for two rounds' chunks: a round's save never evicts what its load reads
        memory = n * (2 * max_chunks + 4)
        self.worker = OffloadWorker(
            KVTierConfig(chunk_size=CHUNK, memory_bytes=memory, load_gate=False),
            rank=0,
            world=1,
            model_id="bench-datapath",
            metrics=self.metrics,
            lookup_endpoint=None,
        )
        views = kv_views(model, layout, num_blocks, device)
        self.worker.register_kv_caches(KVCacheDescription(views, num_blocks, BLOCK, layout))
        self.host = torch.empty(max_chunks * n, dtype=torch.uint8, pin_memory=self.cuda)
        self.dev = torch.empty(max_chunks * n, dtype=torch.uint8, device=device)
        self.side = torch.cuda.Stream(device) if self.cuda else None
        self.keys = Keys(f"datapath-{model.name}")
        self.ops = itertools.count()
        # touch every slot of the tier first (saves then evict, as in service), so no timed
        # copy pays the first-touch page faults of a fresh arena
        stack = self.worker.stack
        assert stack is not None
        for _ in range(-(-stack.memory.num_slots // max_chunks)):
            self.save(max_chunks)

    def blocks(self, n: int) -> list[list[int]]:
        return [list(range(c * self.k, (c + 1) * self.k)) for c in range(n)]

    def save(self, n: int) -> tuple[float, list[ChunkRef]]:
        refs = [ChunkRef(self.keys.next(), b) for b in self.blocks(n)]
        _sync(self.device)
        t = time.perf_counter()
        op = SaveOp(f"sv{next(self.ops)}", "bench", refs, CHUNK * n)
        self.worker.wait_for_save(OffloadMeta(saves=[op]))
        _wait(self.worker)
        return time.perf_counter() - t, refs

    def load(self, refs: list[ChunkRef]) -> float:
        lease = f"bench-lease-{next(self.ops)}"
        stack = self.worker.stack
        assert stack is not None
        if stack.lookup([r.key for r in refs], lease) != len(refs):
            raise RuntimeError("saved chunks left the memory tier during the bench")
        op = LoadOp(f"ld{lease}", "bench", lease, refs, CHUNK * len(refs))
        _sync(self.device)
        t = time.perf_counter()
        self.worker.start_load_kv(OffloadMeta(loads=[op]))
        _wait(self.worker)
        return time.perf_counter() - t

    def forget(self, refs: list[ChunkRef]) -> None:
        stack = self.worker.stack
        assert stack is not None
        stack.forget([r.key for r in refs])

    def raw(self, n: int, to_host: bool) -> float:
        size = self.model.chunk_bytes
        _sync(self.device)
        t = time.perf_counter()
        stream: AbstractContextManager[object] = (
            torch.cuda.stream(self.side) if self.side is not None else nullcontext()
        )
        with stream:
            for c in range(n):
                h = self.host[c * size : (c + 1) * size]
                d = self.dev[c * size : (c + 1) * size]
                (h if to_host else d).copy_(d if to_host else h, non_blocking=self.cuda)
        _sync(self.device)
        return time.perf_counter() - t

    def lane_cpu(self) -> dict[str, float]:
        return {k: self.metrics.value("lane_cpu_seconds_total", lane=k) for k in ("save", "load")}

    def steps(self, n: int, reps: int, warmup: int) -> StepTimes:
        """Save then load `n` fresh chunks per round, the raw copies beside them."""
        saved: list[list[ChunkRef]] = []

        def save() -> float:
            dt, refs = self.save(n)
            saved.append(refs)
            return dt

        def load() -> float:
            # the latest round's chunks (saved first where the rotation puts the load first),
            # then forgotten: every round's save finds room, and the measure is the transfer,
            # not the policy's choice of what a fresh chain may evict
            refs = saved.pop() if saved else self.save(n)[1]
            dt = self.load(refs)
            self.forget(refs)
            return dt

        cpu0 = self.lane_cpu()
        times = interleave(
            {
                "save": save,
                "load": load,
                "d2h": lambda: self.raw(n, True),
                "h2d": lambda: self.raw(n, False),
            },
            warmup,
            warmup + reps,
        )
        cpu1 = self.lane_cpu()
        return StepTimes(
            times["save"], times["load"], times["d2h"], times["h2d"],
            {k: cpu1[k] - cpu0[k] for k in cpu0},
        )  # fmt: skip

    def submit_times(self, n: int, reps: int, warmup: int) -> list[float]:
        """Host seconds inside wait_for_save for a step of `n` saves (the copies run after)."""
        out = []
        for i in range(warmup + reps):
            refs = [ChunkRef(self.keys.next(), b) for b in self.blocks(n)]
            op = SaveOp(f"sv{next(self.ops)}", "bench", refs, CHUNK * n)
            t = time.perf_counter()
            self.worker.wait_for_save(OffloadMeta(saves=[op]))
            if i >= warmup:
                out.append(time.perf_counter() - t)
            _wait(self.worker)
        return out

    def latency(self, reps: int, warmup: int) -> tuple[list[float], list[float]]:
        """One-chunk loads, issue to landed, and raw one-chunk copies, interleaved."""
        _, refs = self.save(1)
        times = interleave(
            {"load": lambda: self.load(refs), "raw": lambda: self.raw(1, False)},
            warmup,
            warmup + reps,
        )
        return times["load"], times["raw"]

    def close(self) -> None:
        self.worker.close()


@contextmanager
def _rig(model: KVModel, layout: str, device: torch.device, max_chunks: int) -> Iterator[_Rig]:
    rig = _Rig(model, layout, device, max_chunks)
    try:
        yield rig
    finally:
        rig.close()


def wait_for_save_row(tag: str, model_name: str, submit: Sequence[float]) -> Row:
    """The p99 host time (ms) of `submit` (seconds per step) against
    `WAIT_FOR_SAVE_MS_TARGET`, judged only from `WAIT_FOR_SAVE_MIN_SAMPLES` steps."""
    row = Row(
        f"{tag}.wait_for_save",
        f"{model_name}: host time in wait_for_save, {STEP_SAVES} chunks per step",
        float(np.percentile(submit, 99)) * 1e3,
        "ms",
        target=Target("value", "<=", WAIT_FOR_SAVE_MS_TARGET),
        detail={"p50_ms": float(np.median(submit)) * 1e3, "samples": len(submit), "stat": "p99"},
    )
    if len(submit) >= WAIT_FOR_SAVE_MIN_SAMPLES:
        return row
    return row.undetermined(f"{len(submit)} steps, judged from {WAIT_FOR_SAVE_MIN_SAMPLES}")


def forward_row(
    report: Report, device: torch.device, layout: str, reps: int, burst: int = 16
) -> Row:
    """The forward's step time (a fixed bf16 matmul loop on the compute stream) with a
    `burst`-chunk save queued after every step, against none, interleaved round by round."""
    model = MODELS[0]
    with _rig(model, layout, device, burst) as rig:
        a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)

        def forward() -> None:
            x = a
            for _ in range(16):
                x = x @ a
            torch.cuda.current_stream(device).synchronize()

        def step(saves: bool) -> float:
            t = time.perf_counter()
            forward()
            if saves:
                refs = [ChunkRef(rig.keys.next(), b) for b in rig.blocks(burst)]
                op = SaveOp(f"sv{next(rig.ops)}", "bench", refs, CHUNK * burst)
                rig.worker.wait_for_save(OffloadMeta(saves=[op]))
            return time.perf_counter() - t

        def window(saves: bool) -> float:
            out = [step(saves) for _ in range(10)]
            _wait(rig.worker)
            return statistics.median(out)

        forward()
        times = interleave({"on": lambda: window(True), "off": lambda: window(False)}, 1, reps + 1)
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    return report.add(
        Row(
            f"datapath.cuda.forward_under_saves.{layout.lower()}",
            f"forward step with a {burst}-chunk save burst per step vs none ({layout}, "
            f"{model.name}), median of {reps} interleaved windows of 10 steps",
            on * 1e3,
            "ms",
            raw=off * 1e3,
            target=Target("ratio", "<=", FORWARD_SLOWDOWN_TARGET),
            detail={"samples": reps, "slowdown_pct": (on / off - 1) * 100},
        )
    )


def _wait(worker: OffloadWorker) -> None:
    if not worker.wait_idle(_IDLE_S):
        raise RuntimeError(f"the worker did not finish a transfer within {_IDLE_S} s")
    report = worker.take_report()
    failed = [r for r in report.results if not r.ok]
    if failed:
        raise RuntimeError(f"a bench transfer failed: {failed[0].reason}")


def summarize(rows: Sequence[dict], judged: bool = True) -> list[tuple[str, str, bool | None]]:
    """The datapath rows of a bench tier report as (check, value, verdict) lines (gpu_check);
    `judged=False` shows every verdict as "-" (the CPU form: its speeds are not a GPU's)."""
    out: list[tuple[str, str, bool | None]] = []
    for r in rows:
        if not r["id"].startswith("datapath."):
            continue
        shown = f"{r['value']:.3g} {r['unit']}"
        if r.get("ratio") is not None:
            shown += f", {r['ratio']:.2f}x raw"
        if r["id"].endswith(".load_latency"):
            d = r["detail"]
            shown += f" (p99 {d['p99_ms']:.3g} ms, raw copy {d['raw_copy_p50_ms']:.3g} ms)"
        verdict = r.get("pass") if judged else None
        out.append((f"bench tier: {r['label'].split(' [')[0]}", shown, verdict))
    return out
