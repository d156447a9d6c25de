"""Predictions made by driving the project's real tier classes the way the engine drives them,
and the accounting every tool shares: chunks the HBM missed, and how many of those a tier served.

Per request, as `OffloadScheduler` and `OffloadWorker` do: the HBM floor is known; when a load
could pay (at least `min_load` chunks past the floor) the scheduler looks the chain up under a
lease, which touches the matched run; the load reads the chunks above the floor; the lease is
released; the scheduler's admission policy (`kvtier.offload.admission`, the real class) decides
the request; the prompt's full chunks past the lookup hit that the tier lacks are then saved,
deepest first, each under its parent, when admitted. A lookup the scheduler skips saves from
chunk 0. With a retention client (`kvtier.cachemodel.retention`) the tier is protected by the
client's table, a hinting request's saves are forced, and the client hints after the saves.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvtier.cachemodel.stream import Request
from kvtier.metrics import Metrics
from kvtier.offload.admission import ALL, REJECTED, AdmissionPolicy
from kvtier.store.disk import DiskTier
from kvtier.store.memory import MemoryTier
from kvtier.store.record import HEADER_BYTES
from kvtier.store.stack import TierStack

# the payload of a modelled chunk: the policy is what is measured, not the copies
_PAYLOAD = 16
_NAMESPACE = bytes(16)

MEMORY = "memory"
DISK = "disk"


@dataclass(frozen=True, slots=True)
class TierHits:
    """Chunks a tier served over a stream, next to what the HBM left for it."""

    requests: int
    usable: int  # leading chunks a hit could cover, summed over requests
    hbm: int  # of those, the HBM's
    served: int  # of the rest, the tier's
    written: int = 0  # chunks saved into the tier
    regret: int = 0  # chunks admission rejected that came back needing the tier

    @property
    def missed(self) -> int:
        """Usable chunks the HBM did not hold."""
        return self.usable - self.hbm

    @property
    def rate(self) -> float:
        """Tier hits over the chunks the HBM missed (0.0 when it missed none)."""
        return self.served / self.missed if self.missed else 0.0

    def to_json(self) -> dict[str, object]:
        """Counts and the rate as plain JSON."""
        return {
            "requests": self.requests,
            "usable_chunks": self.usable,
            "hbm_chunks": self.hbm,
            "served_chunks": self.served,
            "written_chunks": self.written,
            "rejected_returns": self.regret,
            "rate": self.rate,
        }


def looks_up(request: Request, floor: int, min_load: int = 1) -> bool:
    """Whether the scheduler asks the tier at all: a full hit could beat HBM by a load."""
    return request.usable - floor >= min_load


def served(request: Request, floor: int, leading: int, min_load: int = 1) -> int:
    """Chunks a lookup that found `leading` chunks loads above the HBM floor."""
    end = min(leading, request.usable)
    return end - floor if end - floor >= min_load and looks_up(request, floor, min_load) else 0


def tally(
    requests: Sequence[Request],
    floors: Sequence[int],
    leads: Sequence[int],
    min_load: int = 1,
    *,
    written: int = 0,
    regret: int = 0,
) -> TierHits:
    """The stream's totals given each request's HBM floor and tier leading run."""
    return TierHits(
        len(requests),
        sum(r.usable for r in requests),
        sum(floors),
        sum(served(r, h, n, min_load) for r, h, n in zip(requests, floors, leads, strict=True)),
        written,
        regret,
    )


def key_of(chunk: int) -> bytes:
    """The 16-byte key a modelled chunk id is stored under."""
    return chunk.to_bytes(16, "little")


class _Port(Protocol):
    """What the engine flow needs of a rank's tiers."""

    def lookup(self, keys: list[bytes], lease_id: str) -> int: ...
    def read(self, key: bytes, parent: bytes) -> None: ...
    def release(self, lease_id: str) -> None: ...
    def holds(self, key: bytes) -> bool: ...
    def save(self, key: bytes, parent: bytes) -> None: ...


class Hinter(Protocol):
    """A client sending retention hints, on the model's simulated clock."""

    def holds(self, key: bytes) -> bool:
        """Whether `key` is retained now (the tiers' eviction asks)."""
        ...

    def begin(self, i: int) -> bool:
        """Request `i` arrives (the clock moves to it); whether its saves are forced."""
        ...

    def end(self, i: int, keys: Sequence[bytes], held: int) -> None:
        """Request `i` was served and saved; the tier holds the first `held` of `keys`."""
        ...


class _StackPort:
    """A rank's TierStack, called as the worker calls it (reserve and commit, read_into)."""

    def __init__(self, stack: TierStack) -> None:
        self.stack = stack
        self._dst = torch.empty(_PAYLOAD, dtype=torch.uint8)

    def lookup(self, keys: list[bytes], lease_id: str) -> int:
        return self.stack.lookup(keys, lease_id)

    def read(self, key: bytes, parent: bytes) -> None:
        self.stack.read_into(key, self._dst, parent)

    def release(self, lease_id: str) -> None:
        self.stack.release(lease_id)

    def holds(self, key: bytes) -> bool:
        return self.stack.memory.contains(key)

    def save(self, key: bytes, parent: bytes) -> None:
        if self.stack.reserve(key, parent) is not None:
            self.stack.commit(key, _PAYLOAD)


class _DiskPort:
    """A DiskTier alone, called as the stack calls its lower tiers."""

    def __init__(self, disk: DiskTier) -> None:
        self.disk = disk
        self._payload = bytes(_PAYLOAD)

    def lookup(self, keys: list[bytes], lease_id: str) -> int:
        n = self.disk.lease(lease_id, keys)
        self.disk.touch(keys[:n])
        return n

    def read(self, key: bytes, parent: bytes) -> None:
        self.disk.get(key)

    def release(self, lease_id: str) -> None:
        self.disk.release(lease_id)

    def holds(self, key: bytes) -> bool:
        return self.disk.contains(key)

    def save(self, key: bytes, parent: bytes) -> None:
        self.disk.put(key, self._payload, parent=parent)


@dataclass(slots=True)
class Drive:
    """One drive's lookup results (0 when skipped), chunks written, rejected chunks back."""

    leads: list[int]
    written: int = 0
    regret: int = 0


def drive(
    port: _Port,
    requests: Sequence[Request],
    floors: Sequence[int],
    min_load: int,
    admission: AdmissionPolicy | None = None,
    hinter: Hinter | None = None,
) -> Drive:
    """Run the engine flow over `port` (every request admitted without a policy), with the
    retention client `hinter` hinting after each request when given."""
    out = Drive([])
    for i, (r, h) in enumerate(zip(requests, floors, strict=True)):
        forced = hinter.begin(i) if hinter is not None else False
        keys = [key_of(c) for c in r.chunks]
        start = n = 0
        if looks_up(r, h, min_load):
            lease = f"r{i}"
            n = start = port.lookup(keys, lease)
            if served(r, h, n, min_load):
                for c in range(h, min(n, r.usable)):
                    port.read(keys[c], keys[c - 1] if c else b"")
            port.release(lease)
        limit = len(keys)
        if admission is not None and keys:
            decision, seen = admission.decide(keys, hbm_chunks=h, tier_chunks=n, forced=forced)
            limit = decision.limit
            out.regret += seen.returns[REJECTED]
        for c in range(limit - 1, start - 1, -1):
            # the engine saves every admitted chunk above the tier's hit, those under its HBM
            # floor too: a resident one is touched (kept warm in the tier), not rewritten
            fresh = not port.holds(keys[c])
            port.save(keys[c], keys[c - 1] if c else b"")
            out.written += fresh
        if hinter is not None:
            held = 0
            while held < len(keys) and port.holds(keys[held]):
                held += 1
            hinter.end(i, keys, held)
        out.leads.append(n)
    return out


def predict(
    requests: Sequence[Request],
    capacity: int,
    floors: Sequence[int],
    *,
    tier: str = MEMORY,
    min_load: int = 1,
    admission: str = ALL,
) -> TierHits:
    """Tier hits of the real `tier` ("memory": a rank's TierStack over a MemoryTier; "disk": a
    DiskTier in a temporary directory) of `capacity` chunks, driven as the engine drives it
    with the scheduler's `admission` mode ("all": write-through; "adaptive")."""
    done = drive_tier(requests, capacity, floors, tier=tier, min_load=min_load, admission=admission)
    return tally(requests, floors, done.leads, min_load, written=done.written, regret=done.regret)


def drive_tier(
    requests: Sequence[Request],
    capacity: int,
    floors: Sequence[int],
    *,
    tier: str = MEMORY,
    min_load: int = 1,
    admission: str = ALL,
    hinter: Hinter | None = None,
) -> Drive:
    """`predict`'s drive, per request (the tier protected by `hinter`'s retention if given)."""
    if capacity < 1:
        return Drive([0] * len(requests))
    metrics = Metrics()
    policy = AdmissionPolicy(admission, capacity=capacity, history=max(16 * capacity, 4096))
    if tier == MEMORY:
        memory = MemoryTier(
            _PAYLOAD,
            capacity * _PAYLOAD,
            _NAMESPACE,
            metrics,
            max_leases=4,
            verify_reads=False,
            pin_memory=False,
        )
        stack = TierStack(memory, (), metrics)
        if hinter is not None:
            # after the stack, which protects its tiers with its own (here empty) table
            memory.protect(hinter.holds)
        try:
            return drive(_StackPort(stack), requests, floors, min_load, policy, hinter)
        finally:
            stack.close()
    if tier == DISK:
        with tempfile.TemporaryDirectory(prefix="kvtier-cachemodel-") as root:
            disk = DiskTier(root, capacity * (HEADER_BYTES + _PAYLOAD), _NAMESPACE, metrics)
            if hinter is not None:
                disk.protect(hinter.holds)
            try:
                return drive(_DiskPort(disk), requests, floors, min_load, policy, hinter)
            finally:
                disk.close()
    raise ValueError(f"tier={tier!r} is not {MEMORY!r} or {DISK!r}")
