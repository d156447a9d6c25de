"""The main job (`make demo`): the native engine at TP=2 with the memory tier, a two-pass restore
check over HTTP, then a short ON/OFF prefix-pool run, summarised in one table."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvtier.bench import e2e
from kvtier.bench.arms import ServerConfig, ServerProcess, free_port, settled_metrics
from kvtier.bench.client import run_load
from kvtier.bench.table import print_report, report_console
from kvtier.bench.workload import RequestSpec
from kvtier.scrape import (
    EXT_HITS,
    EXT_QUERIES,
    HBM_HITS,
    HBM_QUERIES,
    LOADS,
    RETRIEVED,
    SCHEDULER,
    MetricSet,
)

CHUNK = 64
RESTORE_PROMPTS = 8
RESTORE_LEN = 5 * CHUNK  # whole chunks: pass 2 can restore all but the last token
DEMO_REQUESTS = 96


def _restore_specs(vocab: int, seed: int = 7) -> list[RequestSpec]:
    rng = random.Random(seed)
    return [
        RequestSpec(
            index=i,
            tag="restore",
            prompt=tuple(rng.randrange(3, vocab) for _ in range(RESTORE_LEN)),
            max_tokens=8,
            prefix_id=None,
        )
        for i in range(RESTORE_PROMPTS)
    ]


async def _two_passes(base_url: str, specs: list[RequestSpec]) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=base_url, timeout=120.0) as http:
        first = await run_load(base_url, specs, concurrency=4, progress=False, label="pass 1")
        mid = await settled_metrics(http, 15.0)
        resp = await http.post("/reset_prefix_cache")
        resp.raise_for_status()
        second = await run_load(base_url, specs, concurrency=4, progress=False, label="pass 2")
        end = await settled_metrics(http, 15.0)
    return {"first": first, "second": second, "mid": mid, "end": end}


def restore_check(model: Path, tp: int, env: dict[str, str], say: Any) -> dict[str, Any]:
    """Pass 1 stores; the HBM prefix cache is reset; pass 2 must come from the tier."""
    import json

    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    specs = _restore_specs(vocab)
    cfg = ServerConfig(model_dir=model, tp=tp, hbm_blocks=256, max_num_seqs=4, env=env)
    port = free_port()
    log = Path("runs") / "demo-restore-server.log"
    say(f"starting kvtier serve (TP={tp}, memory tier) for the two-pass restore check")
    with ServerProcess(
        cfg.argv(port, offload=True), cfg.environ(), f"http://127.0.0.1:{port}", log
    ) as server:
        say(f"server ready in {server.startup_s:.1f}s; pass 1 stores, pass 2 restores")
        res = asyncio.run(_two_passes(server.base_url, specs))
    delta: MetricSet = res["end"].delta(res["mid"])
    prompt = sum(len(s.prompt) for s in specs)
    ext = delta.total(EXT_HITS)
    hbm = delta.total(HBM_HITS)
    same = [
        a.output_ids == b.output_ids
        for a, b in zip(res["first"].records, res["second"].records, strict=True)
    ]
    end: MetricSet = res["end"]
    per_rank_tokens = end.by_label(RETRIEVED, "rank")
    per_rank_loads = end.by_label(LOADS, "rank")
    per_rank_tokens.pop(SCHEDULER, None)
    per_rank_loads.pop(SCHEDULER, None)
    queries = end.total(HBM_QUERIES)
    hits = end.total(HBM_HITS)
    ext_q = end.total(EXT_QUERIES)
    ext_total = end.total(EXT_HITS)
    return {
        "prompt_tokens": prompt,
        "external_hits": ext,
        "hbm_hits": hbm,
        "restored_fraction": ext / prompt,
        "outputs_equal": all(same),
        "per_rank_tokens": per_rank_tokens,
        "per_rank_loads": per_rank_loads,
        "identity_queries": (queries - hits, ext_q),
        "identity_retrieved": (sum(per_rank_tokens.values()) / tp, ext_total),
        "log": str(log),
    }


def run(tp: int = 2, console: Console | None = None) -> int:
    """Run the demo; returns the process exit code (1 when a correctness check fails)."""
    con = console or report_console()
    t0 = time.perf_counter()

    def say(msg: str) -> None:
        con.print(f"[dim]{time.perf_counter() - t0:6.1f}s[/dim] {escape(msg)}")

    say("building (or reusing) the small demo model under runs/")
    model = e2e.ensure_model(None, "small")
    # the engine process and both ranks share 2 cores here: give a rank's lookup thread time
    env = {
        "KVTIER_CHUNK_SIZE": str(CHUNK),
        "KVTIER_MEMORY_BYTES": "256MiB",
        "KVTIER_LOOKUP_TIMEOUT_MS": "2000",
    }
    restore = restore_check(model, tp, env, say)
    say(
        f"restore: {restore['external_hits']:.0f} of {restore['prompt_tokens']} prompt tokens "
        f"from the tier ({restore['restored_fraction']:.1%}), HBM hits {restore['hbm_hits']:.0f}"
    )
    say(f"ON/OFF prefix-pool run: {DEMO_REQUESTS} requests per arm, TP={tp}")
    doc = e2e.run(
        tp=tp,
        chunk_size=CHUNK,
        requests=DEMO_REQUESTS,
        progress=say,
        console=con,
        json_path=Path("runs") / "demo-e2e.json",
    )
    ok = _print_table(con, restore, doc, tp)
    say(f"done in {time.perf_counter() - t0:.0f}s")
    return 0 if ok else 1


# rows of the e2e report that are correctness checks (the rest are measurements to report)
_PERF_ROWS = ("no_reuse.",)


def _print_table(con: Console, restore: dict[str, Any], doc: dict[str, Any], tp: int) -> bool:
    t = Table(title=f"kvtier demo: two-pass restore, native engine TP={tp}, memory tier")
    t.add_column("check")
    t.add_column("value", justify="right")
    t.add_column("result")
    checks: list[bool] = []

    def add(name: str, value: str, ok: bool) -> None:
        checks.append(ok)
        t.add_row(name, value, "PASS" if ok else "FAIL")

    tokens = restore["per_rank_tokens"]
    hist = ", ".join(
        f"rank {r}: {int(restore['per_rank_loads'].get(r, 0))} loads / {int(v)} tokens"
        for r, v in sorted(tokens.items())
    )
    even = len(tokens) == tp and len(set(tokens.values())) == 1 and min(tokens.values()) > 0
    frac = restore["restored_fraction"]
    add("pass-2 prompt tokens served by the tier", f"{frac:.2%}", frac >= 0.99)
    add("pass-2 HBM prefix-cache hits", f"{restore['hbm_hits']:.0f}", restore["hbm_hits"] == 0)
    add(
        "pass-2 greedy outputs equal pass 1",
        str(restore["outputs_equal"]),
        restore["outputs_equal"],
    )
    add("per-rank Retrieved histogram (even)", hist, even)
    add(
        "external prefix-cache hits",
        f"{restore['external_hits']:.0f}",
        restore["external_hits"] > 0,
    )
    q, eq = restore["identity_queries"]
    add("prefix queries - hits == external queries", f"{q:.0f} == {eq:.0f}", q == eq)
    r, er = restore["identity_retrieved"]
    add("sum of per-rank retrieved / TP == external hits", f"{r:.0f} == {er:.0f}", r == er)
    con.print(t)
    print_report(doc, console=con)
    for row in doc.get("rows", []):
        if row.get("pass") is not None and not row["id"].startswith(_PERF_ROWS):
            checks.append(bool(row["pass"]))
    return all(checks)
