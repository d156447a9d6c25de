"""The device checks of `scripts/gpu-check.sh`, printed as one table.

1. the layout matrix (tests/offload/test_codec.py) with every KV view on the device;
2. the startup self-test through the codec on the device, for the layouts vLLM uses there;
3. `kvtier bench tier --device` (save/load through the real path vs a raw pinned copy);
4. the native engine's two-pass restore at TP=1 on the device: pass 2 from the tier, outputs
   equal to an engine without offload;
5. the transfer pipeline (`scripts/gpu_pipeline.py`): a step's 64-chunk save and load in GB/s
   against raw pinned cudaMemcpyAsync of the same bytes, the copy lanes' CPU time per GB, and
   the forward's step time with offload on (a save burst per step) vs off.

Usage: python scripts/gpu_check.py --device cuda|cpu [--out DIR]. Exit code 1 on any FAIL.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
Row = tuple[str, str, bool | None]


def layout_matrix(device: str, out: Path) -> Row:
    env = {**os.environ, "KVTIER_TEST_DEVICE": device}
    log = out / "layout-matrix.log"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    cmd += ["tests/offload/test_codec.py", "tests/offload/test_worker.py"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    log.write_text(proc.stdout + proc.stderr)
    tail = (proc.stdout.strip().splitlines() or ["no output"])[-1]
    return (f"layout matrix on {device} (pytest)", tail, proc.returncode == 0)


def self_test(device: str) -> list[Row]:
    from prometheus_client import CollectorRegistry

    from kvtier.bench.datapath import MODELS, kv_views
    from kvtier.config import KVTierConfig
    from kvtier.metrics import Metrics
    from kvtier.offload.pages import KVCacheDescription
    from kvtier.offload.worker import OffloadWorker

    rows: list[Row] = []
    for layout in ("BLHNC", "LBHNC"):
        for model in MODELS:
            views = kv_views(model, layout, 64, torch.device(device))
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
    return rows


def bench(device: str, out: Path, quick: bool) -> list[Row]:
    from kvtier.bench import tier

    doc = tier.run(quick=quick, json_path=out / "bench-tier.json", disk_dir=out, device=device)
    rows: list[Row] = []
    for r in doc["rows"]:
        if not r["id"].startswith("datapath."):
            continue
        ratio = f", {r['ratio']:.2f}x raw" if r["ratio"] is not None else ""
        rows.append(
            (
                f"bench: {r['label'].split(' [')[0]}",
                f"{r['value']:.3g} {r['unit']}{ratio}",
                r["pass"],
            )
        )
    return rows


def two_pass(device: str, out: Path) -> list[Row]:
    from kvtier.config import KVTierConfig
    from kvtier.native import Engine, EngineConfig, SamplingParams
    from kvtier.native.modelgen import init_model
    from kvtier.native.offload import connector_spec

    model = init_model(out / "model", dtype="bfloat16")
    cfg = EngineConfig(device=device, dtype="bfloat16", num_blocks=512, num_threads=2)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 2000, (5 * 64,), generator=g).tolist() for _ in range(8)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    with Engine(model, cfg) as plain:
        want = [o.output_token_ids for o in plain.generate(prompts, greedy)]
    tier = KVTierConfig(chunk_size=64, memory_bytes="256MiB", load_gate=False)
    spec = connector_spec(tier, model, run_dir=out / "run")
    with Engine(model, cfg, spec) as eng:
        first = [o.output_token_ids for o in eng.generate(prompts, greedy)]
        eng.reset_prefix_cache()
        before = eng.stats()
        second = [o.output_token_ids for o in eng.generate(prompts, greedy)]
        after = eng.stats()
    ext = after["external_prefix_cache_hits"] - before["external_prefix_cache_hits"]
    hbm = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    loadable = sum(len(p) - 1 for p in prompts)
    return [
        (
            "two-pass restore: pass-2 tokens from the tier",
            f"{ext:.0f} of {loadable}",
            ext >= 0.99 * loadable,
        ),
        ("two-pass restore: pass-2 HBM hits", f"{hbm:.0f}", hbm == 0),
        (
            "two-pass restore: outputs equal no-offload",
            str(first == want and second == want),
            first == want and second == want,
        ),
    ]


def pipeline(device: str) -> list[Row]:
    sys.path.insert(0, str(ROOT / "scripts"))
    from gpu_pipeline import pipeline_rows

    return pipeline_rows(device)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    p.add_argument("--out", default=str(ROOT / "build" / "gpu-check"))
    p.add_argument("--quick", action="store_true", help="quick bench (fewer repetitions)")
    a = p.parse_args()
    device = "cuda:0" if a.device == "cuda" else a.device
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    env: dict[str, Any] = {"torch": torch.__version__, "device": device}
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            print(
                f"--device {device}: torch {torch.__version__} sees no CUDA device", file=sys.stderr
            )
            return 2
        env["gpu"] = torch.cuda.get_device_name(torch.device(device))
    rows: list[Row] = []
    t0 = time.perf_counter()
    for step in (
        lambda: [layout_matrix(device, out)],
        lambda: self_test(device),
        lambda: bench(device, out, a.quick),
        lambda: two_pass(device, out),
        lambda: pipeline(device),
    ):
        try:
            rows += step()
        except Exception as e:  # noqa: BLE001 - a crashed check is a FAIL row, the rest still run
            (out / "crash.log").open("a").write(traceback.format_exc())
            rows.append(("check crashed", f"{type(e).__name__}: {e}"[:160], False))
    env["elapsed_s"] = round(time.perf_counter() - t0, 1)
    width = max(len(r[0]) for r in rows)
    print(f"\nkvtier gpu-check: {json.dumps(env)}")
    print(f"{'check':<{width}}  {'result':<6}  value")
    for name, value, ok in rows:
        verdict = "-" if ok is None else ("PASS" if ok else "FAIL")
        print(f"{name:<{width}}  {verdict:<6}  {value}")
    (out / "gpu-check.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    return 0 if all(ok is not False for _, _, ok in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
