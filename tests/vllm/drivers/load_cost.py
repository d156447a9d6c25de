"""Load or recompute on vLLM: a shared store behind a throttling TCP proxy (a real redis-server,
`kvtier.bench.throttle`), a small memory tier in front of it, `load_policy: cost`.

1. The proxy at full speed: every prompt (restores, mixed, fillers) is served once, one at a
   time, and written through to the store; the fillers push the others out of the memory tier.
2. Mixed setup, at full speed: each mixed prompt's head is read back from the store, so the
   memory tier holds it. These reads are setup, not the store's speed: the policy is `always`
   for them and the store's read model goes back to what it was after them.
3. The proxy slowed below the break-even: each mixed prompt whole (the head from memory, the
   tail only in the slow store), then each restore prompt (only in the slow store).
Every prompt runs alone, after an HBM reset, in float32 (a recomputed tail is another batch shape
than the first pass's whole prompt). Args (JSON): model, extra (remote_url = the store), slow
(bytes/s), head_chunks.
"""

from __future__ import annotations

import copy
import time
from typing import Any

from tests.vllm.drivers.common import (
    args,
    emit,
    kv_transfer_config,
    make_prompts,
    registry_totals,
    reset_prefix_cache,
)

FAST = 2e9


def main() -> None:
    a = args()
    from urllib.parse import urlsplit

    import redis
    from prometheus_client import REGISTRY
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtier.bench.throttle import ThrottledProxy

    store_url = a["extra"]["remote_url"]
    parts = urlsplit(store_url)
    # listening from here on; closed once the timed passes are done
    proxy = ThrottledProxy((parts.hostname or "127.0.0.1", parts.port or 6379), rate=FAST)
    extra = {**a["extra"], "remote_url": proxy.url()}
    chunk = int(extra["chunk_size"])
    restores = make_prompts(3, 4 * chunk + 40, step=0, seed=21)
    mixed = make_prompts(3, 4 * chunk + 40, step=0, seed=22)
    fillers = make_prompts(4, 4 * chunk + 40, step=0, seed=23)
    heads = [p[: a["head_chunks"] * chunk] for p in mixed]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = LLM(
        model=a["model"], dtype="float32", max_model_len=2048, enforce_eager=True,
        enable_prefix_caching=True, seed=0, disable_log_stats=False,
        kv_transfer_config=kv_transfer_config(extra),
    )  # fmt: skip
    core = llm.llm_engine.engine_core.engine_core.scheduler.get_kv_connector().offload_scheduler
    planner = core.load_planner

    def one(p: list[int]) -> list[int]:
        reset_prefix_cache(llm)
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)
        return list(out.outputs[0].token_ids)

    def decisions() -> dict[str, float]:
        return registry_totals(REGISTRY, "load_decisions")

    # 1. every prompt once, written through; wait (bounded) until the store holds them all
    first = {"restore": [one(p) for p in restores], "mixed": [one(p) for p in mixed]}
    for p in fillers:
        one(p)
    want = sum(len(p) // chunk for p in restores + mixed + fillers)
    store = redis.Redis.from_url(store_url)
    deadline = time.monotonic() + 60
    while store.dbsize() < want and time.monotonic() < deadline:
        time.sleep(0.05)
    stored = store.dbsize()

    # 2. the mixed heads back into the memory tier (setup reads: the model is restored after)
    cost = planner.gate.cost
    saved = copy.deepcopy((cost.tiers.get("remote"), cost.state.get("remote"),
                           cost.last_probe.get("remote")))  # fmt: skip
    planner.policy = "always"
    for h in heads:
        one(h)
    planner.policy = "cost"
    if saved[0] is not None:
        cost.tiers["remote"] = saved[0]
    for table, value in ((cost.state, saved[1]), (cost.last_probe, saved[2])):
        table.pop("remote", None)
        if value is not None:
            table["remote"] = value

    # 3. the store slow
    proxy.set_rate(float(a["slow"]))
    d0 = decisions()
    t0 = time.perf_counter()
    second_mixed = [one(p) for p in mixed]
    d1 = decisions()
    second_restore = [one(p) for p in restores]
    d2 = decisions()
    elapsed = time.perf_counter() - t0
    proxy.close()

    def diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
        return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}

    result: dict[str, Any] = {
        "stored": stored,
        "want_stored": want,
        "first": first,
        "second": {"restore": second_restore, "mixed": second_mixed},
        "mixed_decisions": diff(d1, d0),
        "restore_decisions": diff(d2, d1),
        "skipped": registry_totals(REGISTRY, "skipped_loads"),
        "slow_s": round(elapsed, 2),
    }
    emit(result)


if __name__ == "__main__":
    main()
