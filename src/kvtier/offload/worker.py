"""OffloadWorker: the per-rank half of the offload core.

It owns the rank's TierStack, codec and LookupServer. Loads run on their own lane (a thread),
so a load never queues behind saves; saves pack finished blocks into the memory tier right
after the forward that produced them, and lower tiers are written behind.

Every load reports exactly once, even when the lane cannot: a load still unfinished
`lease_ttl_s` after it was queued (its leases have expired by then) is reported failed with
reason `deadline`, and the lane writes no further block for it when it comes back.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from kvtier.config import KVTierConfig
from kvtier.errors import StartupError
from kvtier.keys import Namespace
from kvtier.layout import TensorSpec, from_tensors
from kvtier.lookup import LookupServer
from kvtier.metrics import Metrics, snapshot
from kvtier.offload import messages
from kvtier.offload.codec import BlockCodec
from kvtier.offload.messages import LoadOp, OffloadMeta, OpResult, SaveOp, WorkerReport
from kvtier.offload.selftest import SELF_TEST_KEY, self_test_payload
from kvtier.store.factory import build_stack
from kvtier.store.stack import TierStack

log = logging.getLogger("kvtier")
# a rank's metrics ride along its reports; an idle rank refreshes them this often
_SNAPSHOT_EVERY_S = 1.0
_GIB = 1 << 30
DEADLINE = "deadline"  # load failure reason: the lane did not finish it within lease_ttl_s


@dataclass(eq=False, slots=True)
class _PendingLoad:
    """A load handed to the lane. `lock` makes finishing and expiring it mutually exclusive,
    and is held while the lane writes KV blocks, so nothing is written once it expired."""

    op: LoadOp
    queued_at: float
    deadline: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: bool = False
    expired: bool = False


class OffloadWorker:
    """Loads and saves KV chunks of one rank and answers its lookups."""

    def __init__(
        self,
        config: KVTierConfig,
        *,
        rank: int,
        world: int,
        model_id: str,
        metrics: Metrics,
        lookup_endpoint: str | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`clock` times the per-load deadline (`config.lease_ttl_s` after a load is queued)."""
        self.config = config
        self.rank = rank
        self.world = world
        self.model_id = model_id
        self.metrics = metrics
        self.lookup_endpoint = lookup_endpoint
        self.tag = f"kvtier[rank {rank}/{world}]"
        self.stack: TierStack | None = None
        self.codec: BlockCodec | None = None
        self.server: LookupServer | None = None
        self._lock = threading.Lock()
        self._results: list[OpResult] = []
        self._recving: list[str] = []
        self._invalid: list[int] = []
        self._sending: list[str] = []
        self._inflight: Counter[str] = Counter()  # req id -> ops not yet reported
        self._delayed: set[str] = set()
        # loads that succeeded here, awaiting the agreed terminal: op id -> (tokens, bytes)
        self._uncounted: dict[str, tuple[int, int]] = {}
        self.metrics_dirty = False
        self._last_snapshot = 0.0
        self._clock = clock
        self._pending: dict[str, _PendingLoad] = {}  # op id -> load not yet reported
        self._loads: queue.Queue[_PendingLoad | None] = queue.Queue()
        self._idle = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None

    # ---- startup ------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor], block_size: int) -> None:
        """Build layout, codec, tiers and lookup server for this rank's KV caches; self-test."""
        chunk = self.config.chunk_size
        specs = {n: TensorSpec(tuple(t.shape), t.dtype, 0) for n, t in kv_caches.items()}
        layout = from_tensors(specs, block_size)
        layout.check_chunk(chunk)
        self.codec = BlockCodec(kv_caches, chunk // block_size, layout.num_blocks)
        if self.codec.chunk_bytes != layout.chunk_bytes(chunk):
            raise StartupError(
                f"{self.tag}: codec chunk of {self.codec.chunk_bytes} bytes disagrees with the "
                f"layout's {layout.chunk_bytes(chunk)}; the registered tensors are not block-major"
            )
        ns = Namespace(
            model_id=self.model_id,
            layout_fingerprint=layout.fingerprint,
            dtype=layout.dtype,
            chunk_size=chunk,
            tp_size=self.world,
            tp_rank=self.rank,
            tenant=self.config.tenant,
        )
        self.stack = build_stack(self.config, ns.fingerprint, self.codec.chunk_bytes, self.metrics)
        self._staging = torch.empty(self.codec.chunk_bytes, dtype=torch.uint8)
        self._self_test()
        if self.lookup_endpoint is not None:
            self.server = LookupServer(self.rank, self.stack, self.lookup_endpoint, self.metrics)
            self.server.start()
        self._thread = threading.Thread(target=self._load_lane, name=f"kvtier-load-{self.rank}")
        self._thread.daemon = True
        self._thread.start()
        log.info(
            "%s: registered %d KV tensors, %d B/block, %d B/chunk, namespace %s, tiers %s, "
            "lookup server %s",
            self.tag,
            len(kv_caches),
            self.codec.bytes_per_block,
            self.codec.chunk_bytes,
            ns.hex,
            "+".join(self.stack.tiers),
            self.lookup_endpoint,
        )

    def _self_test(self) -> None:
        assert self.stack is not None
        payload = self_test_payload(self.codec.chunk_bytes if self.codec else 0)
        if not self.stack.put(SELF_TEST_KEY, payload):
            raise StartupError(f"{self.tag}: self-test could not store a chunk in the memory tier")
        back = torch.empty_like(payload)
        if self.stack.read_into(SELF_TEST_KEY, back) is None or not torch.equal(back, payload):
            raise StartupError(f"{self.tag}: self-test chunk did not read back identical bytes")

    # ---- per step -----------------------------------------------------------------------------

    def start_load_kv(self, meta: OffloadMeta) -> None:
        """Queue this step's loads on the load lane, note delayed frees, count agreed loads."""
        now = self._clock()
        pending = [_PendingLoad(op, now, now + self.config.lease_ttl_s) for op in meta.loads]
        with self._lock:
            for op_id, ok in meta.load_terminals.items():
                tokens, nbytes = self._uncounted.pop(op_id, (0, 0))
                if ok and tokens:
                    self.metrics.retrieved_tokens.inc(tokens)
                    self.metrics.retrieved_bytes.inc(nbytes)
                    self.metrics_dirty = True
            for p in pending:
                self._inflight[p.op.req_id] += 1
                self._pending[p.op.op_id] = p
            self._delayed.update(meta.delayed_free)
        for p in pending:
            self._loads.put(p)

    def wait_for_save(self, meta: OffloadMeta) -> None:
        """Pack this step's finished chunks into the tier (after the forward wrote them)."""
        for op in meta.saves:
            self._record(op.req_id, self._save(op), recv=False, invalid=())

    def take_report(self) -> WorkerReport:
        """Drain what finished since the last call into one report (loads past their deadline
        are reported failed first)."""
        self._expire_loads()
        with self._lock:
            for req_id in list(self._delayed):
                if not self._inflight.get(req_id):
                    self._delayed.discard(req_id)
                    self._sending.append(req_id)
            report = WorkerReport(
                rank=self.rank,
                results=self._results,
                finished_sending=self._sending,
                finished_recving=self._recving,
                invalid_block_ids=self._invalid,
            )
            self._results, self._sending, self._recving, self._invalid = [], [], [], []
        return report

    def encode_report(self, report: WorkerReport) -> bytes:
        """Wire bytes of `report` for the scheduler, with a snapshot of this rank's metrics when
        anything changed (or once a second); b"" when there is nothing to say."""
        now = time.monotonic()
        fresh = self.metrics_dirty or not report.is_empty()
        if fresh or now - self._last_snapshot >= _SNAPSHOT_EVERY_S:
            self.metrics_dirty = False
            report.metrics = snapshot(self.metrics.registry)
            self._last_snapshot = now
        return b"" if report.is_empty() and not report.metrics else messages.encode(report)

    def wait_loads(self, timeout_s: float) -> bool:
        """Block until no load is queued or running (deadline-bounded); for drains and tests."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while any(self._inflight.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self) -> None:
        """Stop the load lane and the lookup server, flush and close the tiers."""
        if self._thread is not None:
            self._loads.put(None)
            self._thread.join(timeout=10)
            self._thread = None
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.stack is not None:
            self.stack.close()
            self.stack = None

    # ---- lanes --------------------------------------------------------------------------------

    def _load_lane(self) -> None:
        while True:
            p = self._loads.get()
            if p is None:
                return
            with p.lock:
                skip = p.expired
            if skip:
                # reported failed while it waited behind a stuck load; only the lease is left
                assert self.stack is not None
                self.stack.release(p.op.lookup_id)
                continue
            outcome = self._load(p)
            if outcome is None:
                log.warning(
                    "%s: load %s came back after its deadline had reported it failed; "
                    "its result is dropped",
                    self.tag,
                    p.op.op_id,
                )
                continue
            self._finish_load(p, *outcome)

    def _finish_load(self, p: _PendingLoad, result: OpResult, invalid: Iterable[int]) -> None:
        with self._lock:
            self._pending.pop(p.op.op_id, None)
        self._record(p.op.req_id, result, recv=True, invalid=invalid)

    def _expire_loads(self) -> None:
        """Report failed every load still unfinished past its deadline (a stuck lane, a tier
        that never returns): the host recomputes instead of waiting forever."""
        now = self._clock()
        with self._lock:
            late = [p for p in self._pending.values() if now >= p.deadline]
        for p in late:
            with p.lock:
                if p.done or p.expired:
                    continue
                # after this, the lane writes no block for it (unpacks hold p.lock)
                p.expired = True
            log.error(
                "%s: load %s not finished %.1fs after it was queued (lease_ttl_s=%.1f); "
                "reporting it failed so the request recomputes",
                self.tag,
                p.op.op_id,
                now - p.queued_at,
                self.config.lease_ttl_s,
            )
            self.metrics.load_failure(DEADLINE).inc()
            result = OpResult(p.op.op_id, False, DEADLINE, 0, now - p.queued_at, "")
            self._finish_load(p, result, self._claimed_blocks(p.op))

    def _record(self, req_id: str, result: OpResult, *, recv: bool, invalid: Iterable[int]) -> None:
        with self._lock:
            self._results.append(result)
            if recv:
                self._recving.append(req_id)
                self._invalid.extend(invalid)
                self._inflight[req_id] -= 1
                if not self._inflight[req_id]:
                    del self._inflight[req_id]
                self._idle.notify_all()

    def _load(self, p: _PendingLoad) -> tuple[OpResult, list[int]] | None:
        """Read and unpack the load's chunks; its result and suspect blocks, or None when its
        deadline reported it failed meanwhile (then nothing of it is counted here)."""
        assert self.stack is not None and self.codec is not None
        op = p.op
        t0 = time.perf_counter()
        written = 0
        served: Counter[str] = Counter()
        reason = ""
        try:
            for ref in op.chunks:
                tier = self.stack.read_into(ref.key, self._staging)
                if tier is None:
                    reason = "miss"
                    break
                served[tier] += 1
                with p.lock:
                    if p.expired:
                        break  # its deadline reported it failed: write no more blocks
                    written += self.codec.unpack(self._staging, ref.block_ids)
        except Exception as e:
            # whatever a tier or the codec raised, the lane must live on to serve later loads
            # and this one must report: an escaped exception would park its request forever
            log.exception("%s: load %s raised", self.tag, op.op_id)
            reason = f"error:{type(e).__name__}"
        finally:
            self.stack.release(op.lookup_id)
        with p.lock:
            if p.expired:
                return None
            p.done = True
        seconds = time.perf_counter() - t0
        nbytes = written * self.codec.bytes_per_block
        got = op.tokens if not reason else 0
        self.metrics.load_seconds.observe(seconds)
        if reason:
            self.metrics.load_failure(reason).inc()
        else:
            with self._lock:
                self._uncounted[op.op_id] = (got, nbytes)
        log.info(
            "%s: Retrieved %d of %d required tokens (%.3f GiB, %.2f GB/s)%s",
            self.tag,
            got,
            op.tokens,
            nbytes / _GIB,
            nbytes / max(seconds, 1e-9) / 1e9,
            f" failed: {reason}" if reason else "",
        )
        tier = served.most_common(1)[0][0] if served else ""
        result = OpResult(op.op_id, not reason, reason, nbytes, seconds, tier)
        # a failed load leaves every block it wrote suspect: the host recomputes them
        return result, (self._claimed_blocks(op) if reason else [])

    @staticmethod
    def _claimed_blocks(op: LoadOp) -> list[int]:
        return [b for ref in op.chunks for b in ref.block_ids if b >= 0]

    def _save(self, op: SaveOp) -> OpResult:
        assert self.stack is not None and self.codec is not None
        t0 = time.perf_counter()
        nbytes = 0
        for ref in op.chunks:
            if self.stack.memory.contains(ref.key):
                continue
            slot = self.stack.reserve(ref.key)
            if slot is None:
                self.metrics.save_failure("no_slot").inc()
                return OpResult(op.op_id, False, "no_slot", nbytes, time.perf_counter() - t0)
            try:
                self.codec.pack(ref.block_ids, slot)
            except (RuntimeError, ValueError) as e:
                self.stack.abort(ref.key)
                log.exception("%s: save %s raised", self.tag, op.op_id)
                return OpResult(op.op_id, False, f"error:{type(e).__name__}", nbytes)
            self.stack.commit(ref.key)
            nbytes += self.codec.chunk_bytes
        seconds = time.perf_counter() - t0
        self.metrics.save_seconds.observe(seconds)
        # only chunks written now count: one the tier already held was not stored again
        self.metrics.stored_tokens.inc(nbytes // self.codec.chunk_bytes * self.config.chunk_size)
        self.metrics.stored_bytes.inc(nbytes)
        return OpResult(op.op_id, True, "", nbytes, seconds, "memory")
