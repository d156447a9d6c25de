"""The host-adapter conformance suite (`tests.offload.conformance.CHECKS`) against
`VLLMRequestView` over a real `vllm.v1.request.Request`, built the way vLLM's own tests do.

Prints `{"checks": {name: "ok" | "<error>"}}`. Args (JSON): none needed (`{}`).
"""

from __future__ import annotations

import traceback
from collections.abc import Sequence
from typing import Any

from tests.offload.conformance import CHECKS, HYBRID_CHECKS, HostAdapter
from tests.vllm.drivers.common import args, emit


def _make(req_id: str, prompt: Sequence[int], computed: int, blocks: Sequence[int]) -> Any:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from kvtier.vllm.request_view import VLLMRequestView

    request = Request(
        request_id=req_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=16),
        pooling_params=None,
    )
    request.num_computed_tokens = computed
    return VLLMRequestView(request, blocks)


def _advance(view: Any, computed: int, blocks: Sequence[int]) -> None:
    # the host (vLLM's scheduler) advances its request; the connector learns the block table
    view.request.num_computed_tokens = computed
    view.set_block_ids(blocks)


def _advance_groups(view: Any, computed: int, groups: Sequence[Sequence[int]]) -> None:
    # a hybrid model: the connector learns every KV cache group's table
    view.request.num_computed_tokens = computed
    view.set_group_block_ids(groups)


def main() -> None:
    args()
    adapter = HostAdapter("vllm", _make, _advance, _advance_groups)
    results: dict[str, str] = {}
    for check in (*CHECKS, *HYBRID_CHECKS):
        try:
            check(adapter)
        except Exception:  # noqa: BLE001 - every check's failure is reported, not just the first
            results[check.__name__] = traceback.format_exc()
        else:
            results[check.__name__] = "ok"
    emit({"checks": results})


if __name__ == "__main__":
    main()
