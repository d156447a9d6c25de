"""Test-only kvtier connectors whose worker half on one rank breaks its load lane mid-load, and
helpers shared by the engine-level fault and shared-tier tests.

`fault="raise"`: reading the second chunk of a load raises `RankDied` (an exception type the
offload worker does not expect), after the first chunk was already written into KV blocks.
`fault="stuck"`: that read blocks until the connector shuts down (or `release` is set), so the
rank never reports the load unless the worker's per-load deadline does it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.config import KVTierConfig
from kvtier.native import Engine, EngineConfig
from kvtier.native.connector import ConnectorContext, ConnectorRole
from kvtier.native.offload import WorkerHalf, connector_spec
from kvtier.native.offload import build as build_kvtier
from kvtier.offload.worker import OffloadWorker
from tests.faults.inject import intercept_reads
from tests.record_key import RECORD_KEY
from tests.redis_local import LOADED_TIMEOUT_MS

FAULTS = ("raise", "stuck")
# a stuck read gives up after this long even if nobody releases it (keeps a failing test bounded)
STUCK_MAX_S = 60.0


class RankDied(Exception):
    """What the broken rank's load lane raises: not a RuntimeError/ValueError/OSError."""


class FaultyLoadWorkerHalf(WorkerHalf):
    """A WorkerHalf whose first `fail_loads` multi-chunk loads break at their second chunk."""

    fault: str
    fail_loads: int
    doomed: set[bytes]
    fired: threading.Event
    release: threading.Event

    def arm(self, fault: str, fail_loads: int) -> None:
        """Set the fault up (the class is swapped in after the WorkerHalf was built)."""
        if fault not in FAULTS:
            raise ValueError(f"fault={fault!r} must be one of {FAULTS}")
        self.fault = fault
        self.fail_loads = fail_loads
        self.doomed = set()
        self.fired = threading.Event()
        self.release = threading.Event()

    def register_kv_caches(self, kv_caches: dict[str, Any], block_size: int) -> None:
        super().register_kv_caches(kv_caches, block_size)
        stack = self.worker.stack
        assert stack is not None
        intercept_reads(stack, self._maybe_fail)

    def start_load_kv(self) -> None:
        for op in self._meta.loads:
            if self.fail_loads > 0 and len(op.chunks) > 1:
                self.doomed.add(op.chunks[1].key)
                self.fail_loads -= 1
        super().start_load_kv()

    def _maybe_fail(self, key: bytes) -> None:
        if key in self.doomed:
            self.doomed.discard(key)
            self.fired.set()
            if self.fault == "raise":
                raise RankDied(f"rank {self.rank}'s load lane died mid-load")
            self.release.wait(STUCK_MAX_S)

    def shutdown(self) -> None:
        self.release.set()
        super().shutdown()


def build(role: ConnectorRole, context: ConnectorContext, **args: Any) -> Any:
    """Like kvtier.native.offload.build, with a faulty worker half on `fail_rank`."""
    fault = args.pop("fault")
    fail_rank = args.pop("fail_rank")
    fail_loads = args.pop("fail_loads", 1)
    half = build_kvtier(role, context, **args)
    if role is ConnectorRole.WORKER and context.tp_rank == fail_rank:
        half.__class__ = FaultyLoadWorkerHalf
        half.arm(fault, fail_loads)
    return half


# ---- helpers shared by the engine-level tests ------------------------------------------------


def kvtier_engine(
    model: Path,
    run_dir: Path,
    *,
    tp: int = 1,
    fault: dict[str, Any] | None = None,
    num_blocks: int = 256,
    **cfg: Any,
) -> Engine:
    """A native engine on `model` with kvtier (64-token chunks, no load gate unless given);
    with `fault`, its worker halves come from this module's `build` with those arguments."""
    cfg.setdefault("chunk_size", 64)
    if "remote_url" in cfg:
        cfg.setdefault("record_key", RECORD_KEY)
    cfg.setdefault("memory_bytes", "64MiB")
    cfg.setdefault("load_gate", False)
    # hit counts are asserted: on 2 oversubscribed cores a rank's lookup can miss 200 ms
    cfg.setdefault("lookup_timeout_ms", 2000)
    if "remote_url" in cfg:
        # and a remote read 100 ms (the default): 16 of 20 remote hits once, under 3 workers
        cfg.setdefault("remote_timeout_ms", LOADED_TIMEOUT_MS)
    # and a save's wait for the write-behind to unpin a memory slot (500 ms by default): a
    # starved writer once cost every save of a 1 MiB memory tier in CI
    cfg.setdefault("write_wait_ms", 5000)
    spec = connector_spec(KVTierConfig(**cfg), model, run_dir=run_dir)
    factory: Any = spec if fault is None else (f"{__name__}:build", {**spec.args, **fault})
    return Engine(
        model,
        EngineConfig(num_threads=1, tensor_parallel_size=tp, num_blocks=num_blocks),
        factory,
    )


def local_worker(eng: Engine) -> OffloadWorker:
    """The in-process OffloadWorker of a TP=1 engine."""
    worker: OffloadWorker = eng.executor.runner.connector.worker  # type: ignore[union-attr]
    return worker


def rank_values(eng: Engine, name: str, **labels: str) -> dict[str, float]:
    """Per-rank values of `kvtier_<name>` (with `labels`) from the merged /metrics collector."""
    out: dict[str, float] = {}
    for fam in eng.connector.collector.collect():
        for s in fam.samples:
            rank = s.labels.get("rank")
            if s.name != f"kvtier_{name}" or rank in (None, "scheduler"):
                continue
            if all(s.labels.get(k) == v for k, v in labels.items()):
                out[rank] = out.get(rank, 0.0) + s.value
    return out


def wait_until(
    cond: Callable[[], bool], timeout_s: float, what: str, step: Callable[[], None] | None = None
) -> None:
    """Run `step` (default: nothing) until `cond()` holds; AssertionError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s}s")
        if step is not None:
            step()
        else:
            # nothing to drive: give the other threads the core without a blind sleep
            threading.Event().wait(0.01)
