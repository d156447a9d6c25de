"""The e2e report, built for both hosts from synthetic windows (no server): the row ids the docs
read, counts that come out of the windows, and per-repetition details that name both arms."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvtier.bench import e2e, vllm_host
from kvtier.bench.arms import OFF, OFF_AGAIN, ON, ArmRun, Window, Workload
from kvtier.bench.client import LoadResult, Record
from kvtier.bench.e2e_report import build_report
from kvtier.bench.vllm_host import EXAMPLE, KVTIER, NONE, NONE_AGAIN
from kvtier.bench.workload import NO_REUSE, PREFIX_POOL
from kvtier.config import KVTierConfig
from kvtier.scrape import MetricSet

_M = (("model_name", "m"),)
_STEPS = {
    ("kvtier_step_seconds_bucket", (("le", "0.01"), ("rank", "0"))): 30.0,
    ("kvtier_step_seconds_bucket", (("le", "+Inf"), ("rank", "0"))): 50.0,
    ("kvtier_step_seconds_count", (("rank", "0"),)): 50.0,
    ("kvtier_step_seconds_sum", (("rank", "0"),)): 0.6,
    # lookups in 10 of the 50 steps: 2 ms of wall and 1 ms of CPU per 12 ms step; the save
    # lane's CPU 2 ms per step
    ("kvtier_hook_seconds_count", (("hook", "lookup"), ("rank", "scheduler"))): 10.0,
    ("kvtier_hook_seconds_sum", (("hook", "lookup"), ("rank", "scheduler"))): 0.1,
    ("kvtier_hook_cpu_seconds_total", (("hook", "lookup"), ("rank", "scheduler"))): 0.05,
    ("kvtier_lane_cpu_seconds_total", (("lane", "save"), ("rank", "0"))): 0.1,
}


def _window(wl: Workload, arm: str, rep: int, tier: bool, *, mismatch: int = 0,
            fail: int = 0, extra_ext_queries: int = 0, pace: float = 1.0) -> Window:  # fmt: skip
    """Each request hits half its prompt in HBM (prefix pool) and, with a tier, a quarter more
    outside; TTFT depends on the arm and the repetition; `pace` stretches every time."""
    records, t, prompt, hits, ext = [], 100.0, 0, 0, 0
    for k, s in enumerate(wl.specs):
        n = len(s.prompt)
        h = n // 2 if wl.name == PREFIX_POOL else 0
        x = n // 4 if tier and wl.name == PREFIX_POOL else 0
        ttft = pace * (0.01 + 0.002 * rep + 0.001 * (k % 3) + (0.0 if tier else 0.005))
        out = [3 + (s.index * 7 + j) % 500 for j in range(s.max_tokens)]
        err = "HTTP 500" if k < fail else None
        records.append(
            Record(
                index=s.index, tag=s.tag, prefix_id=s.prefix_id, start=t, first_token=t + ttft,
                end=t + ttft + 0.02 * pace, prompt_tokens=n, cached_tokens=h + x,
                completion_tokens=None if err else s.max_tokens, max_tokens=s.max_tokens,
                sent_prompt_tokens=n, output_ids=out[:-1] + [1] if k < mismatch else out,
                error=err,
            )
        )  # fmt: skip
        t += 0.015 * pace
        if err is None:
            prompt, hits, ext = prompt + n, hits + h, ext + x
    after = {
        ("vllm:prompt_tokens_total", _M): prompt,
        ("vllm:prefix_cache_queries_total", _M): prompt,
        ("vllm:prefix_cache_hits_total", _M): hits,
        ("vllm:external_prefix_cache_queries_total", _M): (
            (prompt - hits if tier else 0) + extra_ext_queries
        ),
        ("vllm:external_prefix_cache_hits_total", _M): ext,
        ("kvtier_retrieved_tokens_total", (("rank", "0"),)): ext,
        **(_STEPS if tier else {}),
    }
    load = LoadResult(records, 100.0, t + 0.05 * pace)
    return Window(wl.name, load, MetricSet({}), MetricSet(after), Path(f"{arm}-{rep}.jsonl"))


Pace = dict[tuple[str, int], float]


def _runs(arms: dict[str, bool], order: list[tuple[int, str]], workloads: list[Workload],
          tier_arm: str, pace: Pace | None = None,
          mismatch: dict[tuple[str, int], int] | None = None) -> list[ArmRun]:  # fmt: skip
    """Every (rep, arm): the tier arm's rep 1 differs on one output and its no-reuse window
    breaks the HBM-miss identity by 3 tokens; the baseline's rep 1 fails one request; `pace`
    stretches an (arm, rep)'s times; `mismatch` gives an (arm, rep) that many wrong outputs."""
    out = []
    for rep, arm in order:
        ws = {
            wl.name: _window(
                wl, arm, rep, arms[arm],
                mismatch=(mismatch or {}).get((arm, rep), int(arm == tier_arm and rep == 1)),
                fail=int(arm not in (tier_arm, EXAMPLE) and rep == 1 and wl.name == NO_REUSE),
                extra_ext_queries=3 if arm == tier_arm and rep == 1 and wl.name == NO_REUSE else 0,
                pace=(pace or {}).get((arm, rep), 1.0),
            )
            for wl in workloads
        }  # fmt: skip
        out.append(ArmRun(arm, rep, arms[arm], ws, 1.0, 0, Path(f"server-{arm}-{rep}.log")))
    return out


def _prepared(host: str) -> tuple[e2e.Plan, object, list[Workload], dict]:
    vllm = host == e2e.VLLM
    plan = e2e.VLLM_QUICK if vllm else e2e.QUICK
    chunk, block = (256, 128) if vllm else (64, 16)
    kv = KVTierConfig.load({"chunk_size": chunk}, {})
    usable = plan.hbm_blocks - (1 if vllm else 0)
    placement, workloads, _warm, ceilings = e2e.prepare(
        plan, usable, block, 40, chunk, kv, 0, 500, lambda _m: None, host=host
    )
    return plan, placement, workloads, ceilings


NATIVE_IDS = [
    *(f"prefix_pool.{m}" for m in e2e.NATIVE_CAST.pool_metrics),
    "prefix_pool.hit_rate_on", "prefix_pool.external_hit_rate_on", "prefix_pool.hit_rate_off",
    "prefix_pool.hit_rate_bound", "prefix_pool.external_hits_on",
    "identity.hbm_misses_eq_external_queries", "identity.retrieved_eq_external_hits",
    "identity.other_failing", "outputs.mismatches", "requests.failed",
    "no_reuse.output_throughput", "no_reuse.ttft_p50_ms",
    "no_reuse.output_throughput.worst_rep", "no_reuse.ttft_p50_ms.worst_rep",
]  # fmt: skip
VLLM_IDS = [
    *(f"prefix_pool.{m}.{a}" for m in ("output_throughput", "ttft_p50_ms", "ttft_p99_ms")
      for a in (KVTIER, EXAMPLE)),
    "prefix_pool.hit_rate.kvtier", "prefix_pool.hbm_hit_rate.kvtier",
    "prefix_pool.external_hit_rate.kvtier", "prefix_pool.hit_rate.example",
    "prefix_pool.hit_rate.none", "prefix_pool.hit_rate_bound.kvtier",
    "prefix_pool.external_hits.kvtier",
    "identity.hbm_misses_eq_external_queries", "identity.retrieved_eq_external_hits",
    "identity.other_failing", "outputs.mismatches", "outputs.mismatches.example",
    "requests.failed",
    *(f"no_reuse.{m}.{a}" for m in ("output_throughput", "ttft_p50_ms") for a in (KVTIER, EXAMPLE)),
    "no_reuse.output_throughput.worst_rep", "no_reuse.ttft_p50_ms.worst_rep",
    "prefix_pool.output_throughput.kvtier_vs_example", "prefix_pool.ttft_p50_ms.kvtier_vs_example",
]  # fmt: skip
STEP_IDS = [
    f"steps.{w}.{r}" for w in ("prefix_pool", "no_reuse") for r in ("step_ms", "ranks.save")
]


def test_native_report_rows_come_from_the_windows() -> None:
    plan, placement, workloads, ceilings = _prepared(e2e.NATIVE)
    runs = _runs({ON: True, OFF: False}, e2e.arm_order(2), workloads, ON)
    cast = e2e.NATIVE_CAST
    wording = e2e.native_wording(plan, placement, 2)
    doc = build_report(cast, wording, runs, [], workloads, ceilings, 1, True).to_json()
    rows = {r["id"]: r for r in doc["rows"]}
    assert [r["id"] for r in doc["rows"] if not r["id"].startswith("steps.")] == NATIVE_IDS
    assert [r["id"] for r in doc["rows"] if r["id"].startswith("steps.")][:1] == STEP_IDS[:1]
    assert doc["title"] == "kvtier bench e2e (native, TP 1, quick)"
    assert rows["prefix_pool.output_throughput"]["label"].startswith(
        "prefix pool: output tok/s, ON (raw = OFF) [1][2]"
    )
    assert rows["identity.hbm_misses_eq_external_queries"]["value"] == 3
    assert rows["outputs.mismatches"]["value"] == 1
    assert rows["requests.failed"]["value"] == 1
    assert rows["prefix_pool.hit_rate_on"]["value"] == pytest.approx(75.0)
    assert rows["prefix_pool.hit_rate_off"]["value"] == pytest.approx(50.0)
    assert rows["no_reuse.output_throughput.worst_rep"]["target"] == ">= 0.97 x"
    detail = rows["prefix_pool.ttft_p50_ms"]["detail"]
    assert {"rep0.on", "rep0.off", "rep1.ratio", "on.sd", "off.sd", "ratio.mean"} <= set(detail)
    assert set(doc["meta"]["outputs"]) == {PREFIX_POOL, NO_REUSE}


def test_the_step_rows_carry_kvtiers_own_cpu_next_to_the_step() -> None:
    plan, placement, workloads, ceilings = _prepared(e2e.NATIVE)
    runs = _runs({ON: True, OFF: False}, e2e.arm_order(2), workloads, ON)
    wording = e2e.native_wording(plan, placement, 2)
    doc = build_report(e2e.NATIVE_CAST, wording, runs, [], workloads, ceilings, 1, True).to_json()
    rows = {r["id"]: r for r in doc["rows"]}
    for w in (PREFIX_POOL, NO_REUSE):
        path, lanes = rows[f"steps.{w}.path_cpu_ms"], rows[f"steps.{w}.lanes_cpu_ms"]
        assert path["value"] == pytest.approx(1.0) and path["raw"] == pytest.approx(12.0)
        assert lanes["value"] == pytest.approx(2.0)
        assert {"rep0.ms", "rep1.ms"} <= set(path["detail"])
        lookup = rows[f"steps.{w}.scheduler.lookup"]
        assert lookup["value"] == pytest.approx(2.0)
        assert lookup["detail"]["rep0.cpu_ms"] == pytest.approx(1.0)
    # one footnote explains the CPU rows of both workloads
    assert sum(f.startswith("CPU rows:") for f in doc["footnotes"]) == 1
    labels = [rows[f"steps.{w}.path_cpu_ms"]["label"] for w in (PREFIX_POOL, NO_REUSE)]
    assert len({label.rsplit(" ", 1)[-1] for label in labels}) == 1


def test_vllm_report_names_each_arm_and_compares_kvtier_with_example() -> None:
    plan, placement, workloads, ceilings = _prepared(e2e.VLLM)
    arms = {KVTIER: True, EXAMPLE: True, NONE: False}
    order = e2e.alternate(list(vllm_host.VLLM_ARMS), 2)
    runs = _runs(arms, order, workloads, KVTIER)
    wording = e2e.vllm_wording(plan, placement, 256, "0", 1, 2)
    doc = build_report(e2e.VLLM_CAST, wording, runs, [], workloads, ceilings, 1, True).to_json()
    rows = {r["id"]: r for r in doc["rows"]}
    assert [r["id"] for r in doc["rows"] if not r["id"].startswith("steps.")] == VLLM_IDS
    assert rows["prefix_pool.hit_rate.example"]["label"].startswith(
        "prefix pool: hit rate, ExampleConnector (raw = infinite-cache bound)"
    )
    assert rows["outputs.mismatches.example"]["target"] is None
    assert rows["outputs.mismatches"]["value"] == 1
    assert rows["prefix_pool.external_hits.kvtier"]["detail"]["example_external_hits"] > 0
    # the kvtier-vs-ExampleConnector rows hold ExampleConnector's values under its own name
    detail = rows["prefix_pool.output_throughput.kvtier_vs_example"]["detail"]
    example = rows["prefix_pool.output_throughput.example"]["detail"]
    assert detail["rep0.example"] == example["rep0.example"]
    assert "rep0.none" not in detail
    assert set(doc["meta"]["outputs"]) == {KVTIER, EXAMPLE}


def test_every_kvtier_ratio_on_vllm_compares_back_to_back_runs() -> None:
    # the machine drifts more over two arms than one: kvtier runs between the arms it is
    # compared with, in every repetition
    order = e2e.alternate(list(vllm_host.RUN_ORDER), 3)
    for rep in range(3):
        names = [name for r, name in order if r == rep]
        at = names.index(KVTIER)
        assert {names[at - 1], names[at + 1]} == {EXAMPLE, NONE}, names


AA_IDS = [
    "no_reuse.output_throughput.aa_worst_rep", "no_reuse.ttft_p50_ms.aa_worst_rep",
    "prefix_pool.output_throughput.aa_worst_rep", "prefix_pool.ttft_p50_ms.aa_worst_rep",
]  # fmt: skip


def test_the_a_a_pair_judges_the_machine_by_the_no_reuse_targets_either_way_round() -> None:
    # OFF again runs 5% faster than OFF in repetition 0 and 1% slower in repetition 1: the A/A
    # ratio of an arm to itself has no sign, so 1.05 misses ">= 0.97" as 1/1.05 would
    plan, placement, workloads, ceilings = _prepared(e2e.NATIVE)
    order = e2e.arm_order(2, again=True)
    assert order == [(0, ON), (0, OFF), (0, OFF_AGAIN), (1, OFF_AGAIN), (1, OFF), (1, ON)]
    pace = {(OFF_AGAIN, 0): 1 / 1.05, (OFF_AGAIN, 1): 1.01}
    runs = _runs({ON: True, OFF: False, OFF_AGAIN: False}, order, workloads, ON, pace)
    cast = replace(e2e.NATIVE_CAST, again=OFF_AGAIN)
    wording = e2e.native_wording(plan, placement, 2, again=True)
    doc = build_report(cast, wording, runs, [], workloads, ceilings, 1, True).to_json()
    rows = {r["id"]: r for r in doc["rows"]}
    ids = [r["id"] for r in doc["rows"]]
    at = ids.index("no_reuse.ttft_p50_ms.worst_rep")
    assert ids[at + 1 : at + 5] == AA_IDS
    tput = rows["no_reuse.output_throughput.aa_worst_rep"]
    assert tput["detail"]["rep0.ratio"] == pytest.approx(1.05, rel=1e-3)
    assert tput["value"] == pytest.approx(1 / 1.05, rel=1e-3)
    assert tput["pass"] is False and tput["target"] == ">= 0.97 x"
    assert "OFF again/OFF (A/A)" in tput["label"]
    ttft = rows["no_reuse.ttft_p50_ms.aa_worst_rep"]
    assert ttft["value"] == pytest.approx(1.05, rel=1e-2) and ttft["pass"] is False
    # the prefix pool's A/A is shown as measured, not judged
    assert rows["prefix_pool.output_throughput.aa_worst_rep"]["pass"] is None
    assert "order ON, OFF, OFF again, then reversed" in doc["footnotes"][0]
    # the tier's own rows still compare with OFF, not with OFF again
    assert rows["no_reuse.output_throughput.worst_rep"]["detail"]["rep0.ratio"] == pytest.approx(
        rows["no_reuse.output_throughput"]["detail"]["rep0.ratio"]
    )


def test_an_a_a_pair_within_the_margin_passes_and_no_pair_adds_no_rows() -> None:
    plan, placement, workloads, ceilings = _prepared(e2e.NATIVE)
    order = e2e.arm_order(1, again=True)
    runs = _runs({ON: True, OFF: False, OFF_AGAIN: False}, order, workloads, ON,
                 {(OFF_AGAIN, 0): 1.01})  # fmt: skip
    cast = replace(e2e.NATIVE_CAST, again=OFF_AGAIN)
    wording = e2e.native_wording(plan, placement, 1, again=True)
    rows = {
        r["id"]: r
        for r in build_report(cast, wording, runs, [], workloads, ceilings, 1, True).to_json()[
            "rows"
        ]
    }
    assert rows["no_reuse.output_throughput.aa_worst_rep"]["pass"] is True
    assert rows["no_reuse.ttft_p50_ms.aa_worst_rep"]["pass"] is True
    plain = build_report(
        e2e.NATIVE_CAST, wording, _runs({ON: True, OFF: False}, e2e.arm_order(1), workloads, ON),
        [], workloads, ceilings, 1, True,
    ).to_json()  # fmt: skip
    assert not any(r["id"].endswith("aa_worst_rep") for r in plain["rows"])


def test_on_vllm_the_a_a_pair_runs_back_to_back_and_kvtier_keeps_its_neighbours() -> None:
    order = e2e.alternate([*vllm_host.RUN_ORDER, NONE_AGAIN], 3)
    for rep in range(3):
        names = [name for r, name in order if r == rep]
        at = names.index(KVTIER)
        assert {names[at - 1], names[at + 1]} == {EXAMPLE, NONE}, names
        assert abs(names.index(NONE_AGAIN) - names.index(NONE)) == 1, names
    assert vllm_host.make_arms({}, Path("store"))[NONE_AGAIN].transfer_config is None


def test_the_a_a_arms_greedy_outputs_must_equal_the_baselines() -> None:
    # the baseline run again is the same server on the same prompts: one output differing
    # there means the host is not deterministic, so the tier's zero mismatches prove nothing
    plan, placement, workloads, ceilings = _prepared(e2e.NATIVE)
    order = e2e.arm_order(1, again=True)
    arms = {ON: True, OFF: False, OFF_AGAIN: False}
    cast = replace(e2e.NATIVE_CAST, again=OFF_AGAIN)
    wording = e2e.native_wording(plan, placement, 1, again=True)

    def row(mismatch: dict[tuple[str, int], int]) -> dict:
        runs = _runs(arms, order, workloads, ON, mismatch=mismatch)
        doc = build_report(cast, wording, runs, [], workloads, ceilings, 1, True).to_json()
        return {r["id"]: r for r in doc["rows"]}["outputs.mismatches.off_again"]

    same = row({})
    assert same["value"] == 0 and same["pass"] is True
    assert "greedy outputs differing OFF again vs OFF (token ids) (A/A)" == same["label"]
    differs = row({(OFF_AGAIN, 0): 2})
    assert differs["value"] == 4 and differs["pass"] is False  # 2 in each of 2 windows
    assert differs["detail"]["compared"] == same["detail"]["compared"] > 0
