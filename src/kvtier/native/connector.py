"""The KV-connector hook contract of the native engine (vLLM v1's names and semantics).

A connector has two halves. The scheduler half lives in the engine process, next to the
scheduler; one worker half lives in every TP rank, next to that rank's KV cache. Both are built
from a `ConnectorSpec`: a dotted path to a callable `f(role, context, **args)` and msgspec-
serialisable `args`, so a worker process builds its half without pickle.

Per engine step (see `Engine.step`):

scheduler half, engine process
    get_num_new_matched_tokens(req, hbm_hit)   at admission: (external tokens beyond the HBM
                                               hit, load_async); (None, False) = ask later.
                                               May be asked again if allocation then fails.
    update_state_after_alloc(req, blocks, n)   right after the request got its blocks;
                                               req.num_computed_tokens is the HBM hit (the
                                               floor) and n the external tokens it will count
    request_preempted(req)                     before a running or loaded request's blocks
                                               are taken back (never while its load is on
                                               the ranks)
    build_connector_meta(scheduler_output)     once per step, before the forward (requests'
                                               num_computed_tokens are still pre-step);
                                               `encode_meta` turns it into bytes for every rank
worker half, every rank, in this order
    decode_meta(bytes) -> bind_connector_metadata(meta)
    -> handle_preemptions(ids)  [only when the step preempted requests: finish any use of
                                their blocks before returning, they may be reused this step]
    -> start_load_kv()  [before the forward if the step has synchronous loads, else after it]
    -> forward [wait_for_layer_load(layer) before each layer] -> wait_for_save()
    -> get_finished(finished_req_ids)
    -> get_block_ids_with_load_errors() -> build_worker_meta() -> clear_connector_metadata()
    Steps with nothing to compute still run these hooks (no forward), so transfers progress.
scheduler half again
    update_connector_output(ConnectorOutput)   ids every rank reported (quorum), invalid blocks
                                               of any rank (union), each rank's worker bytes
    request_finished(req, block_ids) -> bool   when a request finishes or is aborted; True =
                                               keep its blocks until its id is finished_sending
    get_external_cache_hit_sources(req, n)     optional: after the step that finished a load
                                               of n tokens, {CacheHitSource value: tokens}
                                               summing to n (absent: all external_unspecified)

Loads. `(n, False)`: the engine counts the n tokens as computed at once and the rank must fill
them in `start_load_kv` before the forward. `(n, True)`: the request waits in
WAITING_FOR_REMOTE_KVS, holding its blocks, until every rank reported it in `finished_recving`;
it then resumes from HBM hit + n tokens. Every asynchronous load must end in `finished_recving`,
failed or not. A failed block is reported through `get_block_ids_with_load_errors` no later than
the step that reports the request finished_recving (or, for a synchronous load, in the step of
the load); the engine recomputes the request from its first failed block. The engine never asks
for a load below the HBM hit, and always computes the last prompt token itself: a connector
holding the whole prompt answers with one token less.
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import torch

from kvtier.errors import ConfigError

if TYPE_CHECKING:
    from kvtier.native.sched_output import SchedulerOutput


# vLLM's CacheHitSource values (vllm/v1/metrics/cache_hit_source.py), nearest tier first
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
UNSPECIFIED_SOURCE = "external_unspecified"


class ConnectorRole(enum.Enum):
    """Which half a factory call must build."""

    SCHEDULER = "scheduler"
    WORKER = "worker"


class ConnectorContext(msgspec.Struct, frozen=True):
    """What a connector half may know about the engine and its KV geometry."""

    model_dir: str
    model_type: str
    dtype: str
    block_size: int
    num_blocks: int
    num_layers: int
    num_kv_heads: int  # whole model
    num_kv_heads_per_rank: int
    head_dim: int
    tp_size: int
    tp_rank: int  # -1 for the scheduler half
    device: str
    # layout of each registered per-layer tensor; a block is one contiguous `cache[b]` slice
    kv_layout: str = "block,kv,token,head,dim"
    max_model_len: int = 0  # the longest sequence the engine serves; 0 = not told


class ConnectorSpec(msgspec.Struct, frozen=True):
    """`path` = "package.module:callable" taking (role, context, **args); args msgspec-safe."""

    path: str
    args: dict[str, Any] = msgspec.field(default_factory=dict)

    @classmethod
    def of(cls, spec: ConnectorSpec | tuple[str, dict[str, Any]] | str) -> ConnectorSpec:
        """Accept a spec, a `(path, args)` tuple or a bare path."""
        if isinstance(spec, ConnectorSpec):
            out = spec
        elif isinstance(spec, str):
            out = cls(spec)
        elif isinstance(spec, tuple | list) and len(spec) == 2:
            out = cls(spec[0], dict(spec[1]))
        else:
            raise ConfigError(
                f"connector_factory={spec!r} is not a ConnectorSpec, a (path, args) tuple or "
                "a 'module:callable' string"
            )
        try:
            msgspec.msgpack.encode(out.args)
        except (TypeError, msgspec.EncodeError) as e:
            raise ConfigError(
                f"connector args {out.args!r} cannot be sent to worker processes ({e}); "
                "use plain str/int/float/bool/list/dict values"
            ) from None
        return out


@dataclass
class ConnectorOutput:
    """What the ranks reported in one step, aggregated for the scheduler half."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    worker_meta: list[bytes] = field(default_factory=list)  # index = rank; b"" = nothing


class ConnectorRequest(Protocol):
    """The request attributes a connector may read (never write)."""

    request_id: str
    prompt_token_ids: list[int]
    num_computed_tokens: int
    num_cached_tokens: int  # HBM hit at first admission; -1 until that admission settled
    num_external_tokens: int  # loaded at first admission
    block_ids: list[int]

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by output."""


class SchedulerConnector(Protocol):
    """The engine-process half."""

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """(external tokens beyond the HBM hit, load_async); None = ask later."""

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """The request got `block_ids`; `num_external_tokens` will count as computed."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> object:
        """This step's work for the ranks."""

    def encode_meta(self, meta: object) -> bytes:
        """Bytes of a `build_connector_meta` result, for every rank."""

    def update_connector_output(self, output: ConnectorOutput) -> None:
        """What the ranks reported this step (quorum and union applied)."""

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> bool:
        """Finished or aborted; True keeps its blocks until it is finished_sending."""

    def request_preempted(self, request: ConnectorRequest) -> None:
        """Its blocks are about to be taken back (recompute preemption)."""

    def shutdown(self) -> None:
        """Stop background work; called once at engine close."""


class WorkerConnector(Protocol):
    """The per-rank half."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], block_size: int) -> None:
        """This rank's per-layer caches, `[num_blocks, 2, block_size, heads, dim]`."""

    def decode_meta(self, data: bytes) -> object:
        """Inverse of the scheduler half's `encode_meta`."""

    def bind_connector_metadata(self, meta: object) -> None:
        """The step's metadata, before anything else of the step."""

    def handle_preemptions(self, preempted_req_ids: set[str]) -> None:
        """Finish any use of these requests' blocks before returning."""

    def start_load_kv(self) -> None:
        """Start (sync: finish) the step's loads."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Inside the forward, before `layer_name` reads its KV (every layer, every step)."""

    def wait_for_save(self) -> None:
        """After the forward: save what the step computed."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(finished_sending, finished_recving) ids of this rank since the last call."""

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call."""

    def build_worker_meta(self) -> bytes:
        """Opaque per-rank bytes for the scheduler half (b"" = nothing)."""

    def clear_connector_metadata(self) -> None:
        """End of the step."""

    def shutdown(self) -> None:
        """Stop background work; called once at engine close."""


class NullConnector:
    """Both halves, doing nothing: no external tokens, nothing saved, nothing delayed."""

    def __init__(self, role: ConnectorRole, context: ConnectorContext, **args: Any) -> None:
        self.role = role
        self.context = context

    # scheduler half
    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Never anything external."""
        return 0, False

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """Nothing to record."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> object:
        """No work."""
        return None

    def encode_meta(self, meta: object) -> bytes:
        """Empty bytes."""
        return b""

    def update_connector_output(self, output: ConnectorOutput) -> None:
        """Nothing to track."""

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> bool:
        """Free at once."""
        return False

    def request_preempted(self, request: ConnectorRequest) -> None:
        """Nothing in flight."""

    # worker half
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], block_size: int) -> None:
        """Nothing to register."""

    def decode_meta(self, data: bytes) -> object:
        """No metadata."""
        return None

    def bind_connector_metadata(self, meta: object) -> None:
        """Nothing to bind."""

    def handle_preemptions(self, preempted_req_ids: set[str]) -> None:
        """Nothing in flight."""

    def start_load_kv(self) -> None:
        """Nothing to load."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing loading."""

    def wait_for_save(self) -> None:
        """Nothing to save."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """Nothing finished."""
        return set(), set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """No loads, no errors."""
        return set()

    def build_worker_meta(self) -> bytes:
        """Nothing to report."""
        return b""

    def clear_connector_metadata(self) -> None:
        """Nothing bound."""

    def shutdown(self) -> None:
        """Nothing to stop."""


NULL_CONNECTOR = ConnectorSpec("kvtier.native.connector:NullConnector")


def external_cache_hit_sources(
    connector: object, request: ConnectorRequest, num_external_tokens: int
) -> dict[str, int]:
    """The optional hook's split of a load by tier; a missing hook, or counts that name an
    unknown source or do not sum to the load, count as `external_unspecified` (vLLM's rule)."""
    hook = getattr(connector, "get_external_cache_hit_sources", None)
    if num_external_tokens <= 0:
        return {}
    split = dict(hook(request, num_external_tokens)) if callable(hook) else {}
    if sum(split.values()) != num_external_tokens or not set(split) <= set(CACHE_HIT_SOURCES):
        return {UNSPECIFIED_SOURCE: num_external_tokens}
    return {k: v for k, v in split.items() if v}


def resolve(path: str) -> Callable[..., Any]:
    """Import `package.module:callable` (or `package.module.callable`)."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"connector path {path!r} must look like 'package.module:callable'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"connector module {module_name!r} cannot be imported: {e}") from e
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"connector module {module_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise ConfigError(f"connector path {path!r} names {type(obj).__name__}, not a callable")
    return obj


SCHEDULER_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "encode_meta",
    "update_connector_output",
    "request_finished",
    "request_preempted",
    "shutdown",
)
WORKER_HOOKS = (
    "register_kv_caches",
    "decode_meta",
    "bind_connector_metadata",
    "handle_preemptions",
    "start_load_kv",
    "wait_for_layer_load",
    "wait_for_save",
    "get_finished",
    "get_block_ids_with_load_errors",
    "build_worker_meta",
    "clear_connector_metadata",
    "shutdown",
)


def build_connector(spec: ConnectorSpec, role: ConnectorRole, context: ConnectorContext) -> Any:
    """Build one half from its spec and check it has every hook of its role."""
    half = resolve(spec.path)(role, context, **spec.args)
    hooks = SCHEDULER_HOOKS if role is ConnectorRole.SCHEDULER else WORKER_HOOKS
    missing = [name for name in hooks if not callable(getattr(half, name, None))]
    if missing:
        raise ConfigError(
            f"connector {spec.path!r} built a {type(half).__name__} for the {role.value} role "
            f"that lacks the hooks {missing}"
        )
    return half


class KVOutputAggregator:
    """Per-request quorum over ranks: an id is finished only once every rank reported it."""

    def __init__(self, world: int) -> None:
        self.world = world
        self._sending: dict[str, set[int]] = {}
        self._recving: dict[str, set[int]] = {}
        self.ignored = 0  # reports for ids nobody waits for

    def add(
        self,
        rank: int,
        sending: Iterable[str],
        recving: Iterable[str],
        expect_sending: Container[str],
        expect_recving: Container[str],
    ) -> tuple[set[str], set[str]]:
        """Record one rank's report; returns the ids this report completed."""
        return (
            self._vote(self._sending, rank, sending, expect_sending),
            self._vote(self._recving, rank, recving, expect_recving),
        )

    def _vote(
        self, table: dict[str, set[int]], rank: int, ids: Iterable[str], expect: Container[str]
    ) -> set[str]:
        done = set()
        for rid in ids:
            if rid not in expect:
                self.ignored += 1
                continue
            votes = table.setdefault(rid, set())
            votes.add(rank)  # a duplicate from the same rank adds no quorum
            if len(votes) == self.world:
                del table[rid]
                done.add(rid)
        return done

    def forget(self, req_id: str) -> None:
        """Drop partial votes of a request whose lifecycle ended."""
        self._sending.pop(req_id, None)
        self._recving.pop(req_id, None)

    def pending(self) -> dict[str, Sequence[int]]:
        """Partial recving votes, for tests and debugging."""
        return {k: sorted(v) for k, v in self._recving.items()}
