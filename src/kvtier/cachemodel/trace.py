"""The one reader of Mooncake-format traces (JSONL, one request per line).

A row is `{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}`
where each hash id names one block of the prompt and equal ids at equal positions are equal
prefixes. The edge cases, decided once for every tool:

* `output_length` defaults to 1 (every request generates at least one token) and must be >= 1;
* `hash_ids` must be a non-empty list of integers >= 0 (a prompt has at least one block);
* rows replay in `timestamp` order, file order breaking ties; a trace with no timestamps at all
  replays in file order at time 0, and one that mixes rows with and without is refused;
* with `block_tokens` given, `input_length` must fit in its hash ids' blocks.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvtier.data import MOONCAKE_SYNTHETIC, resolve_trace
from kvtier.errors import ConfigError

MOONCAKE_BLOCK = 512

_EXAMPLE = '{"timestamp": 0, "input_length": 1000, "output_length": 8, "hash_ids": [0, 1]}'


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One request: arrival in ms, prompt and output lengths in tokens, the prompt's block ids."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace_rows(
    path: str | Path, *, block_tokens: int | None = None, limit: int | None = None
) -> list[TraceRow]:
    """The rows of the trace file at `path` in replay order (the first `limit` of them)."""
    p = resolve_trace(path)
    if not p.is_file():
        raise ConfigError(
            f"trace {str(path)!r} is not a file; pass a Mooncake JSONL trace path (.jsonl or "
            f".jsonl.gz) or {MOONCAKE_SYNTHETIC!r} for the trace bundled with kvtier"
        )
    opened = gzip.open(p, "rt", encoding="utf-8") if p.suffix == ".gz" else p.open(encoding="utf-8")
    with opened as fh:
        return parse_trace_rows(fh, source=p.name, block_tokens=block_tokens, limit=limit)


def parse_trace_rows(
    lines: Iterable[str],
    *,
    source: str = "trace",
    block_tokens: int | None = None,
    limit: int | None = None,
) -> list[TraceRow]:
    """Rows from Mooncake JSONL `lines` (blank lines skipped) in replay order; a bad row raises
    ConfigError naming `source`, its line and the fix."""
    if block_tokens is not None and (isinstance(block_tokens, bool) or block_tokens < 1):
        raise ConfigError(f"trace block size {block_tokens!r} must be an integer >= 1, e.g. 512")
    if limit is not None and limit < 1:
        raise ConfigError(f"trace limit {limit!r} must be >= 1 requests")
    rows: list[tuple[float | None, int, TraceRow]] = []
    for lineno, line in enumerate(lines, 1):
        if line.strip():
            ts, row = _row(line, f"{source}:{lineno}", block_tokens)
            rows.append((ts, lineno, row))
    if not rows:
        raise ConfigError(
            f"{source} has no requests; give a Mooncake JSONL file with one row per line, "
            f"such as {_EXAMPLE}"
        )
    timed = [r for r in rows if r[0] is not None]
    if timed and len(timed) < len(rows):
        untimed = next(r for r in rows if r[0] is None)
        raise ConfigError(
            f"{source}: line {timed[0][1]} has a timestamp and line {untimed[1]} has none; give "
            "every row a timestamp (ms) or none (then rows replay in file order)"
        )
    if timed:
        rows.sort(key=lambda r: (r[0], r[1]))
    out = [r[2] for r in rows]
    return out if limit is None else out[:limit]


def _row(line: str, where: str, block_tokens: int | None) -> tuple[float | None, TraceRow]:
    try:
        doc = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{where}: not JSON ({exc.msg}); each line must be one Mooncake object such as "
            f"{_EXAMPLE}"
        ) from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: a JSON {type(doc).__name__}, not an object like {_EXAMPLE}")
    ids = doc.get("hash_ids")
    if not isinstance(ids, list) or not ids or not all(_int_at_least(h, 0) for h in ids):
        raise ConfigError(
            f"{where}: 'hash_ids' must be a non-empty list of integers >= 0 (got {ids!r}); "
            "every prompt has at least one block"
        )
    n_in = doc.get("input_length")
    if not _int_at_least(n_in, 1):
        raise ConfigError(f"{where}: 'input_length' must be an integer >= 1 (got {n_in!r})")
    n_out = doc.get("output_length", 1)
    if not _int_at_least(n_out, 1):
        raise ConfigError(
            f"{where}: 'output_length' must be an integer >= 1 (got {n_out!r}); leave it out for 1"
        )
    ts = doc.get("timestamp")
    if ts is not None and (
        isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts) or ts < 0
    ):
        raise ConfigError(f"{where}: 'timestamp' must be a finite number of ms >= 0 (got {ts!r})")
    if block_tokens is not None and n_in > len(ids) * block_tokens:
        raise ConfigError(
            f"{where}: input_length {n_in} needs more than its {len(ids)} hash ids of "
            f"{block_tokens} tokens ({len(ids) * block_tokens}); give the trace's block size "
            f"(--trace-block; Mooncake traces use {MOONCAKE_BLOCK})"
        )
    stamp = None if ts is None else float(ts)
    return stamp, TraceRow(0.0 if stamp is None else stamp, n_in, n_out, tuple(ids))


def _int_at_least(value: object, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low
