"""One side of a prefill/decode hand-off through the shared tier: a `kv_producer` engine
prefills (and decodes, to give the reference output) and saves, never loads; a `kv_consumer`
engine in another process loads the prefix the producer stored and decodes, never saves.
The producer returns once the shared store holds every chunk it wrote.
Args (JSON): model, extra (with remote_url), role, expect_keys (producer).
"""

from __future__ import annotations

import time

from tests.vllm.drivers.common import args, emit, kv_transfer_config, llm_metrics, make_prompts


def main() -> None:
    a = args()
    import redis
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = make_prompts(3, 600, seed=11)
    # float32: the consumer computes only the tails, in another batch shape than the
    # producer's whole prompts; bf16 greedy ties flipped its 16th token once in a full run
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ktc = {**kv_transfer_config(a["extra"]), "kv_role": a["role"]}
    llm = LLM(
        model=a["model"], dtype="float32", max_model_len=2048, enforce_eager=True,
        enable_prefix_caching=True, seed=0, disable_log_stats=False, kv_transfer_config=ktc,
    )  # fmt: skip
    store = redis.Redis.from_url(a["extra"]["remote_url"])
    keys_before = store.dbsize()
    m0 = llm_metrics(llm)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp)
    m1 = llm_metrics(llm)
    if a["role"] == "kv_producer":
        # write-behind is asynchronous: wait (bounded) until the store holds every chunk
        deadline = time.monotonic() + 60
        while store.dbsize() < a["expect_keys"] and time.monotonic() < deadline:
            time.sleep(0.05)
    emit(
        {
            "out": [list(o.outputs[0].token_ids) for o in outs],
            "cached": [o.num_cached_tokens for o in outs],
            "metrics": {k: m1.get(k, 0) - m0.get(k, 0) for k in m1},
            "keys_before": keys_before,
            "keys_after": store.dbsize(),
            "prompt_lens": [len(p) for p in prompts],
        }
    )


if __name__ == "__main__":
    main()
