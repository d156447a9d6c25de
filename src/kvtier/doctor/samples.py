"""Typed lookups over one /metrics scrape (worker ranks are the numeric `rank` labels), the
number formatting every check shares, and what the server's startup log says."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvtier.scrape import SCHEDULER, MetricSet

_CLIENT_LINE = re.compile(r"kvtier: lookup client on ranks \[([0-9,\s]*)\] \(world=(\d+)\)")
_RETRIEVED_LINE = re.compile(r"kvtier\[rank (\d+)/\d+\]: Retrieved (\d+) of (\d+) required tokens")


class Samples:
    """Typed lookups over one scrape: worker ranks are the numeric `rank` labels; `declared`
    holds every family the text names, with or without samples."""

    def __init__(self, ms: MetricSet, declared: frozenset[str] = frozenset()) -> None:
        self.ms = ms
        self.declared = declared

    def has(self, name: str) -> bool:
        """Whether any sample is named `name`."""
        return self.ms.has(name)

    def exported(self, name: str) -> bool:
        """Whether the server exports `name` at all (a family with no sample yet counts: a
        counter by reason gets its first sample with its first event)."""
        return name in self.declared or self.ms.has(name)

    def total(self, name: str, **labels: str) -> float:
        """Sample `name` summed over the labels `labels` does not fix."""
        return self.ms.total(name, **labels)

    def group(self, name: str, *labels: str, **fixed: str) -> dict[tuple[str, ...], float]:
        """Sample `name` summed per combination of `labels` (samples lacking one are skipped)."""
        out: dict[tuple[str, ...], float] = {}
        for (n, key), v in self.ms.samples.items():
            if n != name:
                continue
            d = dict(key)
            if any(d.get(k) != want for k, want in fixed.items()):
                continue
            if all(k in d for k in labels):
                combo = tuple(d[k] for k in labels)
                out[combo] = out.get(combo, 0.0) + v
        return out

    def per_rank(self, name: str, **fixed: str) -> dict[int, float]:
        """Sample `name` per worker rank (the scheduler's samples left out)."""
        return {int(r): v for (r,), v in self.group(name, "rank", **fixed).items() if r.isdigit()}

    def worker_ranks(self) -> set[int]:
        """Ranks that report any kvtier sample of their own."""
        out: set[int] = set()
        for n, key in self.ms.samples:
            rank = dict(key).get("rank")
            if n.startswith("kvtier_") and rank is not None and rank.isdigit():
                out.add(int(rank))
        return out

    def scheduler_value(self, name: str) -> float | None:
        """The scheduler's (rank="scheduler") sample of `name`, if any."""
        for (n, key), v in self.ms.samples.items():
            if n == name and dict(key).get("rank") == SCHEDULER:
                return v
        return None


def num(x: float) -> int | float:
    """A count as an int when it is whole (JSON and sentences read better)."""
    return int(x) if float(x).is_integer() else x


def fmt(counts: Mapping[Any, float]) -> str:
    """`key: count` pairs of the non-zero counts, or "none"."""
    return ", ".join(f"{k}: {num(v)}" for k, v in sorted(counts.items()) if v) or "none"


def sorted_ranks(xs: Iterable[int]) -> list[int]:
    """Ranks in order, as a list."""
    return sorted(xs)


@dataclass(frozen=True)
class ClientLine:
    """`kvtier: lookup client on ranks [..] (world=N)` as logged at startup."""

    ranks: tuple[int, ...]
    world: int


def parse_client_line(log_text: str) -> ClientLine | None:
    """The last lookup-client line of a startup log (a restarted server appends a new one)."""
    found = _CLIENT_LINE.findall(log_text)
    if not found:
        return None
    ranks, world = found[-1]
    return ClientLine(tuple(int(r) for r in ranks.replace(",", " ").split()), int(world))


def log_retrievals(log_text: str) -> dict[int, int]:
    """Per rank, the `Retrieved N of M` lines with N > 0 (the log's Retrieved histogram)."""
    out: dict[int, int] = {}
    for rank, got, _ in _RETRIEVED_LINE.findall(log_text):
        if int(got) > 0:
            out[int(rank)] = out.get(int(rank), 0) + 1
    return out


def declared(text: str) -> frozenset[str]:
    """Every family name the exposition declares (counters under both spellings)."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        if family.type == "counter":
            names.add(f"{family.name}_total")
    return frozenset(names)
