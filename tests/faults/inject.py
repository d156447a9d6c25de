"""What the fault suite injects, and the harness's end of it.

Inside the ranks: a fault agent (a thread of the suite's connector worker half) switches
disk-full, an unreachable lookup server and a failing load lane on and off, driven by flag files
in a control directory, and answers flush and probe requests there. `intercept_reads` is the
load-lane interception it shares with the engine-level fault tests. Outside them: a staller
that keeps the shared redis-server in back-to-back DEBUG SLEEPs, and a corruptor that flips a
payload byte of every kvtier record in the store.
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from kvtier.lookup import LookupServer
from kvtier.native.connector import ConnectorContext, ConnectorRole
from kvtier.native.offload import WorkerHalf
from kvtier.native.offload import build as build_kvtier
from kvtier.store import record
from kvtier.store.stack import TierStack
from tests.redis_local import RedisServer

log = logging.getLogger("kvtier")

AGENT_POLL_S = 0.01
ACK_TIMEOUT_S = 60.0


# ----------------------------------------------------------------------------------------------
# the in-rank fault agent (runs in every TP rank, inside the connector's worker half)
# ----------------------------------------------------------------------------------------------

FLAG_DISK_FULL = "disk_full"
FLAG_LOOKUP_DOWN = "lookup_down"
FLAG_LOAD_FAIL = "load_fail"
_PROBE_KEY = bytes(record.KEY_BYTES)  # never a chunk key: a presence probe through the breaker


def intercept_reads(stack: TierStack, before_read: Callable[[bytes], None]) -> None:
    """Call `before_read(key)` ahead of every chunk read of `stack`, so that it can break the
    read (raise) or hold it (block)."""
    read_into, pinned_view = stack.read_into, stack.pinned_view

    def checked_read(key: bytes, dst: Any, *rest: Any) -> str | None:
        before_read(key)
        return read_into(key, dst, *rest)

    def checked_view(key: bytes) -> Any:
        before_read(key)
        return pinned_view(key)

    # instance attributes shadow the methods for every caller (the load lane included; on the
    # CPU it scatters from a pinned slot's view, else reads into device staging)
    stack.read_into = checked_read  # type: ignore[method-assign]
    stack.pinned_view = checked_view  # type: ignore[method-assign]


class FaultWorkerHalf(WorkerHalf):
    """kvtier's worker half plus a fault agent: flags in `ctl_dir` switch faults inside the
    rank, and `<kind>-<n>.req` files ask it to drain the write-behind (`flush`) or probe the
    lower tiers through their breakers (`probe`); it answers in `<kind>-<n>.rank<r>`."""

    def setup(self, ctl_dir: str, fail_rank: int, log_path: str, bench_pid: int) -> None:
        """Called once right after the class swap in `build_connector`."""
        if os.getpid() != bench_pid:
            # a TP worker process: its injected failures go to the suite's log, not the tty
            log_to(Path(log_path).with_suffix(f".rank{self.rank}.log"))
        self.ctl_dir = Path(ctl_dir)
        self.fail_rank = fail_rank
        self.flags: frozenset[str] = frozenset()
        self.doomed: set[bytes] = set()
        self._stop = threading.Event()
        self._agent: threading.Thread | None = None

    def register_kv_caches(self, kv_caches: dict[str, Any], block_size: int) -> None:
        super().register_kv_caches(kv_caches, block_size)
        stack = self.worker.stack
        assert stack is not None
        intercept_reads(stack, self._fail_doomed)
        for tier in stack.lower:
            if tier.name == "disk":
                write_temp = tier._write_temp  # type: ignore[attr-defined]

                def full_disk(path: Path, header: bytes, payload: Any, _w: Any = write_temp) -> Any:
                    if FLAG_DISK_FULL in self.flags:
                        raise OSError(errno.ENOSPC, "No space left on device (injected)", str(path))
                    return _w(path, header, payload)

                tier._write_temp = full_disk  # type: ignore[attr-defined]
        self._agent = threading.Thread(
            target=self._agent_loop, name=f"kvtier-fault-agent-{self.rank}", daemon=True
        )
        self._agent.start()

    def _fail_doomed(self, key: bytes) -> None:
        if key in self.doomed:
            self.doomed.discard(key)
            raise RuntimeError(f"injected: rank {self.rank}'s load lane failed mid-load")

    def start_load_kv(self) -> None:
        if FLAG_LOAD_FAIL in self.flags and self.rank == self.fail_rank:
            # the second chunk: the first one is already in the KV blocks when the lane fails
            self.doomed.update(op.chunks[1].key for op in self._meta.loads if len(op.chunks) > 1)
        super().start_load_kv()

    def shutdown(self) -> None:
        self._stop.set()
        if self._agent is not None:
            self._agent.join(10.0)
        super().shutdown()

    # ---- the agent thread ----------------------------------------------------------------

    def _agent_loop(self) -> None:
        while not self._stop.wait(AGENT_POLL_S):
            try:
                self._tick()
            except OSError:
                if self.ctl_dir.exists():
                    log.exception("kvtier faults: fault agent of rank %d stopped", self.rank)
                # else the suite removed the control directory: it is tearing down
                return

    def _tick(self) -> None:
        flags = frozenset(p.stem for p in self.ctl_dir.glob("*.flag"))
        if (FLAG_LOOKUP_DOWN in flags) != (FLAG_LOOKUP_DOWN in self.flags) and (
            self.rank == self.fail_rank
        ):
            self._lookup_server(up=FLAG_LOOKUP_DOWN not in flags)
        self.flags = flags
        for req in sorted(self.ctl_dir.glob("*.req")):
            ack = req.with_suffix(f".rank{self.rank}")
            if ack.exists():
                continue
            kind = req.stem.split("-", 1)[0]
            answer = self._answer(kind)
            tmp = ack.with_suffix(ack.suffix + ".tmp")
            tmp.write_text(json.dumps(answer), encoding="utf-8")
            os.replace(tmp, ack)

    def _answer(self, kind: str) -> dict[str, Any]:
        stack = self.worker.stack
        assert stack is not None
        if kind == "flush":
            return {"ok": stack.flush(ACK_TIMEOUT_S / 2)}
        if kind == "probe":
            breakers = {}
            for tier in stack.lower:
                breaker = getattr(tier, "breaker", None)
                if breaker is None:
                    continue
                tier.contains(_PROBE_KEY)  # a real call: lets the breaker's probe through
                breakers[tier.name] = breaker.state.value
            return {"breakers": breakers}
        return {"error": f"unknown request {kind!r}"}

    def _lookup_server(self, *, up: bool) -> None:
        """Take this rank's lookup server away, or bring a new one up on the same endpoint."""
        w = self.worker
        if not up:
            if w.server is not None:
                w.server.close()
                w.server = None
            return
        if w.server is None and w.stack is not None and w.lookup_endpoint is not None:
            w.server = LookupServer(w.rank, w.stack, w.lookup_endpoint, w.metrics).start()


def build_connector(role: ConnectorRole, context: ConnectorContext, **args: Any) -> Any:
    """Connector factory for the suite's engines: kvtier, with a fault agent in every rank."""
    ctl_dir = args.pop("ctl_dir")
    fail_rank = args.pop("fail_rank")
    log_path = args.pop("log_path")
    bench_pid = args.pop("bench_pid")
    half = build_kvtier(role, context, **args)
    if role is ConnectorRole.WORKER:
        half.__class__ = FaultWorkerHalf
        half.setup(ctl_dir, fail_rank, log_path, bench_pid)
    return half


def log_to(path: Path) -> logging.Handler:
    """Send the `kvtier` loggers of this process to `path` (and nowhere else); the handler."""
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("kvtier")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return handler


class Control:
    """The harness's end of the fault agents: flag files and request/answer files."""

    def __init__(self, ctl_dir: Path, world: int) -> None:
        self.dir = ctl_dir
        self.world = world
        self._seq = itertools.count()
        ctl_dir.mkdir(parents=True, exist_ok=True)

    def set(self, flag: str) -> None:
        """Switch `flag` on in every rank (its agent sees it within a poll)."""
        (self.dir / f"{flag}.flag").touch()

    def clear(self, flag: str) -> None:
        """Switch `flag` off."""
        (self.dir / f"{flag}.flag").unlink(missing_ok=True)

    def request(
        self,
        kind: str,
        timeout_s: float = ACK_TIMEOUT_S,
        give_up: Callable[[], str | None] | None = None,
    ) -> list[dict[str, Any]]:
        """Ask every rank's agent for `kind`; their answers, by rank. `give_up` says why no
        answer can come any more (the engine died while asking): then no answers, at once."""
        stem = f"{kind}-{next(self._seq)}"
        req = self.dir / f"{stem}.req"
        req.touch()
        acks = [self.dir / f"{stem}.rank{r}" for r in range(self.world)]
        deadline = time.monotonic() + timeout_s
        try:
            while not all(a.exists() for a in acks):
                if give_up is not None and give_up() is not None:
                    return []
                if time.monotonic() > deadline:
                    missing = [r for r, a in enumerate(acks) if not a.exists()]
                    raise RuntimeError(
                        f"fault agents of ranks {missing} did not answer {kind!r} "
                        f"within {timeout_s:g}s"
                    )
                time.sleep(AGENT_POLL_S)  # a poll interval on files, not a synchronisation
            return [json.loads(a.read_text(encoding="utf-8")) for a in acks]
        finally:
            req.unlink(missing_ok=True)
            for a in acks:
                a.unlink(missing_ok=True)


# ----------------------------------------------------------------------------------------------
# the shared store
# ----------------------------------------------------------------------------------------------


class Staller:
    """Keeps a redis-server slow: back-to-back `DEBUG SLEEP`s from its own connection."""

    def __init__(self, store: RedisServer, sleep_s: float) -> None:
        self._admin = store.client(timeout_s=sleep_s + 5.0)
        self._sleep_s = sleep_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-redis-staller", daemon=True)
        self.sleeps = 0

    def start(self) -> None:
        """Begin the sleeps (on their own thread)."""
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._admin.execute_command("DEBUG", "SLEEP", self._sleep_s)
            except redis.exceptions.RedisError:
                log.exception("kvtier faults: the redis staller stopped")
                return
            self.sleeps += 1

    def stop(self) -> None:
        """Let the sleep under way end, then stop."""
        self._stop.set()
        self._thread.join(self._sleep_s + 10.0)
        self._admin.close()


def corrupt_remote(store: RedisServer) -> int:
    """Flip one payload byte of every kvtier record in the store; returns how many."""
    admin = store.client()
    n = 0
    try:
        for rkey in admin.scan_iter(match="kvtier:*"):
            at = record.HEADER_BYTES + 100
            old = admin.getrange(rkey, at, at)
            if old:
                admin.setrange(rkey, at, bytes([old[0] ^ 0xFF]))
                n += 1
    finally:
        admin.close()
    return n
