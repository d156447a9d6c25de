"""Start `vllm.LLM` with KVTierConnector under a config that must not start.

A wrong topology or layout must stop startup (never serve a write-only tier). Prints whether
the engine came up and the exception chain. Args (JSON): model, tp, extra, `codec_fault`
(the codec writes no block; needs VLLM_ENABLE_V1_MULTIPROCESSING=0 so the worker is in process),
and `load_format` (`dummy`: random weights for a model directory holding only its config).
"""

from __future__ import annotations

from tests.vllm.drivers.common import args, emit, exception_chain, kv_transfer_config


def main() -> None:
    a = args()
    from vllm import LLM

    if a.get("codec_fault"):
        from kvtier.offload.codec import PageCodec

        PageCodec.scatter = lambda self, src, block_ids: 0  # type: ignore[method-assign]

    try:
        llm = LLM(
            model=a["model"],
            dtype="bfloat16",
            max_model_len=2048,
            tensor_parallel_size=a.get("tp", 1),
            enforce_eager=True,
            enable_prefix_caching=True,
            kv_transfer_config=kv_transfer_config(a["extra"]),
            load_format=a.get("load_format", "auto"),
        )
    except Exception as exc:  # noqa: BLE001 - the driver reports whatever startup raised
        emit({"started": False, "errors": exception_chain(exc)})
        return
    del llm
    emit({"started": True, "errors": []})


if __name__ == "__main__":
    main()
