"""Hypothesis drives KVTierConnector's scheduler hooks through a real vLLM engine with
arbitrary request ids and token lists (invariant 18): every request ends with its tokens, no
kvtier hook fails, the engine lives. Prompts share prefixes stored in the tier first, and vLLM's
prefix cache is emptied before each example, so lookups, loads and saves all run.
Args (JSON): model, extra, examples.
"""

from __future__ import annotations

import traceback
from typing import Any

from tests.vllm.drivers.common import (
    args,
    emit,
    kv_transfer_config,
    make_llm,
    registry_totals,
    reset_prefix_cache,
)

VOCAB = 2048  # the tiny model's vocabulary


def main() -> None:
    a = args()
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from prometheus_client import REGISTRY
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = make_llm(a["model"], kv_transfer_config(a["extra"]))
    engine = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    # prefixes of one and two whole chunks, stored once: later prompts extend or cut them
    bases = [[(7 * i + 3) % VOCAB for i in range(n)] for n in (256, 512, 700)]
    llm.generate([TokensPrompt(prompt_token_ids=b) for b in bases], sp)

    ids = st.text(min_size=1, max_size=600)  # any unicode, control characters included
    tokens = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=64)
    prompt = st.one_of(
        st.builds(lambda b, cut, tail: bases[b][:cut] + tail,
                  st.integers(0, 2), st.integers(0, 700), tokens),
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=900),
    )  # fmt: skip
    seen: dict[str, Any] = {"examples": 0, "requests": 0}

    @settings(max_examples=a["examples"], deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(st.lists(st.tuples(ids, prompt), min_size=1, max_size=4, unique_by=lambda x: x[0]))
    def run(batch: list[tuple[str, list[int]]]) -> None:
        reset_prefix_cache(llm)
        for rid, p in batch:
            engine.add_request(rid, TokensPrompt(prompt_token_ids=p), sp)
        done: dict[str, int] = {}
        for _ in range(10_000):
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = len(out.outputs[0].token_ids)
        assert sorted(done) == sorted(rid for rid, _ in batch), (sorted(done), batch)
        assert set(done.values()) == {2}, done
        errors = registry_totals(REGISTRY, "hook_errors")
        assert not any(errors.values()), errors
        seen["examples"] += 1
        seen["requests"] += len(batch)

    result: dict[str, Any] = {}
    try:
        run()
    except Exception:  # noqa: BLE001 - the falsifying example goes to the test
        result["failure"] = traceback.format_exc()[-6000:]
    names = ("lookups", "retrieved_tokens", "stored_tokens", "hook_errors")
    totals = {n: registry_totals(REGISTRY, n) for n in names}
    emit({**result, **seen, "totals": totals})


if __name__ == "__main__":
    main()
