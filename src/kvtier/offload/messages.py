"""Scheduler -> worker operations and worker -> scheduler reports (msgspec, no pickle).

A chunk of an operation names its key and the KV block of each of its block positions; `-1`
marks a position the worker must not touch (below the HBM floor, or past what a load claims).
"""

from __future__ import annotations

import msgspec


class ChunkRef(msgspec.Struct, frozen=True, array_like=True):
    """One chunk: its 16-byte key, `chunk_size // block_size` block ids (-1 = skip) and the key
    of the chunk before it in the prompt (b"" for the first), which the tiers keep so they can
    evict leaves before their parents. `part` >= 0: part `part` of a boundary's state record
    (its block ids the state groups' blocks), whose parent is the part before it (part 0's: the
    chunk it ends)."""

    key: bytes
    block_ids: list[int]
    parent: bytes = b""
    part: int = -1


class LoadOp(msgspec.Struct, frozen=True):
    """Read chunks from the tier into KV blocks; `tokens` is what the load claims and
    `first_chunk` the index of its first chunk in the prompt. A `sync` load is finished inside
    `start_load_kv`, before the step's forward reads its blocks, and reports no
    finished_recving (its request is running, not parked). A load with `fail` set reads
    nothing: every rank reports it failed with that reason at once (the scheduler could not
    make the load the host was promised; the host recomputes its blocks)."""

    op_id: str
    req_id: str
    lookup_id: str
    chunks: list[ChunkRef]
    tokens: int
    first_chunk: int = 0
    sync: bool = False
    fail: str = ""
    # its request was admitted again after a preemption: the hosts count such admissions
    # apart from their external hits, so its tokens are counted apart too
    readmitted: bool = False


class SaveOp(msgspec.Struct, frozen=True):
    """Pack KV blocks of whole prompt chunks into the tier; `first_chunk` is the index of its
    first chunk in the prompt."""

    op_id: str
    req_id: str
    chunks: list[ChunkRef]
    tokens: int
    first_chunk: int = 0


class OffloadMeta(msgspec.Struct):
    """Everything the workers must do for one engine step."""

    loads: list[LoadOp] = msgspec.field(default_factory=list)
    saves: list[SaveOp] = msgspec.field(default_factory=list)
    # requests whose block frees the host delayed; workers report them finished_sending once idle
    delayed_free: list[str] = msgspec.field(default_factory=list)
    # agreed load terminals (op id -> every rank succeeded): a rank counts its retrieved tokens
    # only for loads that succeeded on every rank, so sum(retrieved) / TP == external hits
    load_terminals: dict[str, bool] = msgspec.field(default_factory=dict)
    # requests whose blocks the host took back this step: their in-flight saves must not commit
    preempted: list[str] = msgspec.field(default_factory=list)
    # saves whose blocks the host handed to another request this step (a hybrid model's
    # sliding-window blocks): they must not commit, as a preempted request's
    cancel_saves: list[str] = msgspec.field(default_factory=list)

    def is_empty(self) -> bool:
        return not (
            self.loads
            or self.saves
            or self.delayed_free
            or self.load_terminals
            or self.preempted
            or self.cancel_saves
        )


class OpResult(msgspec.Struct, frozen=True, array_like=True):
    """The outcome of one operation on one rank."""

    op_id: str
    ok: bool
    reason: str = ""
    nbytes: int = 0
    seconds: float = 0.0
    tier: str = ""


class TierChange(msgspec.Struct, frozen=True, array_like=True):
    """A chunk a rank's tier stored or dropped (`change` "stored" | "removed"), for KV events."""

    change: str
    tier: str
    key: bytes


class WorkerReport(msgspec.Struct):
    """What one rank finished since its last report."""

    rank: int
    results: list[OpResult] = msgspec.field(default_factory=list)
    finished_sending: list[str] = msgspec.field(default_factory=list)
    finished_recving: list[str] = msgspec.field(default_factory=list)
    invalid_block_ids: list[int] = msgspec.field(default_factory=list)
    # what this rank's tiers stored and dropped (only when the host publishes KV events)
    changes: list[TierChange] = msgspec.field(default_factory=list)
    # this rank's metrics (kvtier.metrics.snapshot), for the process that serves /metrics
    metrics: bytes = b""
    # the startup self-test's load through the real path (tokens, seconds), sent once: the
    # scheduler's load gate starts from it instead of the config's seed
    selftest_load: tuple[int, float] | None = None

    def is_empty(self) -> bool:
        return not (
            self.results
            or self.finished_sending
            or self.finished_recving
            or self.invalid_block_ids
            or self.changes
            or self.selftest_load
        )


_meta_encoder = msgspec.msgpack.Encoder()
_meta_decoder = msgspec.msgpack.Decoder(OffloadMeta)
_report_decoder = msgspec.msgpack.Decoder(WorkerReport)


def encode(msg: OffloadMeta | WorkerReport) -> bytes:
    """msgpack bytes of a meta or report."""
    return _meta_encoder.encode(msg)


def decode_meta(data: bytes) -> OffloadMeta:
    """Inverse of `encode` for an OffloadMeta."""
    return _meta_decoder.decode(data)


def decode_report(data: bytes) -> WorkerReport:
    """Inverse of `encode` for a WorkerReport."""
    return _report_decoder.decode(data)
