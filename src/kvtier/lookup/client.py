"""`LookupClient`: asks every rank at once, under a deadline, and takes the minimum."""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import zmq

from kvtier.errors import ConfigError, StartupError, TopologyError
from kvtier.lookup.auth import REPLIES, REQUESTS, FrameMac, RefusalLog, check_key
from kvtier.lookup.curve import curve_keys
from kvtier.lookup.endpoints import key_dir_of, parse_endpoint
from kvtier.lookup.keyfile import engine_key
from kvtier.lookup.messages import (
    ADMIN_OPS,
    DEFAULT_MAX_FRAME_BYTES,
    KEY_BYTES,
    MAX_LOOKUP_ID_CHARS,
    PROTOCOL_VERSION,
    REJECT_AUTH,
    REJECT_FRAMES,
    REJECT_RANGE,
    AdminReply,
    AdminRequest,
    Codec,
    FrameError,
    LookupReply,
    LookupRequest,
    Message,
    Ping,
    Pong,
    ReleaseRequest,
)
from kvtier.lookup.peers import Peers
from kvtier.lookup.result import LookupResult, PendingLookup, deepest_tier, merged_runs
from kvtier.metrics import Metrics

log = logging.getLogger("kvtier")

# Lookup ids per release message; keeps each frame far below the frame cap.
_RELEASE_BATCH = 1024
# the longest one startup probe waits (each waits twice the one before)
MAX_PROBE_MS = 1000
# Keys per admin message: about 600 KB of msgpack, far below the default 4 MiB frame cap.
_ADMIN_BATCH = 32768


def format_client_line(ranks: Iterable[int], world: int) -> str:
    """The startup line people grep for: `kvtier: lookup client on ranks [0, 1] (world=2)`."""
    return f"kvtier: lookup client on ranks {sorted(ranks)} (world={world})"


def _no_other_reply(rank: int, msg: Message) -> bool:
    return False


class LookupClient:
    """Scheduler-side lookup over the ranks in `endpoints` (rank -> endpoint), one socket each.

    Counts on `metrics`: `lookup_seconds`, `lookup_hit_tokens` (hit chunks x `chunk_size`),
    `lookup_timeout(target)` and `rejected_frame(reason)` for bad replies; `lookups` is counted
    by each server. Calls are serialised, so several threads may share a client.

    Every request carries a MAC under the engine's `key` and every reply must carry one (a
    reply without it is dropped and counted as `auth`); without `key`, the key is read from
    the run dir the endpoints name (`lookup/keyfile.py`), which must be one engine's.

    A rank that misses `miss_limit` deadlines in a row is down: lookups stop waiting for it
    (it counts as a timeout at once) and probe it again every `probe_interval_s` of `clock`;
    its socket is replaced so requests queued behind a stuck server are dropped. Any answer,
    a pong included, brings it back. Sockets connect in the background: call `wait_ready()`
    before the first lookup.
    """

    def __init__(
        self,
        endpoints: Mapping[int, str],
        metrics: Metrics,
        *,
        chunk_size: int,
        world: int,
        timeout_ms: int = 200,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        miss_limit: int = 3,
        probe_interval_s: float = 1.0,
        context: zmq.Context | None = None,
        clock: Callable[[], float] = time.monotonic,
        key: bytes | None = None,
        tier_order: Sequence[str],
    ) -> None:
        if not endpoints:
            raise TopologyError("lookup client needs at least one rank endpoint, got none")
        if world <= 0:
            raise TopologyError(f"lookup client world={world} must be >= 1")
        outside = sorted(r for r in endpoints if not 0 <= r < world)
        if outside:
            raise TopologyError(f"lookup ranks {outside} are outside [0, world={world})")
        if chunk_size <= 0:
            raise ConfigError(f"lookup chunk_size={chunk_size} must be > 0 tokens")
        if timeout_ms <= 0:
            raise ConfigError(f"lookup timeout_ms={timeout_ms} must be > 0")
        if miss_limit <= 0 or probe_interval_s < 0:
            raise ConfigError(
                f"lookup miss_limit={miss_limit} must be >= 1 and "
                f"probe_interval_s={probe_interval_s} >= 0"
            )
        for ep in endpoints.values():
            parse_endpoint(ep)
        key = _one_engine_key(endpoints) if key is None else check_key(key)
        # one key per rank: a frame sent to one rank is refused by every other
        self._mac_out = {r: FrameMac(key, REQUESTS, r) for r in endpoints}
        self._mac_in = {r: FrameMac(key, REPLIES, r) for r in endpoints}
        self._refusals = RefusalLog(log, "lookup client")
        self.ranks: tuple[int, ...] = tuple(sorted(endpoints))
        self.world = world
        self.chunk_size = chunk_size
        # tier names from the accelerator outwards (the tier registry's), to merge ranks' runs
        self.tier_order = tuple(tier_order)
        self.timeout_ms = timeout_ms
        self._m = metrics
        self._codec = Codec(max_frame_bytes)
        self._clock = clock
        self._lock = threading.Lock()
        self._reqs = itertools.count(1)
        # a context of its own unless given one: another library in the process may term()
        # the process-wide one at its shutdown, and every lookup would fail from then on
        self._own_ctx = zmq.Context() if context is None else None
        self._peers = Peers(
            context if context is not None else self._own_ctx,
            metrics,
            max_frame_bytes=self._codec.max_frame_bytes,
            miss_limit=miss_limit,
            probe_s=probe_interval_s,
        )
        self._closed = False
        self._inflight: dict[int, PendingLookup] = {}  # request number -> lookup in flight
        # Diagnostics for tests and `kvtier doctor`; no metric family exists for them.
        self.stale_replies = 0
        self.dropped_releases: dict[int, int] = dict.fromkeys(self.ranks, 0)
        for rank in self.ranks:
            tcp = parse_endpoint(endpoints[rank])[0] == "tcp"
            self._peers.connect(rank, endpoints[rank], curve_keys(key, rank) if tcp else None)
        log.info(format_client_line(self.ranks, world))

    @property
    def socket_resets(self) -> dict[int, int]:
        """Per rank, how often its socket was replaced after it went down (a diagnostic)."""
        return self._peers.socket_resets

    # -- public API ---------------------------------------------------------------------------

    def lookup(
        self,
        keys: Sequence[bytes],
        lookup_id: str,
        lease: bool = True,
        *,
        timeout_ms: int | None = None,
    ) -> LookupResult:
        """Leading chunks of `keys` held by every rank (minimum), leased under `lookup_id`.

        Never raises for a dead or slow rank: it counts as 0 and is listed in `timed_out`.
        The caller must `release([lookup_id])` on every path when `lease` is true.
        """
        pending = self.begin(keys, lookup_id, lease, timeout_ms=timeout_ms)  # any chunk ends
        result = self.poll(pending, wait_ms=math.inf)
        assert result is not None  # an unbounded wait ends at the deadline at the latest
        return result

    def begin(
        self,
        keys: Sequence[bytes],
        lookup_id: str,
        lease: bool = True,
        ends: Sequence[bytes] | None = None,
        *,
        timeout_ms: int | None = None,
    ) -> PendingLookup:
        """Send the lookup to every rank and return at once; `poll` collects the answer. With
        `ends`, a rank's run may end only after a chunk `i` whose `ends[i]` it holds."""
        _check_lookup_id(lookup_id)
        _check_keys(keys)
        if ends:
            _check_keys(ends)
        t0 = time.perf_counter()
        deadline = t0 + (self.timeout_ms if timeout_ms is None else timeout_ms) / 1000.0
        with self._lock:
            self._check_open()
            req = next(self._reqs)
            frame = self._codec.encode(
                LookupRequest(PROTOCOL_VERSION, lookup_id, req, list(keys), lease, list(ends or ()))
            )
            if len(frame) > self._codec.max_frame_bytes:
                raise ValueError(
                    f"lookup of {len(keys)} keys is a {len(frame)}-byte frame, over "
                    f"max_frame_bytes={self._codec.max_frame_bytes}; look up fewer keys or "
                    "raise the cap"
                )
            now = self._clock()
            peers = self._peers.by_rank
            targets = [p.rank for p in peers.values() if not self._peers.is_down(p, now)]
            sent, unsent = self._peers.send_all(self._signed(frame), [peers[r] for r in targets])
            p = PendingLookup(lookup_id, req, len(keys), t0, deadline, now, targets, sent, unsent,
                              with_ends=bool(ends))  # fmt: skip
            self._inflight[req] = p
        return p

    def poll(self, p: PendingLookup, wait_ms: float = 0.0) -> LookupResult | None:
        """The lookup's result once every rank answered or its deadline passed, waiting at most
        `wait_ms` for that; None while it is still in flight (poll again later)."""
        if p.result is not None:
            return p.result
        with self._lock:
            self._check_open()
            if p.pending:
                until = min(p.deadline, time.perf_counter() + wait_ms / 1000.0)
                self._gather(lambda: not p.pending, until, _no_other_reply)
            if p.pending and time.perf_counter() < p.deadline:
                return None
            return self._finish(p)

    def cancel(self, p: PendingLookup) -> None:
        """Stop waiting for a lookup (its request is gone); release its lease if it took one."""
        with self._lock:
            self._inflight.pop(p.req, None)
        if p.result is None:
            p.result = LookupResult(0, 0, None, dict.fromkeys(self.ranks, 0), ())
        self.release([p.lookup_id])

    def _finish(self, p: PendingLookup) -> LookupResult:
        """Count the ranks that did not answer as 0 and settle the peers' miss records."""
        self._inflight.pop(p.req, None)
        missed = sorted(r for r in self.ranks if r not in p.per_rank)
        for rank in missed:
            p.per_rank[rank] = 0
            self._m.lookup_timeout(rank).inc()
        for rank in p.targets:
            peer = self._peers.by_rank.get(rank)
            if peer is None:
                continue
            if rank in p.pending or rank in p.unsent:
                self._peers.missed(peer, p.sent_at)
            else:
                self._peers.answered(peer)
        ordered = {r: p.per_rank[r] for r in self.ranks}
        hit = min(ordered.values())
        if p.with_ends:
            # each rank cut its run at its own deepest end; the hit ends at one every rank
            # holds (ranks diverge after a save failed on one, or unequal evictions)
            common = frozenset.intersection(*(p.ends.get(r, frozenset()) for r in self.ranks))
            hit = max((e for e in common if e <= hit), default=0)
        limiting = None if hit == p.n else min(ordered, key=lambda r: (ordered[r], r))
        runs = merged_runs((p.runs.get(r, ()) for r in self.ranks), hit, self.tier_order)
        # the counted chunks' deepest tier (a rank's own answer may name a deeper tier for
        # chunks beyond the run every rank holds)
        tier = deepest_tier((t for t, _ in runs) if runs else p.tiers.values(), self.tier_order)
        p.result = LookupResult(
            hit_chunks=hit,
            hit_tokens=hit * self.chunk_size,
            limiting_rank=limiting,
            per_rank=ordered,
            timed_out=tuple(missed),
            errors=p.errors,
            tier=tier if hit else "",
            runs=runs,
        )
        self._m.lookup_hit_tokens.inc(p.result.hit_tokens)
        self._m.lookup_seconds.observe(time.perf_counter() - p.t0)
        return p.result

    def _accept_reply(self, rank: int, msg: LookupReply) -> bool:
        """Route a lookup reply to its in-flight lookup; False for a stale one."""
        p = self._inflight.get(msg.req)
        if p is None or msg.lookup_id != p.lookup_id or rank not in p.pending:
            return False
        p.pending.discard(rank)
        if msg.rank != rank:
            self._peers.wrong_rank(rank, msg.rank)
            p.errors[rank] = f"reply from rank {msg.rank} on rank {rank}'s endpoint"
            p.per_rank[rank] = 0
        elif msg.error is not None:
            p.errors[rank] = msg.error
            p.per_rank[rank] = 0
        elif msg.hit_chunks > p.n:
            self._m.rejected_frame(REJECT_RANGE).inc()
            p.errors[rank] = f"claimed {msg.hit_chunks} hits for {p.n} keys"
            p.per_rank[rank] = 0
        else:
            p.per_rank[rank] = msg.hit_chunks
            p.tiers[rank] = msg.tier
            p.runs[rank] = msg.runs
            p.ends[rank] = frozenset(e for e in msg.ends_held if 0 < e <= msg.hit_chunks)
        return True

    def release(self, lookup_ids: Iterable[str]) -> None:
        """Release the leases of `lookup_ids` on every rank. Fire-and-forget: never blocks,
        never raises for a dead rank; a message that cannot be queued is counted in
        `dropped_releases[rank]` and the lease expires at its deadline instead."""
        ids = list(lookup_ids)
        for lookup_id in ids:
            _check_lookup_id(lookup_id)
        if not ids:
            return
        with self._lock:
            self._check_open()
            for start in range(0, len(ids), _RELEASE_BATCH):
                batch = ids[start : start + _RELEASE_BATCH]
                frames = self._signed(self._codec.encode(ReleaseRequest(PROTOCOL_VERSION, batch)))
                self._send_nowait(
                    frames, f"release of {len(batch)} lookup ids (their leases will expire)"
                )

    def ping(self, timeout_ms: int | None = None) -> dict[int, bool]:
        """Which ranks answered a ping with their own rank before the deadline."""
        return {r: p is not None for r, p in self.server_stats(timeout_ms).items()}

    def server_stats(self, timeout_ms: int | None = None) -> dict[int, Pong | None]:
        """Each rank's `Pong` (rank, served, released, rejected), or None if it did not answer.
        Pings go to every rank, down or not; an answer brings a down rank back."""
        deadline = (
            time.perf_counter() + (self.timeout_ms if timeout_ms is None else timeout_ms) / 1e3
        )
        with self._lock:
            self._check_open()
            nonce = next(self._reqs)
            pongs: dict[int, Pong | None] = dict.fromkeys(self.ranks)
            waiting: set[int] = set()

            def accept(rank: int, msg: Message) -> bool:
                if not (isinstance(msg, Pong) and msg.nonce == nonce and rank in waiting):
                    return False
                waiting.discard(rank)
                if msg.rank != rank:
                    self._peers.wrong_rank(rank, msg.rank)
                else:
                    pongs[rank] = msg
                return True

            frames = self._signed(self._codec.encode(Ping(PROTOCOL_VERSION, nonce)))
            waiting, _ = self._peers.send_all(frames, list(self._peers.by_rank.values()))
            self._gather(lambda: not waiting, deadline, accept)
            for rank, pong in pongs.items():
                if pong is not None:
                    self._peers.answered(self._peers.by_rank[rank])
        return pongs

    def admin(
        self,
        op: str,
        keys: Sequence[bytes],
        until: float = 0.0,
        *,
        timeout_ms: int | None = None,
    ) -> dict[int, AdminAnswer]:
        """Carry out `op` (retain, release, prefetch, forget) on `keys` on every rank and wait
        for each rank's count; a rank that did not answer in time has `count=None`. Keys go in
        batches that fit a frame; the counts add up over the batches."""
        if op not in ADMIN_OPS:
            raise ValueError(f"admin op {op!r} is not one of {', '.join(ADMIN_OPS)}")
        _check_keys(keys)
        answers = {r: AdminAnswer(0, None) for r in self.ranks}
        for start in range(0, max(len(keys), 1), _ADMIN_BATCH):
            batch = list(keys[start : start + _ADMIN_BATCH])
            for rank, got in self._admin_batch(op, batch, until, timeout_ms).items():
                before = answers[rank]
                if got.count is None or before.count is None:
                    answers[rank] = AdminAnswer(None, got.error or before.error)
                else:
                    answers[rank] = AdminAnswer(before.count + got.count, got.error or before.error)
        return answers

    def admin_send(self, op: str, keys: Sequence[bytes], until: float = 0.0) -> None:
        """`admin` without answers: queued to every rank at once, never blocking or raising for
        a rank (one that cannot take it is counted in `dropped_releases` and logged)."""
        if op not in ADMIN_OPS:
            raise ValueError(f"admin op {op!r} is not one of {', '.join(ADMIN_OPS)}")
        _check_keys(keys)
        with self._lock:
            self._check_open()
            for start in range(0, len(keys), _ADMIN_BATCH):
                batch = list(keys[start : start + _ADMIN_BATCH])
                req = AdminRequest(PROTOCOL_VERSION, next(self._reqs), op, batch, until, False)
                self._send_nowait(self._signed(self._codec.encode(req)), f"admin {op}")

    def _send_nowait(self, frames: Mapping[int, tuple[bytes]], what: str) -> None:
        for rank, peer in self._peers.by_rank.items():
            try:
                peer.sock.send_multipart(frames[rank], zmq.NOBLOCK)
            except zmq.Again:
                self.dropped_releases[rank] += 1
                # a rank already known to be missing was logged when it went missing
                log.log(
                    logging.DEBUG if peer.misses else logging.WARNING,
                    "kvtier: %s not sent to rank %d (unreachable)",
                    what,
                    rank,
                )

    def _admin_batch(
        self, op: str, keys: list[bytes], until: float, timeout_ms: int | None
    ) -> dict[int, AdminAnswer]:
        budget_ms = self.timeout_ms if timeout_ms is None else timeout_ms
        deadline = time.perf_counter() + budget_ms / 1e3
        with self._lock:
            self._check_open()
            req = next(self._reqs)
            got: dict[int, AdminAnswer] = {
                r: AdminAnswer(None, "no answer in time") for r in self.ranks
            }
            waiting: set[int] = set()

            def accept(rank: int, msg: Message) -> bool:
                if not (isinstance(msg, AdminReply) and msg.req == req and rank in waiting):
                    return False
                waiting.discard(rank)
                if msg.rank != rank:
                    self._peers.wrong_rank(rank, msg.rank)
                    got[rank] = AdminAnswer(None, f"reply from rank {msg.rank}")
                else:
                    got[rank] = AdminAnswer(msg.count, msg.error)
                return True

            body = self._codec.encode(AdminRequest(PROTOCOL_VERSION, req, op, keys, until))
            waiting, _ = self._peers.send_all(
                self._signed(body), list(self._peers.by_rank.values())
            )
            self._gather(lambda: not waiting, deadline, accept)
        return got

    def wait_ready(self, timeout_s: float = 10.0, probe_ms: int = 50) -> None:
        """Ping until every rank answers, or raise StartupError naming the silent ranks. Each
        probe waits twice as long as the one before (up to `MAX_PROBE_MS`): a rank slower than
        the first probe answers a later one, where fixed probes each queued one more ping ahead
        of the next on it and a live rank was refused as silent."""
        deadline = time.perf_counter() + timeout_s
        wait_ms = probe_ms
        while True:
            left_ms = (deadline - time.perf_counter()) * 1000.0
            probe = max(1, int(min(wait_ms, left_ms)))
            down = [r for r, ok in self.ping(probe).items() if not ok]
            if not down:
                return
            wait_ms = min(2 * wait_ms, MAX_PROBE_MS)
            left_ms = (deadline - time.perf_counter()) * 1000.0
            if left_ms <= 0:
                eps = {r: self._peers.by_rank[r].endpoint for r in down}
                raise StartupError(
                    f"lookup ranks {down} did not answer within {timeout_s}s at {eps}; "
                    "are their LookupServers started on these endpoints?"
                )
            # A rank with no live connection fails its ping at once; wait until its socket
            # becomes writable (connected) instead of spinning, bounded by the probe interval.
            self._wait_writable(down, min(probe_ms, math.ceil(left_ms)))

    def wait_connected(self, timeout_s: float = 10.0) -> list[int]:
        """Wait until every rank's socket has a live connection; returns the ranks without one."""
        deadline = time.perf_counter() + timeout_s
        while True:
            left_ms = max(0, math.ceil((deadline - time.perf_counter()) * 1000.0))
            down = self._wait_writable(self.ranks, left_ms)
            if not down or left_ms == 0:
                return down

    def close(self) -> None:
        """Close every socket (no linger). The client is unusable afterwards."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._peers.close()
            if self._own_ctx is not None:
                self._own_ctx.destroy(linger=0)  # its sockets are closed: returns at once

    def __enter__(self) -> LookupClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------

    def _gather(
        self, done: Callable[[], bool], deadline: float, accept: Callable[[int, Message], bool]
    ) -> None:
        """Read replies until `done()` or the `perf_counter` deadline passed.

        Every readable socket is drained: a lookup reply goes to its in-flight lookup, anything
        else to `accept`; late replies of finished requests are discarded (counted in
        `stale_replies`) instead of waiting to be mistaken for answers. A reply without the
        engine's MAC is dropped before it is decoded (whoever sent it is not the engine's rank).
        """
        while not done():
            left_ms = (deadline - time.perf_counter()) * 1000.0
            if left_ms <= 0:
                return
            for rank, frames in self._peers.received(math.ceil(left_ms)):
                self._take(rank, frames, accept)
                if time.perf_counter() >= deadline:
                    # a socket that never runs dry (a flood of junk on a port someone else
                    # holds) keeps no caller past its wait: the scheduler loop's bound
                    return

    def _take(self, rank: int, frames: list[bytes], accept: Callable[[int, Message], bool]) -> None:
        """One message from `rank`: an authentic reply to its request, else dropped (counted)."""
        frame = self._authentic(rank, frames)
        if frame is None:
            return
        try:
            msg = self._codec.decode(frame)
        except FrameError as e:
            self._m.rejected_frame(e.reason).inc()
            log.warning("kvtier: lookup reply from rank %d rejected: %s", rank, e)
            return
        taken = self._accept_reply(rank, msg) if isinstance(msg, LookupReply) else accept(rank, msg)
        if not taken:
            self.stale_replies += 1

    def _signed(self, body: bytes) -> dict[int, tuple[bytes]]:
        """The one frame, `MAC || body`, every request travels as, per rank (each its own
        MAC)."""
        return {r: (mac.seal(body),) for r, mac in self._mac_out.items()}

    def _authentic(self, rank: int, frames: list[bytes]) -> bytes | None:
        """The body of a reply whose MAC the engine's key made; None (counted) otherwise."""
        if len(frames) != 1:
            self._m.rejected_frame(REJECT_FRAMES).inc()
            self._refusals.refused(f"rank {rank}'s endpoint sent {len(frames)} frames, not 1")
            return None
        mac_in = self._mac_in.get(rank)
        body = None if mac_in is None else mac_in.opened(frames[0])
        if body is None:
            self._m.rejected_frame(REJECT_AUTH).inc()
            self._refusals.refused(
                f"a reply on rank {rank}'s endpoint does not carry the engine's MAC (is "
                "another process listening there?)"
            )
            return None
        return body

    def _wait_writable(self, ranks: Iterable[int], timeout_ms: int) -> list[int]:
        """Wait up to `timeout_ms` for any of `ranks` to be writable; returns the unwritable."""
        with self._lock:
            self._check_open()
            return self._peers.unwritable(ranks, timeout_ms)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("lookup client is closed")


def _one_engine_key(endpoints: Mapping[int, str]) -> bytes:
    """The key of the one engine every endpoint belongs to; ConfigError if they name engines
    with different keys (one client asks the ranks of one engine)."""
    keys: dict[bytes, list[int]] = {}
    by_dir: dict[str, bytes] = {}
    for rank, ep in sorted(endpoints.items()):
        run = str(key_dir_of(ep))
        if run not in by_dir:
            by_dir[run] = engine_key(run)
        keys.setdefault(by_dir[run], []).append(rank)
    if len(keys) > 1:
        groups = sorted(keys.values())
        raise ConfigError(
            f"lookup ranks {groups} belong to engines with different keys (run dirs "
            f"{sorted(by_dir)}); one client asks the ranks of one engine: derive every "
            "endpoint from the same run dir"
        )
    return next(iter(keys))


@dataclass(frozen=True, slots=True)
class AdminAnswer:
    """One rank's answer to an admin request: keys acted on (None: no answer) and why not."""

    count: int | None
    error: str | None


def _check_keys(keys: Sequence[bytes]) -> None:
    for i, k in enumerate(keys):
        if type(k) is not bytes or len(k) != KEY_BYTES:
            size = len(k) if isinstance(k, bytes | bytearray | memoryview) else "?"
            raise ValueError(
                f"lookup key {i} is {type(k).__name__} of length {size}; "
                f"chunk keys are {KEY_BYTES}-byte bytes (kvtier.keys)"
            )


def _check_lookup_id(lookup_id: str) -> None:
    if not isinstance(lookup_id, str) or not lookup_id or len(lookup_id) > MAX_LOOKUP_ID_CHARS:
        raise ValueError(
            f"lookup id {lookup_id!r} must be a non-empty str of at most "
            f"{MAX_LOOKUP_ID_CHARS} characters (e.g. the request id)"
        )
