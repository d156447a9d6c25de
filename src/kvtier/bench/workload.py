"""Seeded request streams for end-to-end benches, and placing a prefix pool in the tier's window.

Every generator is a pure function of its arguments: the same seed gives the same token ids on
any machine and in any process (numpy's PCG64 seeded with integers, never Python's `hash()`).
Each request's unique part starts with a cache-bust marker (its index as two base-(vocab - 3)
digits), so no two requests of one stream share a whole prompt, as aiperf's
`--cache-bust first-turn-suffix` guarantees.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from kvtier.errors import ConfigError

# Token ids below this are the tiny model's special tokens (<s>, </s>, <unk>); never sent.
FIRST_TOKEN = 3
MARKER_TOKENS = 2

PREFIX_POOL = "prefix_pool"
NO_REUSE = "no_reuse"
WARMUP = "warmup"

# Salts keep the streams of different generators apart under one seed.
_SALT = {PREFIX_POOL: 1, NO_REUSE: 2, WARMUP: 3}


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request to send: its prompt as token ids, how many tokens to generate, its stream's
    tag, and the id of the shared prefix it starts with (None when it shares none)."""

    index: int
    tag: str
    prompt: tuple[int, ...]
    max_tokens: int
    prefix_id: int | None = None

    def to_json(self) -> dict[str, object]:
        """Plain JSON fields (the prompt as a list)."""
        out = asdict(self)
        out["prompt"] = list(self.prompt)
        return out


def dumps(specs: Sequence[RequestSpec]) -> str:
    """The stream as canonical JSON (sorted keys, no spaces): equal streams give equal bytes."""
    return json.dumps([s.to_json() for s in specs], sort_keys=True, separators=(",", ":"))


def prefix_pool(
    n_prefixes: int,
    prefix_len: int,
    tail_len: int,
    n_requests: int,
    seed: int,
    vocab: int,
    *,
    max_tokens: int = 16,
) -> list[RequestSpec]:
    """`n_requests` prompts, each one of `n_prefixes` shared random prefixes of `prefix_len`
    tokens (drawn uniformly at random per request) followed by a unique tail of `tail_len`."""
    _check_positive(n_prefixes=n_prefixes, prefix_len=prefix_len, n_requests=n_requests)
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
    return [
        RequestSpec(
            index=i,
            tag=PREFIX_POOL,
            prompt=tuple(prefixes[p] + _marker(i, vocab) + rest[i]),
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
    _check_positive(n_requests=n_requests)
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


# ----------------------------------------------------------------------------------------------
# placement in [HBM pool, tier)
# ----------------------------------------------------------------------------------------------


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


def reuse_distance(n_prefixes: int, prefix_len: int, tail_len: int) -> int:
    """Distinct tokens between two uses of one prefix in a round-robin pool, itself included."""
    return n_prefixes * (prefix_len + tail_len)


def place_in_window(
    hbm_pool_tokens: int,
    tier_tokens: int,
    prefix_len: int,
    tail_len: int = 0,
    *,
    low_margin: float = 2.0,
    high_margin: float = 2.0,
    min_prefixes: int = 2,
) -> Placement:
    """The smallest prefix count whose reuse distance is at least `low_margin` x the HBM pool
    and at most the tier over `high_margin`; raises ConfigError naming the sizes if none is.

    Random prefix choice spreads reuse gaps geometrically (some reuses come back soon and hit
    HBM; some wait several rounds), hence the margins on both sides.
    """
    _check_positive(
        hbm_pool_tokens=hbm_pool_tokens,
        tier_tokens=tier_tokens,
        prefix_len=prefix_len,
        min_prefixes=min_prefixes,
    )
    if tail_len < 0:
        raise ConfigError(f"tail_len={tail_len} is negative; use 0 or more tokens")
    if not (low_margin >= 1.0 and high_margin >= 1.0):
        raise ConfigError(
            f"low_margin={low_margin}, high_margin={high_margin}: margins must be >= 1.0"
        )
    per_prefix = prefix_len + tail_len
    low = math.ceil(low_margin * hbm_pool_tokens)
    high = math.floor(tier_tokens / high_margin)
    n = max(min_prefixes, -(-low // per_prefix))
    d = reuse_distance(n, prefix_len, tail_len)
    if d > high:
        raise ConfigError(
            f"no prefix pool fits the window: {n} prefixes x ({prefix_len} + {tail_len}) tokens "
            f"= {d} tokens of reuse distance are needed to exceed {low_margin:g} x the HBM pool "
            f"of {hbm_pool_tokens} tokens, but the tier holds {tier_tokens} tokens (at most "
            f"{high} with margin {high_margin:g}); raise the tier (KVTIER_MEMORY_BYTES), lower "
            "the HBM pool (--hbm-blocks) or shorten the prefix"
        )
    return Placement(n, prefix_len, tail_len, d, hbm_pool_tokens, tier_tokens, low, high)


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def _marker(i: int, vocab: int) -> list[int]:
    """Request `i` as two base-(vocab - FIRST_TOKEN) digits of non-special token ids."""
    base = vocab - FIRST_TOKEN
    return [FIRST_TOKEN + i // base, FIRST_TOKEN + i % base]


def _check_common(seed: int, vocab: int, max_tokens: int, n_requests: int) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"seed={seed!r} must be an integer >= 0")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab <= FIRST_TOKEN + 1:
        raise ConfigError(f"vocab={vocab!r} must be an integer > {FIRST_TOKEN + 1}")
    _check_positive(max_tokens=max_tokens)
    if n_requests > (vocab - FIRST_TOKEN) ** 2:
        raise ConfigError(
            f"n_requests={n_requests} exceeds the {(vocab - FIRST_TOKEN) ** 2} unique markers "
            f"of a {vocab}-token vocabulary; send fewer requests per stream"
        )


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name}={value!r} must be an integer >= 1")
