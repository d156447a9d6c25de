"""Predictions made by driving the project's real tier classes the way the engine drives them,
and the accounting every tool shares: chunks the HBM missed, and how many of those a tier served.

Per request, as `OffloadScheduler` and `OffloadWorker` do: the HBM floor is known; when a load
could pay (at least `min_load` chunks past the floor) the scheduler looks the chain up under a
lease, which touches the matched run; the load reads the chunks above the floor; the lease is
released; the scheduler's admission policy (`kvtier.offload.admission`, the real class) decides
the request; the prompt's full chunks past the lookup hit that the tier lacks are then saved
when admitted, each under its parent: as each engine step ends, the chunks it computed, deepest
first (a step computes the engine's token budget of a prompt). A lookup the scheduler skips
saves from chunk 0. With a retention client (`kvtier.cachemodel.retention`) the tier is
protected by the client's table, a hinting request's saves are forced, and the client hints
after the saves.
"""

from __future__ import annotations

import hashlib
import tempfile
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvtier.cachemodel.stream import Request
from kvtier.metrics import Metrics
from kvtier.offload.admission import ALL, REJECTED, AdmissionPolicy
from kvtier.offload.selftest import SELF_TEST_KEY
from kvtier.store.disk import DiskTier
from kvtier.store.memory import MemoryTier
from kvtier.store.record import HEADER_BYTES
from kvtier.store.stack import TierStack

# the payload of a modelled chunk: the policy is what is measured, not the copies
_PAYLOAD = 16
_NAMESPACE = bytes(16)
# the copies still in flight, uncommitted, when a save lane reserves the next chunk's slot (0:
# each chunk committed before the next takes its slot): under eviction pressure, when each chunk
# takes its slot and when it is committed decides what stays. The save lane retires whatever
# landed before each slot it reserves (`offload/saving.py`), so on the CPU, where every copy has
# landed when it is issued, nothing is in flight; on a GPU up to `transfer_depth` may be
TRANSFER_DEPTH = 0

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
    """The 16-byte key a modelled chunk id is stored under: the id itself when it fits in 128
    bits, else its 16-byte blake2b digest (a trace's hash ids may be any integers >= 0)."""
    if 0 <= chunk < 1 << 128:
        return chunk.to_bytes(16, "little")
    return hashlib.blake2b(str(chunk).encode(), digest_size=16).digest()


class _Port(Protocol):
    """What the engine flow needs of a rank's tiers."""

    def lookup(self, keys: list[bytes], lease_id: str) -> int: ...
    def read(self, key: bytes, parent: bytes) -> None: ...
    def release(self, lease_id: str) -> None: ...
    def holds(self, key: bytes) -> bool: ...
    def save(self, chunks: Sequence[tuple[bytes, bytes]]) -> None:
        """One save operation of (key, parent) pairs, in the order the worker issues them."""
        ...


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

    def __init__(self, stack: TierStack, depth: int = TRANSFER_DEPTH) -> None:
        self.stack = stack
        self.depth = depth
        self._dst = torch.empty(_PAYLOAD, dtype=torch.uint8)

    def lookup(self, keys: list[bytes], lease_id: str) -> int:
        return self.stack.lookup(keys, lease_id)

    def read(self, key: bytes, parent: bytes) -> None:
        self.stack.read_into(key, self._dst, parent)

    def release(self, lease_id: str) -> None:
        self.stack.release(lease_id)

    def holds(self, key: bytes) -> bool:
        return self.stack.memory.contains(key)

    def save(self, chunks: Sequence[tuple[bytes, bytes]]) -> None:
        # as the worker's save lane (`offload/saving.py`): a resident chunk is passed over (no
        # touch); every other one takes its slot as it is issued, and with `depth` copies in
        # flight the oldest lands (is committed) before the next one is pushed
        flying: deque[bytes] = deque()
        for key, parent in chunks:
            if self.stack.memory.contains(key) or self.stack.reserve(key, parent) is None:
                continue
            flying.append(key)
            while len(flying) > self.depth:
                self.stack.commit(flying.popleft(), _PAYLOAD)
        for key in flying:
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

    def save(self, chunks: Sequence[tuple[bytes, bytes]]) -> None:
        # only a chunk memory committed is written behind: a resident one is passed over
        for key, parent in chunks:
            if not self.disk.contains(key):
                self.disk.put(key, self._payload, parent=parent)


@dataclass(slots=True)
class Drive:
    """One drive's lookup results (0 when skipped), chunks written, rejected chunks back."""

    leads: list[int]
    written: int = 0
    regret: int = 0


def save_ops(
    start: int, computed_from: int, limit: int, step_chunks: int | None, loaded: bool = False
) -> list[range]:
    """The save operations of chunks [start, limit), in order, each deepest first: the engine
    saves what each step computed as that step ends, and a prefill from `computed_from` computes
    `step_chunks` chunks a step (None: the whole prompt in one step); a `loaded` request's
    first save waits one more step, for its load's report."""
    if limit <= start:
        return []
    ends = [limit]
    if step_chunks:
        first = max(computed_from, start) + step_chunks * (2 if loaded else 1)
        ends = [*range(first, limit, step_chunks), limit]
    ops, lo = [], start
    for hi in ends:
        if hi > lo:
            ops.append(range(hi - 1, lo - 1, -1))
            lo = hi
    return ops


def drive(
    port: _Port,
    requests: Sequence[Request],
    floors: Sequence[int],
    min_load: int,
    admission: AdmissionPolicy | None = None,
    hinter: Hinter | None = None,
    step_chunks: int | None = None,
) -> Drive:
    """Run the engine flow over `port` (every request admitted without a policy), with the
    retention client `hinter` hinting after each request when given; a prefill computes
    `step_chunks` chunks a step (the engine's token budget; None: a whole prompt a step)."""
    out = Drive([])
    for i, (r, h) in enumerate(zip(requests, floors, strict=True)):
        forced = hinter.begin(i) if hinter is not None else False
        keys = [key_of(c) for c in r.chunks]
        start = n = 0
        computed_from, loaded = h, False
        if looks_up(r, h, min_load):
            lease = f"r{i}"
            n = start = port.lookup(keys, lease)
            if served(r, h, n, min_load):
                computed_from, loaded = min(n, r.usable), True
                for c in range(h, computed_from):
                    port.read(keys[c], keys[c - 1] if c else b"")
            port.release(lease)
        limit = len(keys)
        if admission is not None and keys:
            decision, seen = admission.decide(keys, hbm_chunks=h, tier_chunks=n, forced=forced)
            limit = decision.limit
            out.regret += seen.returns[REJECTED]
        # the engine saves every admitted chunk above the tier's hit, those under its HBM floor
        # too (an evicted one is written again, a resident one passed over untouched), step by
        # step: under eviction pressure the order decides what stays
        for op in save_ops(start, computed_from, limit, step_chunks, loaded):
            out.written += sum(not port.holds(keys[c]) for c in op)
            port.save([(keys[c], keys[c - 1] if c else b"") for c in op])
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
    step_chunks: int | None = None,
) -> TierHits:
    """Tier hits of the real `tier` ("memory": a rank's TierStack over a MemoryTier; "disk": a
    DiskTier in a temporary directory) of `capacity` chunks, driven as the engine drives it
    with the scheduler's `admission` mode ("all": write-through; "adaptive")."""
    done = drive_tier(
        requests, capacity, floors, tier=tier, min_load=min_load, admission=admission,
        step_chunks=step_chunks,
    )  # fmt: skip
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
    step_chunks: int | None = None,
    transfer_depth: int = TRANSFER_DEPTH,
    self_test: bool = False,
) -> Drive:
    """`predict`'s drive, per request (the tier protected by `hinter`'s retention if given);
    memory takes `transfer_depth` copies in flight (0: one chunk at a time, as a lower tier
    receives them); `self_test` starts it holding the chunk a live engine's startup self-test
    leaves (for a model held to a live run, chunk for chunk)."""
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
        port = _StackPort(stack, transfer_depth)
        if self_test:
            # the rank's startup self-test saves a chunk and looks it up (a second touch): it
            # stays in memory, one slot, until evicted
            port.save([(SELF_TEST_KEY, b"")])
            port.lookup([SELF_TEST_KEY], "kvtier-self-test")
            port.release("kvtier-self-test")
        try:
            return drive(port, requests, floors, min_load, policy, hinter, step_chunks)
        finally:
            stack.close()
    if tier == DISK:
        with tempfile.TemporaryDirectory(prefix="kvtier-cachemodel-") as root:
            disk = DiskTier(root, capacity * (HEADER_BYTES + _PAYLOAD), _NAMESPACE, metrics)
            if hinter is not None:
                disk.protect(hinter.holds)
            try:
                port = _DiskPort(disk)
                return drive(port, requests, floors, min_load, policy, hinter, step_chunks)
            finally:
                disk.close()
    raise ValueError(f"tier={tier!r} is not {MEMORY!r} or {DISK!r}")
