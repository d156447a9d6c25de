"""From a URL to a verdict: `diagnose` runs every check on one scrape, `fetch_metrics` reads
it, the table or JSON shows it, and `doctor_command` exits 1 on any FAIL (2 when unread)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import typer

from kvtier.doctor import coverage, health
from kvtier.doctor.result import DROPPED, HOOK_ERRORS, SAVE_FAILURES, VERIFY, Check, Status
from kvtier.doctor.samples import Samples, declared
from kvtier.scrape import SCHEDULER, WORLD_SIZE, MetricSet


class DoctorError(Exception):
    """The server or the log could not be read (unreachable, not HTTP 200); exit code 2."""


# the most ranks an engine can have that doctor will walk (a larger value is not a kvtier
# server's: doctor would loop over it)
MAX_RANKS = 65536


def diagnose(metrics_text: str, log_text: str | None, tp: int | None) -> list[Check]:
    """Every check on one /metrics scrape (and the startup log, when given), per engine when
    several report (vLLM data parallelism), each check's worst verdict naming the engine.

    `tp` is the tensor-parallel size the deployment intends; None takes the server's world.
    Raises ValueError for a `tp` below 1, text that is not Prometheus exposition, or a rank
    count or rank label that is not one.
    """
    if tp is not None and tp < 1:
        raise ValueError(f"--tp {tp} must be >= 1 (the engine's tensor-parallel size)")
    try:
        ms = MetricSet.parse(metrics_text)
    except ValueError as exc:
        raise ValueError(f"the /metrics body is not Prometheus text ({exc})") from None
    _check_ranks(ms)
    names = declared(metrics_text)
    per_engine = {e: _diagnose_engine(m, names, log_text, tp) for e, m in ms.engines().items()}
    if len(per_engine) == 1:
        return next(iter(per_engine.values()))
    return _merge(per_engine)


def _world(value: float) -> int:
    """The scheduler's `kvtier_world_size`, checked: a whole number of ranks."""
    if not (math.isfinite(value) and value.is_integer() and 1 <= value <= MAX_RANKS):
        raise ValueError(
            f'{WORLD_SIZE}{{rank="scheduler"}} is {value}, not a rank count (a whole number '
            f"from 1 to {MAX_RANKS}): this /metrics is not a kvtier server's, or it is damaged"
        )
    return int(value)


def _check_ranks(ms: MetricSet) -> None:
    """Every `rank` label of a kvtier sample is "scheduler" or a rank number doctor can walk."""
    for name, key in ms.samples:
        rank = dict(key).get("rank")
        if rank is None or rank == SCHEDULER or not name.startswith("kvtier_"):
            continue
        if not (rank.isascii() and rank.isdigit() and int(rank) < MAX_RANKS):
            raise ValueError(
                f"{name} has rank={rank!r}, not a rank number below {MAX_RANKS}: this /metrics "
                "is not a kvtier server's, or it is damaged"
            )


_WORST = (Status.FAIL, Status.WARN, Status.UNDETERMINED, Status.PASS)


def _merge(per_engine: dict[str, list[Check]]) -> list[Check]:
    """One check per name: the worst engine's verdict; the detail names each engine's when
    they differ, and the numbers are per engine."""
    out = []
    by_name: dict[str, dict[str, Check]] = {}
    for engine, checks in per_engine.items():
        for ch in checks:
            by_name.setdefault(ch.name, {})[engine] = ch
    for name, checks in by_name.items():
        status = min((ch.status for ch in checks.values()), key=_WORST.index)
        details = {ch.detail for ch in checks.values()}
        if len(details) == 1:
            detail = details.pop()
        else:
            order = sorted(checks, key=lambda e: (_WORST.index(checks[e].status), e))
            detail = "; ".join(f"engine {e}: {checks[e].detail}" for e in order)
        numbers = {"engines": {e: ch.numbers for e, ch in sorted(checks.items())}}
        out.append(Check(name, status, detail, numbers))
    return out


def _diagnose_engine(
    ms: MetricSet, names: frozenset[str], log_text: str | None, tp: int | None
) -> list[Check]:
    """Every check on one engine's samples."""
    s = Samples(ms, names)
    present = coverage.present(s)
    if present.status is Status.FAIL:
        return [present]
    world_value = s.scheduler_value(WORLD_SIZE)
    world_metric = _world(world_value) if world_value is not None else None
    workers = s.worker_ranks()
    world = tp if tp is not None else world_metric
    if world is None and workers:
        world = max(workers) + 1
    c = coverage.Context(s, log_text, tp, world_metric, world, workers)
    return [
        present,
        health.progress(s),
        coverage.scope(c),
        coverage.workers(c),
        coverage.retrieving(c),
        coverage.external(s),
        coverage.identities(c),
        health.counted(
            VERIFY, s, "kvtier_verify_failures_total", ("tier", "reason"), Status.FAIL,
            "records failed verification",
            "the tier holds corrupted bytes (each was dropped and recomputed, never used)",
        ),
        health.counted(
            HOOK_ERRORS, s, "kvtier_hook_errors_total", ("hook",), Status.FAIL,
            "exceptions inside kvtier hooks",
            "a defect of kvtier's own: each cost a request its tier hit or a rank its tier, "
            "never the engine; the server log holds the first traceback of each hook",
        ),
        health.leases(s),
        health.timeouts(s),
        health.counted(
            DROPPED, s, "kvtier_dropped_writes_total", ("tier", "reason"), Status.WARN,
            "write-behind chunks dropped",
            "lower tiers miss those chunks (queue full, or the tier refused them)",
        ),
        health.load_failures(s),
        health.counted(
            SAVE_FAILURES, s, "kvtier_save_failures_total", ("reason",), Status.WARN,
            "save failures", "those chunks are saved again later, or missing from the tier",
        ),
        health.store_failures(s),
        health.skipped(s),
        health.breakers(s),
        health.policy(s),
        health.admission(s),
        health.retention(s),
        health.load_cost(s),
        health.states(s),
    ]  # fmt: skip


# ------------------------------------------------------------------------------ fetching


def metrics_url(url: str) -> str:
    """`URL/metrics` (a URL already ending in /metrics is kept; a bare host:port gets http://)."""
    url = url.strip()
    if not url:
        raise DoctorError("the URL is empty; pass the server's base URL, e.g. http://host:8000")
    if "://" not in url:
        url = f"http://{url}"
    url = url.rstrip("/")
    return url if url.endswith("/metrics") else f"{url}/metrics"


def fetch_metrics(url: str, timeout_s: float = 10.0) -> str:
    """The text of `URL/metrics`; DoctorError names the URL and the cause when it cannot."""
    target = metrics_url(url)
    try:
        r = httpx.get(target, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise DoctorError(
            f"cannot reach {target} ({type(exc).__name__}: {exc}); is the server up, and is "
            "the URL its host and port?"
        ) from None
    if r.status_code != 200:
        raise DoctorError(
            f"{target} answered HTTP {r.status_code}: {r.text[:200]!r}; point doctor at the "
            "server's base URL"
        )
    return r.text


# ------------------------------------------------------------------------------ output


_STYLE = {
    Status.PASS: "green",
    Status.WARN: "yellow",
    Status.FAIL: "bold red",
    Status.UNDETERMINED: "cyan",
}


def render_table(checks: list[Check], url: str) -> None:
    """Print the checks as a rich table, then a one-line verdict."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvtier doctor: {url}", show_lines=True)
    table.add_column("check", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("detail")
    for ch in checks:
        table.add_row(ch.name, f"[{_STYLE[ch.status]}]{ch.status}[/]", ch.detail)
    con = Console()
    con.print(table)
    failed = [ch.name for ch in checks if ch.status is Status.FAIL]
    con.print(f"[bold red]FAIL[/]: {', '.join(failed)}" if failed else "[green]no check failed[/]")


def render_json(checks: list[Check], url: str) -> str:
    """The checks as one JSON document: url, ok (no FAIL) and the checks in order."""
    doc = {
        "url": url,
        "ok": not any(ch.status is Status.FAIL for ch in checks),
        "checks": [ch.to_json() for ch in checks],
    }
    return json.dumps(doc, indent=2)


def doctor_command(
    url: str = typer.Argument(..., help="Base URL of the server (its /metrics is read)."),
    log: Path | None = typer.Option(
        None, "--log", help="The server's startup log, to check its lookup-client line."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    tp: int | None = typer.Option(
        None, "--tp", help="Tensor-parallel size the deployment intends (checked against world)."
    ),
    timeout: float = typer.Option(10.0, "--timeout", help="Seconds to wait for /metrics."),
) -> None:
    """Check a running kvtier server: PASS/FAIL/WARN per check; exit 1 on any FAIL, 2 if unread."""
    try:
        log_text = None
        if log is not None:
            try:
                log_text = log.read_text(errors="replace")
            except OSError as exc:
                raise DoctorError(
                    f"cannot read --log {log} ({exc.strerror}); pass a file"
                ) from None
        text = fetch_metrics(url, timeout_s=timeout)
        checks = diagnose(text, log_text, tp)
    except (DoctorError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from None
    shown = metrics_url(url)
    if json_out:
        typer.echo(render_json(checks, shown))
    else:
        render_table(checks, shown)
    raise typer.Exit(code=1 if any(ch.status is Status.FAIL for ch in checks) else 0)
