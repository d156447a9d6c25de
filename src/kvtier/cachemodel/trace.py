"""The one reader of Mooncake-format traces (JSONL, one request per line).

A row is `{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}`
where each hash id names one block of the prompt and equal ids at equal positions are equal
prefixes. The edge cases, decided once for every tool:

* `output_length` defaults to 1 (every request generates at least one token) and must be >= 1;
* `hash_ids` must be a non-empty list of integers >= 0 (a prompt has at least one block);
* rows replay in `timestamp` order, file order breaking ties; a trace with no timestamps at all
  replays in file order at time 0, and one that mixes rows with and without is refused;
* with `block_tokens` given, `input_length` must fit in its hash ids' blocks;
* the file is read as bytes, a line at a time: gzip is recognised by its magic bytes (whatever the
  name), a line that is not UTF-8 text or longer than `MAX_LINE_BYTES` is refused by its number,
  and with `max_blocks` reading stops at the line where the trace passes that many blocks, so a
  huge or binary file costs one line of memory before its error, never the whole file.
"""

from __future__ import annotations

import gzip
import json
import math
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.data import MOONCAKE_SYNTHETIC, resolve_trace
from kvtier.errors import ConfigError

MOONCAKE_BLOCK = 512
# one row's JSON: 64 MiB holds millions of hash ids, far past any prompt
MAX_LINE_BYTES = 64 << 20
_GZIP_MAGIC = b"\x1f\x8b"

_EXAMPLE = '{"timestamp": 0, "input_length": 1000, "output_length": 8, "hash_ids": [0, 1]}'


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One request: arrival in ms, prompt and output lengths in tokens, the prompt's block ids."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace_rows(
    path: str | Path,
    *,
    block_tokens: int | None = None,
    limit: int | None = None,
    max_blocks: int | None = None,
) -> list[TraceRow]:
    """The rows of the trace file at `path` in replay order (the first `limit` of them); with
    `max_blocks`, a trace of more blocks is refused at the line that passes them."""
    p = resolve_trace(path)
    if not p.is_file():
        raise ConfigError(
            f"trace {str(path)!r} is not a file; pass a Mooncake JSONL trace path (.jsonl or "
            f".jsonl.gz) or {MOONCAKE_SYNTHETIC!r} for the trace bundled with kvtier"
        )
    try:
        with p.open("rb") as raw:
            gz = raw.read(2) == _GZIP_MAGIC
        opened = gzip.open(p, "rb") if gz else p.open("rb")
        with opened as fh:
            return parse_trace_rows(
                _text_lines(fh, p.name),
                source=p.name,
                block_tokens=block_tokens,
                limit=limit,
                max_blocks=max_blocks,
            )
    except (OSError, EOFError, zlib.error) as exc:
        kind = "gzip " if p.suffix == ".gz" else ""
        raise ConfigError(
            f"{p.name}: cannot read it as a {kind}Mooncake JSONL trace ({exc}); give a complete "
            "JSONL file, plain or gzip-compressed"
        ) from None


def _text_lines(fh: Any, source: str) -> Iterator[str]:
    """The lines of binary file `fh` as text, one bounded line in memory at a time."""
    lineno = 0
    while True:
        raw = fh.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        lineno += 1
        if len(raw) > MAX_LINE_BYTES:
            raise ConfigError(
                f"{source}:{lineno}: a line longer than {MAX_LINE_BYTES:,} bytes; each line must "
                f"be one Mooncake request such as {_EXAMPLE} (is this a JSONL trace?)"
            )
        try:
            yield raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"{source}:{lineno}: not UTF-8 text (byte {exc.start} of the line); a trace is "
                f"JSONL text, one request per line such as {_EXAMPLE}, plain or gzip-compressed"
            ) from None


def parse_trace_rows(
    lines: Iterable[str],
    *,
    source: str = "trace",
    block_tokens: int | None = None,
    limit: int | None = None,
    max_blocks: int | None = None,
) -> list[TraceRow]:
    """Rows from Mooncake JSONL `lines` (blank lines skipped) in replay order; a bad row raises
    ConfigError naming `source`, its line and the fix, and so does the line where the trace
    passes `max_blocks` blocks (nothing after it is read)."""
    if block_tokens is not None and (isinstance(block_tokens, bool) or block_tokens < 1):
        raise ConfigError(f"trace block size {block_tokens!r} must be an integer >= 1, e.g. 512")
    if limit is not None and limit < 1:
        raise ConfigError(f"trace limit {limit!r} must be >= 1 requests")
    if max_blocks is not None and max_blocks < 1:
        raise ConfigError(f"trace max_blocks {max_blocks!r} must be >= 1 blocks")
    rows: list[tuple[int | float | None, int, TraceRow]] = []
    blocks = 0
    for lineno, line in enumerate(lines, 1):
        if line.strip():
            ts, row = _row(line, f"{source}:{lineno}", block_tokens)
            blocks += len(row.hash_ids)
            if max_blocks is not None and blocks > max_blocks:
                raise ConfigError(
                    f"{source}:{lineno}: the trace passes {max_blocks:,} hash ids (blocks) at "
                    f"this line, more than can be replayed here; keep its first {lineno - 1:,} "
                    "lines, e.g. with head -n"
                )
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


def _row(line: str, where: str, block_tokens: int | None) -> tuple[int | float | None, TraceRow]:
    try:
        doc = json.loads(line)
    except (ValueError, RecursionError) as exc:
        # ValueError: JSONDecodeError, or a number past Python's digit limit; RecursionError:
        # arrays or objects nested thousands deep
        msg = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc).split(";")[0]
        raise ConfigError(
            f"{where}: not JSON ({msg}); each line must be one Mooncake object such as {_EXAMPLE}"
        ) from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: a JSON {type(doc).__name__}, not an object like {_EXAMPLE}")
    ids = doc.get("hash_ids")
    if not isinstance(ids, list) or not ids:
        raise ConfigError(
            f"{where}: 'hash_ids' must be a non-empty list of integers >= 0 (got "
            f"{_show(ids)}); every prompt has at least one block"
        )
    bad = next((i for i, h in enumerate(ids) if not _int_at_least(h, 0)), None)
    if bad is not None:
        raise ConfigError(
            f"{where}: 'hash_ids' must be a non-empty list of integers >= 0 (got "
            f"hash_ids[{bad}] = {_show(ids[bad])} in a list of {len(ids):,})"
        )
    n_in = doc.get("input_length")
    if not _int_at_least(n_in, 1):
        raise ConfigError(f"{where}: 'input_length' must be an integer >= 1 (got {_show(n_in)})")
    n_out = doc.get("output_length", 1)
    if not _int_at_least(n_out, 1):
        raise ConfigError(
            f"{where}: 'output_length' must be an integer >= 1 (got {_show(n_out)}); leave it "
            "out for 1"
        )
    ts = doc.get("timestamp")
    if ts is not None and not _finite_at_least_0(ts):
        raise ConfigError(
            f"{where}: 'timestamp' must be a finite number of ms >= 0 (got {_show(ts)})"
        )
    if block_tokens is not None and n_in > len(ids) * block_tokens:
        raise ConfigError(
            f"{where}: input_length {n_in} needs more than its {len(ids)} hash ids of "
            f"{block_tokens} tokens ({len(ids) * block_tokens}); give the trace's block size "
            f"(--trace-block; Mooncake traces use {MOONCAKE_BLOCK})"
        )
    # replay sorts by the value as written: two integer stamps float() would merge stay apart
    return ts, TraceRow(0.0 if ts is None else float(ts), n_in, n_out, tuple(ids))


def _show(value: object, width: int = 60) -> str:
    """`value`'s repr, cut to `width` characters (a row may hold megabytes)."""
    text = repr(value)
    return text if len(text) <= width else f"{text[: width - 3]}... ({len(text):,} characters)"


def _finite_at_least_0(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        f = float(value)
    except OverflowError:  # an integer past any float
        return False
    return math.isfinite(f) and f >= 0


def _int_at_least(value: object, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low
