"""Leases: a lookup leases the chunks it counted so they cannot be evicted before the load.

A lease is held under the lookup's id until released or until its deadline passes. A key stays
pinned while any live lease holds it. Releasing an id that is not held is a counted no-op.
Internal leases (a tier pinning a slot for its own write-behind, or a lower tier holding a
lookup's chunk that the memory tier already counts) pass `counted=False` so the lease metrics
count each lookup once. Callers hold their own lock: the table is not thread-safe.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from kvtier.metrics import Metrics


class LeaseTable:
    """Pin counts per key, grouped by lease id, with a deadline per lease and a cap on leases."""

    def __init__(
        self,
        metrics: Metrics,
        ttl_s: float = 30.0,
        max_leases: int = 65536,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s <= 0 or max_leases <= 0:
            raise ValueError(f"lease ttl_s ({ttl_s}) and max_leases ({max_leases}) must be > 0")
        self._m = metrics
        self._ttl = ttl_s
        self._max = max_leases
        self._clock = clock
        # lease id -> (deadline, keys); ordered by creation, so the oldest expire first
        self._leases: OrderedDict[str, tuple[float, list[bytes], bool]] = OrderedDict()
        self._pins: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def acquire(self, lease_id: str, keys: Iterable[bytes], counted: bool = True) -> None:
        """Pin `keys` under `lease_id` (adding to it if held), refreshing its deadline."""
        self.expire()
        keys = list(keys)
        if lease_id in self._leases:
            _, held, counted = self._leases.pop(lease_id)
            held.extend(keys)
        else:
            held = keys
            while len(self._leases) >= self._max:
                oldest = next(iter(self._leases))
                if self._leases[oldest][2]:
                    self._m.lease_expiries.inc()
                self._drop(oldest)
        self._leases[lease_id] = (self._clock() + self._ttl, held, counted)
        for k in keys:
            self._pins[k] = self._pins.get(k, 0) + 1

    def is_pinned(self, key: bytes) -> bool:
        """True while a lease holds `key` (past-deadline leases hold until `expire()` runs)."""
        return key in self._pins

    def release(self, lease_id: str) -> list[bytes]:
        """Release a lease; returns keys no longer pinned. Unknown ids are counted no-ops."""
        entry = self._leases.get(lease_id)
        if entry is None:
            self._m.lease_double_releases.inc()
            return []
        if entry[2]:
            self._m.lease_releases.inc()
        return self._drop(lease_id)

    def expire(self) -> list[bytes]:
        """Drop every lease past its deadline; returns keys no longer pinned."""
        now = self._clock()
        freed: list[bytes] = []
        while self._leases:
            lease_id, (deadline, _, counted) = next(iter(self._leases.items()))
            if deadline > now:
                break
            freed.extend(self._drop(lease_id))
            if counted:
                self._m.lease_expiries.inc()
        return freed

    def _drop(self, lease_id: str) -> list[bytes]:
        _, keys, _ = self._leases.pop(lease_id)
        freed = []
        for k in keys:
            n = self._pins[k] - 1
            if n:
                self._pins[k] = n
            else:
                del self._pins[k]
                freed.append(k)
        return freed
