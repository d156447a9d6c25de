"""Calls to the remote store's shards behind their circuit breakers.

A call whose shard's breaker is open is skipped without touching the network; a failed call
(timeout, lost connection) counts a store failure and feeds the breaker, a refusal the server
answered in time (OOM, READONLY) counts too but is no outage; every breaker transition is
logged once and published, and a shard that answers again makes the client re-read the
topology (a replica may have been promoted).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvtier.metrics import Metrics
from kvtier.store.breaker import ShardBreakers, Transition
from kvtier.store.remote_transport import StoreError, Transport

# the remote tier's logger: operators filter on it, whichever module logs
# write refusals that last until the store's operator acts (not a timeout or a lost connection)
WRITE_REFUSALS = frozenset({"oom", "read_only", "no_permission"})

log = logging.getLogger("kvtier.store.remote")

_T = TypeVar("_T")


class ShardGuard:
    """The remote tier's calls through `transport`, each behind its shard's breaker; counts on
    `metrics` under the tier `name`, and names the store by its masked `url` in logs."""

    def __init__(
        self,
        transport: Transport,
        breakers: ShardBreakers,
        metrics: Metrics,
        url: str,
        name: str = "remote",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.transport = transport
        self.breakers = breakers
        self._m = metrics
        self._url = url
        self._name = name
        self._lock = threading.Lock()
        self._logged: set[str] = set()
        self._epoch = -1
        self._clock = clock
        self._refused_since: float | None = None  # the first refused write of the streak
        self.publish()

    def shard(self, rkey: bytes) -> str:
        """The shard of `rkey`; republishes the breakers when the topology changed."""
        if self.transport.epoch != self._epoch:
            self.publish()
        return self.transport.shard_of(rkey)

    def call(self, rkey: bytes, fn: Callable[[], _T], *, write: bool) -> _T | None:
        """`fn()` behind the key's shard breaker; None when skipped or failed (counted)."""
        shard = self.shard(rkey)
        if not self.breakers[shard].allow():
            return None
        try:
            value = fn()
        except StoreError as e:
            if e.reason == "too_large" and not write:
                # a value longer than this layout's record cannot be its chunk
                self._m.verify_failure(self._name, "length_mismatch").inc()
                self.succeeded(shard)
                return None
            self.failed(e, write)
            return None
        self.succeeded(shard)
        return value

    def batch(
        self,
        rkeys: list[bytes],
        send: Callable[[Sequence[bytes]], Sequence[object]],
        *,
        write: bool,
    ) -> list[object]:
        """`send` the keys whose shard's breaker allows it, as one batch; a reply per key (None
        where skipped or failed). Each shard's outcome feeds its breaker once."""
        shards = [self.shard(r) for r in rkeys]
        allowed = {s: self.breakers[s].allow() for s in dict.fromkeys(shards)}
        idx = [i for i, s in enumerate(shards) if allowed[s]]
        out: list[object] = [None] * len(rkeys)
        if not idx:
            return out
        replies = send([rkeys[i] for i in idx])
        errors: dict[str, StoreError] = {}
        for i, reply in zip(idx, replies, strict=True):
            if isinstance(reply, StoreError):
                errors.setdefault(shards[i], reply)
            else:
                out[i] = reply
        for shard in dict.fromkeys(shards[i] for i in idx):
            if shard in errors:
                self.failed(errors[shard], write)
            else:
                self.succeeded(shard)
        return out

    def succeeded(self, shard: str) -> None:
        """The shard answered: its breaker closes (or stays closed)."""
        self.transition(shard, self.breakers[shard].success(), None)

    def failed(self, e: StoreError, write: bool) -> None:
        """A call failed: a refusal is counted and logged once, an outage feeds the breaker."""
        if not e.outage:
            self.rejected(e, write)
            # the server answered in time; that is what the breaker guards
            self.succeeded(e.shard)
            return
        reason = e.reason if write else f"read_{e.reason}"
        self._m.store_failure(self._name, reason).inc()
        if e.reason == "timeout":
            # a client library that prints its own line on stderr for every timeout (glide,
            # whatever its log level): one line of ours says what those lines are
            printed = self.transport.timeout_stderr
            said = (
                f" The client library prints '{printed}' on stderr for each such call (its "
                "log level does not silence it)."
                if printed
                else ""
            )
            self.log_once(
                reason,
                "kvtier: remote tier %s shard %s: a %s timed out (%s); counted as "
                "store_failures{reason=%s}, a read's chunks are recomputed.%s A store this slow "
                "is read no more once the load cost model has measured it (load_policy: cost); "
                "raise remote_timeout_ms if it should be waited for",
                self._url,
                e.shard,
                "write" if write else "read",
                e,
                reason,
                said,
            )
        else:
            log.debug("kvtier: remote tier %s call failed: %s", self._url, e)
        self.transition(e.shard, self.breakers[e.shard].failure(), e)

    def rejected(self, e: StoreError, write: bool) -> None:
        """The server refused a call it answered in time: counted, logged once per reason; a
        write refused for a standing reason (full, read-only, no permission) starts or extends
        the refusal streak `kvtier_tier_writes_refused_seconds` shows."""
        reason = e.reason if write else f"read_{e.reason}"
        self._m.store_failure(self._name, reason).inc()
        if write and e.reason in WRITE_REFUSALS:
            self._refused(e)
        self.log_once(
            reason,
            "kvtier: remote tier %s refused a %s (%s); counted as store_failures{reason=%s}",
            self._url,
            "write" if write else "read",
            e,
            reason,
        )

    def write_accepted(self) -> None:
        """A write went in: a refusal streak, if any, is over."""
        if self._refused_since is None:
            return
        with self._lock:
            since, self._refused_since = self._refused_since, None
        if since is not None:
            self._m.writes_refused(self._name).set(0)
            log.warning(
                "kvtier: remote tier %s accepts writes again after refusing them for %.0f s",
                self._url,
                self._clock() - since,
            )

    def _refused(self, e: StoreError) -> None:
        now = self._clock()
        with self._lock:
            started = self._refused_since is None
            if started:
                self._refused_since = now
            since = self._refused_since
        assert since is not None
        self._m.writes_refused(self._name).set(now - since)
        if started:
            log.warning(
                "kvtier: remote tier %s refuses every write (%s): nothing more is stored there "
                "until it accepts them again (a full store needs maxmemory-policy allkeys-lru, "
                "or volatile-lru with remote_ttl_s > 0)",
                self._url,
                e,
            )

    def log_once(self, what: str, msg: str, *args: object) -> None:
        """WARNING the first time for `what`, DEBUG afterwards."""
        # once per reason: a full store refuses every write, and the counter carries the rate
        with self._lock:
            first = what not in self._logged
            self._logged.add(what)
        log.log(logging.WARNING if first else logging.DEBUG, msg, *args)

    def transition(
        self,
        shard: str,
        transition: Transition | None,
        cause: BaseException | None,
        at_startup: bool = False,
    ) -> None:
        """Log and publish a breaker's change of state (nothing when it did not change)."""
        if transition is None:
            return
        self.publish()
        if transition in (Transition.OPENED, Transition.REOPENED) and not at_startup:
            # the next probe goes over new connections: an old one that lost a reply (a
            # middlebox dropping it) would answer every later request with the one before's
            self.transport.reconnect()
        if transition is Transition.OPENED:
            why = (
                "is unreachable at startup"
                if at_startup
                else f"failed {self.breakers.failures} calls in a row"
            )
            log.warning(
                "kvtier: remote tier %s shard %s %s (%s); circuit breaker open: its reads miss "
                "and writes are dropped, probing again every %.1fs",
                self._url,
                shard,
                why,
                cause if cause is not None else "no error",
                self.breakers.probe_s,
            )
        elif transition is Transition.REOPENED:
            log.debug("kvtier: remote tier %s shard %s probe failed: %s", self._url, shard, cause)
        else:
            log.info(
                "kvtier: remote tier %s shard %s answers again; circuit breaker closed",
                self._url,
                shard,
            )
            # after an outage the owners may have changed (a replica promoted)
            self.transport.refresh()

    def publish(self) -> None:
        """The number of open breakers as the tier's gauge, over the shards the topology has."""
        # a shard the topology no longer has (a failed-over master) is no longer shed: no key
        # maps to it, so its open breaker would never be probed closed
        self._epoch = self.transport.epoch
        self.breakers.retain(set(self.transport.shards()))
        self._m.breaker(self._name).set(len(self.breakers.open_shards()))
