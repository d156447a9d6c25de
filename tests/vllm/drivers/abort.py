"""Abort while a tier load is in flight.

Pass 1 stores the prompts. Then one request is admitted, its tier load is held back by
`GatedKVTierConnector`, and the request is aborted while it waits in WAITING_FOR_REMOTE_KVS.
vLLM holds such a request's blocks until the load's finished_recving; kvtier must not also
report it finished_sending (vLLM would free the blocks twice). Once the gate opens the engine
must drain to no requests and no used blocks, and serve the prompts again correctly.

Args (JSON): model, extra, and optionally n, base_len, max_tokens. In-process engine only: the
driver reads vLLM's scheduler to check that nothing leaked.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from tests.vllm.drivers.common import (
    args,
    emit,
    kv_transfer_config,
    make_prompts,
    reset_prefix_cache,
)

_DRAIN_TIMEOUT_S = 120.0


def drain(step: Callable[[], object], busy: Callable[[], bool], what: str) -> None:
    """Step the engine until `busy()` is false; the load lane runs on its own thread, so the
    deadline is wall time, not a step count."""
    deadline = time.monotonic() + _DRAIN_TIMEOUT_S
    while busy():
        if time.monotonic() > deadline:
            raise RuntimeError(f"engine did not drain within {_DRAIN_TIMEOUT_S}s {what}")
        step()


def main() -> None:
    a = args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from tests.vllm.drivers.faulty_connectors import GatedKVTierConnector

    prompts = make_prompts(a.get("n", 3), a.get("base_len", 600))
    sp = SamplingParams(temperature=0.0, max_tokens=a.get("max_tokens", 16), ignore_eos=True)
    ktc = kv_transfer_config(
        a["extra"], connector="GatedKVTierConnector", module="tests.vllm.drivers.faulty_connectors"
    )
    llm = LLM(
        model=a["model"],
        dtype="bfloat16",
        max_model_len=2048,
        enforce_eager=True,
        enable_prefix_caching=True,
        seed=0,
        kv_transfer_config=ktc,
    )
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    core = sched.get_kv_connector().offload_scheduler

    def generate() -> list[list[int]]:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp)
        return [list(o.outputs[0].token_ids) for o in outs]

    GatedKVTierConnector.gate.set()
    out1 = generate()
    reset_prefix_cache(llm)

    GatedKVTierConnector.gate.clear()
    engine = llm.llm_engine
    engine.add_request("victim", TokensPrompt(prompt_token_ids=prompts[0]), sp)
    # vLLM suffixes the id it was given; find the engine-side id
    (victim,) = [rid for rid in sched.requests if rid.startswith("victim")]

    def not_parked() -> bool:
        # the lookup never blocks the scheduler loop: on a loaded machine its answer may take
        # a step or more; then the request is admitted, its load emitted and held by the gate
        return str(sched.requests[victim].status) == "WAITING"

    drain(engine.step, not_parked, "until the victim's load is emitted")
    waiting = str(sched.requests[victim].status)
    pending = core.pending_load(victim)
    engine.abort_request(["victim"])
    engine.step()  # vLLM finishes the aborted request and keeps its blocks
    held_after_abort = victim in sched.requests
    GatedKVTierConnector.gate.set()

    def busy() -> bool:
        return bool(sched.requests) or core.has_pending_work()

    drain(engine.step, busy, "after the abort")
    usage_after_abort = sched.kv_cache_manager.usage
    out2 = generate()
    drain(engine.step, busy, "after pass 2")
    emit(
        {
            "prompt_lens": [len(p) for p in prompts],
            "victim_status_before_abort": waiting,
            "victim_pending_load": pending,
            "victim_blocks_held_after_abort": held_after_abort,
            "usage_after_abort": usage_after_abort,
            "usage_at_end": sched.kv_cache_manager.usage,
            "out1": out1,
            "out2": out2,
        }
    )


if __name__ == "__main__":
    main()
