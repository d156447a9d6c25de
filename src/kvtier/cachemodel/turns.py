"""Timed turns of conversations: each request with its arrival time and when its conversation
comes back, which is what a client that knows its own conversation can tell the cache.

Synthetic workloads know their sessions; a Mooncake trace has none, so a request's next turn is
the first later request whose prompt holds this one's full chunks (all but the last at least:
a trace's last block may be cut differently) on top of more than the first chunk.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvtier.cachemodel.stream import Request, from_trace
from kvtier.cachemodel.trace import TraceRow
from kvtier.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Turn:
    """One request, when it arrives (s), its conversation's next arrival (None on its last
    turn), its conversation's id, and whether that conversation's client sends hints."""

    request: Request
    at: float
    next_at: float | None
    session: int
    hints: bool = True

    @property
    def gap(self) -> float | None:
        """Seconds until this conversation's next turn (None on its last)."""
        return None if self.next_at is None else self.next_at - self.at


def requests_of(turns: Sequence[Turn]) -> list[Request]:
    """The requests of `turns`, in order."""
    return [t.request for t in turns]


def link_next(
    requests: Sequence[Request], times: Sequence[float], sessions: Sequence[int] | None = None
) -> list[Turn]:
    """Turns for `requests` arriving at `times` (sorted), each session's next turn found by id
    when `sessions` is given, else by prompt: see the module docstring."""
    if len(requests) != len(times) or any(b < a for a, b in zip(times, times[1:], strict=False)):
        raise ConfigError("link_next needs one time per request, in non-decreasing order")
    n = len(requests)
    nxt: list[int | None] = [None] * n
    sess = list(sessions) if sessions is not None else list(range(n))
    if sessions is not None:
        last: dict[int, int] = {}
        for i in range(n - 1, -1, -1):
            nxt[i] = last.get(sess[i])
            last[sess[i]] = i
    else:
        # the earliest later request holding chunk c, for every chunk: a backward pass
        first_after: dict[int, int] = {}
        for i in range(n - 1, -1, -1):
            r = requests[i]
            deep = len(r.chunks) - 1 if len(r.chunks) > 2 else len(r.chunks)
            if deep >= 2:  # one shared chunk is a system prompt, not a conversation
                nxt[i] = first_after.get(r.chunks[deep - 1])
            for c in r.chunks:
                first_after[c] = i
        for i in range(n):  # a conversation's id is its first turn's index
            j = nxt[i]
            if j is not None and sess[j] == j:
                sess[j] = sess[i]
    return [
        Turn(r, t, None if j is None else times[j], s)
        for r, t, j, s in zip(requests, times, nxt, sess, strict=True)
    ]


def trace_turns(rows: Sequence[TraceRow], block_tokens: int) -> list[Turn]:
    """The trace's requests as turns at their timestamps, linked by prompt."""
    return link_next(from_trace(rows, block_tokens), [r.timestamp_ms / 1000 for r in rows])


def hinting_share(turns: Sequence[Turn], share: float, seed: int = 0) -> list[Turn]:
    """`turns` with a seeded `share` of the conversations hinting and the rest silent."""
    if not 0 <= share <= 1:
        raise ConfigError(f"hinting share {share} must lie in [0, 1]")
    rng = random.Random(seed)
    decided: dict[int, bool] = {}
    out = []
    for t in turns:
        if t.session not in decided:
            decided[t.session] = rng.random() < share
        out.append(replace(t, hints=decided[t.session]))
    return out
