"""KVTierConnector as a MultiConnector child (first, so it serves loads) next to vLLM's
ExampleConnector, with a corrupted chunk in pass 2: with the parent's kv_load_failure_policy
set to recompute as documented, the failed tier load is recomputed and the outputs are right;
with the parent left at "fail", kvtier says so at startup and exports the gauge doctor reads.
Args (JSON): model, extra, example_dir, parent_policy ("recompute" | "fail").
"""

from __future__ import annotations

from tests.vllm.drivers.common import (
    args,
    emit,
    make_llm,
    make_prompts,
    registry_totals,
    reset_prefix_cache,
)


def main() -> None:
    a = args()
    from prometheus_client import REGISTRY
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = make_prompts(3, 600)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ktc = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": a["parent_policy"],
        "kv_connector_extra_config": {
            "connectors": [
                {
                    "kv_connector": "CorruptingKVTierConnector",
                    "kv_connector_module_path": "tests.vllm.drivers.faulty_connectors",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {**a["extra"], "verify_memory_reads": True},
                },
                {
                    "kv_connector": "ExampleConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"shared_storage_path": a["example_dir"]},
                },
            ]
        },
    }
    llm = make_llm(
        a["model"],
        ktc,
    )

    def run() -> tuple[list[list[int]], list[str | None]]:
        # one prompt per call in both passes: the request that recomputes after the corrupted
        # load runs alone, as in pass 1, not behind a batch of a shape pass 1 never had
        outs = [llm.generate([TokensPrompt(prompt_token_ids=p)], sp)[0] for p in prompts]
        return (
            [list(o.outputs[0].token_ids) for o in outs],
            [o.outputs[0].finish_reason for o in outs],
        )

    out1, why1 = run()
    gauge: dict[str, float] = {}
    for metric in REGISTRY.collect():
        for s in metric.samples:
            if s.name == "kvtier_load_failure_fails_request":
                gauge[s.labels.get("rank", "?")] = float(s.value)
    result = {"out1": out1, "why1": why1, "fails_request": gauge}
    if a["parent_policy"] == "recompute":
        reset_prefix_cache(llm)
        out2, why2 = run()
        result.update(out2=out2, why2=why2, verify=registry_totals(REGISTRY, "verify_failures"))
    emit(result)


if __name__ == "__main__":
    main()
