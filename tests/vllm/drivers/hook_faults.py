"""Each kvtier hook raises in turn inside one vLLM engine (invariant 18): per hook, a pass
stores the prompts (a new namespace epoch first), vLLM's prefix cache is reset, and a pass
restores them; the hook raises for the victim request (or once, for a rank's own bookkeeping:
last, as that turns the tier off on the rank). Float32: the victim recomputes behind the
others, a batch shape no pass without the fault has. Prints, per hook, both passes' outputs,
the restore pass's external hits and the hook error counters; then a last pass.
Args (JSON): model, extra, hooks.
"""

from __future__ import annotations

from typing import Any

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
from tests.vllm.drivers.faulty_connectors import HookFaultKVTierConnector


def main() -> None:
    a = args()
    from prometheus_client import REGISTRY
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    ktc = kv_transfer_config(
        a["extra"],
        connector="HookFaultKVTierConnector",
        module="tests.vllm.drivers.faulty_connectors",
    )
    llm = make_llm(a["model"], ktc, dtype="float32")
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def run(ps: list[list[int]]) -> list[list[int]]:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], sp)
        return [list(o.outputs[0].token_ids) for o in outs]

    result: dict[str, Any] = {}
    for i, hook in enumerate(a["hooks"]):
        prompts = make_prompts(3, 300, step=7, seed=100 + i)
        reset_prefix_cache(llm, reset_connector=True)
        # the victim is the second request of whichever pass the hook fires in
        HookFaultKVTierConnector.fault = {"hook": hook, "victim": _victim_prefix(llm, 1)}
        store = run(prompts)
        reset_prefix_cache(llm)
        m0 = llm_metrics(llm)
        HookFaultKVTierConnector.fault = {"hook": hook, "victim": _victim_prefix(llm, 1)}
        restore = run(prompts)
        m1 = llm_metrics(llm)
        HookFaultKVTierConnector.fault = {}
        result[hook] = {
            "store": store,
            "restore": restore,
            "hits": delta(m1, m0).get("vllm:external_prefix_cache_hits", 0.0),
            "errors": registry_totals(REGISTRY, "hook_errors"),
        }
    last = make_prompts(3, 300, step=7, seed=99)
    result["last"] = {"a": run(last), "b": run(last)}
    emit(result)


def _victim_prefix(llm: Any, offset: int) -> str:
    """The start of the id vLLM gives the `offset`-th request of the next generate call: LLM
    numbers requests with a counter, and the engine appends `-` and 8 random characters."""
    return f"{llm.request_counter.counter + offset}-"


if __name__ == "__main__":
    main()
