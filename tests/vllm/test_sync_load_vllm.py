"""Loads inside the forward on vLLM (`get_num_new_matched_tokens` -> `(n, False)`, finished in
`start_load_kv` before the step's forward): pass 2 of a two-pass run restores every prompt
without parking it, counts each load once, and the one load whose chunk was corrupted is
reported through `get_block_ids_with_load_errors` in its own step, so vLLM recomputes that
request from its first bad block and still decodes the right tokens."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.vllm.conftest import CHUNK, TIER, DriverRun, loadable_tokens, retrieved_lines


def test_sync_loads_restore_in_the_forward_and_a_failed_one_is_recomputed(
    run_driver: Callable[..., DriverRun], tiny_vllm_model: Path
) -> None:
    args = {
        "model": str(tiny_vllm_model),
        # every load after the first measured step runs inside the forward
        "extra": {**TIER, "verify_memory_reads": True, "sync_load_fraction": 1e9},
        "connector": "CorruptingKVTierConnector",
        "module": "tests.vllm.drivers.faulty_connectors",
        # one prompt per call in both passes: the recomputed request runs alone, as in pass 1
        "serial": True,
    }
    run = run_driver("two_pass", args, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    r = run.result
    n = len(r["prompt_lens"])
    want = loadable_tokens(r["prompt_lens"], CHUNK)

    lines = retrieved_lines(run.stderr)
    assert len(lines) == n
    sync_lines = [ln for ln in run.stderr.splitlines() if "Retrieved" in ln]
    assert all("in the forward)" in ln for ln in sync_lines), sync_lines
    failed = [x for x in lines if x.failed]
    assert [(x.got, x.failed) for x in failed] == [(0, "miss")]
    # the failed load's blocks reached vLLM in the step of the load: it recomputed them
    assert "Recovered from KV load failure: 1 request(s) rescheduled" in run.stdout + run.stderr
    assert r["out2"] == r["out1"], "a load inside the forward changed the greedy output"
    kv = r["kvtier"]
    assert kv["sync_loads"]["rank=scheduler"] == n
    # the good loads' bytes are counted once, on the rank, after the agreed terminal
    assert kv["retrieved_tokens"]["rank=0"] == want - failed[0].required
    assert kv["load_failures"] == {"rank=0,reason=miss": 1.0, "rank=scheduler,reason=miss": 1.0}
    assert kv["verify_failures"] == {"rank=0,reason=checksum_mismatch,tier=memory": 1.0}
    # the recomputing request keeps running: vLLM never asks the tier for it a second time
    assert not kv["skipped_loads"]
