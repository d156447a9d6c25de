"""One arm of the hybrid-model comparison behind docs/hybrid.md: a model's prompts run twice,
vLLM's own prefix cache reset between the passes, through kvtier, vLLM's OffloadingConnector, or
no connector. Prints each pass's wall time (one output token: time to first token of the batch),
vLLM's external hit counters, and whether pass 2's greedy outputs are those of a pass served by
vLLM's own prefix cache at the same boundaries (its batch shape). Run by hand, one arm per process:

    .venv-vllm/bin/python tests/vllm/drivers/hybrid_compare.py '{"model": DIR, "arm": "kvtier"}'

Args (JSON): model, arm (kvtier | offloading | none), serial (outputs compared one prompt
per call), chunk (a multiple of vLLM's block size,
which a larger state page raises: 640 for docs/hybrid.md's model), n, base_len, repeats,
llm_kwargs.
Needs VLLM_ENABLE_V1_MULTIPROCESSING=0 and VLLM_CPU_KVCACHE_SPACE (tests/vllm/conftest.py).
"""

from __future__ import annotations

import time
from typing import Any

from tests.vllm.drivers.common import (
    args,
    delta,
    emit,
    kv_transfer_config,
    llm_metrics,
    make_llm,
    make_prompts,
    reset_prefix_cache,
)


def connector(arm: str, chunk: int) -> dict[str, Any] | None:
    """The arm's kv_transfer_config (None: vLLM alone)."""
    if arm == "kvtier":
        return kv_transfer_config({"memory_bytes": "512MiB", "chunk_size": chunk,
                                   "load_gate": False})  # fmt: skip
    if arm == "offloading":
        return {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": 512 << 20, "block_size": chunk},
        }
    if arm == "none":
        return None
    raise ValueError(f"arm {arm!r} is not kvtier, offloading or none")


def main() -> None:
    a = args()
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = make_llm(a["model"], connector(a["arm"], a.get("chunk", 256)), mamba_cache_mode="align",
                   **a.get("llm_kwargs", {}))  # fmt: skip
    ttft = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    rounds = []
    for r in range(a.get("repeats", 3)):
        # fresh prompts each round: nothing of an earlier round is in any cache
        prompts = make_prompts(a.get("n", 3), a.get("base_len", 600), seed=100 + r)
        batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]

        def outputs(sp: SamplingParams, batch: list[TokensPrompt] = batch) -> list[list[int]]:
            # serial: one prompt per call, so a restore's batch is the HBM hit's batch (a batch
            # of parked loads lands in steps that depend on timing)
            if a.get("serial"):
                return [list(llm.generate([p], sp)[0].outputs[0].token_ids) for p in batch]
            return [list(o.outputs[0].token_ids) for o in llm.generate(batch, sp)]

        t0 = time.perf_counter()
        llm.generate(batch, full)
        t1 = time.perf_counter()
        # vLLM's own prefix cache at the same boundaries: the batch shape of a tier restore
        out_hbm = outputs(full)
        reset_prefix_cache(llm)
        if a["arm"] == "offloading":
            time.sleep(1.0)  # its stores complete asynchronously, with no completion signal
        m1 = llm_metrics(llm)
        t2 = time.perf_counter()
        llm.generate(batch, ttft)
        t3 = time.perf_counter()
        m_ttft = llm_metrics(llm)
        reset_prefix_cache(llm)
        out2 = outputs(full)
        m2 = llm_metrics(llm)
        rounds.append({
            "prompt_lens": [len(p) for p in prompts],
            "pass1_s": round(t1 - t0, 3),
            "pass2_first_token_s": round(t3 - t2, 3),
            "pass2_first_token": delta(m_ttft, m1),
            "pass2": delta(m2, m_ttft),
            "same_output_as_hbm_hit": out2 == out_hbm,
        })  # fmt: skip
    emit({"arm": a["arm"], "rounds": rounds})


if __name__ == "__main__":
    main()
