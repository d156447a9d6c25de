"""What a lookup answers: the minimum over ranks of the leading chunks held, who limited it and
the deepest tier of the counted run; and a lookup still in flight."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class LookupResult:
    """Minimum over ranks of the leading chunks held, and who limited it.

    `limiting_rank` is the lowest-numbered rank holding the fewest chunks, or None when every
    rank holds every key. A rank that timed out (or was skipped as down) or answered with an
    error counts as 0; `timed_out` and `errors` say which and why.
    """

    hit_chunks: int
    hit_tokens: int
    limiting_rank: int | None
    per_rank: dict[int, int]
    timed_out: tuple[int, ...]
    errors: dict[int, str] = field(default_factory=dict)
    # the deepest tier any rank serves the counted run from ("" when nothing is held)
    tier: str = ""
    # (tier, chunks) per run of the counted chunks: each chunk at the deepest tier any rank
    # serves it from (empty when no rank said)
    runs: tuple[tuple[str, int], ...] = ()


def deepest_tier(tiers: Iterable[str], order: Sequence[str]) -> str:
    """The outermost of `tiers` by `order` (the tier registry's names, accelerator outwards);
    an unknown name counts as outermost, "" as none."""
    rank = {t: i for i, t in enumerate(order)}
    named = [t for t in tiers if t]
    return max(named, key=lambda t: rank.get(t, len(order))) if named else ""


def merged_runs(
    per_rank: Iterable[tuple[tuple[str, int], ...]], chunks: int, order: Sequence[str]
) -> tuple[tuple[str, int], ...]:
    """The first `chunks` chunks' runs, each chunk at the deepest tier any rank's runs put
    it in (every rank must read it: the slowest decides); empty when a rank's runs are
    missing or do not cover them."""
    each: list[list[str]] = []
    for runs in per_rank:
        tiers = [t for t, n in runs for _ in range(n)]
        if len(tiers) < chunks:
            return ()
        each.append(tiers[:chunks])
    if not each or not chunks:
        return ()
    out: list[tuple[str, int]] = []
    for i in range(chunks):
        tier = deepest_tier((t[i] for t in each), order)
        if out and out[-1][0] == tier:
            out[-1] = (tier, out[-1][1] + 1)
        else:
            out.append((tier, 1))
    return tuple(out)


@dataclass(eq=False, slots=True)
class PendingLookup:
    """A lookup sent to the ranks and not yet settled (`LookupClient.begin` / `poll`)."""

    lookup_id: str
    req: int
    n: int  # keys asked
    t0: float  # perf_counter at send
    deadline: float  # perf_counter
    sent_at: float  # the client clock at send (for the peers' miss records)
    targets: list[int]
    pending: set[int]  # ranks sent to that have not answered
    unsent: set[int]
    per_rank: dict[int, int] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    tiers: dict[int, str] = field(default_factory=dict)
    runs: dict[int, tuple[tuple[str, int], ...]] = field(default_factory=dict)
    # asked with ends: per rank, the chunk counts after which it holds the end
    with_ends: bool = False
    ends: dict[int, frozenset[int]] = field(default_factory=dict)
    result: LookupResult | None = None
