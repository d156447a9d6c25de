"""Preemption through vLLM's own path: pass 1 stores the prompts; in pass 2 every request
restores its prefix from the tier and starts decoding, then
`reset_prefix_cache(reset_running_requests=True)` preempts them all and vLLM re-admits them in
the very next step, so each restores again. The greedy outputs must still be pass 1's.

Pass 2 recomputes decoded tokens as a prefill at a point that depends on timing, so no pass of
the same batch shape exists to compare with: the model runs in float32 (bf16 outputs follow the
batch shape and the CPU's kernels; the test builds a float32 model).

A gated-delta-net hybrid runs in bf16 only on vLLM's CPU backend: its test compares counters,
not tokens (`dtype`, `llm_kwargs`).

Args (JSON): model, extra, and optionally n, base_len, max_tokens, decode_before_preempt,
dtype (float32), llm_kwargs.
"""

from __future__ import annotations

import time

from tests.vllm.drivers.common import (
    args,
    delta,
    emit,
    kv_transfer_config,
    llm_metrics,
    make_llm,
    make_prompts,
    registry_totals,
    reset_prefix_cache,
)

# kvtier's families reach vLLM's frontend registry through the connector-stats path
KVTIER_COUNTERS = (
    "retrieved_tokens",
    "readmitted_retrieved_tokens",
    "state_parts_loaded",
    "load_failures",
    "lookup_timeouts",
    "skipped_loads",
)


def kvtier_totals() -> dict[str, float]:
    """kvtier's retrieval counters summed over ranks."""
    from prometheus_client import REGISTRY

    return {n: sum(registry_totals(REGISTRY, n).values()) for n in KVTIER_COUNTERS}


def main() -> None:
    a = args()
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    prompts = make_prompts(a.get("n", 3), a.get("base_len", 600))
    max_tokens = a.get("max_tokens", 24)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm = make_llm(a["model"], kv_transfer_config(a["extra"]), dtype=a.get("dtype", "float32"),
                   **a.get("llm_kwargs", {}))  # fmt: skip
    out1 = [
        list(o.outputs[0].token_ids)
        for o in llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp)
    ]
    reset_prefix_cache(llm)
    m1 = llm_metrics(llm)
    k1 = kvtier_totals()

    engine = llm.llm_engine
    ids = [f"pre{i}" for i in range(len(prompts))]
    # every step's tokens, so the driver sees decoding start (LLM.generate asks for final only)
    sp2 = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        output_kind=RequestOutputKind.CUMULATIVE,
    )
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, TokensPrompt(prompt_token_ids=p), sp2)
    decoded = dict.fromkeys(ids, 0)
    final: dict[str, list[int]] = {}
    preempted_at: dict[str, int] | None = None
    # wall-time deadline: loads run on the workers' load lanes, not inside engine steps
    deadline = time.monotonic() + 120.0
    while engine.has_unfinished_requests():
        if time.monotonic() > deadline:
            raise RuntimeError("pass 2 did not finish within 120 s")
        for o in engine.step():
            decoded[o.request_id] = len(o.outputs[0].token_ids)
            if o.finished:
                final[o.request_id] = list(o.outputs[0].token_ids)
        if preempted_at is None and min(decoded.values()) >= a.get("decode_before_preempt", 4):
            preempted_at = dict(decoded)
            if not engine.reset_prefix_cache(reset_running_requests=True):
                raise RuntimeError("vLLM could not preempt its running requests")
    m2 = llm_metrics(llm)
    k2 = kvtier_totals()
    emit(
        {
            "prompt_lens": [len(p) for p in prompts],
            "out1": out1,
            "out2": [final[rid] for rid in ids],
            "preempted_at": preempted_at,
            "pass2": delta(m2, m1),
            "kvtier2": delta(k2, k1),
        }
    )


if __name__ == "__main__":
    main()
