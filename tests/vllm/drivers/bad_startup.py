"""Start `vllm.LLM` with KVTierConnector under a config that must not start.

A wrong topology or layout must stop startup (never serve a write-only tier). Prints whether
the engine came up and the exception chain. Args (JSON): model, tp, extra, `codec_fault`
(the codec writes no block; needs VLLM_ENABLE_V1_MULTIPROCESSING=0 so the worker is in process),
`load_format` (`dummy`: random weights for a model directory holding only its config),
`llm_kwargs` (more `LLM` arguments), `no_connector` (vLLM alone) and `generate` (one prompt
after startup: whether vLLM itself can serve the configuration).
"""

from __future__ import annotations

from tests.vllm.drivers.common import args, emit, exception_chain, kv_transfer_config


def main() -> None:
    a = args()
    from vllm import LLM

    if a.get("codec_fault"):
        from kvtier.offload.codec import PageCodec

        PageCodec.scatter = lambda self, src, block_ids: 0  # type: ignore[method-assign]

    kw = {
        "model": a["model"],
        "dtype": "bfloat16",
        "max_model_len": 2048,
        "tensor_parallel_size": a.get("tp", 1),
        "enforce_eager": True,
        "enable_prefix_caching": True,
        "kv_transfer_config": None if a.get("no_connector") else kv_transfer_config(a["extra"]),
        "load_format": a.get("load_format", "auto"),
    }
    try:
        llm = LLM(**{**kw, **a.get("llm_kwargs", {})})
    except Exception as exc:  # noqa: BLE001 - the driver reports whatever startup raised
        emit({"started": False, "errors": exception_chain(exc)})
        return
    if a.get("generate"):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompt = TokensPrompt(prompt_token_ids=[(i * 7) % 1000 for i in range(600)])
        try:
            llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0))
        except Exception as exc:  # noqa: BLE001 - the driver reports whatever vLLM raised
            emit({"started": True, "generated": False, "errors": exception_chain(exc)})
            return
    del llm
    emit({"started": True, "generated": bool(a.get("generate")), "errors": []})


if __name__ == "__main__":
    main()
