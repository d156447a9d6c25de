"""The device checks of `scripts/gpu-check.sh`, printed as one table.

1. the layout matrix (tests/offload/test_codec.py, test_worker.py) with every KV view on the
   device;
2. the startup self-test through the codec on the device, for the layouts vLLM uses there and
   for a hybrid with a state group (its boundary-state records);
3. `kvtier bench tier --device`'s datapath rows: save and load at 4, 16 and (on a GPU) 64 chunks per
   step against raw pinned copies of the same bytes, a one-chunk load's latency, the host time
   in `wait_for_save`, and the forward's step time under a save burst per layout (the same code
   and bytes as the bench: `kvtier.bench.datapath`);
4. the native engine's two-pass restore at TP=1 on the device: pass 2 from the tier, outputs
   equal to an engine without offload;
5. restore at scale (the Llama-3.1-8B shape): restore vs recompute and vs the raw transfer, the
   first restore vs later ones, the cost model's prediction;
6. layer by layer: half-restored prompts with the load in waves vs whole before the forward.

Every argument a device run passes is checked before anything runs (`plan`), and the CPU form
runs in `make test` (tests/test_gpu_check.py), so an import or argument error cannot wait for
a GPU. Usage: python scripts/gpu_check.py --device cuda|cuda:N|cpu [--quick] [--out DIR].
Exit code 1 on any FAIL, 2 when the device is unusable.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from kvtier.bench import tier
from kvtier.bench.datapath import MODELS, kv_views, resolve_device, run_datapath, summarize
from kvtier.bench.ring_sim import GIL_ARMS, measure_ring
from kvtier.bench.ring_sim import PER_STEP as RING_PER_STEP
from kvtier.bench.ring_sim import STEPS as RING_STEPS
from kvtier.bench.table import Report, write_json
from kvtier.config import KVTierConfig
from kvtier.metrics import Metrics
from kvtier.native import Engine, EngineConfig, SamplingParams
from kvtier.native.modelgen import init_model
from kvtier.native.offload import connector_spec
from kvtier.offload.device import ops_for
from kvtier.offload.groups import FULL, STATE, GroupSpec
from kvtier.offload.pages import KVCacheDescription
from kvtier.offload.worker import OffloadWorker

ROOT = Path(__file__).resolve().parents[1]
Row = tuple[str, str, bool | None]
SELF_TEST_LAYOUTS = ("BLHNC", "LBNHC", "LBHNC")
RESTORE_PROMPTS = 8
RESTORE_CHUNK = 64


@dataclass(frozen=True)
class Plan:
    """Everything a run passes to kvtier, built (and so validated) before any check runs."""

    device: str  # as torch names it: cpu or cuda:N
    engine: EngineConfig
    tier: KVTierConfig
    out: Path
    quick: bool

    @property
    def burst_reps(self) -> int:
        """Repetitions of the ring and GIL bursts: their rows are measured, never judged, and on
        the CPU they only prove the paths run (one rep there saves the suite 10 s)."""
        if not self.device.startswith("cuda"):
            return 1 if self.quick else 3
        return 3 if self.quick else 5


def plan(device_arg: str, out: Path, quick: bool) -> Plan:
    """The run's arguments for `--device device_arg`; ValueError/ConfigError name the fix.
    Needs no GPU: CPU tests build the plans of `cuda`, `cuda:0` and `cuda:1`."""
    kind, _, index = device_arg.partition(":")
    if kind not in ("cpu", "cuda") or (kind == "cpu" and index) or (index and not index.isdigit()):
        raise ValueError(f"--device {device_arg!r}: use cpu, cuda or cuda:N")
    device = "cpu" if kind == "cpu" else f"cuda:{index or 0}"
    engine = EngineConfig(device=device, dtype="bfloat16", num_blocks=512, num_threads=2)
    # exact token counts: its CPU form runs beside the test suite, whose load can make a rank
    # miss the 200 ms default lookup deadline (a lost hit, not a wrong byte)
    restore = KVTierConfig(
        chunk_size=RESTORE_CHUNK, memory_bytes="256MiB", load_gate=False, lookup_timeout_ms=2000
    )
    return Plan(device, engine, restore, out, quick)


def layout_matrix(p: Plan) -> list[Row]:
    env = {**os.environ, "KVTIER_TEST_DEVICE": p.device}
    log = p.out / "layout-matrix.log"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    cmd += ["tests/offload/test_codec.py", "tests/offload/test_worker.py"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    log.write_text(proc.stdout + proc.stderr)
    tail = (proc.stdout.strip().splitlines() or ["no output"])[-1]
    return [(f"layout matrix on {p.device} (pytest)", tail, proc.returncode == 0)]


def self_test(p: Plan) -> list[Row]:
    rows: list[Row] = []
    for layout in SELF_TEST_LAYOUTS:
        for model in MODELS:
            views = kv_views(model, layout, 64, torch.device(p.device))
            worker = OffloadWorker(
                KVTierConfig(chunk_size=256, memory_bytes=model.chunk_bytes * 4),
                rank=0,
                world=1,
                model_id="gpu-check",
                metrics=Metrics(0, registry=CollectorRegistry()),
                lookup_endpoint=None,
            )
            name = f"self-test through the codec: {model.name}, {layout}"
            try:
                t0 = time.perf_counter()
                worker.register_kv_caches(KVCacheDescription(views, 64, 16, layout))
                rows.append((name, f"{time.perf_counter() - t0:.2f} s", True))
            except Exception as e:  # noqa: BLE001 - the row reports it, the check fails
                rows.append((name, f"{type(e).__name__}: {e}"[:160], False))
            finally:
                worker.close()
    return [*rows, state_hybrid_row(p)]


def state_hybrid_row(p: Plan) -> Row:
    """The self-test of a hybrid with a state group: its boundary state's own record through
    the real save and load paths on the device."""
    worker = OffloadWorker(
        KVTierConfig(chunk_size=16, memory_bytes="16MiB"), rank=0, world=1, model_id="gpu-check",
        metrics=Metrics(0, registry=CollectorRegistry()), lookup_endpoint=None,
    )  # fmt: skip
    name = "self-test of a state hybrid (attention + gated-delta-net state records)"
    try:
        t0 = time.perf_counter()
        worker.register_kv_caches(state_hybrid(torch.device(p.device)))
        return (name, f"{time.perf_counter() - t0:.2f} s", True)
    except Exception as e:  # noqa: BLE001 - the row reports it, the check fails
        return (name, f"{type(e).__name__}: {e}"[:160], False)
    finally:
        worker.close()


def state_hybrid(device: torch.device, num_blocks: int = 64) -> KVCacheDescription:
    """A gated-delta-net hybrid's registration as vLLM's CPU runner hands it: one pool whose
    blocks hold either an attention layer's page (bf16 K/V) or a state layer's state (a byte
    view of its page), the state page padded to the attention page."""
    page = 2 * 16 * 2 * 64 * 2  # K and V, 16 tokens, 2 heads of 64, bf16
    pool = torch.zeros(num_blocks, page, dtype=torch.uint8, device=device)
    attention = pool.view(torch.bfloat16).view(num_blocks, 2, 16, 2, 64)
    state = pool[:, : page - 512]  # a block's unpadded state bytes (the same pool)
    groups = (
        GroupSpec(STATE, 16, ("gdn",), detail="gdn_attn state bytes"),
        GroupSpec(FULL, 16, ("attn",)),
    )
    return KVCacheDescription({"gdn": state, "attn": attention}, num_blocks, 16, "LBHNC",
                              groups=groups)  # fmt: skip


def bench(p: Plan) -> list[Row]:
    # bench tier's datapath section itself (its host-only memory, disk and lookup rows are the
    # same on any machine and cost a minute: `kvtier bench tier` runs them)
    plan = tier.QUICK if p.quick else tier.FULL
    report = Report("tier", f"kvtier bench tier --device {p.device}: the datapath rows")
    run_datapath(report, p.device, plan.datapath_reps, plan.datapath_warmup, print, p.quick)
    doc = report.to_json()
    write_json(p.out / "bench-tier.json", doc)
    # on the CPU the rows prove the paths run; their targets are a GPU's, and a 2-core
    # machine's quick medians miss them on noise alone (0.61x once, 0.99x the next step size)
    return summarize(doc["rows"], judged=p.device.startswith("cuda"))


def two_pass(p: Plan) -> list[Row]:
    model = init_model(p.out / "model", dtype="bfloat16")
    g = torch.Generator().manual_seed(3)
    prompts = [
        torch.randint(3, 2000, (5 * RESTORE_CHUNK,), generator=g).tolist()
        for _ in range(RESTORE_PROMPTS)
    ]
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    with Engine(model, p.engine) as plain:
        want = [o.output_token_ids for o in plain.generate(prompts, greedy)]
    spec = connector_spec(p.tier, model, run_dir=p.out / "run")
    with Engine(model, p.engine, spec) as eng:
        first = [o.output_token_ids for o in eng.generate(prompts, greedy)]
        eng.reset_prefix_cache()
        before = eng.stats()
        second = [o.output_token_ids for o in eng.generate(prompts, greedy)]
        after = eng.stats()
    ext = after["external_prefix_cache_hits"] - before["external_prefix_cache_hits"]
    hbm = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    loadable = sum(len(q) - 1 for q in prompts)
    same = first == want and second == want
    return [
        ("two-pass restore: pass-2 tokens from the tier", f"{ext:.0f} of {loadable}",
         ext >= 0.99 * loadable),
        ("two-pass restore: pass-2 HBM hits", f"{hbm:.0f}", hbm == 0),
        ("two-pass restore: outputs equal no-offload", str(same), same),
    ]  # fmt: skip


@dataclass(frozen=True)
class Shape:
    """A Llama shape for the restore rows, and the prompts restored."""

    name: str
    model: dict[str, int]
    prompts: int
    prompt_len: int


# Llama-3.1-8B's shape (128 KiB of bf16 KV per token) with a 32k vocabulary (the KV and the
# layers' compute are the 8B's; only the tokenizer and lm_head are smaller); its CPU form is the
# same code on a small shape
LLAMA_8B = Shape(
    "Llama-3.1-8B shape",
    {"hidden": 4096, "layers": 32, "heads": 32, "kv_heads": 8, "head_dim": 128,
     "intermediate": 14336, "vocab_size": 32000, "max_position": 8192},
    prompts=8, prompt_len=4096,
)  # fmt: skip
SMALL = Shape(
    "small shape (CPU form)",
    {"hidden": 256, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 64,
     "intermediate": 512, "vocab_size": 2048, "max_position": 4096},
    prompts=4, prompt_len=512,
)  # fmt: skip
RESTORE_TO_TRANSFER_TARGET = 1.25
FIRST_TO_LATER_TARGET = 1.2
# the load-or-recompute issue: the cost model predicts a restore within 25%
PREDICTION_TARGET = 1.25


@dataclass(frozen=True)
class Restore:
    """The restore checks' model, engine and prompts (the model is written once per run)."""

    shape: Shape
    model: Path
    engine: EngineConfig
    prompts: list[list[int]]
    nbytes: int  # the prompts' KV
    cuda: bool

    def timed(self, eng: Engine, prompts: list[list[int]] | None = None) -> float:
        """A one-token generate() of `prompts` (default: all) after HBM forgot every prefix."""
        sync = torch.cuda.synchronize if self.cuda else (lambda: None)
        eng.reset_prefix_cache()
        sync()
        t0 = time.perf_counter()
        eng.generate(self.prompts if prompts is None else prompts, ONE)
        sync()
        return time.perf_counter() - t0


ONE = SamplingParams(temperature=0.0, max_tokens=1)
_WRITTEN: dict[Path, str] = {}  # restore models written in this run, by directory


def restore_setup(p: Plan) -> Restore:
    """The Llama-3.1-8B shape on a GPU (the small one on a CPU), written under `p.out`."""
    shape = LLAMA_8B if p.device.startswith("cuda") else SMALL
    path = p.out / "restore-model"
    if _WRITTEN.get(path) != shape.name:  # once per run: an earlier run's may be another shape
        init_model(path, dtype="bfloat16", device=p.device, **shape.model)
        _WRITTEN[path] = shape.name
    m = shape.model
    kv_bytes_per_token = 2 * m["layers"] * m["kv_heads"] * m["head_dim"] * 2
    tokens = shape.prompts * shape.prompt_len
    engine = EngineConfig(
        device=p.device, dtype="bfloat16", num_blocks=-(-tokens // 16) + 64, num_threads=2,
        max_num_batched_tokens=8192, max_num_seqs=shape.prompts,
        max_model_len=shape.prompt_len + 16,
    )  # fmt: skip
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, m["vocab_size"], (shape.prompt_len,), generator=g).tolist()
               for _ in range(shape.prompts)]  # fmt: skip
    return Restore(shape, path, engine, prompts, tokens * kv_bytes_per_token,
                   p.device.startswith("cuda"))  # fmt: skip


def restore(p: Plan) -> list[Row]:
    """A one-token generate() of prompts whose KV left HBM, restored from the memory tier,
    against recomputing them and against the raw transfer of the same bytes; the first restore
    after the saving pass against the later ones."""
    r = restore_setup(p)
    shape, model, engine, cuda, nbytes = r.shape, r.model, r.engine, r.cuda, r.nbytes
    timed = r.timed
    tokens = shape.prompts * shape.prompt_len

    with Engine(model, engine) as plain:
        timed(plain)  # warm: allocator, kernels
        recompute = sorted(timed(plain) for _ in range(2))[0]
    tier = KVTierConfig(chunk_size=256, memory_bytes=int(nbytes * 1.3) + (256 << 20),
                        load_gate=False)  # fmt: skip
    spec = connector_spec(tier, model, run_dir=p.out / "rr")  # short: see layerwise
    with Engine(model, engine, spec) as eng:
        saving = timed(eng)
        before = eng.stats()
        first = timed(eng)
        mid = eng.stats()
        ratio0 = _prediction_ratio(eng)
        later = sorted(timed(eng) for _ in range(3))[1]
        ratio1 = _prediction_ratio(eng)
    loads = ratio1[1] - ratio0[1]
    # the cost model's word on the later restores' loads, after the first restore taught it
    predicted = (ratio1[0] - ratio0[0]) / loads if loads else float("nan")
    hit = mid["external_prefix_cache_hits"] - before["external_prefix_cache_hits"]
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=p.device)
    piece = 32 << 20
    raws = []
    for _ in range(3):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for off in range(0, nbytes, piece):
            dev[off : off + piece].copy_(host[off : off + piece], non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        raws.append(time.perf_counter() - t0)
    raw = sorted(raws)[1]
    what = f"{shape.name}, {shape.prompts} x {shape.prompt_len} tokens, {nbytes / 1e9:.2f} GB"
    judged = cuda  # a CPU's restore and copies share its cores: the targets are a GPU's
    return [
        (f"restore: tokens from the tier ({what})", f"{hit:.0f} of {tokens - shape.prompts}",
         hit >= 0.99 * (tokens - shape.prompts)),
        ("restore vs recompute (one-token generate)",
         f"{later:.3f} s vs {recompute:.3f} s ({later / recompute:.2f}x)", None),
        ("restore / raw pinned transfer of the same bytes",
         f"{later / raw:.2f}x ({later:.3f} s vs {raw:.3f} s, {nbytes / raw / 1e9:.1f} GB/s raw)",
         later / raw <= RESTORE_TO_TRANSFER_TARGET if judged else None),
        ("first restore after the saving pass / later ones",
         f"{first / later:.2f}x ({first:.3f} s vs {later:.3f} s)",
         first / later <= FIRST_TO_LATER_TARGET if judged else None),
        ("saving pass vs offload off", f"{saving:.3f} s vs {recompute:.3f} s "
         f"({(saving / recompute - 1) * 100:+.1f}%)", None),
        ("cost model: a later restore's loads, measured / predicted (mean)",
         f"{predicted:.2f}x over {loads:.0f} loads",
         1 / PREDICTION_TARGET <= predicted <= PREDICTION_TARGET if judged else None),
    ]  # fmt: skip


def layerwise(p: Plan) -> list[Row]:
    """Prompts whose first half is restored from the memory tier and whose second half is new,
    their one-token generate() with the load landing layer by layer (`load_waves` 4: the
    forward over the new half starts after the first wave) against the whole load first (1).
    Both engines are up at once, each saves the halves, then the arms alternate round by
    round, every round with new second halves. On the CPU the copies are synchronous and both
    arms take the same path: its ratio is the machine's noise."""
    r = restore_setup(p)
    half = r.shape.prompt_len // 2
    vocab = r.shape.model["vocab_size"]
    g = torch.Generator().manual_seed(9)
    times: dict[int, list[float]] = {4: [], 1: []}
    with contextlib.ExitStack() as stack:
        engines = {}
        for waves in times:
            tier = KVTierConfig(chunk_size=256, memory_bytes=int(r.nbytes * 0.8) + (256 << 20),
                                load_gate=False, load_waves=waves)  # fmt: skip
            # a short name: the lookup socket's path must fit 107 bytes under a deep --out
            spec = connector_spec(tier, r.model, run_dir=p.out / f"lw{waves}")
            eng = engines[waves] = stack.enter_context(Engine(r.model, r.engine, spec))
            eng.generate([q[:half] for q in r.prompts], ONE)  # the halves into the tier
        for i in range(5):
            tails = [torch.randint(3, vocab, (r.shape.prompt_len - half,), generator=g).tolist()
                     for _ in r.prompts]  # fmt: skip
            prompts = [q[:half] + t for q, t in zip(r.prompts, tails, strict=True)]
            for waves in (4, 1) if i % 2 else (1, 4):
                dt = r.timed(engines[waves], prompts)
                if i:  # the first round warms both paths
                    times[waves].append(dt)
    w4, w1 = sorted(times[4])[1], sorted(times[1])[1]
    note = "" if r.cuda else "; CPU: the same path in both arms"
    return [
        (f"layer by layer: half-restored prompts ({r.shape.name}), load_waves 4 / 1",
         f"{w4 / w1:.2f}x ({w4:.3f} s vs {w1:.3f} s{note})", None),
    ]  # fmt: skip


def ring(p: Plan) -> list[Row]:
    """Issue 41, item 3: a burst of 16 steps' saves (then loads), each step one lane job queued
    behind a busy lane, through workers that keep the transfer ring across jobs and drain it at
    each job's end, arms interleaved (`kvtier.bench.ring_sim`); wall time kept / drained and
    the lanes' CPU per chunk. Measured, not judged: no GPU has run it yet."""
    device = torch.device(p.device)
    got = measure_ring(lambda: ops_for(device), device, p.burst_reps, print)
    rows: list[Row] = []
    for what in ("save", "load"):
        kept, drained = (got.median("seconds", what, arm) for arm in ("kept", "drained"))
        cpu = got.median("lane_us", what, "kept")
        rows.append((
            f"transfer ring kept across steps: a burst of {RING_STEPS} steps x {RING_PER_STEP} "
            f"chunks, {what}, kept / drained",
            f"{kept / drained:.2f}x ({kept * 1e3:.1f} vs {drained * 1e3:.1f} ms; lane CPU "
            f"{cpu:.0f} us a chunk)",
            None,
        ))  # fmt: skip
    return rows


def gil(p: Plan) -> list[Row]:
    """Issue 41, item 6: the same bursts beside a forward thread that runs Python without
    pause, at the interpreter's 5 ms GIL switch interval and at kvtier's `gil_switch_ms`, with
    the burst alone; time over alone, and the forward's slowdown. Measured, not judged."""
    device = torch.device(p.device)
    got = measure_ring(lambda: ops_for(device), device, p.burst_reps, print,
                       arms=GIL_ARMS)  # fmt: skip
    alone_arm, *busy_arms = (a.name for a in GIL_ARMS)
    rows: list[Row] = []
    for what in ("save", "load"):
        alone = got.median("seconds", what, alone_arm)
        parts = []
        for arm in busy_arms:
            t, slow = got.median("seconds", what, arm), got.median("slowdown", what, arm)
            parts.append(f"{arm[5:]}: {t / alone:.2f}x, forward {-100 * slow:+.0f}%")
        rows.append((
            f"GIL: a burst of {RING_STEPS} steps x {RING_PER_STEP} chunks, {what}, beside a "
            "forward running Python, over the burst alone",
            f"{'; '.join(parts)} (alone {alone * 1e3:.1f} ms)",
            None,
        ))  # fmt: skip
    return rows


def _prediction_ratio(eng: Engine) -> tuple[float, float]:
    """The sum and count of every finished load's measured over predicted time so far."""
    m = eng.connector.metrics  # type: ignore[union-attr]
    return m.value("load_prediction_ratio_sum"), m.value("load_prediction_ratio_count")


CHECKS: tuple[tuple[str, Callable[[Plan], list[Row]]], ...] = (
    ("layout matrix", layout_matrix),
    ("self-test", self_test),
    ("bench tier", bench),
    ("two-pass restore", two_pass),
    ("restore at scale", restore),
    ("layer by layer", layerwise),
    ("transfer ring", ring),
    ("gil", gil),
)


def run(p: Plan, only: set[str] | None = None) -> tuple[dict[str, Any], list[Row]]:
    """Every check in order (or the `only` ones); a check that crashes is one FAIL row and the
    rest still run."""
    env: dict[str, Any] = {"torch": torch.__version__, "device": p.device, "quick": p.quick}
    if p.device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(torch.device(p.device))
    rows: list[Row] = []
    t0 = time.perf_counter()
    for name, check in CHECKS:
        if only and name not in only:
            continue
        try:
            rows += check(p)
        except Exception as e:  # noqa: BLE001 - a crashed check is a FAIL row, the rest still run
            with (p.out / "crash.log").open("a") as log:
                log.write(f"--- {name}\n{traceback.format_exc()}")
            rows.append((f"{name}: check crashed", f"{type(e).__name__}: {e}"[:160], False))
    env["elapsed_s"] = round(time.perf_counter() - t0, 1)
    return env, rows


def print_table(env: dict[str, Any], rows: list[Row]) -> None:
    width = max(len(r[0]) for r in rows)
    print(f"\nkvtier gpu-check: {json.dumps(env)}")
    print(f"{'check':<{width}}  {'result':<6}  value")
    for name, value, ok in rows:
        verdict = "-" if ok is None else ("PASS" if ok else "FAIL")
        print(f"{name:<{width}}  {verdict:<6}  {value}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    ap.add_argument("--out", default=str(ROOT / "build" / "gpu-check"))
    ap.add_argument("--quick", action="store_true", help="fewer bench repetitions")
    names = [n for n, _ in CHECKS]
    ap.add_argument(
        "--only", action="append", choices=names, help="run this check only (repeatable)"
    )
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        p = plan(a.device, out, a.quick)
        resolve_device(p.device)
    except ValueError as e:
        print(f"gpu-check: {e}", file=sys.stderr)
        return 2
    env, rows = run(p, set(a.only or ()))
    print_table(env, rows)
    (out / "gpu-check.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    return 0 if all(ok is not False for _, _, ok in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
