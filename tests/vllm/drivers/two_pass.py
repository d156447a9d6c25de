"""Two-pass restore through `vllm.LLM` with KVTierConnector.

Pass 1 stores every prompt's whole chunks in the tier; `reset_prefix_cache()` empties vLLM's
own prefix cache; pass 2 must get its prefix from the tier. Prints greedy outputs of both
passes, vLLM's cache counters per pass and kvtier's counters as vLLM's own Prometheus registry
holds them (every rank, through the connector-stats path). Args (JSON): model, tp, pp, dp, extra,
and optionally connector, module, n, base_len, max_tokens, async_scheduling (vLLM's default on
GPUs, which its CPU platform turns off: the driver turns it back on after the platform hook),
serial (one prompt per `generate` call in both passes: a request that recomputes after a failed
load then runs alone, as in pass 1, instead of lagging a batch whose shape pass 1 never had),
llm_kwargs (more `LLM` arguments, e.g. disable_hybrid_kv_cache_manager), dtype (bfloat16),
hbm_pass (pass 1's prompts again before the reset, from vLLM's own prefix cache: `out_hbm`),
hbm_after (that pass after pass 2 instead, from the prefix cache pass 2's restore filled: then
every record pass 2 reads was stored by pass 1, a prompt's first sight),
corrupt_pass3 (a third pass from the tier whose first load's record a CorruptingKVTierConnector
subclass corrupts: `out3`; in-process engines only).
"""

from __future__ import annotations

import time

from tests.vllm.drivers.common import (
    args,
    delta,
    emit,
    kv_transfer_config,
    llm_metrics,
    make_prompts,
    registry_totals,
    reset_prefix_cache,
)

KVTIER_COUNTERS = (
    "retrieved_tokens",
    "stored_tokens",
    "stored_bytes",
    "save_failures",
    "load_failures",
    "verify_failures",
    "skipped_loads",
    "lookup_hit_tokens",
    "sync_loads",
    "state_parts_stored",
    "state_parts_loaded",
)


def force_async_scheduling() -> None:
    """Async scheduling on the CPU platform, as a GPU host runs by default: the platform hook
    turns it off, so turn it on again right after (vLLM reads it from here on)."""
    from vllm.platforms.cpu import CpuPlatform

    update = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def check_and_update_config(cls: type, vllm_config: object) -> None:
        update(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True  # type: ignore[attr-defined]

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign,assignment]


def scheduler_name(llm: object) -> str:
    """The engine's scheduler class (in-process engines only; "" otherwise)."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    sched = getattr(getattr(core, "engine_core", None), "scheduler", None)
    return "" if sched is None else type(sched).__name__


def kv_cache_groups(llm: object) -> list[str]:
    """The spec class of each of the engine's KV cache groups (in-process engines only)."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    sched = getattr(getattr(core, "engine_core", None), "scheduler", None)
    config = getattr(sched, "kv_cache_config", None)
    groups = getattr(config, "kv_cache_groups", None) or ()
    return [type(g.kv_cache_spec).__name__ for g in groups]


def main() -> None:
    a = args()
    if a.get("async_scheduling"):
        force_async_scheduling()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = make_prompts(a.get("n", 3), a.get("base_len", 600))
    sp = SamplingParams(temperature=0.0, max_tokens=a.get("max_tokens", 16), ignore_eos=True)
    ktc = kv_transfer_config(
        a["extra"],
        connector=a.get("connector", "KVTierConnector"),
        module=a.get("module", "kvtier.vllm"),
    )
    t0 = time.perf_counter()
    llm = LLM(
        model=a["model"],
        dtype=a.get("dtype", "bfloat16"),
        max_model_len=2048,
        tensor_parallel_size=a.get("tp", 1),
        pipeline_parallel_size=a.get("pp", 1),
        data_parallel_size=a.get("dp", 1),
        enforce_eager=True,
        enable_prefix_caching=True,
        seed=0,
        disable_log_stats=False,
        kv_transfer_config=ktc,
        **a.get("llm_kwargs", {}),
    )
    t1 = time.perf_counter()

    def generate(ps: list[list[int]]) -> list[list[int]]:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], sp)
        return [list(o.outputs[0].token_ids) for o in outs]

    def run() -> list[list[int]]:
        if a.get("serial"):
            return [generate([p])[0] for p in prompts]
        return generate(prompts)

    corrupting = None
    if a.get("corrupt_pass3"):
        # the in-process engine's connector class: its corruption waits for pass 3
        from tests.vllm.drivers.faulty_connectors import CorruptingKVTierConnector as corrupting

        corrupting.armed = False
    m0 = llm_metrics(llm)
    out1 = run()
    m1 = llm_metrics(llm)
    out_hbm: list[list[int]] = []
    if a.get("hbm_pass"):
        # the same prompts from vLLM's own prefix cache: the batch shape of a tier restore
        # that ends at the same boundaries (the reference a bf16-only model is compared with)
        out_hbm = run()
        m1 = llm_metrics(llm)
    reset_prefix_cache(llm)
    t2 = time.perf_counter()
    out2 = run()
    m2 = llm_metrics(llm)
    t3 = time.perf_counter()
    if a.get("hbm_after"):
        out_hbm = run()
    out3: list[list[int]] = []
    m3 = m2
    if corrupting is not None:
        # pass 3: the tier again, its first load's record corrupted on the rank
        reset_prefix_cache(llm)
        corrupting.armed = True
        out3 = run()
        m3 = llm_metrics(llm)

    # kvtier's families reach vLLM's frontend registry through the connector-stats path
    from prometheus_client import REGISTRY

    emit(
        {
            "prompt_lens": [len(p) for p in prompts],
            "out1": out1,
            "out2": out2,
            "out_hbm": out_hbm,
            "out3": out3,
            "pass3": delta(m3, m2),
            "pass1": delta(m1, m0),
            "pass2": delta(m2, m1),
            "kvtier": {name: registry_totals(REGISTRY, name) for name in KVTIER_COUNTERS},
            "async_scheduling": bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling),
            "scheduler": scheduler_name(llm),
            "kv_cache_groups": kv_cache_groups(llm),
            "init_s": round(t1 - t0, 2),
            "pass2_s": round(t3 - t2, 2),
        }
    )


if __name__ == "__main__":
    main()
