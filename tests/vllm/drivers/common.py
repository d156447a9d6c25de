"""Helpers shared by the vLLM driver scripts (they run under .venv-vllm, never under pytest).

A driver prints exactly one `KVTIER_RESULT {json}` line on stdout; vLLM logs go to stdout and
stderr around it, kvtier's log lines to stderr.
"""

from __future__ import annotations

import json
import random
import sys
from collections import defaultdict
from typing import Any

RESULT_PREFIX = "KVTIER_RESULT "

# vLLM counters read by the drivers (LLM.get_metrics() drops the `_total` suffix)
CACHE_METRICS = (
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:external_prefix_cache_queries",
    "vllm:external_prefix_cache_hits",
    "vllm:prompt_tokens_cached",
    "vllm:num_preemptions",
)


def emit(result: dict[str, Any]) -> None:
    """Print the driver's one result line."""
    sys.stdout.flush()
    print(RESULT_PREFIX + json.dumps(result, sort_keys=True), flush=True)


def args() -> dict[str, Any]:
    """The driver's arguments: one JSON object in argv[1]."""
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: {sys.argv[0]} '<json args>'")
    return json.loads(sys.argv[1])


def make_prompts(n: int, base_len: int, step: int = 37, seed: int = 0) -> list[list[int]]:
    """`n` distinct random prompts (token ids in [3, 2048)), lengths base_len + i*step."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 2048) for _ in range(base_len + i * step)] for i in range(n)]


def kv_transfer_config(
    extra: dict[str, Any],
    connector: str = "KVTierConnector",
    module: str = "kvtier.vllm",
) -> dict[str, Any]:
    """The kv_transfer_config that loads kvtier (or a test subclass) out of tree."""
    return {
        "kv_connector": connector,
        "kv_connector_module_path": module,
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def llm_metrics(llm: Any) -> dict[str, float]:
    """vLLM's cache counters of an `LLM`, plus `by_source:<source>` from the labelled counter."""
    out: dict[str, float] = defaultdict(float)
    for m in llm.get_metrics():
        value = getattr(m, "value", None)
        if value is None:
            continue
        if m.name in CACHE_METRICS:
            out[m.name] += float(value)
        elif m.name == "vllm:prompt_tokens_cached_by_source":
            out[f"by_source:{m.labels.get('source', '?')}"] += float(value)
    return dict(out)


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """Per-key difference of two metric snapshots."""
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in sorted(set(after) | set(before))}


def exception_chain(exc: BaseException | None) -> list[str]:
    """`module.Type: message` for an exception and its causes, outermost first."""
    chain: list[str] = []
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        chain.append(f"{type(exc).__module__}.{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
    return chain


def registry_totals(registry: Any, name: str) -> dict[str, float]:
    """Samples of `kvtier_<name>_total` in a prometheus registry, keyed by kvtier's labels
    (vLLM's `model_name`/`engine` labels dropped)."""
    out: dict[str, float] = {}
    for metric in registry.collect():
        for s in metric.samples:
            if s.name == f"kvtier_{name}_total":
                labels = {k: v for k, v in s.labels.items() if k not in ("model_name", "engine")}
                key = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
                out[key] = out.get(key, 0.0) + float(s.value)
    return out


def reset_prefix_cache(llm: Any, timeout_s: float = 60.0, **kw: bool) -> None:
    """`llm.reset_prefix_cache(**kw)`, stepping the engine until vLLM takes it: `generate`
    returns while kvtier's last saves still copy, and their blocks are freed only when a later
    engine step reports them finished (vLLM steps an idle engine for that)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not llm.reset_prefix_cache(**kw):
        if time.monotonic() > deadline:
            raise RuntimeError(f"vLLM refused reset_prefix_cache({kw}) for {timeout_s:g} s")
        llm.llm_engine.step()
        time.sleep(0.005)  # a poll interval while the save lane finishes its copies


def kernel_report() -> dict[str, Any]:
    """Which CPU kernels this process runs: ATen's capability and the vLLM kernel library
    loaded (`_C`: AVX-512 BF16 or AMX, `_C_AVX512`, `_C_AVX2`)."""
    import re

    import torch

    with open("/proc/self/maps") as maps:
        libs = set(re.findall(r"vllm/(_C[A-Z0-9_]*)\.abi3\.so", maps.read()))
    return {"torch_capability": torch.backends.cpu.get_cpu_capability(), "vllm_libs": sorted(libs)}


def make_llm(model: str, kv_transfer_config: dict[str, Any] | None, **kw: Any) -> Any:
    """`vllm.LLM` on the tiny model the way every driver runs it (bf16, eager, prefix caching,
    stats on, seed 0), with `kw` on top."""
    from vllm import LLM

    base: dict[str, Any] = {
        "model": model,
        "dtype": "bfloat16",
        "max_model_len": 2048,
        "enforce_eager": True,
        "enable_prefix_caching": True,
        "seed": 0,
        "disable_log_stats": False,
        "kv_transfer_config": kv_transfer_config,
    }
    return LLM(**{**base, **kw})
