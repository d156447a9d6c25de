"""`kvtier plan`: bytes per token from config fields, the (HBM pool, tier] window verdicts of the
ATOM recipes, exact reuse distances of a hand-made trace, fill time, break-even bandwidth, CLI."""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner, Result

from kvtier.cachemodel.reuse import percentile, reuse_distances
from kvtier.errors import ConfigError, LayoutError
from kvtier.plan import (
    ABOVE_TIER,
    BELOW_POOL,
    INSIDE,
    NO_REUSE,
    GiB,
    PlanResult,
    SyntheticWorkload,
    parse_trace,
    plan,
    plan_command,
    read_trace,
    trace_reuse_profile,
    window_verdict,
)
from kvtier.plan.presets import PRESETS, preset, preset_names
from tests.test_layout import DEEPSEEK_V3, GLM_5X, LLAMA_31_8B

app = typer.Typer()
app.command()(plan_command)

# The GLM-5.x recipe runs of atom-offload.md §5.4 / §6.3: a 28,672-token shared prefix plus a
# 4,096-token unique tail, concurrency 8, TP4, fp8 KV, block 64.
PREFIX, TAIL, CONC = 28_672, 4_096, 8
ISL = PREFIX + TAIL
DEFAULT_POOL = 3_440_832  # default HBM pool of the GLM-5.3 run (util 0.95)
OVERRIDE_POOL_BYTES = 8192 * 64 * 47_700  # --num-gpu-blocks-override 8192: "≈ 25 GB/rank"


def glm_plan(**kw: object) -> PlanResult:
    args: dict[str, object] = {"model": "glm-5-dsa", "kv_dtype": "fp8", "tp": 4, "block_size": 64}
    args.update(kw)
    return plan(preset("glm-5-dsa"), **args)  # type: ignore[arg-type]


def synthetic(n: int) -> SyntheticWorkload:
    return SyntheticWorkload(n, PREFIX, TAIL, CONC)


def invoke(*args: str) -> Result:
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "250"})


# ------------------------------------------------------------------------------ bytes per token


def test_glm_dsa_fp8_is_47700_per_rank_from_its_fields() -> None:
    cfg = preset("glm-5-dsa")
    r = glm_plan(hbm_tokens=DEFAULT_POOL, tier_bytes=256 * GiB, workload=synthetic(64))
    owners = cfg["indexer_types"].count("full")
    index_bytes = cfg["index_head_dim"] + 4 * math.ceil(cfg["index_head_dim"] / 128)
    latent = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    assert (owners, index_bytes, latent) == (21, 132, 576)
    assert r.bytes_per_token == cfg["num_hidden_layers"] * latent + owners * index_bytes == 47_700
    assert r.total_bytes_per_token == 4 * 47_700  # MLA is replicated on every rank
    assert r.geometry.replicated_across_tp is True
    # a 28,672-token prefix is 1.2737 GiB per rank (the LMCache log's "size: 1.2737 gb")
    assert round(r.geometry.bytes_for_tokens(PREFIX) / GiB, 4) == 1.2737


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_llama_31_8b_bf16_is_131072_over_all_ranks(tp: int) -> None:
    cfg = preset("llama-3.1-8b")
    r = plan(
        cfg,
        model="llama-3.1-8b",
        kv_dtype="bf16",
        tp=tp,
        hbm_tokens=1000,
        tier_bytes=GiB,
        workload=SyntheticWorkload(1, 100),
    )
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    full = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * 2
    assert r.total_bytes_per_token == full == 131_072
    assert r.bytes_per_token == 131_072 // tp


@pytest.mark.parametrize("tp", [1, 8])
def test_deepseek_v3_mla_is_70272_per_rank(tp: int) -> None:
    cfg = preset("deepseek-v3")
    r = plan(
        cfg, tp=tp, hbm_tokens=1000, tier_bytes=GiB, workload=SyntheticWorkload(1, 100)
    )  # kv_dtype auto: the config's bfloat16
    latent = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    assert r.geometry.kv_dtype == "bfloat16"
    assert r.bytes_per_token == cfg["num_hidden_layers"] * latent * 2 == 70_272
    assert r.total_bytes_per_token == 70_272 * tp


def test_presets_are_configs_matching_the_layout_tests() -> None:
    assert preset_names() == [
        "llama-3.1-8b",
        "llama-3.1-70b",
        "qwen2.5-7b",
        "deepseek-v3",
        "glm-5-dsa",
        "qwen3-next-80b",
    ]
    assert preset("GLM-5-DSA") == GLM_5X
    assert DEEPSEEK_V3.items() <= preset("deepseek-v3").items()
    kv_fields = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size")
    assert all(preset("llama-3.1-8b")[k] == LLAMA_31_8B[k] for k in kv_fields)
    # a copy: editing it leaves the preset alone
    cfg = preset("qwen2.5-7b")
    cfg["num_hidden_layers"] = 1
    assert PRESETS["qwen2.5-7b"]["num_hidden_layers"] == 28
    # GQA presets from their fields: 70B 80 x 2 x 8 x 128 x 2, Qwen2.5-7B 28 x 2 x 4 x 128 x 2
    work = SyntheticWorkload(1, 100)
    bpt = {
        name: plan(preset(name), hbm_tokens=10, tier_bytes=GiB, workload=work).bytes_per_token
        for name in ("llama-3.1-70b", "qwen2.5-7b")
    }
    assert bpt == {"llama-3.1-70b": 327_680, "qwen2.5-7b": 57_344}


# ------------------------------------------------------------------ window verdicts (§5.4)


@pytest.mark.parametrize(
    ("n_prefixes", "hbm", "tier_bytes", "kind", "distance", "tier_tokens"),
    [
        # pool 64 x 32K sits below the 3.44M default HBM pool: hit rate 0 by construction
        (64, {"hbm_tokens": DEFAULT_POOL}, 256 * GiB, BELOW_POOL, 72 * ISL, 5_762_639),
        # pool 128 lands inside [3.44M, 5.76M) with the 256 GiB/rank tier
        (128, {"hbm_tokens": DEFAULT_POOL}, 256 * GiB, INSIDE, 136 * ISL, 5_762_639),
        # pool 128 behind the 8192-block override pool against a 90 GiB/rank tier: too small
        (128, {"hbm_bytes": OVERRIDE_POOL_BYTES}, 90 * GiB, ABOVE_TIER, 136 * ISL, 2_025_927),
    ],
    ids=["below_the_pool", "inside", "above_the_tier"],
)
def test_section_5_4_window_verdicts(
    n_prefixes: int,
    hbm: dict[str, int],
    tier_bytes: int,
    kind: str,
    distance: int,
    tier_tokens: int,
) -> None:
    r = glm_plan(tier_bytes=tier_bytes, workload=synthetic(n_prefixes), **hbm)
    # (n_prefixes + concurrency) x ISL: the pool round plus what the requests in flight hold
    assert r.reuse_distance_tokens == distance
    assert r.tier_tokens == tier_tokens == tier_bytes // 47_700
    assert r.verdict.kind == kind
    if "hbm_bytes" in hbm:
        assert r.hbm_pool_tokens == 524_288  # 25 GB/rank back to the override's 8192 blocks
    else:
        assert r.hbm_pool_tokens == DEFAULT_POOL
    if kind == INSIDE:
        assert r.warnings == ()
        assert r.verdict.message.startswith("tier can hit")
    else:
        assert r.verdict.message in r.warnings
    if kind == BELOW_POOL:
        assert r.verdict.message.startswith("HBM already hits; the tier cannot add hits")
    if kind == ABOVE_TIER:
        need = 136 * ISL * 47_700
        assert r.verdict.needed_tier_bytes == need == 212_572_569_600
        assert r.verdict.message.startswith(
            f"tier too small: reuse distance exceeds it; need {need:,} bytes"
        )


@pytest.mark.parametrize(
    ("n_prefixes", "kind"), [(64, BELOW_POOL), (128, INSIDE)], ids=["pool_64", "pool_128"]
)
def test_section_5_4_arithmetic_as_written_gives_the_same_verdicts(
    n_prefixes: int, kind: str
) -> None:
    # the recipe writes (pool_size - 1) x ISL: 2.06M and 4.16M
    distance = (n_prefixes - 1) * ISL
    assert round(distance / 1e6, 2) == {64: 2.06, 128: 4.16}[n_prefixes]
    assert window_verdict(distance, DEFAULT_POOL, 5_762_639, 47_700).kind == kind


def test_window_edges_follow_lru_a_reuse_of_d_hits_a_cache_of_d() -> None:
    assert window_verdict(100, 100, 200, 1).kind == BELOW_POOL
    assert window_verdict(101, 100, 200, 1).kind == INSIDE
    assert window_verdict(200, 100, 200, 1).kind == INSIDE
    over = window_verdict(201, 100, 200, 3)
    assert (over.kind, over.needed_tier_bytes) == (ABOVE_TIER, 603)
    assert window_verdict(None, 100, 200, 1).kind == NO_REUSE


def test_sizing_for_the_reusable_set_and_fill_time() -> None:
    # "64 x 1.2737 = 81.5 GiB/rank; 90 is 1.10x"
    r = glm_plan(
        hbm_bytes=OVERRIDE_POOL_BYTES, tier_bytes=90 * GiB, workload=synthetic(64), store_gbps=5
    )
    assert r.reusable_tokens == 64 * PREFIX
    assert r.reusable_bytes == 64 * PREFIX * 47_700 == 87_529_881_600
    assert round(r.reusable_bytes / GiB, 1) == 81.5
    assert round(r.tier_over_reusable, 2) == 1.10
    assert r.tier_fill_s == pytest.approx(90 * GiB / 5e9)
    assert r.working_set_fill_s == pytest.approx(87_529_881_600 / 5e9)
    assert r.tier_bytes_all_ranks == 4 * 90 * GiB
    # "fills at ~0.287 GiB/s/rank, so a 186 GiB/rank working set needs ~650 s"
    slow = glm_plan(
        hbm_tokens=DEFAULT_POOL,
        tier_bytes=186 * GiB,
        workload=synthetic(128),
        store_gbps=0.287 * GiB / 1e9,
    )
    assert slow.tier_fill_s == pytest.approx(186 / 0.287)
    assert 640 < slow.tier_fill_s < 660


def test_undersized_tier_against_the_reusable_set_warns_even_when_the_window_fits() -> None:
    # 2 prefixes of 1,000 tokens, 100-token tails, nothing in flight: distance 2,200 tokens
    r = plan(
        preset("llama-3.1-8b"),
        hbm_tokens=1_000,
        tier_bytes=2_500 * 131_072,
        workload=SyntheticWorkload(2, 1_000, 100, 0),
    )
    assert (r.reuse_distance_tokens, r.verdict.kind, r.warnings) == (2_200, INSIDE, ())
    tight = plan(
        preset("llama-3.1-8b"),
        hbm_tokens=2_300,
        tier_bytes=1_500 * 131_072,
        workload=SyntheticWorkload(2, 1_000, 100, 0),
    )
    assert tight.verdict.kind == BELOW_POOL
    assert any("empty" in w for w in tight.warnings)
    assert any("smaller than the reusable working set" in w for w in tight.warnings)


# --------------------------------------------------------------------------------- break-even


def test_break_even_bandwidth_by_hand() -> None:
    llama = plan(
        preset("llama-3.1-8b"),
        hbm_tokens=1000,
        tier_bytes=GiB,
        workload=SyntheticWorkload(1, 100),
        prefill_tokens_per_s=10_000,
    )
    assert llama.break_even_gbps == pytest.approx(131_072 * 10_000 / 1e9) == 1.31072
    # GLM-5.2 re-prefill costs 71.0 µs/token: 47,700 B in 71 µs is 0.672 GB/s per rank
    glm = glm_plan(
        hbm_tokens=DEFAULT_POOL,
        tier_bytes=GiB,
        workload=synthetic(1),
        prefill_tokens_per_s=1 / 71.0e-6,
    )
    assert glm.break_even_gbps == pytest.approx(0.6718309859)
    none = glm_plan(hbm_tokens=DEFAULT_POOL, tier_bytes=GiB, workload=synthetic(1))
    assert none.break_even_gbps is None


# ------------------------------------------------------------------------------------ traces

# Four requests of 100-token blocks, written out of time order (replay sorts by timestamp):
#   t=0 [1 2 3]   t=1 [1 2 4]   t=2 [5]   t=3 [1 2 3 6]
# Each request touches its blocks last-to-first, so its head is the most recent.
#   t=1: block 1 last used at the head of t=0, nothing since: distance 1 block
#        block 2: block 1 used after it: 2
#   t=3: block 1: since t=1, block 5: 2;  block 2: 1 and 5: 3;  block 3: 2, 1, 4, 5: 5
HAND_TRACE = [
    {"timestamp": 0, "input_length": 300, "output_length": 10, "hash_ids": [1, 2, 3]},
    {"timestamp": 2000, "input_length": 80, "output_length": 10, "hash_ids": [5]},
    {"timestamp": 1000, "input_length": 300, "output_length": 10, "hash_ids": [1, 2, 4]},
    {"timestamp": 3000, "input_length": 350, "output_length": 10, "hash_ids": [1, 2, 3, 6]},
]
LLAMA_BPT = 131_072


def write_trace(tmp_path: Path, rows: list[dict[str, object]]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    return path


def test_hand_trace_reuse_distances_and_reusable_bytes(tmp_path: Path) -> None:
    trace = read_trace(write_trace(tmp_path, HAND_TRACE), block_tokens=100)
    assert [r.hash_ids for r in trace.requests] == [(1, 2, 3), (1, 2, 4), (5,), (1, 2, 3, 6)]
    assert reuse_distances([r.hash_ids for r in trace.requests]) == [1, 2, 2, 3, 5]

    r = plan(
        preset("llama-3.1-8b"),
        hbm_tokens=100,
        tier_bytes=400 * LLAMA_BPT,
        workload=trace,
    )
    p = r.profile
    assert p is not None
    assert p.distances == (100, 200, 200, 300, 500)
    assert (p.median, p.p90) == (200, 500)  # nearest rank: 3rd and 5th of 5
    assert (p.block_uses, p.distinct_blocks, p.reusable_blocks) == (11, 6, 3)
    assert (p.below_pool, p.inside, p.above_tier) == (1, 3, 1)
    # reusable = blocks 1, 2, 3 (each seen twice or more) x 100 tokens
    assert r.reusable_tokens == 300
    assert r.reusable_bytes == 300 * LLAMA_BPT
    assert (r.reuse_distance_tokens, r.reuse_p90_tokens) == (200, 500)
    assert r.verdict.kind == INSIDE
    assert r.warnings == ()

    # ceilings in trace blocks (full blocks only: t=2's 80 tokens store none, t=3 stores 1 2 3):
    # usable 2 + 2 + 0 + 3; the 1-block HBM keeps block 1, hit by t=1 and t=3; a 4-block tier
    # holds all four blocks stored, so it serves block 2 of t=1 and blocks 2, 3 of t=3
    c = r.ceilings
    assert c is not None
    assert (c.hbm_blocks, c.tier_blocks) == (1, 4)
    assert (c.usable_blocks, c.hbm_hit_blocks) == (7, 2)
    assert (c.kvtier.served, c.optimum.served, c.infinite.served) == (3, 3, 3)
    assert c.kvtier.rate == pytest.approx(3 / 5)


def test_hand_trace_bad_verdicts(tmp_path: Path) -> None:
    trace = read_trace(write_trace(tmp_path, HAND_TRACE), block_tokens=100)
    below = plan(preset("llama-3.1-8b"), hbm_tokens=200, tier_bytes=400 * LLAMA_BPT, workload=trace)
    assert below.verdict.kind == BELOW_POOL
    assert below.profile is not None
    assert (below.profile.below_pool, below.profile.inside, below.profile.above_tier) == (3, 1, 1)
    above = plan(preset("llama-3.1-8b"), hbm_tokens=100, tier_bytes=150 * LLAMA_BPT, workload=trace)
    assert above.verdict.kind == ABOVE_TIER
    assert above.verdict.needed_tier_bytes == 200 * LLAMA_BPT
    no_reuse = parse_trace(
        [json.dumps({"input_length": 10, "hash_ids": [i]}) for i in range(3)], block_tokens=16
    )
    r = plan(preset("llama-3.1-8b"), hbm_tokens=16, tier_bytes=GiB, workload=no_reuse)
    assert (r.verdict.kind, r.reuse_distance_tokens, r.reusable_tokens) == (NO_REUSE, None, 0)
    assert r.verdict.message in r.warnings


def _naive_distances(requests: list[list[int]]) -> list[int]:
    """Quadratic reference: replay the touch order and count distinct blocks since a reuse."""
    history: list[int] = []
    out = []
    for req in requests:
        start = len(history)
        for key in dict.fromkeys(req):
            if key in history:
                prev = len(history) - 1 - history[::-1].index(key)
                out.append(len(set(history[prev + 1 : start])) + 1)
        history += list(reversed(list(dict.fromkeys(req))))
    return out


def test_reuse_distances_match_a_naive_replay_on_a_random_chained_trace() -> None:
    rng = random.Random(7)
    roots = [[rng.randrange(10**6) for _ in range(rng.randint(1, 6))] for _ in range(12)]
    requests = []
    for i in range(150):
        root = roots[rng.randrange(len(roots))]
        requests.append(root[: rng.randint(1, len(root))] + [10**7 + i])
    assert reuse_distances(requests) == _naive_distances(requests)


def test_percentile_is_nearest_rank() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2
    assert percentile([1, 2, 3, 4], 90) == 4
    assert percentile([7], 50) == 7
    with pytest.raises(ConfigError, match="no reuse"):
        percentile([], 50)


def test_reuse_profile_with_an_empty_window_counts_everything_past_the_pool() -> None:
    trace = parse_trace(
        [json.dumps({"input_length": 10, "hash_ids": h}) for h in ([1], [2], [1])],
        block_tokens=10,
    )
    p = trace_reuse_profile(trace, hbm_pool_tokens=10, tier_tokens=5)
    assert p.distances == (20,)
    assert (p.below_pool, p.inside, p.above_tier) == (0, 0, 1)


# --------------------------------------------------------------------------------------- CLI


def test_cli_table_prints_quantities_units_and_warning() -> None:
    result = invoke(
        "--model", "glm-5-dsa", "--kv-dtype", "fp8", "--tp", "4", "--block-size", "64",
        "--hbm-tokens", str(DEFAULT_POOL), "--tier-bytes", "256GiB",
        "--prefixes", "64", "--prefix-len", str(PREFIX), "--tail-len", str(TAIL),
        "--concurrency", "8", "--prefill-tokens-per-s", "10000",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    out = result.stdout
    for text in (
        "kvtier plan: glm-5-dsa",
        "bytes per token per rank",
        "47,700",
        "190,800 (replicated)",
        "5,762,639",
        "2,359,296",
        "87,529,881,600 (81.52 GiB)",
        "0.477",  # 47,700 B x 10,000 tokens/s
        "GB/s",
        "tokens",
        "WARNING: HBM already hits; the tier cannot add hits",
    ):
        assert text in out, text
    assert out.count("WARNING:") == 1


def test_cli_inside_window_has_no_warning_and_hbm_bytes_convert() -> None:
    result = invoke(
        "--model", "glm-5-dsa", "--kv-dtype", "fp8", "--tp", "4", "--block-size", "64",
        "--hbm-bytes", str(OVERRIDE_POOL_BYTES), "--tier-bytes", "256GiB",
        "--prefixes", "16", "--prefix-len", str(PREFIX), "--tail-len", str(TAIL),
        "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["bytes_per_token_per_rank"] == 47_700
    assert doc["hbm_pool_tokens"] == 524_288
    assert doc["hbm_from"] == "--hbm-bytes"
    assert doc["reuse_distance_tokens"] == (16 + 1) * ISL  # default concurrency 1
    assert doc["verdict"]["kind"] == INSIDE
    assert doc["warnings"] == []
    assert doc["workload"] == {
        "kind": "synthetic",
        "n_prefixes": 16,
        "prefix_len": PREFIX,
        "tail_len": TAIL,
        "concurrency": 1,
    }
    assert doc["break_even_gbps"] is None
    assert doc["ceilings"] is None
    assert "WARNING" not in result.output


def test_cli_json_trace_and_config_path(tmp_path: Path) -> None:
    model_dir = tmp_path / "llama"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(LLAMA_31_8B), encoding="utf-8")
    trace = write_trace(tmp_path, HAND_TRACE)
    result = invoke(
        "--model", str(model_dir), "--hbm-tokens", "100", "--tier-bytes", str(400 * LLAMA_BPT),
        "--trace", str(trace), "--trace-block", "100", "--store-gbps", "2", "--json",
        "--png", str(tmp_path / "curve.png"),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["bytes_per_token_all_ranks"] == 131_072
    assert doc["tier_tokens"] == 400
    assert doc["reuse_profile"]["median_tokens"] == 200
    assert doc["reuse_profile"]["p90_tokens"] == 500
    assert doc["reusable_bytes"] == 300 * LLAMA_BPT
    assert doc["working_set_fill_s"] == pytest.approx(300 * LLAMA_BPT / 2e9)
    assert doc["ceilings"]["kvtier"]["served_chunks"] == 3
    # the curve: kvtier never above the optimum, the optimum never above the infinite tier
    curve = doc["hit_curve"]
    assert [p["fraction_of_working_set"] for p in curve][-1] == 1.0
    for point in curve:
        rates = [point[k]["rate"] for k in ("kvtier", "optimum", "infinite")]
        assert rates[0] <= rates[1] + 1e-9 and rates[1] <= rates[2] + 1e-9
    assert curve[-1]["optimum"]["rate"] == curve[-1]["infinite"]["rate"]
    png = Path(doc["hit_curve_png"])
    assert png == tmp_path / "curve.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert doc["workload"]["requests"] == 4
    assert doc["workload"]["prompt_tokens"] == 1030


    table = invoke(
        "--model", str(model_dir / "config.json"), "--hbm-tokens", "200",
        "--tier-bytes", str(400 * LLAMA_BPT), "--trace", str(trace), "--trace-block", "100",
        "--png", str(tmp_path / "table.png"),
    )  # fmt: skip
    assert table.exit_code == 0, table.output
    assert f"hit curve: {tmp_path / 'table.png'}" in table.stdout
    assert "reuses in HBM / window / above tier" in table.stdout
    assert "3 / 1 / 1" in table.stdout
    assert "WARNING: HBM already hits" in table.stdout


def test_a_trace_plan_without_matplotlib_gives_its_numbers_and_says_why_no_png(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pip install kvtier` alone has no matplotlib, yet the README promises `plan` there: the
    trace plan stopped at its PNG with an error (a review found it); now the numbers come,
    and one line says how to get the picture."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    trace = write_trace(tmp_path, HAND_TRACE)
    png = tmp_path / "curve.png"
    args = (
        "--model", "llama-3.1-8b", "--hbm-tokens", "100", "--tier-bytes", str(400 * LLAMA_BPT),
        "--trace", str(trace), "--trace-block", "100", "--png", str(png),
    )  # fmt: skip
    result = invoke(*args, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["ceilings"]["kvtier"]["served_chunks"] == 3 and doc["hit_curve"]
    assert doc["hit_curve_png"] is None and not png.exists()
    assert "pip install 'kvtier[bench]'" in result.stderr
    table = invoke(*args)
    assert table.exit_code == 0 and "hit curve:" not in table.stdout
    assert "no hit-curve PNG" in table.stderr


# ------------------------------------------------------------------------------------- errors

BASE = ["--tier-bytes", "1GiB", "--prefixes", "2", "--prefix-len", "100"]


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (
            ["--model", "llama-9b", "--hbm-tokens", "10", *BASE],
            ["'llama-9b' is neither a preset nor a config.json", *PRESETS],
        ),
        (
            ["--model", "llama-3.1-8b", "--hbm-tokens", "10", "--hbm-bytes", "1GiB", *BASE],
            ["given twice", "--hbm-tokens", "--hbm-bytes", "only one"],
        ),
        (["--model", "llama-3.1-8b", *BASE], ["HBM pool is missing", "--hbm-tokens N"]),
        (
            ["--model", "llama-3.1-8b", "--hbm-tokens", "10", "--tier-bytes", "1GiB"],
            ["no workload", "--prefixes and --prefix-len missing", "--trace FILE"],
        ),
        (
            [
                "--model",
                "llama-3.1-8b",
                "--hbm-tokens",
                "10",
                "--tier-bytes",
                "64Gb/s",
                "--prefixes",
                "2",
                "--prefix-len",
                "100",
            ],
            ["--tier-bytes", "not a size", "64GiB"],
        ),
        (
            ["--model", "llama-3.1-8b", "--hbm-tokens", "10", "--kv-dtype", "fp7", *BASE],
            ["--kv-dtype", "'fp7'", "bfloat16"],
        ),
        (
            ["--model", "llama-3.1-8b", "--hbm-tokens", "10", "--tp", "3", *BASE],
            ["--model llama-3.1-8b", "tp_size 3", "use a tp_size that divides 8"],
        ),
        (
            ["--model", "llama-3.1-8b", "--hbm-bytes", "1KiB", *BASE],
            ["--hbm-bytes 1024 holds no block", "80GiB"],
        ),
        (
            [
                "--model",
                "llama-3.1-8b",
                "--hbm-tokens",
                "10",
                "--tier-bytes",
                "100",
                "--prefixes",
                "2",
                "--prefix-len",
                "100",
            ],
            ["--tier-bytes 100 holds no token of 131,072 bytes"],
        ),
        (
            [
                "--model",
                "llama-3.1-8b",
                "--hbm-tokens",
                "10",
                "--tier-bytes",
                "1GiB",
                "--prefixes",
                "0",
                "--prefix-len",
                "100",
            ],
            ["--prefixes 0 must be an integer >= 1"],
        ),
        (
            ["--model", "llama-3.1-8b", "--hbm-tokens", "10", *BASE, "--store-gbps", "0"],
            ["--store-gbps 0.0 must be"],
        ),
    ],
    ids=[
        "unknown_preset",
        "hbm_twice",
        "hbm_missing",
        "no_workload",
        "bad_size",
        "bad_kv_dtype",
        "tp_heads",
        "hbm_bytes_below_a_block",
        "tier_below_a_token",
        "zero_prefixes",
        "zero_store_bandwidth",
    ],
)
def test_cli_errors_name_the_flag_and_the_fix(args: list[str], needles: list[str]) -> None:
    result = invoke(*args)
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr.startswith("error: ")
    for needle in needles:
        assert needle in result.stderr, needle


def test_missing_config_fields_are_named(tmp_path: Path) -> None:
    cfg = {k: v for k, v in preset("llama-3.1-8b").items() if k != "num_hidden_layers"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg), encoding="utf-8")
    result = invoke("--model", str(path), "--hbm-tokens", "10", *BASE)
    assert result.exit_code == 2
    assert "'num_hidden_layers'" in result.stderr
    assert f"--model {path}" in result.stderr
    with pytest.raises(LayoutError, match="no 'kv_lora_rank'|no 'qk_rope_head_dim'"):
        plan(
            {**preset("deepseek-v3"), "qk_rope_head_dim": None},
            hbm_tokens=10,
            tier_bytes=GiB,
            workload=SyntheticWorkload(1, 10),
        )
    path.write_text("[1, 2]", encoding="utf-8")
    bad = invoke("--model", str(path), "--hbm-tokens", "10", *BASE)
    assert bad.exit_code == 2
    assert "not an HF config object" in bad.stderr


def test_trace_errors_name_the_line_and_the_flag(tmp_path: Path) -> None:
    good = json.dumps({"input_length": 10, "hash_ids": [1]})
    cases = [
        ([good, "{not json"], "t.jsonl:2: not JSON"),
        ([json.dumps({"input_length": 10, "hash_ids": []})], "t.jsonl:1: 'hash_ids' must be"),
        ([json.dumps({"hash_ids": [1]})], "t.jsonl:1: 'input_length' must be an integer"),
        ([json.dumps({"input_length": 1000, "hash_ids": [1]})], r"block size \(--trace-block"),
        ([""], "has no requests"),
    ]
    for lines, needle in cases:
        with pytest.raises(ConfigError, match=needle):
            parse_trace(lines, block_tokens=512, source="t.jsonl")
    path = write_trace(tmp_path, HAND_TRACE)
    mixed = invoke(
        "--model", "llama-3.1-8b", "--hbm-tokens", "10", "--tier-bytes", "1GiB",
        "--trace", str(path), "--prefixes", "3",
    )  # fmt: skip
    assert mixed.exit_code == 2
    assert "--trace and --prefixes both describe the workload" in mixed.stderr
    missing = invoke(
        "--model", "llama-3.1-8b", "--hbm-tokens", "10", "--tier-bytes", "1GiB",
        "--trace", str(tmp_path / "nope.jsonl"),
    )  # fmt: skip
    assert missing.exit_code == 2
    assert "is not a file" in missing.stderr
    small_block = invoke(
        "--model", "llama-3.1-8b", "--hbm-tokens", "10", "--tier-bytes", "1GiB",
        "--trace", str(path), "--trace-block", "16",
    )  # fmt: skip
    assert small_block.exit_code == 2
    want = "trace.jsonl:1: input_length 300 needs more than its 3 hash ids of 16"
    assert want in small_block.stderr


# gpt-oss-shaped: 128-token sliding windows on every other layer (HF `layer_types`)
GPT_OSS_LIKE = {
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_size": 512,
    "torch_dtype": "bfloat16",
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
}


def test_sliding_window_layers_cost_window_bytes_per_chunk_in_the_tier() -> None:
    work = SyntheticWorkload(1, 100)
    per_layer = 2 * 2 * 64 * 2  # K and V, 2 heads, 64 dims, bf16
    # 16-token blocks, 256-token chunks: a sliding layer stores the 8 blocks its window reads
    r = plan(GPT_OSS_LIKE, hbm_tokens=1024, tier_bytes=GiB, workload=work, block_size=16)
    assert r.bytes_per_token == 4 * per_layer
    assert r.tier_token_bytes == 2 * per_layer + 2 * per_layer // 2
    assert r.tier_tokens == GiB // r.tier_token_bytes
    assert r.to_json()["tier_bytes_per_token_per_rank"] == 3 * per_layer
    # a window wider than the chunk stores the whole chunk: no saving
    wide = {**GPT_OSS_LIKE, "sliding_window": 4096}
    r = plan(wide, hbm_tokens=1024, tier_bytes=GiB, workload=work, block_size=16)
    assert r.tier_token_bytes == r.bytes_per_token
    # a dense config is unchanged
    dense = {k: v for k, v in GPT_OSS_LIKE.items() if k != "layer_types"}
    assert plan(dense, hbm_tokens=1024, tier_bytes=GiB, workload=work).tier_bytes_per_token == 0


def test_hybrid_tier_bytes_need_whole_blocks_per_chunk_and_print_in_the_table() -> None:
    work = SyntheticWorkload(1, 100)
    with pytest.raises(ConfigError, match="--chunk-size 100 is not a whole number of --block-size"):
        plan(GPT_OSS_LIKE, hbm_tokens=1024, tier_bytes=GiB, workload=work, chunk_size=100)
    r = plan(GPT_OSS_LIKE, hbm_tokens=1024, tier_bytes=GiB, workload=work, chunk_size=1024)
    # 1024-token chunks of 16-token blocks: a sliding layer stores 8 of 64 blocks
    assert r.tier_token_bytes == 2 * 512 + 2 * 512 * 8 // 64


def test_a_state_hybrids_plan_reports_its_boundary_state_in_chunk_sized_records() -> None:
    r = plan(preset("qwen3-next-80b"), hbm_tokens=100_000, tier_bytes=64 * GiB,
             workload=SyntheticWorkload(4, 8192), block_size=256)  # fmt: skip
    # 73.7 MiB of state per boundary: 13 records of a 256-token chunk's 6 MiB of attention KV
    assert (r.tier_token_bytes, r.geometry.state_bytes, r.state_records) == (
        24_576, 77_266_944, 13,
    )  # fmt: skip
    from kvtier.plan.report import report_rows

    rows = {q: v for q, v, _ in report_rows(r)}
    assert rows["boundary state per rank (36 state layers)"] == "77,266,944"
    assert rows["state records per stored boundary (chunk-sized)"] == "13 x 6,291,456"
