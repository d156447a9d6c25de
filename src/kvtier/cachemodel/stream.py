"""Request streams as the tier sees them: each prompt a chain of chunk ids, plus the engine's
HBM prefix cache in front of the tier.

A chunk id names a chunk together with everything before it (a chained hash, or a Mooncake hash
id), so equal ids mean equal prefixes. Only full chunks are stored; a hit never covers the last
prompt token, which the engine computes to get logits.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from kvtier.cachemodel.trace import TraceRow
from kvtier.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Request:
    """One prompt: the chained ids of its full chunks, and how many leading ones a hit may
    cover (one fewer when the prompt ends exactly on a chunk boundary)."""

    chunks: tuple[int, ...]
    usable: int

    def __post_init__(self) -> None:
        if not 0 <= self.usable <= len(self.chunks):
            raise ConfigError(
                f"a request of {len(self.chunks)} chunks cannot have {self.usable} usable ones"
            )


def from_trace(rows: Sequence[TraceRow], block_tokens: int) -> list[Request]:
    """Trace rows as requests whose chunks are the trace's blocks (Mooncake ids chain already)."""
    out = []
    for row in rows:
        full = min(len(row.hash_ids), row.input_length // block_tokens)
        usable = min(full, (row.input_length - 1) // block_tokens)
        out.append(Request(tuple(row.hash_ids[:full]), usable))
    return out


class ChainIds:
    """Exact chained ids of fixed-size units of token prompts: a unit is named by its parent's
    id and its own tokens, interned to a small int, so equal ids mean equal prefixes."""

    def __init__(self, unit: int) -> None:
        if unit < 1:
            raise ConfigError(f"unit={unit} must be >= 1 tokens")
        self.unit = unit
        self._ids: dict[tuple[int, tuple[int, ...]], int] = {}

    def of(self, prompt: Sequence[int]) -> list[int]:
        """The ids of the full units of `prompt`."""
        out = []
        parent = -1
        u = self.unit
        for i in range(len(prompt) // u):
            key = (parent, tuple(prompt[i * u : (i + 1) * u]))
            parent = self._ids.setdefault(key, len(self._ids))
            out.append(parent)
        return out


def from_prompts(prompts: Iterable[Sequence[int]], chunk_size: int) -> list[Request]:
    """Token prompts as requests of `chunk_size`-token chunks."""
    ids = ChainIds(chunk_size)
    out = []
    for prompt in prompts:
        if not prompt:
            raise ConfigError("an empty prompt cannot be a request; every prompt needs tokens")
        chunks = ids.of(prompt)
        out.append(Request(tuple(chunks), min(len(chunks), (len(prompt) - 1) // chunk_size)))
    return out


def working_set(requests: Iterable[Request]) -> int:
    """Distinct chunks over the stream: the tier size that holds everything ever stored."""
    return len({c for r in requests for c in r.chunks})


class ChainLRU:
    """The engine's prefix cache: ids in recency order (least recent first), at most `capacity`
    of them (None: unbounded), each prompt touched tail first so its head is evicted last."""

    def __init__(self, capacity: int | None) -> None:
        if capacity is not None and capacity < 0:
            raise ConfigError(f"cache capacity {capacity} is negative; use 0 or more")
        self.capacity = capacity
        self._keys: OrderedDict[Hashable, None] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def leading(self, keys: Sequence[Hashable]) -> int:
        """How many of `keys`, from the first, are present."""
        n = 0
        for key in keys:
            if key not in self._keys:
                break
            n += 1
        return n

    def touch_chain(self, keys: Sequence[Hashable]) -> None:
        """Insert or refresh a prefix chain tail first, evicting least recent keys over the cap."""
        if self.capacity == 0:
            return
        for key in reversed(keys):
            self._keys[key] = None
            self._keys.move_to_end(key)
            if self.capacity is not None and len(self._keys) > self.capacity:
                self._keys.popitem(last=False)


def hbm_floors(requests: Sequence[Request], hbm_chunks: int) -> list[int]:
    """The HBM hit of each request, in chunks, with an HBM prefix cache of `hbm_chunks` in front
    (it holds every prompt it computed or loaded, whatever the tier did)."""
    hbm = ChainLRU(hbm_chunks)
    out = []
    for r in requests:
        out.append(hbm.leading(r.chunks[: r.usable]))
        hbm.touch_chain(r.chunks)
    return out
