"""Seeded request streams for benches, and placing a prefix pool in the tier's window.

Every generator is a pure function of its arguments: the same seed gives the same token ids on
any machine and in any process (numpy's PCG64 seeded with integers, never Python's `hash()`).
Each request's (or conversation's) unique part starts with a marker (its index as two
base-(vocab - 3) digits), so no two requests of one stream share a whole prompt. A run-level
`bust` id appends `BUST_TOKENS` more tokens after the first turn (aiperf's
`--cache-bust first-turn-suffix`): shared prefixes still hit within a run, while a second run
against the same live server cannot hit the first run's whole prompts.

Streams: a prefix pool, unique prompts (no reuse), multi-turn conversations whose turns extend
the previous prompt, and a Mooncake-format trace replayed with one block of token ids per hash id.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.cachemodel.reuse import pool_reuse_distance
from kvtier.cachemodel.trace import TraceRow
from kvtier.errors import ConfigError

# Token ids below this are the tiny model's special tokens (<s>, </s>, <unk>); never sent.
FIRST_TOKEN = 3
MARKER_TOKENS = 2

BUST_TOKENS = 4

PREFIX_POOL = "prefix_pool"
NO_REUSE = "no_reuse"
WARMUP = "warmup"
MULTI_TURN = "multi_turn"
TRACE = "trace"

# Salts keep the streams of different generators apart under one seed.
_SALT = {PREFIX_POOL: 1, NO_REUSE: 2, WARMUP: 3, MULTI_TURN: 4, TRACE: 5}
_SALT_BUST = 101
_SALT_ARRIVALS = 102


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request to send: its prompt as token ids, how many tokens to generate, its stream's
    tag, and the id of the shared prefix it starts with (None when it shares none).

    A later turn of a conversation names its previous turn in `parent` (always a lower index)
    and ends with `new_tokens` new user tokens; its `prompt` holds the parent's prompt, a seeded
    stand-in for the parent's output and those user tokens. `arrival` (seconds from the start
    of the load) schedules an open-loop send; None sends as soon as a worker is free.
    """

    index: int
    tag: str
    prompt: tuple[int, ...]
    max_tokens: int
    prefix_id: int | None = None
    conversation: int | None = None
    turn: int = 0
    parent: int | None = None
    new_tokens: int = 0
    arrival: float | None = None

    def to_json(self) -> dict[str, object]:
        """Plain JSON fields (the prompt as a list)."""
        out = asdict(self)
        out["prompt"] = list(self.prompt)
        return out

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> RequestSpec:
        """The spec `to_json` wrote."""
        fields = dict(doc)
        fields["prompt"] = tuple(int(t) for t in fields["prompt"])
        return cls(**fields)


def dumps(specs: Sequence[RequestSpec]) -> str:
    """The stream as canonical JSON (sorted keys, no spaces): equal streams give equal bytes."""
    return json.dumps([s.to_json() for s in specs], sort_keys=True, separators=(",", ":"))


def write_lines(path: str | Path, docs: Iterable[Mapping[str, Any]]) -> Path:
    """One compact JSON object per line (parent directories created); returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps(doc, separators=(",", ":")) + "\n")
    return out


def read_lines(path: str | Path) -> list[dict[str, Any]]:
    """The objects `write_lines` wrote."""
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_specs(path: str | Path, specs: Iterable[RequestSpec]) -> Path:
    """One spec per line as JSON (parent directories created); returns the path."""
    return write_lines(path, (s.to_json() for s in specs))


def read_specs(path: str | Path) -> list[RequestSpec]:
    """Specs written by `write_specs`."""
    return [RequestSpec.from_json(doc) for doc in read_lines(path)]


def bust_marker(bust: int | None, vocab: int) -> list[int]:
    """`BUST_TOKENS` non-special token ids derived from a run's bust id (same id, same tokens);
    none without one."""
    if bust is None:
        return []
    if isinstance(bust, bool) or not isinstance(bust, int) or bust < 0:
        raise ConfigError(f"bust={bust!r} must be an integer >= 0 (a run id)")
    rng = np.random.default_rng([bust, _SALT_BUST])
    return [int(t) for t in rng.integers(FIRST_TOKEN, vocab, size=BUST_TOKENS)]


def prefix_pool(
    n_prefixes: int,
    prefix_len: int,
    tail_len: int,
    n_requests: int,
    seed: int,
    vocab: int,
    *,
    max_tokens: int = 16,
    bust: int | None = None,
) -> list[RequestSpec]:
    """`n_requests` prompts, each one of `n_prefixes` shared random prefixes of `prefix_len`
    tokens (drawn uniformly at random per request) followed by a unique tail of `tail_len`
    (and the run's bust marker when `bust` is given)."""
    check_positive(n_prefixes=n_prefixes, prefix_len=prefix_len, n_requests=n_requests)
    _check_common(seed, vocab, max_tokens, n_requests)
    if tail_len < MARKER_TOKENS:
        raise ConfigError(
            f"tail_len={tail_len} cannot hold the {MARKER_TOKENS}-token cache-bust marker; "
            f"use tail_len >= {MARKER_TOKENS} so every prompt stays unique"
        )
    rng = np.random.default_rng([seed, _SALT[PREFIX_POOL]])
    prefixes = rng.integers(FIRST_TOKEN, vocab, size=(n_prefixes, prefix_len)).tolist()
    picks = rng.integers(0, n_prefixes, size=n_requests).tolist()
    rest = rng.integers(FIRST_TOKEN, vocab, size=(n_requests, tail_len - MARKER_TOKENS)).tolist()
    suffix = bust_marker(bust, vocab)
    return [
        RequestSpec(
            index=i,
            tag=PREFIX_POOL,
            prompt=tuple(prefixes[p] + _marker(i, vocab) + rest[i] + suffix),
            max_tokens=max_tokens,
            prefix_id=p,
        )
        for i, p in enumerate(picks)
    ]


def no_reuse(
    n_requests: int,
    prompt_len: int,
    seed: int,
    vocab: int,
    *,
    max_tokens: int = 16,
    tag: str = NO_REUSE,
) -> list[RequestSpec]:
    """`n_requests` random prompts of `prompt_len` tokens sharing no block: each one starts with
    its own marker, so not even a first block repeats. `tag` WARMUP draws another stream."""
    check_positive(n_requests=n_requests)
    _check_common(seed, vocab, max_tokens, n_requests)
    if prompt_len < MARKER_TOKENS + 1:
        raise ConfigError(
            f"prompt_len={prompt_len} is too short; use prompt_len >= {MARKER_TOKENS + 1}"
        )
    if tag not in _SALT:
        raise ConfigError(f"tag={tag!r} is not one of {sorted(_SALT)}")
    rng = np.random.default_rng([seed, _SALT[tag]])
    body = rng.integers(FIRST_TOKEN, vocab, size=(n_requests, prompt_len - MARKER_TOKENS)).tolist()
    return [
        RequestSpec(
            index=i,
            tag=tag,
            prompt=tuple(_marker(i, vocab) + body[i]),
            max_tokens=max_tokens,
        )
        for i in range(n_requests)
    ]


def multi_turn(
    n_conversations: int,
    turns: int,
    user_len: int,
    seed: int,
    vocab: int,
    *,
    max_tokens: int = 16,
    n_prefixes: int = 0,
    prefix_len: int = 0,
    bust: int | None = None,
) -> list[RequestSpec]:
    """`n_conversations` conversations of `turns` turns each, in round-robin order (every
    conversation's turn t before any turn t + 1), so a history waits for all the others.

    Turn 0 is an optional shared prefix (one of `n_prefixes` of `prefix_len` tokens, picked at
    random per conversation), the conversation's marker, `user_len - 2` random tokens and the
    bust marker; turn t > 0 is turn t - 1's prompt, a seeded stand-in for its `max_tokens`
    output tokens, and `user_len` new random tokens. The client may swap the stand-in for the
    output the server really gave (`extend_prompt`).
    """
    check_positive(n_conversations=n_conversations, turns=turns, user_len=user_len)
    _check_common(seed, vocab, max_tokens, n_conversations)
    if user_len < MARKER_TOKENS:
        raise ConfigError(
            f"user_len={user_len} cannot hold the {MARKER_TOKENS}-token conversation marker; "
            f"use user_len >= {MARKER_TOKENS}"
        )
    if (n_prefixes > 0) != (prefix_len > 0) or n_prefixes < 0 or prefix_len < 0:
        raise ConfigError(
            f"n_prefixes={n_prefixes}, prefix_len={prefix_len}: give both > 0 for a shared "
            "prefix pool, or both 0 for none"
        )
    rng = np.random.default_rng([seed, _SALT[MULTI_TURN]])
    # every draw happens up front in a fixed shape, so a stream does not depend on its order
    prefixes = rng.integers(FIRST_TOKEN, vocab, size=(max(n_prefixes, 1), prefix_len)).tolist()
    picks = rng.integers(0, max(n_prefixes, 1), size=n_conversations).tolist()
    first = rng.integers(FIRST_TOKEN, vocab, size=(n_conversations, user_len - MARKER_TOKENS))
    later = rng.integers(FIRST_TOKEN, vocab, size=(n_conversations, turns, user_len))
    standin = rng.integers(FIRST_TOKEN, vocab, size=(n_conversations, turns, max_tokens))
    suffix = bust_marker(bust, vocab)
    prompts: list[list[int]] = []
    for c in range(n_conversations):
        head = prefixes[picks[c]] if n_prefixes else []
        prompts.append(head + _marker(c, vocab) + first[c].tolist() + suffix)
    out: list[RequestSpec] = []
    for t in range(turns):
        for c in range(n_conversations):
            if t > 0:
                prompts[c] = prompts[c] + standin[c, t - 1].tolist() + later[c, t].tolist()
            out.append(
                RequestSpec(
                    index=t * n_conversations + c,
                    tag=MULTI_TURN,
                    prompt=tuple(prompts[c]),
                    max_tokens=max_tokens,
                    prefix_id=picks[c] if n_prefixes else None,
                    conversation=c,
                    turn=t,
                    parent=None if t == 0 else (t - 1) * n_conversations + c,
                    new_tokens=0 if t == 0 else user_len,
                )
            )
    return out


def extend_prompt(
    spec: RequestSpec, parent_prompt: Sequence[int], parent_output: Sequence[int]
) -> tuple[int, ...]:
    """A later turn's prompt with the parent's real prompt and output in place of the stand-in:
    parent prompt + parent output + this turn's `new_tokens` user tokens."""
    if spec.parent is None:
        return spec.prompt
    new = spec.prompt[len(spec.prompt) - spec.new_tokens :] if spec.new_tokens else ()
    return tuple(parent_prompt) + tuple(parent_output) + tuple(new)


def sent_prompts(
    specs: Sequence[RequestSpec], outputs: Mapping[int, Sequence[int]] | None
) -> dict[int, tuple[int, ...]]:
    """The prompt each spec went out with, by index: its own prompt, or with `outputs` (the
    real output ids by index) every later turn rebuilt as the client built it."""
    by_index = {s.index: s for s in specs}
    out: dict[int, tuple[int, ...]] = {}
    for spec in sorted(specs, key=lambda s: s.index):
        if outputs is None or spec.parent is None:
            out[spec.index] = spec.prompt
            continue
        if spec.parent not in by_index or spec.parent not in out:
            raise ConfigError(
                f"request {spec.index} continues request {spec.parent}, which is not in the "
                "stream; keep every turn of a conversation up to the last one sent"
            )
        out[spec.index] = extend_prompt(spec, out[spec.parent], outputs.get(spec.parent, ()))
    return out


def trace_requests(
    rows: Sequence[TraceRow],
    seed: int,
    vocab: int,
    *,
    block: int,
    source_block: int | None = None,
    time_scale: float = 1.0,
    max_tokens: int | None = None,
    bust: int | None = None,
) -> list[RequestSpec]:
    """One request per row: hash id h becomes `block` seeded token ids (the same h, the same
    block, so shared hash ids are shared prefixes), the blocks are joined and cut to the input
    length, and the arrival is (timestamp - first timestamp) / 1000 x `time_scale` seconds.

    `source_block` (512 for Mooncake's own traces) scales lengths by `block / source_block`, so
    a trace replayed with smaller blocks keeps its shape instead of growing a long last block.
    `max_tokens` caps output_length. The bust marker, when given, is appended to every prompt.
    """
    check_positive(block=block)
    if source_block is not None:
        check_positive(source_block=source_block)
    if max_tokens is not None:
        check_positive(max_tokens=max_tokens)
    _check_common(seed, vocab, 1, 1)
    if not (math.isfinite(time_scale) and time_scale >= 0):
        raise ConfigError(f"time_scale={time_scale!r} must be a finite number >= 0")
    if not rows:
        raise ConfigError("the trace has no rows; pass at least one")
    t0 = min(r.timestamp_ms for r in rows)
    blocks: dict[int, list[int]] = {}
    suffix = bust_marker(bust, vocab)
    out = []
    for i, row in enumerate(rows):
        n = row.input_length
        if source_block is not None:
            n = max(1, math.ceil(n * block / source_block))
        room = len(row.hash_ids) * block
        if n > room:
            raise ConfigError(
                f"trace row {i}: input_length {n} needs more than its {len(row.hash_ids)} "
                f"hash ids x {block} tokens = {room}; set the trace's own block size "
                "(workload.trace_source_block=512 for Mooncake traces) or a larger "
                "workload.trace_block"
            )
        prompt: list[int] = []
        for h in row.hash_ids[: -(-n // block)]:
            got = blocks.get(h)
            if got is None:
                rng = np.random.default_rng([seed, _SALT[TRACE], h])
                got = blocks[h] = rng.integers(FIRST_TOKEN, vocab, size=block).tolist()
            prompt += got
        out_len = row.output_length if max_tokens is None else min(row.output_length, max_tokens)
        out.append(
            RequestSpec(
                index=i,
                tag=TRACE,
                prompt=tuple(prompt[:n] + suffix),
                max_tokens=out_len,
                arrival=(row.timestamp_ms - t0) / 1000.0 * time_scale,
            )
        )
    return out


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """`n` arrival times (s) of a Poisson process of `rate` requests/s, the first at 0."""
    check_positive(n=n)
    if not (math.isfinite(rate) and rate > 0):
        raise ConfigError(f"rate={rate!r} must be a positive number of requests per second")
    rng = np.random.default_rng([seed, _SALT_ARRIVALS])
    gaps = rng.exponential(1.0 / rate, size=n - 1)
    return [0.0] + np.cumsum(gaps).tolist()


def with_arrivals(specs: Sequence[RequestSpec], arrivals: Sequence[float]) -> list[RequestSpec]:
    """The specs with `arrival` set, one time per spec in stream order."""
    if len(arrivals) != len(specs):
        raise ConfigError(f"{len(arrivals)} arrival times for {len(specs)} requests")
    return [replace(s, arrival=float(t)) for s, t in zip(specs, arrivals, strict=True)]


@dataclass(frozen=True, slots=True)
class Placement:
    """A prefix-pool size whose reuse distance lies in `[low_margin x HBM, tier / high_margin]`.

    `reuse_distance` = n_prefixes x (prefix_len + tail_len): the distinct tokens touched from one
    use of a prefix to its next when every other prefix comes up once in between (round robin),
    the prefix itself included, i.e. the cache a reuse needs to hit.
    """

    n_prefixes: int
    prefix_len: int
    tail_len: int
    reuse_distance: int
    hbm_pool_tokens: int
    tier_tokens: int
    low: int  # the smallest reuse distance accepted (low_margin x HBM pool)
    high: int  # the largest reuse distance accepted (tier / high_margin)

    def to_json(self) -> dict[str, int]:
        """Plain JSON fields."""
        return asdict(self)


def place_in_window(
    hbm_pool_tokens: int,
    tier_tokens: int,
    prefix_len: int,
    tail_len: int = 0,
    *,
    low_margin: float = 2.0,
) -> Placement:
    """The smallest prefix count (at least 2) whose reuse distance is at least `low_margin` x
    the HBM pool and at most half the tier; raises ConfigError naming the sizes if none is.

    Random prefix choice spreads reuse gaps geometrically (some reuses come back soon and hit
    HBM; some wait several rounds), hence the margins on both sides.
    """
    check_positive(hbm_pool_tokens=hbm_pool_tokens, tier_tokens=tier_tokens, prefix_len=prefix_len)
    if tail_len < 0:
        raise ConfigError(f"tail_len={tail_len} is negative; use 0 or more tokens")
    high_margin, min_prefixes = 2.0, 2
    if not low_margin >= 1.0:
        raise ConfigError(
            f"low_margin={low_margin}, high_margin={high_margin}: margins must be >= 1.0"
        )
    per_prefix = prefix_len + tail_len
    low = math.ceil(low_margin * hbm_pool_tokens)
    high = math.floor(tier_tokens / high_margin)
    n = max(min_prefixes, -(-low // per_prefix))
    d = pool_reuse_distance(n, prefix_len, tail_len)
    if d > high:
        raise ConfigError(
            f"no prefix pool fits the window: {n} prefixes x ({prefix_len} + {tail_len}) tokens "
            f"= {d} tokens of reuse distance are needed to exceed {low_margin:g} x the HBM pool "
            f"of {hbm_pool_tokens} tokens, but the tier holds {tier_tokens} tokens (at most "
            f"{high} with margin {high_margin:g}); raise the tier (KVTIER_MEMORY_BYTES), lower "
            "the HBM pool (--hbm-blocks) or shorten the prefix"
        )
    return Placement(n, prefix_len, tail_len, d, hbm_pool_tokens, tier_tokens, low, high)


def _marker(i: int, vocab: int) -> list[int]:
    """Request `i` as two base-(vocab - FIRST_TOKEN) digits of non-special token ids."""
    base = vocab - FIRST_TOKEN
    return [FIRST_TOKEN + i // base, FIRST_TOKEN + i % base]


def _check_common(seed: int, vocab: int, max_tokens: int, n_requests: int) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"seed={seed!r} must be an integer >= 0")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab <= FIRST_TOKEN + 1:
        raise ConfigError(f"vocab={vocab!r} must be an integer > {FIRST_TOKEN + 1}")
    check_positive(max_tokens=max_tokens)
    if n_requests > (vocab - FIRST_TOKEN) ** 2:
        raise ConfigError(
            f"n_requests={n_requests} exceeds the {(vocab - FIRST_TOKEN) ** 2} unique markers "
            f"of a {vocab}-token vocabulary; send fewer requests per stream"
        )


def check_positive(**values: int) -> None:
    """Each of `values` must be an integer >= 1 (ConfigError naming it)."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name}={value!r} must be an integer >= 1")
