"""Seeded chunk-level request streams for `kvtier bench cache`: prefix pools (Zipf or uniform
popularity, a one-off tail per request), chat sessions with think times, agent loops with tool
and human pauses (both also as timed turns for the retention model), and round-robin
conversations (the turn order of `kvtier bench run --workload multi_turn`).

Each prompt ends inside a partial chunk (the user's last words), so every full chunk can hit.
Ids are fresh integers per new chunk, so equal ids are equal prefixes.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator

from kvtier.cachemodel.stream import Request
from kvtier.cachemodel.turns import Turn, link_next, requests_of
from kvtier.errors import ConfigError


def _ids() -> Iterator[int]:
    return itertools.count(1)


def _request(chunks: list[int]) -> Request:
    return Request(tuple(chunks), len(chunks))


def prefix_pool(
    n_prefixes: int = 200,
    prefix_chunks: tuple[int, int] = (4, 16),
    n_requests: int = 8000,
    *,
    tail_chunks: int = 1,
    zipf: float | None = None,
    seed: int = 0,
) -> list[Request]:
    """Requests on one of `n_prefixes` shared prefixes (uniform, or Zipf with exponent `zipf`),
    each followed by `tail_chunks` chunks of its own (a cache-bust suffix)."""
    if n_prefixes < 1 or n_requests < 1 or tail_chunks < 0:
        raise ConfigError("prefix_pool needs n_prefixes >= 1, n_requests >= 1, tail_chunks >= 0")
    rng = random.Random(seed)
    ids = _ids()
    prefixes = [[next(ids) for _ in range(rng.randint(*prefix_chunks))] for _ in range(n_prefixes)]
    weights = None if zipf is None else [1 / (i + 1) ** zipf for i in range(n_prefixes)]
    out = []
    for _ in range(n_requests):
        pick = rng.choices(range(n_prefixes), weights=weights)[0]
        out.append(_request(prefixes[pick] + [next(ids) for _ in range(tail_chunks)]))
    return out


def sessions(
    n_sessions: int = 1500,
    span_s: float = 2000.0,
    *,
    mean_turns: float = 8.0,
    quick_s: float = 5.0,
    slow_s: float = 1000.0,
    p_slow: float = 0.3,
    first_chunks: tuple[int, int] = (2, 8),
    turn_chunks: tuple[int, int] = (1, 3),
    system_prompts: int = 4,
    system_chunks: int = 2,
    seed: int = 0,
) -> list[Request]:
    """Chat sessions starting uniformly over `span_s` seconds, each opening with one of
    `system_prompts` shared system prompts; a turn adds the answer and the next question to the
    history. Between turns the user thinks `quick_s` on average, or `slow_s` with probability
    `p_slow` (a coffee break): quick turns find their history in HBM, slow ones need the tier."""
    return requests_of(
        session_turns(
            n_sessions,
            span_s,
            mean_turns=mean_turns,
            quick_s=quick_s,
            slow_s=slow_s,
            p_slow=p_slow,
            first_chunks=first_chunks,
            turn_chunks=turn_chunks,
            system_prompts=system_prompts,
            system_chunks=system_chunks,
            seed=seed,
        )
    )


def session_turns(
    n_sessions: int = 1500,
    span_s: float = 2000.0,
    *,
    mean_turns: float = 8.0,
    quick_s: float = 5.0,
    slow_s: float = 1000.0,
    p_slow: float = 0.3,
    first_chunks: tuple[int, int] = (2, 8),
    turn_chunks: tuple[int, int] = (1, 3),
    system_prompts: int = 4,
    system_chunks: int = 2,
    seed: int = 0,
) -> list[Turn]:
    """The `sessions` stream as timed turns (see `sessions` for the parameters)."""
    if n_sessions < 1 or mean_turns < 1:
        raise ConfigError("sessions needs n_sessions >= 1 and mean_turns >= 1")
    return _conversations(
        n_sessions, span_s, mean_turns, first_chunks, turn_chunks, system_prompts,
        system_chunks, seed,
        lambda rng: rng.expovariate(1.0 / (slow_s if rng.random() < p_slow else quick_s)),
    )  # fmt: skip


def agent_turns(
    n_agents: int = 600,
    span_s: float = 2000.0,
    *,
    mean_steps: float = 12.0,
    tool_s: float = 3.0,
    human_s: float = 600.0,
    p_human: float = 0.1,
    task_chunks: tuple[int, int] = (2, 6),
    step_chunks: tuple[int, int] = (1, 4),
    system_prompts: int = 4,
    system_chunks: int = 4,
    seed: int = 0,
) -> list[Turn]:
    """Agent loops starting uniformly over `span_s` seconds on one of `system_prompts` shared
    tool-laden system prompts: each step appends the model's call and the tool's result, after a
    tool pause of `tool_s` on average, or with probability `p_human` a person's pause of
    `human_s` on average (an approval, a question back): the pauses a recency policy loses."""
    if n_agents < 1 or mean_steps < 1:
        raise ConfigError("agent_turns needs n_agents >= 1 and mean_steps >= 1")
    return _conversations(
        n_agents, span_s, mean_steps, task_chunks, step_chunks, system_prompts, system_chunks,
        seed, lambda rng: rng.expovariate(1.0 / (human_s if rng.random() < p_human else tool_s)),
    )  # fmt: skip


def _conversations(
    n: int,
    span_s: float,
    mean_turns: float,
    first_chunks: tuple[int, int],
    turn_chunks: tuple[int, int],
    system_prompts: int,
    system_chunks: int,
    seed: int,
    pause: Callable[[random.Random], float],
) -> list[Turn]:
    """`n` conversations starting uniformly over `span_s` on one of the shared system prompts,
    a geometric number of turns each, `pause(rng)` seconds between turns."""
    rng = random.Random(seed)
    ids = _ids()
    systems = [[next(ids) for _ in range(system_chunks)] for _ in range(system_prompts)]
    events: list[tuple[float, int, int, list[int]]] = []
    for c in range(n):
        t = rng.uniform(0.0, span_s)
        turns = 1
        while rng.random() > 1.0 / mean_turns:
            turns += 1
        history = list(rng.choice(systems)) + [next(ids) for _ in range(rng.randint(*first_chunks))]
        for turn in range(turns):
            if turn:
                history = history + [next(ids) for _ in range(rng.randint(*turn_chunks))]
            events.append((t, c, turn, history))
            t += pause(rng)
    return _timed(events)


def _timed(events: list[tuple[float, int, int, list[int]]]) -> list[Turn]:
    """Events (time, session, turn, chunks) in time order, each knowing its session's next."""
    events.sort(key=lambda e: (e[0], e[1], e[2]))
    return link_next(
        [_request(e[3]) for e in events], [e[0] for e in events], [e[1] for e in events]
    )


def round_robin(
    n_conversations: int = 100,
    turns: int = 8,
    *,
    first_chunks: int = 4,
    turn_chunks: int = 2,
    shuffle: bool = False,
    seed: int = 0,
) -> list[Request]:
    """Conversations taking turns in rounds, every conversation's turn t before any turn t + 1
    (in a fixed order, or shuffled per round): a loop longer than the cache once they grow."""
    if n_conversations < 1 or turns < 1:
        raise ConfigError("round_robin needs n_conversations >= 1 and turns >= 1")
    rng = random.Random(seed)
    ids = _ids()
    histories = [[next(ids) for _ in range(first_chunks)] for _ in range(n_conversations)]
    out = []
    for turn in range(turns):
        order = list(range(n_conversations))
        if shuffle:
            rng.shuffle(order)
        for c in order:
            if turn:
                histories[c] = histories[c] + [next(ids) for _ in range(turn_chunks)]
            out.append(_request(histories[c]))
    return out
