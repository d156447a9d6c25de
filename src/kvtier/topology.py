"""The one place that reads tensor/pipeline/data-parallel sizes and ranks, from any config shape.

A TP4 replica read as world 1 is the bug this module exists to prevent: sizes are read from the
top level *and* from `parallel_config`; a disagreement or a missing size is a startup error.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvtier.errors import TopologyError

__all__ = ["Topology", "resolve", "validate_lookup_scope"]

_MISSING = object()
_SIZE_KEYS = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")
_RANK_KEYS = ("data_parallel_rank", "rank")
# context parallelism multiplies vLLM's world, which world = tp x pp would silently miss
# decode context parallelism shards each block's tokens across the TP ranks (interleaved, a
# block then covers block_size x dcp tokens) with the same tensor shapes as without it: an
# engine with it and one without would share page identities and read each other's blocks,
# and an MLA model would be taken for replicated (rank 1 restoring rank 0's token shard)
_UNSUPPORTED_SIZE_KEYS = ("prefill_context_parallel_size", "decode_context_parallel_size")


@dataclass(frozen=True)
class Topology:
    """Parallel layout of one replica: `world = tp_size * pp_size` ranks, this one is `rank`."""

    tp_size: int
    pp_size: int
    dp_size: int
    dp_rank: int
    world: int
    rank: int

    def __post_init__(self) -> None:
        for name in ("tp_size", "pp_size", "dp_size", "world"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise TopologyError(f"Topology.{name}={value!r} must be a positive int")
        if self.world != self.tp_size * self.pp_size:
            raise TopologyError(
                f"Topology.world={self.world} != tp_size x pp_size = "
                f"{self.tp_size} x {self.pp_size}; build it with topology.resolve()"
            )
        if not _is_int(self.rank) or not 0 <= self.rank < self.world:
            raise TopologyError(
                f"Topology.rank={self.rank!r} is outside [0, {self.world}) "
                f"(world={self.world} from {self.origin}); pass the worker's rank in its replica"
            )
        if not _is_int(self.dp_rank) or not 0 <= self.dp_rank < self.dp_size:
            raise TopologyError(
                f"Topology.dp_rank={self.dp_rank!r} is outside [0, {self.dp_size}) "
                f"(dp_size={self.dp_size}); check data_parallel_rank and data_parallel_size"
            )

    @property
    def origin(self) -> str:
        """How the world was formed, for messages: `tp=4 x pp=1`."""
        return f"tp={self.tp_size} x pp={self.pp_size}"

    @property
    def tp_rank(self) -> int:
        """Rank inside this rank's tensor-parallel group (ranks are pp-major, as in vLLM)."""
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        """Pipeline stage of this rank."""
        return self.rank // self.tp_size

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank of the replica, `(0, ..., world - 1)`."""
        return tuple(range(self.world))

    def with_rank(self, rank: int) -> Topology:
        """The same replica seen from `rank` (a worker), validated."""
        return replace(self, rank=rank)

    def describe(self) -> str:
        """One line for logs: `world=4 from tp=4 x pp=1, rank 2, dp 0/1`."""
        return (
            f"world={self.world} from {self.origin}, rank {self.rank}, "
            f"dp {self.dp_rank}/{self.dp_size}"
        )


def _is_int(value: Any) -> bool:
    # bool is an int subclass, and True as a TP size is a config bug, not 1
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _get(obj: Any, key: str) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(key, _MISSING)
    return getattr(obj, key, _MISSING)


def _label(base: str, obj: Any, key: str) -> str:
    return f"{base}[{key!r}]" if isinstance(obj, Mapping) else f"{base}.{key}"


def _read(layers: list[tuple[str, Any]], key: str) -> tuple[int, str] | None:
    """`key` from every layer that has it; all present values must agree. None if absent."""
    found: list[tuple[int, str]] = []
    for base, obj in layers:
        value = _get(obj, key)
        if value is _MISSING or value is None:
            continue
        where = _label(base, obj, key)
        if not _is_int(value):
            raise TopologyError(
                f"{where}={value!r} is a {type(value).__name__}, not an int; "
                f"set {key} to a whole number"
            )
        found.append((int(value), where))
    if not found:
        return None
    first_value, first_where = found[0]
    for value, where in found[1:]:
        if value != first_value:
            raise TopologyError(
                f"{key} disagrees: {first_where}={first_value} but {where}={value}; "
                f"make both say the real {key} (or drop one) so every rank derives the same world"
            )
    return found[0]


def _layers(config_like: Any) -> list[tuple[str, Any]]:
    layers: list[tuple[str, Any]] = [("config", config_like)]
    nested = _get(config_like, "parallel_config")
    if nested is not _MISSING and nested is not None:
        layers.append((_label("config", config_like, "parallel_config"), nested))
    return layers


def resolve(config_like: Any, *, rank: int | None = None, allow_default: bool = False) -> Topology:
    """Read TP/PP/DP sizes and ranks from a native config, a vLLM `VllmConfig` or a dict.

    Sizes are read at the top level and under `parallel_config`; disagreement or absence raises.
    """
    if isinstance(config_like, Topology):
        return config_like if rank is None else config_like.with_rank(rank)
    if config_like is None:
        if not allow_default:
            raise TopologyError(
                "no config to read tensor_parallel_size from (got None); pass the engine config"
            )
        config_like = {}
    layers = _layers(config_like)
    where = " and ".join(base for base, _ in layers)

    tp = _read(layers, "tensor_parallel_size")
    pp = _read(layers, "pipeline_parallel_size")
    dp = _read(layers, "data_parallel_size")
    if tp is None and not allow_default:
        seen = "no parallel sizes" if pp is None else f"{pp[1]}={pp[0]} but no tensor size"
        raise TopologyError(
            f"tensor_parallel_size not found in {where} ({seen}); kvtier will not guess a world "
            "of 1 (a TP4 replica read as world 1 loses every lookup off rank 0). Set "
            "tensor_parallel_size at the top level or under parallel_config"
        )
    for key in _UNSUPPORTED_SIZE_KEYS:
        extra = _read(layers, key)
        if extra is not None and extra[0] != 1:
            raise TopologyError(
                f"{extra[1]}={extra[0]}: context parallelism is not supported by kvtier; "
                f"run with {key}=1 or disable offload"
            )

    sizes = {}
    for key, got in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp)):
        value, src = got if got is not None else (1, "default")
        if value < 1:
            raise TopologyError(f"{src}={value} must be >= 1; set {key} to a positive int")
        sizes[key] = value
    dp_size, dp_src = dp if dp is not None else (1, "default")
    if dp_size < 1:
        raise TopologyError(f"{dp_src}={dp_size} must be >= 1; set data_parallel_size >= 1")
    dp_found = _read(layers, "data_parallel_rank")
    dp_rank = dp_found[0] if dp_found is not None else 0
    if not 0 <= dp_rank < dp_size:
        raise TopologyError(
            f"{dp_found[1] if dp_found else 'data_parallel_rank'}={dp_rank} is outside "
            f"[0, {dp_size}) (data_parallel_size={dp_size}); fix data_parallel_rank"
        )

    tp_size = sizes["tensor_parallel_size"]
    pp_size = sizes["pipeline_parallel_size"]
    world = tp_size * pp_size
    if rank is not None:
        if not _is_int(rank):
            raise TopologyError(f"rank={rank!r} is not an int; pass the worker's rank")
        this_rank, rank_src = int(rank), "rank argument"
    else:
        found_rank = _read(layers, "rank")
        this_rank, rank_src = found_rank if found_rank is not None else (0, "default rank")
    if not 0 <= this_rank < world:
        raise TopologyError(
            f"{rank_src}={this_rank} is outside [0, {world}) (world={world} from tp={tp_size} "
            f"x pp={pp_size}); pass rank= the worker's rank within its replica"
        )
    return Topology(
        tp_size=tp_size,
        pp_size=pp_size,
        dp_size=dp_size,
        dp_rank=dp_rank,
        world=world,
        rank=this_rank,
    )


def validate_lookup_scope(scope: Sequence[int] | None, topology: Topology) -> tuple[int, ...]:
    """Ranks a lookup asks: every rank when `scope` is None, else `scope` checked against world.

    Empty, duplicate, non-int or out-of-range ids raise TopologyError naming them and the world.
    """
    world = topology.world
    ctx = f"(world={world} from {topology.origin})"
    fix = (
        f"list ranks in [0, {world}) or leave lookup_scope unset to ask every rank; if the world "
        "is wrong, check tensor_parallel_size/pipeline_parallel_size in the engine config"
    )
    if scope is None:
        return topology.ranks
    if isinstance(scope, str | bytes):
        raise TopologyError(
            f"lookup_scope {scope!r} is a string; parse it with KVTierConfig first ({fix})"
        )
    ids = tuple(scope)
    shown = f"lookup_scope {ids}"
    if not ids:
        raise TopologyError(f"{shown} is empty {ctx}; {fix}")
    bad_type = [r for r in ids if not _is_int(r)]
    if bad_type:
        raise TopologyError(f"{shown} has non-int ids {bad_type} {ctx}; {fix}")
    dupes = sorted({r for r in ids if ids.count(r) > 1})
    if dupes:
        raise TopologyError(f"{shown} names ranks {dupes} more than once {ctx}; {fix}")
    outside = sorted(r for r in ids if not 0 <= r < world)
    if outside:
        raise TopologyError(f"{shown} names ranks {outside} outside [0, {world}) {ctx}; {fix}")
    return tuple(int(r) for r in ids)
