"""A sliding-window hybrid whose saves are still in flight when vLLM hands their window blocks
to other requests: pass 1 runs with every save held back until its `generate` returned (the
save lane waits on a gate), on a small block pool with chunked prefill, so vLLM frees each
request's out-of-window blocks and reallocates them while the saves that read them wait. kvtier
must cancel those saves (no byte read after the reuse commits); pass 2, after a prefix-cache
reset, restores what was committed of the prompts' first `cut` tokens (a hit there reads the
window blocks pass 1 lost first) and must decode what pass 3 decodes: the same prompts, same
batch, recomputed after a connector reset (float32).

`no_cancel` turns kvtier's cancel off (the scheduler never hears of the reallocations): the
mutation that shows the test sees wrong bytes. Args (JSON): model, extra, no_cancel, n,
base_len, cut, blocks, batch. Needs VLLM_ENABLE_V1_MULTIPROCESSING=0 (the worker in process).
"""

from __future__ import annotations

import threading

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

GATE_TIMEOUT_S = 120.0


def main() -> None:
    a = args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtier.offload.saving import SavePath
    from kvtier.offload.scheduler import OffloadScheduler

    gate = threading.Event()
    gate.set()
    issue = SavePath._issue

    def held_issue(self, lane, flights, run, ref):  # type: ignore[no-untyped-def]
        # every chunk's gather waits here, before it reads a block; the self-test's save runs
        # at startup with the gate open
        if not gate.wait(GATE_TIMEOUT_S):
            raise RuntimeError("the save gate never opened")
        return issue(self, lane, flights, run, ref)

    SavePath._issue = held_issue  # type: ignore[method-assign]
    if a.get("no_cancel"):
        OffloadScheduler.blocks_allocated = lambda self, block_ids: None  # type: ignore[method-assign]

    prompts = make_prompts(a.get("n", 3), a.get("base_len", 1100))
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm = LLM(
        model=a["model"],
        dtype="float32",
        max_model_len=2048,
        enforce_eager=True,
        enable_prefix_caching=True,
        seed=0,
        disable_log_stats=False,
        kv_transfer_config=kv_transfer_config(a["extra"]),
        num_gpu_blocks_override=a.get("blocks", 48),
        max_num_batched_tokens=a.get("batch", 256),
    )

    def generate(ps: list[list[int]]) -> list[list[int]]:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], sp)
        return [list(o.outputs[0].token_ids) for o in outs]

    m0 = llm_metrics(llm)
    gate.clear()
    out1 = generate(prompts)
    gate.set()
    m1 = llm_metrics(llm)
    reset_prefix_cache(llm)
    cut = [p[: a.get("cut", 600)] for p in prompts]
    out2 = generate(cut)
    m2 = llm_metrics(llm)
    # the reference: the same prompts in one call, nothing in the tier (a new namespace epoch)
    reset_prefix_cache(llm, reset_connector=True)
    out3 = generate(cut)
    m3 = llm_metrics(llm)
    from prometheus_client import REGISTRY

    emit(
        {
            "prompt_lens": [len(p) for p in prompts],
            "out1": out1,
            "out2": out2,
            "out3": out3,
            "pass1": delta(m1, m0),
            "pass2": delta(m2, m1),
            "pass3": delta(m3, m2),
            "kvtier": {
                name: registry_totals(REGISTRY, name)
                for name in ("retrieved_tokens", "stored_tokens", "save_failures", "load_failures")
            },
        }
    )


if __name__ == "__main__":
    main()
