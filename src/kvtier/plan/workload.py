"""What `kvtier plan` sizes for: a synthetic prefix pool or a Mooncake trace, read by the one
trace reader, and its reuse distances against the pool and the tier."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.cachemodel.reuse import ReuseProfile, pool_reuse_distance, reuse_profile
from kvtier.cachemodel.stream import Request, from_trace
from kvtier.cachemodel.trace import TraceRow, parse_trace_rows, read_trace_rows
from kvtier.errors import ConfigError

# Above this many trace blocks the pure-Python ceiling replay and hit curve take minutes; a trace
# file is read only up to the line that passes it (a 10 GB file costs one line, not 10 GB).
MAX_TRACE_BLOCKS = 2_000_000


def check_int(flag: str, value: object, low: int) -> None:
    """ConfigError naming `flag` unless `value` is an integer >= `low`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{flag} {value!r} must be an integer >= {low}")


@dataclass(frozen=True, slots=True)
class SyntheticWorkload:
    """A prefix pool: `n_prefixes` shared prefixes of `prefix_len` tokens, each request adding a
    unique `tail_len`-token tail, `concurrency` requests in flight."""

    n_prefixes: int
    prefix_len: int
    tail_len: int = 0
    concurrency: int = 1

    def __post_init__(self) -> None:
        for flag, value, low in (
            ("--prefixes", self.n_prefixes, 1),
            ("--prefix-len", self.prefix_len, 1),
            ("--tail-len", self.tail_len, 0),
            ("--concurrency", self.concurrency, 0),
        ):
            check_int(flag, value, low)

    @property
    def request_tokens(self) -> int:
        """Prompt tokens of one request (prefix plus tail)."""
        return self.prefix_len + self.tail_len

    @property
    def in_flight_tokens(self) -> int:
        """Tokens held by requests in flight: pinned in HBM, so a reuse must also get past them."""
        return self.concurrency * self.request_tokens

    @property
    def reuse_distance_tokens(self) -> int:
        """Round-robin reuse distance of a prefix (the whole pool, itself included) plus what the
        requests in flight hold."""
        pool = pool_reuse_distance(self.n_prefixes, self.prefix_len, self.tail_len)
        return pool + self.in_flight_tokens

    @property
    def reusable_tokens(self) -> int:
        """Distinct shared-prefix tokens: what a tier must hold to serve every prefix."""
        return self.n_prefixes * self.prefix_len

    def describe(self) -> str:
        """One line for the report."""
        return (
            f"{self.n_prefixes:,} prefixes x ({self.prefix_len:,} + {self.tail_len:,}) tokens, "
            f"concurrency {self.concurrency}"
        )

    def to_json(self) -> dict[str, Any]:
        """Plain JSON fields."""
        return {
            "kind": "synthetic",
            "n_prefixes": self.n_prefixes,
            "prefix_len": self.prefix_len,
            "tail_len": self.tail_len,
            "concurrency": self.concurrency,
        }


@dataclass(frozen=True, slots=True)
class Trace:
    """A Mooncake-format request trace whose hash ids name `block_tokens`-token blocks."""

    requests: tuple[TraceRow, ...]
    block_tokens: int = 512
    source: str = ""

    def __post_init__(self) -> None:
        check_int("--trace-block", self.block_tokens, 1)
        if not self.requests:
            raise ConfigError(
                f"--trace {self.source or '(inline)'} has no requests; give a Mooncake JSONL "
                "file with one {hash_ids, input_length, output_length, timestamp} row per line"
            )

    @property
    def chunk_requests(self) -> list[Request]:
        """The requests as the tier sees them, one chunk per trace block."""
        return from_trace(self.requests, self.block_tokens)

    @property
    def num_blocks(self) -> int:
        """Block uses over every request."""
        return sum(len(r.hash_ids) for r in self.requests)

    @property
    def prompt_tokens(self) -> int:
        """Sum of `input_length`."""
        return sum(r.input_length for r in self.requests)

    def describe(self) -> str:
        """One line for the report."""
        name = Path(self.source).name if self.source else "trace"
        return (
            f"{name}: {len(self.requests):,} requests, {self.num_blocks:,} blocks of "
            f"{self.block_tokens:,} tokens"
        )

    def to_json(self) -> dict[str, Any]:
        """Plain JSON fields."""
        return {
            "kind": "trace",
            "source": self.source,
            "requests": len(self.requests),
            "blocks": self.num_blocks,
            "block_tokens": self.block_tokens,
            "prompt_tokens": self.prompt_tokens,
        }


Workload = SyntheticWorkload | Trace


def parse_trace(lines: Iterable[str], block_tokens: int = 512, source: str = "") -> Trace:
    """A Trace from Mooncake JSONL lines, read by the one trace reader
    (`kvtier.cachemodel.trace`: timestamp order, output length 1 by default, no empty rows)."""
    check_int("--trace-block", block_tokens, 1)
    rows = parse_trace_rows(lines, source=source or "--trace", block_tokens=block_tokens)
    return Trace(tuple(rows), block_tokens, source)


def read_trace(
    path: str | Path, block_tokens: int = 512, *, max_blocks: int | None = MAX_TRACE_BLOCKS
) -> Trace:
    """Read a Mooncake JSONL trace file; ConfigError names the line and the fix, and the line
    where the trace passes `max_blocks` blocks (None: no limit), without reading further."""
    check_int("--trace-block", block_tokens, 1)
    rows = read_trace_rows(path, block_tokens=block_tokens, max_blocks=max_blocks)
    return Trace(tuple(rows), block_tokens, str(path))


def trace_reuse_profile(trace: Trace, hbm_pool_tokens: int, tier_tokens: int) -> ReuseProfile:
    """Reuse distances of the trace's blocks against the pool and the tier."""
    requests = [r.hash_ids for r in trace.requests]
    return reuse_profile(requests, trace.block_tokens, hbm_pool_tokens, tier_tokens)
