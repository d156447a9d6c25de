"""What the `kvtier bench tier` sections share: the plan of repetitions, fresh chunk keys,
interleaved timing and GB/s rows (one module, so the sections never import each other)."""

from __future__ import annotations

import gc
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvtier import remote_endpoint
from kvtier.bench.table import Report, Row, Target
from kvtier.config import mask_url
from kvtier.errors import ConfigError

Progress = Callable[[str], None]
STORE_RATIO_TARGET = 0.85
_GB = 1e9
SERVER_FLAG = "--remote-url"
CLUSTER_FLAG = "--remote-cluster-url"


@dataclass(frozen=True, slots=True)
class Plan:
    """Repetition counts of one run (`FULL` or `QUICK`)."""

    mem_slots: int
    mem_sources: int
    mem_warmup: int
    mem_reps: int
    disk_files: int
    disk_warmup: int
    disk_reps: int
    disk_cold_reps: int
    hash_reps: int
    lookup_warmup: int
    lookup_reps: int
    datapath_warmup: int = 3
    datapath_reps: int = 30


class Keys:
    """Fresh, distinct 16-byte chunk keys (a counter under a tag)."""

    def __init__(self, tag: str) -> None:
        self._tag = tag.encode()
        self._n = 0

    def next(self) -> bytes:
        self._n += 1
        return hashlib.blake2b(self._tag + self._n.to_bytes(8, "little"), digest_size=16).digest()


def interleave(
    methods: dict[str, Callable[[], float]], warmup: int, rounds: int
) -> dict[str, list[float]]:
    """Run every method once per round, rotating their order; seconds per method after warmup."""
    names = list(methods)
    out: dict[str, list[float]] = {name: [] for name in names}
    gc.collect()
    for i in range(rounds):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            dt = methods[name]()
            if i >= warmup:
                out[name].append(dt)
    return out


def gbps_row(
    report: Report,
    row_id: str,
    label: str,
    nbytes: int,
    seconds: Sequence[float],
    raw_seconds: Sequence[float],
    target: Target | None = None,
) -> Row:
    """A GB/s row from per-repetition seconds (median), with its raw baseline's median."""
    med, raw_med = float(np.median(seconds)), float(np.median(raw_seconds))
    return report.add(
        Row(
            row_id,
            label,
            nbytes / med / _GB,
            "GB/s",
            raw=nbytes / raw_med / _GB,
            target=target,
            detail={
                "samples": len(seconds),
                "median_ms": med * 1e3,
                "p10_ms": float(np.percentile(seconds, 10) * 1e3),
                "p90_ms": float(np.percentile(seconds, 90) * 1e3),
                "raw_median_ms": raw_med * 1e3,
                "bytes": nbytes,
            },
        )
    )


def remote_url(url: str | None, flag: str) -> str | None:
    """`url` checked with kvtier's own `remote_url` parser for the rows behind `flag`: a TCP
    server (`SERVER_FLAG`) or cluster (`CLUSTER_FLAG`); None stays None. ConfigError naming the
    fix; messages show the URL masked."""
    if url is None:
        return None
    shown = mask_url(url)
    try:
        endpoint = remote_endpoint.parse(url)
    except ValueError as e:
        raise ConfigError(
            f"{flag} {shown!r} is not a valid remote URL: {e}; {remote_endpoint.URL_FORMS}"
        ) from None
    if endpoint.unix:
        # the raw baselines (valkey-glide, redis-py over TCP) cannot follow the tier there
        raise ConfigError(
            f"{flag} {shown!r} names a unix socket; the remote rows compare the tier with "
            "valkey-glide over TCP: give a redis:// or rediss:// URL"
        )
    cluster = flag == CLUSTER_FLAG
    if endpoint.cluster and not cluster:
        raise ConfigError(
            f"{flag} {shown!r} names a cluster; pass it as {CLUSTER_FLAG}, and one server "
            f"as {SERVER_FLAG} (redis://host:6379/0)"
        )
    if cluster and not endpoint.cluster:
        raise ConfigError(
            f"{flag} {shown!r} names one server; pass it as {SERVER_FLAG}, or give the "
            "cluster as redis+cluster://host1:7000,host2:7001"
        )
    return url
