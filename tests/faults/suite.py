"""The fault suite under load against the native engine (tests/faults/test_fault_suite.py).

Invariant 9 (degrade, never break) measured: for each fault a fresh engine (in-process
`EngineServer`; TP ranks are worker processes) with a memory tier of a few chunks, so that
replays read from the tier below it, serves three phases over its HTTP API:

* before: a seed pass of new prompts, the write-behind drained, the HBM prefix cache reset,
  then a replay of the same prompts (its external hits are the phase's hits);
* during: the same with the fault on;
* after: the same once the fault is cleared and the engine has noticed.

Every output is checked token for token against a run of the same prompts without offload.
A row reads "nothing lost" when every request sent completed and every output was right; hits
may drop during a fault (that is the price), and must come back after it.

Faults are injected where they happen in production: the shared store is a real `redis-server`
the suite starts, kills, restarts, stalls (DEBUG SLEEP) and corrupts from outside; disk-full,
an unreachable lookup server and a failing load lane are switched inside the ranks by a small
fault agent (a thread of the suite's connector, driven by flag files in a control directory:
`tests.faults.inject`). One fault's phases are `tests.faults.runner`; this module is the suite
and its table.
A genuinely full filesystem is an 8 MiB tmpfs a filler file fills; HBM-pool pressure is a pool
that fits two tier loads, replayed all at once; a killed TP rank is a SIGKILL, and that row
passes on a clean failure (the engine names the rank and stops, nothing is served wrong); a
namespace collision is a second weight set with the same config.json and directory name on
the same disk tier; the sampling edge values are replays with temperature 1e-39 and the like.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from kvtier import __version__
from kvtier.bench.table import MISS, Report, Row, Target, write_json
from kvtier.errors import ConfigError, StartupError
from tests.faults import fault_env
from tests.faults.inject import log_to
from tests.faults.runner import (
    CHUNK,
    MAX_TOKENS,
    MEMORY_CHUNKS,
    PRESSURE_BLOCKS,
    PROMPT_LEN,
    Fault,
    FaultResult,
    FaultRun,
    PhaseResult,
    Plan,
    Progress,
    greedy_reference,
    prompts_for,
)
from tests.redis_local import RedisServer, RedisServerError

FAULTS: dict[str, Fault] = {
    f.name: f
    for f in (
        Fault(
            "remote_restart",
            "remote killed + restarted",
            "remote",
            ("ranks:store_failures{tier=remote}", "ranks:dropped_writes{tier=remote}"),
        ),
        Fault(
            "remote_slow",
            "remote slow (DEBUG SLEEP)",
            "remote",
            ("ranks:store_failures{tier=remote}", "ranks:dropped_writes{tier=remote}"),
        ),
        Fault(
            "remote_corrupt",
            "corrupted remote values",
            "remote",
            ("ranks:verify_failures{tier=remote}", "scheduler:load_failures"),
        ),
        Fault("disk_full", "disk full (ENOSPC)", "disk", ("ranks:store_failures{tier=disk}",)),
        Fault(
            "lookup_down",
            "a rank's lookup server unreachable",
            "disk",
            ("scheduler:lookup_timeouts", "scheduler:skipped_loads{reason=lookup_timeout}"),
        ),
        Fault("load_fail", "a load failing on one rank", "disk", ("scheduler:load_failures",)),
        Fault(
            "hbm_pressure",
            "HBM pool fits two loads, replays all at once",
            "disk",
            ("engine:num_preemptions", "scheduler:skipped_loads"),
            pool_blocks=PRESSURE_BLOCKS,
        ),
        Fault(
            "tp_rank_killed",
            "a TP rank killed (SIGKILL)",
            "disk",
            ("engine:error",),
            min_tp=2,
            clean_failure=True,
        ),
        Fault(
            "disk_tmpfs",
            "filesystem genuinely full (8 MiB tmpfs)",
            "disk",
            # a full filesystem shrinks the tier's budget and evicts (tier_full on ENOSPC)
            (
                "ranks:store_failures{tier=disk}",
                "ranks:tier_full{tier=disk}",
                "ranks:evictions{tier=disk}",
            ),
        ),
        Fault(
            "namespace_collision",
            "other weights, same config.json and dir name",
            "disk",
            ("scheduler:lookups",),
        ),
        Fault("sampling_edges", "sampling edge values (temperature 1e-39, ...)", "disk", ()),
    )
}


FULL = Plan(prompts_per_phase=8, concurrency=4, tp=2)
QUICK = Plan(prompts_per_phase=4, concurrency=4, tp=1)


def shared_store(work_dir: Path) -> RedisServer:
    """The throwaway redis-server of the shared-tier faults (DEBUG on, for the staller), not
    started yet; StartupError naming the way out when there is no redis-server."""
    try:
        return RedisServer(work_dir, debug=True)
    except RedisServerError as e:
        raise StartupError(
            f"the fault suite needs `redis-server` on PATH for the shared-tier faults ({e}); "
            "or run only the disk and rank faults (faults=['disk_full', 'lookup_down', "
            "'load_fail'])"
        ) from None


@contextmanager
def _logging_to(path: Path) -> Iterator[None]:
    """The `kvtier` loggers of this process write to `path` only, for the duration."""
    logger = logging.getLogger("kvtier")
    saved = (logger.level, logger.propagate)
    handler = log_to(path)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        handler.close()
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


@contextmanager
def _workdir() -> Iterator[Path]:
    # short and private: lookup ipc sockets live under it
    path = Path(tempfile.mkdtemp(prefix="kvf-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def run(
    json_path: str | Path,
    quick: bool = False,
    *,
    faults: Sequence[str] | None = None,
    tp: int | None = None,
    model_dir: str | Path | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Run the fault suite, write the JSON report to `json_path` and return it.

    `faults` picks a subset of `FAULTS` (default: all, in order); `tp` overrides the plan's TP
    size (2, or 1 with `quick`); `model_dir` defaults to a tiny float32 model built in a temp
    directory. A lost request is reported in its row (`pass: false`), never raised.
    """
    out = Path(json_path)
    if out.is_dir():
        raise ValueError(
            f"json_path {str(out)!r} is a directory; pass a file path such as {out}/x.json"
        )
    names = list(FAULTS) if not faults else list(faults)
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        raise ConfigError(f"unknown faults {unknown}; pick from {list(FAULTS)}")
    plan = QUICK if quick else FULL
    world = plan.tp if tp is None else tp
    if world < 1:
        raise ConfigError(f"tp={world} must be >= 1")
    say = progress or (lambda _msg: None)
    report = Report("faults", "fault suite" + (" (quick)" if quick else ""))
    t0 = time.monotonic()
    out.parent.mkdir(parents=True, exist_ok=True)
    log_path = out.with_suffix(".log")
    say(f"engine logs (injected failures log tracebacks): {log_path}")
    with _workdir() as work, _logging_to(log_path):
        # first: a missing redis-server fails the run before anything is built
        needs_store = any(FAULTS[n].lower == "remote" for n in names)
        store = shared_store(work / "redis") if needs_store else None
        model = Path(model_dir) if model_dir is not None else _tiny_model(work / "model")
        k = plan.prompts_per_phase
        prompts = {
            n: {
                ph: prompts_for(1000 * i + j, k)
                for j, ph in enumerate(("before", "during", "after"))
            }
            for i, n in enumerate(names)
        }
        every = [p for per in prompts.values() for ps in per.values() for p in ps]
        say(f"reference: {len(every)} prompts without offload (tp={world})")
        reference = greedy_reference(model, world, every)
        results: list[FaultResult] = []
        try:
            if store is not None:
                store.start()
                say(f"redis-server on {store.url}")
            for i, name in enumerate(names):
                fault = FAULTS[name]
                if store is not None:
                    if not store.running:
                        store.restart()
                    store.flushall()
                fault_tp = max(world, fault.min_tp)
                say(f"[{name}] {fault.title}: engine tp={fault_tp}, memory + {fault.lower}")
                args: dict[str, Any] = {
                    "tp": fault_tp, "plan": plan, "prompts": prompts[name], "store": store,
                    "say": say, "log_path": log_path,
                }  # fmt: skip
                if name == "namespace_collision":
                    results.append(_run_collision(fault, model, reference, work / f"f{i}", args))
                    continue
                fw = work / f"f{i}"
                run_ = FaultRun(fault, model_dir=model, reference=reference, work=fw, **args)
                try:
                    results.append(run_.run())
                finally:
                    run_.close()
        finally:
            if store is not None:
                store.kill()
    for res in results:
        _add_row(report, res)
    report.meta = {
        "kvtier": __version__,
        "quick": quick,
        "plan": {**asdict(plan), "tp": world},
        "prompt_tokens": PROMPT_LEN,
        "chunk_size": CHUNK,
        "memory_chunks_per_rank": MEMORY_CHUNKS,
        "max_tokens": MAX_TOKENS,
        "elapsed_s": round(time.monotonic() - t0, 2),
    }
    report.footnotes.append(
        "hits = external prefix-cache hit tokens of each phase's replay; verified = greedy "
        "token ids equal a run of the same prompts without offload"
    )
    doc = report.to_json()
    write_json(out, doc)
    say(f"wrote {out}")
    return doc


def _run_collision(
    fault: Fault,
    model: Path,
    reference: dict[tuple[int, ...], list[int]],
    work: Path,
    args: dict[str, Any],
) -> FaultResult:
    """Weights A fill a disk tier; weights B, under the same config.json and directory name,
    then replay A's prompts on that tier: every output must be B's own, and B may hit only what
    B stored."""
    t0 = time.monotonic()
    disk = work / "disk"
    first = FaultRun(
        fault, model_dir=model, reference=reference, work=work / "a", disk_dir=disk, **args
    )
    try:
        phases = {"before": first.phase("before")}
    finally:
        first.close()
    other = fault_env.other_weights(model, work / "weights-b")
    prompts = args["prompts"]
    ref_b = greedy_reference(other, args["tp"], [*prompts["before"], *prompts["after"]])
    args["say"](f"[{fault.name}] second weight set at {other}, same config.json and name")
    second = FaultRun(
        fault, model_dir=other, reference=ref_b, work=work / "b", disk_dir=disk, **args
    )
    try:
        during = PhaseResult()
        hits0 = second.stats()["external_prefix_cache_hits"]
        second.replay(prompts["before"], "during-replay", during)
        during.hit_tokens = int(second.stats()["external_prefix_cache_hits"] - hits0)
        if all(ref_b[tuple(p)] == reference[tuple(p)] for p in prompts["before"]):
            # the check cannot tell the two models apart: it proves nothing
            during.verified = 0
            during.errors.append("the second weight set gives the first one's outputs")
        phases["during"] = during
        phases["after"] = second.phase("after")
        return second.result(phases, t0)
    finally:
        second.close()


def _tiny_model(path: Path) -> Path:
    from kvtier.native.modelgen import init_model

    return init_model(path, dtype="float32")


def _add_row(report: Report, res: FaultResult) -> None:
    why = {
        k: v for k, v in res.counters.items() if any(_matches(k, w) for w in FAULTS[res.fault].why)
    }
    detail: dict[str, float | int | str] = {
        "fault": res.fault,
        "title": res.title,
        "sent": res.sent,
        "completed": res.completed,
        "verified": res.verified,
        "nothing_lost": "yes" if res.nothing_lost else "no",
        "hits_before": res.phases["before"].hit_tokens,
        "hits_during": res.phases["during"].hit_tokens,
        "hits_after": res.phases["after"].hit_tokens if "after" in res.phases else 0,
        "outcome": "clean failure" if res.clean_failure else "nothing lost",
        "ended_cleanly": "yes" if res.ended_cleanly else "no",
        "engine_error": res.engine_error[:500],
        "ranks_left": res.ranks_left,
        "hit_tokens_possible": res.hit_tokens_possible,
        "why": ", ".join(f"{_short(k)}={v:g}" for k, v in sorted(why.items())) or "—",
        "seconds": res.seconds,
        "errors": "; ".join(e for p in res.phases.values() for e in p.errors)[:2000],
    }
    for key, value in sorted(res.counters.items()):
        detail[f"counter:{key}"] = value
    if res.clean_failure:
        # the engine cannot serve on: what counts is how it stopped
        row = Row(
            id=res.fault,
            label=f"{res.title}: ended cleanly",
            value=1.0 if res.ended_cleanly else 0.0,
            unit="clean",
            target=Target("value", ">=", 1.0),
            detail=detail,
        )
    else:
        row = Row(
            id=res.fault,
            label=f"{res.title}: verified / sent",
            value=float(res.verified),
            unit="requests",
            raw=float(res.sent),
            target=Target("ratio", ">=", 1.0),
            detail=detail,
        )
    report.add(row)


def _short(counter: str) -> str:
    """`where:family{k=v,...}` as `family(v,...)`, for the table."""
    name = counter.partition(":")[2]
    family, _, labels = name.partition("{")
    values = [kv.partition("=")[2] for kv in labels.rstrip("}").split(",") if kv]
    return f"{family}({','.join(values)})" if values else family


def _matches(counter: str, pattern: str) -> bool:
    """Whether counter `where:family{labels}` is where and of the family `pattern` names, and
    carries its labels."""
    where, _, name = counter.partition(":")
    want_where, _, want_name = pattern.partition(":")
    family, _, labels = name.partition("{")
    want_family, _, want = want_name.partition("{")
    if (where, family) != (want_where, want_family):
        return False
    have = set(labels.rstrip("}").split(",")) if labels else set()
    return all(w in have for w in want.rstrip("}").split(",") if w)


# ----------------------------------------------------------------------------------------------
# output
# ----------------------------------------------------------------------------------------------


def render(doc: dict[str, Any]) -> Group:
    """The fault table: per fault, requests sent/completed/verified, hits per phase, why."""
    table = Table(title=str(doc.get("title", "fault suite")), title_justify="left")
    # compact headers so the table stays readable in an 80-column terminal or CI log
    table.add_column("fault", ratio=3, min_width=11)
    for col in ("sent", "done", "ok", "hits\nbefore", "hits\nduring", "hits\nafter"):
        table.add_column(col, justify="right", no_wrap=True)
    table.add_column("metrics say", ratio=4, overflow="fold", min_width=10)
    table.add_column("result", ratio=1, min_width=7)
    lost = 0
    for row in doc["rows"]:
        d = row["detail"]
        ok = row["pass"]
        lost += 0 if ok else 1
        table.add_row(
            str(d["title"]),
            str(d["sent"]),
            str(d["completed"]),
            str(d["verified"]),
            str(d["hits_before"]),
            str(d["hits_during"]),
            str(d["hits_after"]),
            str(d["why"]).replace(", ", "\n"),
            _verdict(d, bool(ok)),
        )
    parts: list[Table | Text] = [table]
    for i, note in enumerate(doc.get("footnotes", []), start=1):
        parts.append(Text(f"[{i}] {note}", style="dim"))
    summary = f"as intended: {len(doc['rows']) - lost} of {len(doc['rows'])} faults"
    parts.append(Text(summary, style="bold green" if lost == 0 else "bold red"))
    return Group(*parts)


def _verdict(d: dict[str, Any], ok: bool) -> Text:
    if d.get("outcome") == "clean failure":
        if ok:
            return Text("clean failure", style="bold green")
        return Text(f"{MISS}: did not end cleanly", style="bold red")
    if ok:
        return Text("nothing lost", style="bold green")
    return Text(f"{MISS}: {d['sent'] - d['verified']} lost", style="bold red")
