"""A synthetic recorded run directory, exactly in the layout `kvtier bench run` writes.

Two arms ("on" with a tier, "off" without) x 2 repetitions over a 4 x 3 multi-turn stream;
per-request hits are the simulator's own (so the server counters close every identity and
each arm measures exactly its predicted ceiling), TTFT differs by arm, and /metrics samples
every second carry a growing tier residency for "on".
"""

from __future__ import annotations

import json
from pathlib import Path

from kvtier.bench.arms import ArmSpec, alternate
from kvtier.bench.ceiling import simulate
from kvtier.bench.client import LoadOptions, Record, write_jsonl
from kvtier.bench.replay import (
    CeilingConfig,
    RunConfig,
    WorkloadConfig,
    build_specs,
    run_meta,
)
from kvtier.bench.table import write_json
from kvtier.bench.workload import MULTI_TURN, RequestSpec, sent_prompts, write_specs
from kvtier.scrape import MetricSet

BLOCK = 16
HBM_BLOCKS = 6
CHUNK = 16
GAP_S = 0.5  # request i is sent at i x GAP_S
TTFT_S = {"on": 0.020, "off": 0.045}
T0 = 1000.0  # the records' clock at each load's start


def outputs_of(spec: RequestSpec) -> list[int]:
    return [3 + (spec.index * 7 + k) % 500 for k in range(spec.max_tokens)]


def per_request_hits(
    prompts: list[tuple[int, ...]], outs: list[list[int]], tier: bool
) -> list[tuple[int, int]]:
    """(HBM, external) hit tokens of each request, as the simulator counts them."""
    out = []
    for i in range(len(prompts)):
        counted = [k == i for k in range(i + 1)]
        c = simulate(
            prompts[: i + 1], block_size=BLOCK, hbm_blocks=HBM_BLOCKS, chunk_size=CHUNK,
            tier_chunks=100 if tier else 0, outputs=outs[: i + 1], counted=counted,
        )  # fmt: skip
        out.append((c.hbm_hit_tokens, c.external_hit_tokens))
    return out


def metrics_text(
    prompt: int, hbm_hits: int, ext_q: int, ext_hits: int, resident: int | None
) -> str:
    lines = [
        "# TYPE vllm:prompt_tokens counter",
        f'vllm:prompt_tokens_total{{model_name="m"}} {prompt}',
        "# TYPE vllm:prefix_cache_queries counter",
        f'vllm:prefix_cache_queries_total{{model_name="m"}} {prompt}',
        "# TYPE vllm:prefix_cache_hits counter",
        f'vllm:prefix_cache_hits_total{{model_name="m"}} {hbm_hits}',
        "# TYPE vllm:external_prefix_cache_queries counter",
        f'vllm:external_prefix_cache_queries_total{{model_name="m"}} {ext_q}',
        "# TYPE vllm:external_prefix_cache_hits counter",
        f'vllm:external_prefix_cache_hits_total{{model_name="m"}} {ext_hits}',
        "# TYPE kvtier_retrieved_tokens counter",
        f'kvtier_retrieved_tokens_total{{rank="0"}} {ext_hits}',
        "# TYPE kvtier_world_size gauge",
        'kvtier_world_size{rank="scheduler"} 1.0',
    ]
    if resident is not None:
        lines += [
            "# TYPE kvtier_tier_residency_bytes gauge",
            f'kvtier_tier_residency_bytes{{rank="0",tier="memory"}} {resident}',
        ]
    return "\n".join(lines) + "\n"


def _scrape_at(t: float, records: list[Record], hits: list[tuple[int, int]], tier: bool) -> str:
    """/metrics at time `t`: every request sent before it fully counted."""
    done = [(r, hit) for r, hit in zip(records, hits, strict=True) if r.start < t]
    p = sum(r.prompt_tokens or 0 for r, _ in done)
    hh = sum(hit[0] for _, hit in done)
    xx = sum(hit[1] for _, hit in done)
    resident = int((t - T0) * 2**20) if tier else None
    return metrics_text(p, hh, p - hh if tier else 0, xx, resident)


def make_run(out: Path, *, cut_s: float = 0.0, bucket_s: float = 1.0) -> Path:
    """Write the run directory under `out` (created) and return it."""
    wc = WorkloadConfig(
        kind=MULTI_TURN, seed=0, vocab=2048, osl=4, isl=24, prefixes=2, prefix_len=32,
        conversations=4, turns=3, bust=1,
    )  # fmt: skip
    argv = ("serve", "--hbm-blocks", str(HBM_BLOCKS), "--block-size", str(BLOCK))
    arms = (
        ArmSpec("on", (*argv, "--offload"), offload=True),
        ArmSpec("off", (*argv, "--no-offload"), offload=False),
    )
    cfg = RunConfig(
        out_dir=out, workload=wc, load=LoadOptions(concurrency=2), arms=arms, repeat=2,
        ceiling=CeilingConfig(BLOCK, HBM_BLOCKS, CHUNK, 100, 0), cut_s=cut_s, bucket_s=bucket_s,
        scrape_interval_s=1.0,
    )  # fmt: skip
    specs = build_specs(wc)
    order = alternate(["on", "off"], 2)
    out.mkdir(parents=True, exist_ok=True)
    write_specs(out / "workload.jsonl", specs)
    meta = run_meta(cfg, order, specs, {})
    meta["complete"] = True
    write_json(out / "meta.json", meta)

    outputs = {s.index: outputs_of(s) for s in specs}
    prompts = sent_prompts(specs, outputs)
    stream = [prompts[s.index] for s in specs]
    outs = [outputs[s.index] for s in specs]
    for rep, arm in order:
        tier = arm == "on"
        hits = per_request_hits(stream, outs, tier)
        records = []
        for s, (h, x) in zip(specs, hits, strict=True):
            start = T0 + s.index * GAP_S
            first = start + TTFT_S[arm] * (1 + 0.1 * rep) + 0.001 * s.turn
            records.append(
                Record(
                    index=s.index, tag=s.tag, prefix_id=s.prefix_id, start=start,
                    first_token=first, end=first + 0.015, prompt_tokens=len(prompts[s.index]),
                    cached_tokens=h + x, completion_tokens=s.max_tokens,
                    max_tokens=s.max_tokens, sent_prompt_tokens=len(prompts[s.index]),
                    output_ids=outputs[s.index], conversation=s.conversation, turn=s.turn,
                    token_times=[first + 0.005 * k for k in range(s.max_tokens)],
                )
            )  # fmt: skip
        finished = max(r.end or 0.0 for r in records)

        before = MetricSet.parse(_scrape_at(T0, records, hits, tier))
        after = MetricSet.parse(_scrape_at(finished + 1, records, hits, tier))
        samples = [
            {
                "t": T0 + k,
                "residency": MetricSet.parse(_scrape_at(T0 + k, records, hits, tier)).by_label(
                    "kvtier_tier_residency_bytes", "tier"
                ),
                "counters": {
                    key: MetricSet.parse(_scrape_at(T0 + k, records, hits, tier)).total(name)
                    for key, name in (
                        ("prompt_tokens", "vllm:prompt_tokens_total"),
                        ("hbm_queries", "vllm:prefix_cache_queries_total"),
                        ("hbm_hits", "vllm:prefix_cache_hits_total"),
                        ("ext_queries", "vllm:external_prefix_cache_queries_total"),
                        ("ext_hits", "vllm:external_prefix_cache_hits_total"),
                        ("retrieved", "kvtier_retrieved_tokens_total"),
                    )
                },
            }
            for k in range(int(finished - T0) + 2)
        ]
        name = f"{arm}-rep{rep}"
        write_jsonl(out / "records" / f"{name}.jsonl", records)
        scrapes = {
            "arm": arm, "rep": rep, "base_url": "http://127.0.0.1:1", "model": "m",
            "argv": list(arms[0 if tier else 1].argv), "offload": tier, "started": T0,
            "finished": finished, "unsent": 0, "stopped_by": "all_sent", "startup_s": 1.0,
            "exit_code": 0, "log": None, "before": before.to_json(), "after": after.to_json(),
            "samples": samples, "sample_errors": 0,
        }  # fmt: skip
        (out / "scrapes").mkdir(exist_ok=True)
        (out / "scrapes" / f"{name}.json").write_text(json.dumps(scrapes))
    return out
