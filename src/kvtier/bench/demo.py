"""The main job (`make demo`): the native engine at TP=2 with the memory tier, a two-pass restore
check over HTTP, then a short ON/OFF prefix-pool run, summarised in one table."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvtier.bench import e2e
from kvtier.bench.arms import Drive, ServerConfig, Workload, post_reset
from kvtier.bench.breakdown import COST_SHARE_LIMIT, cost_share
from kvtier.bench.client import LoadOptions
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
)

CHUNK = 64
RESTORE_PROMPTS = 8
RESTORE_LEN = 5 * CHUNK  # whole chunks: pass 2 can restore all but the last token
# 96 prefix-pool requests (and 38 unique ones) per arm: a fresh clone's `make demo`, its .venv
# build included, takes 3m55s-4m15s on 2 cores; with 80, the shorter no-reuse window read the
# tier's cost at 0.96x and 0.89x against 1.10x and 1.02x with 96
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


def restore_check(model: Path, tp: int, env: dict[str, str], say: Any) -> dict[str, Any]:
    """Pass 1 stores; the HBM prefix cache is reset; pass 2 must come from the tier."""
    specs = _restore_specs(int(e2e.model_config(model)["vocab_size"]))
    runs = Path("runs")
    log = runs / "demo-restore-server.log"
    # the check is of the restore path, not of the load policy: under `load_policy: cost` a
    # loaded 2-core host can judge a memory load slower than a small model's prefill and
    # recompute pass 2 by design, which this check would call a FAIL
    env = {**env, "KVTIER_LOAD_POLICY": "always"}
    server = ServerConfig(model_dir=model, tp=tp, hbm_blocks=256, max_num_seqs=4, env=env)
    drive = Drive(
        [Workload("pass1", specs), Workload("pass2", specs)],
        runs,
        LoadOptions(concurrency=4, require_token_ids=True),
        reset=post_reset("/reset_prefix_cache"),
        say=say,
        progress=False,
        records="demo-restore-{workload}.jsonl",
    )
    what = f"kvtier serve (TP={tp}, memory tier): pass 1 stores, pass 2 restores"
    run = drive.run("restore", 0, True, server.process(log), what=what)
    first, second = run.windows["pass1"], run.windows["pass2"]
    prompt = sum(len(s.prompt) for s in specs)
    delta, end = second.delta, second.after
    assert end is not None
    ext = delta.total(EXT_HITS)
    hbm = delta.total(HBM_HITS)
    same = [
        a.output_ids == b.output_ids
        for a, b in zip(first.load.records, second.load.records, strict=True)
    ]
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
        bars=False,
        json_path=Path("runs") / "demo-e2e.json",
    )
    full = Path("runs") / "demo-full-table.txt"
    with full.open("w", encoding="utf-8") as f:
        print_report(doc, console=Console(file=f, width=140))
    png = write_figure(doc, Path("runs") / "demo.png")
    ok = _print_table(con, restore, doc, tp)
    say(f"done in {time.perf_counter() - t0:.0f}s; full table: {full} (and runs/demo-e2e.json), "
        f"figure: {png}")  # fmt: skip
    return 0 if ok else 1


# the e2e rows the story reads (the full table is in the run directory)
_ROW = {
    "on": "prefix_pool.hit_rate_on",
    "off": "prefix_pool.hit_rate_off",
    "ttft": "prefix_pool.ttft_p50_ms",
    "ttft_aa": "prefix_pool.ttft_p50_ms.aa_worst_rep",
    "tput": "prefix_pool.output_throughput",
    "tput_aa": "prefix_pool.output_throughput.aa_worst_rep",
    "cost": "no_reuse.output_throughput",
    "cost_path": "steps.no_reuse.path_ms",
    "cost_lanes": "steps.no_reuse.lanes_cpu_ms",
    "cost_aa": "no_reuse.output_throughput.aa_worst_rep",
    "mismatch": "outputs.mismatches",
    "failed": "requests.failed",
}
_IDENTITIES = ("identity.hbm_misses_eq_external_queries", "identity.retrieved_eq_external_hits")
MAX_ROWS = 12


def tier_cost_share(rows: dict[str, dict[str, Any]]) -> float | None:
    """The ON arm's no-reuse window: kvtier's share of the step (`breakdown.cost_share`),
    from the report's step rows (value = ms per step, raw = the step's mean)."""
    path, lanes = rows.get(_ROW["cost_path"]), rows.get(_ROW["cost_lanes"])
    if path is None:
        return None
    return cost_share(path["value"], None if lanes is None else lanes["value"], path.get("raw"))


def story(restore: dict[str, Any], doc: dict[str, Any], tp: int) -> list[tuple[str, str, str]]:
    """The demo's table: (what, value, verdict) rows, at most `MAX_ROWS`; verdicts are PASS,
    FAIL or "" for a measurement, and the last row is the overall verdict."""
    rows = {r["id"]: r for r in doc.get("rows", [])}
    out: list[tuple[str, str, str]] = []

    def check(name: str, value: str, ok: bool) -> None:
        out.append((name, value, "PASS" if ok else "FAIL"))

    def ratio(key: str) -> float:
        r = rows[_ROW[key]]
        return r["value"] / r["raw"] if r.get("raw") else float("nan")

    frac = restore["restored_fraction"]
    tokens = restore["per_rank_tokens"]
    even = len(tokens) == tp and len(set(tokens.values())) == 1 and min(tokens.values()) > 0
    check(
        "restore: HBM emptied, pass 2 served by the tier",
        f"{frac:.1%} of prompt tokens, {tp} ranks evenly" if even else f"{frac:.1%}, ranks uneven",
        frac >= 0.99 and even and restore["hbm_hits"] == 0,
    )
    check("restore: greedy outputs equal pass 1", str(restore["outputs_equal"]),
          restore["outputs_equal"])  # fmt: skip
    on, off = rows[_ROW["on"]], rows[_ROW["off"]]
    out.append((
        "prefix pool: hit rate ON vs OFF",
        f"{on['value']:.1f}% vs {off['value']:.1f}% (ceilings {on['raw']:.1f}% / "
        f"{off['raw']:.1f}%)",
        "",
    ))  # fmt: skip
    aa_t, aa_p = rows[_ROW["ttft_aa"]]["value"], rows[_ROW["tput_aa"]]["value"]
    out.append(("prefix pool: TTFT p50 ON/OFF", f"{ratio('ttft'):.2f}x (A/A {aa_t:.2f}x)", ""))
    out.append(("prefix pool: output tok/s ON/OFF", f"{ratio('tput'):.2f}x (A/A {aa_p:.2f}x)", ""))
    # the tier's cost is judged by kvtier's own time on the ON arm's steps, read within one
    # window; the ON/OFF ratio of two 12 s windows moves 5-10% with a 2-core machine alone
    # (it failed a correct tier at 0.91x), so it is shown beside the verdict, not as one
    share = tier_cost_share(rows)
    cost, cost_aa = ratio("cost"), rows[_ROW["cost_aa"]]["value"]
    out.append((
        "no reuse: output tok/s ON/OFF",
        f"{cost:.2f}x (A/A {cost_aa:.2f}x: the machine's own noise)",
        "",
    ))  # fmt: skip
    check(
        "the tier's cost: kvtier's time on the step",
        "not measured" if share is None
        else f"{share:.1%} of the step (limit {COST_SHARE_LIMIT:.0%})",
        share is not None and share <= COST_SHARE_LIMIT,
    )
    mism = rows[_ROW["mismatch"]]
    check("greedy outputs ON vs OFF", f"{mism['value']:.0f} differ", bool(mism.get("pass")))
    q, eq = restore["identity_queries"]
    r, er = restore["identity_retrieved"]
    ids_ok = q == eq and r == er and all(rows[i].get("pass") for i in _IDENTITIES if i in rows)
    check("counter identities (restore and both arms)", "all hold" if ids_ok else "broken",
          ids_ok)  # fmt: skip
    failed = rows[_ROW["failed"]]
    check("requests failed, every arm", f"{failed['value']:.0f}", bool(failed.get("pass")))
    ok = all(v != "FAIL" for _, _, v in out)
    out.append(("verdict", "the tier brings back what HBM lost, outputs equal" if ok
                else "a check failed: see the full table", "PASS" if ok else "FAIL"))  # fmt: skip
    assert len(out) <= MAX_ROWS
    return out


def _print_table(con: Console, restore: dict[str, Any], doc: dict[str, Any], tp: int) -> bool:
    rows = story(restore, doc, tp)
    t = Table(title=f"kvtier demo: native engine TP={tp}, host-memory tier")
    t.add_column("what")
    t.add_column("value", justify="right")
    t.add_column("result")
    for name, value, verdict in rows:
        t.add_row(name, value, verdict or "—")
    con.print(t)
    return rows[-1][2] == "PASS"


def write_figure(doc: dict[str, Any], path: Path) -> Path:
    """Hit rate and TTFT p50, ON vs OFF, next to the ceilings (a PNG)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = {r["id"]: r for r in doc.get("rows", [])}
    on, off, ttft = rows[_ROW["on"]], rows[_ROW["off"]], rows[_ROW["ttft"]]
    fig = Figure(figsize=(9, 4), dpi=100)
    FigureCanvasAgg(fig)
    hits, lat = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    hits.bar(["OFF", "ON"], [off["value"], on["value"]], color=["C7", "C0"])
    hits.scatter(["OFF", "ON"], [off["raw"], on["raw"]], marker="_", s=900, color="k",
                 label="ceiling")  # fmt: skip
    hits.set_ylabel("prompt tokens from cache (%)")
    hits.set_title("prefix pool: hit rate")
    hits.legend()
    lat.bar(["OFF", "ON"], [ttft["raw"], ttft["value"]], color=["C7", "C0"])
    lat.set_ylabel("TTFT p50 (ms)")
    lat.set_title("prefix pool: time to first token")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
