"""A tier failure during a load: a worker corrupts one stored chunk right before loading it,
`verify_memory_reads` catches it, the load fails, vLLM recomputes the request, and the output
is still the right one. kvtier's counters say why."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.vllm.conftest import CHUNK, TIER, DriverRun, loadable_tokens, retrieved_lines


def test_corrupted_chunk_is_recomputed_with_correct_output(
    run_driver: Callable[..., DriverRun], tiny_vllm_model: Path
) -> None:
    args = {
        "model": str(tiny_vllm_model),
        "extra": {**TIER, "verify_memory_reads": True},
        "connector": "CorruptingKVTierConnector",
        "module": "tests.vllm.drivers.faulty_connectors",
        # one prompt per call in both passes: the recomputed request runs alone, as in pass 1
        "serial": True,
    }
    run = run_driver("two_pass", args, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    r = run.result
    n = len(r["prompt_lens"])
    want = loadable_tokens(r["prompt_lens"], CHUNK)

    # exactly one of the pass-2 loads failed (the corrupted one), the others loaded
    lines = retrieved_lines(run.stderr)
    failed = [x for x in lines if x.failed]
    assert [(x.got, x.failed) for x in failed] == [(0, "miss")]
    assert len(lines) == n
    # vLLM took the failed blocks back and recomputed them: same greedy output as pass 1
    assert "Recovered from KV load failure: 1 request(s) rescheduled" in run.stdout + run.stderr
    assert r["out2"] == r["out1"]
    assert r["pass2"]["vllm:prompt_tokens_cached"] == want - failed[0].required
    kv = r["kvtier"]
    assert kv["verify_failures"] == {"rank=0,reason=checksum_mismatch,tier=memory": 1.0}
    assert kv["load_failures"] == {"rank=0,reason=miss": 1.0, "rank=scheduler,reason=miss": 1.0}
    # the recomputed request does not ask the tier a second time in its lifecycle
    assert kv["skipped_loads"] == {"rank=scheduler,reason=failed_before": 1.0}
    assert kv["retrieved_tokens"]["rank=0"] == want - failed[0].required
