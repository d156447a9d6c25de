"""What every tier provides to the `TierStack` (memory, disk, remote)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


class Tier(Protocol):
    """One storage tier holding verified chunk payloads under 16-byte chunk keys.

    A tier is built for one namespace fingerprint (model, layout, dtype, chunk size, TP size and
    rank); records written under another namespace never read back as hits.
    """

    name: str

    def contains(self, key: bytes) -> bool:
        """True if the tier holds `key` (cheap; no payload read)."""
        ...

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """`contains` for a batch, in one round trip where the tier is remote."""
        ...

    def get(self, key: bytes) -> bytes | memoryview | None:
        """The verified payload of `key`, or None on a miss. A record that fails verification
        is dropped, counted in `kvtier_verify_failures_total{tier=...}` and reads as a miss."""
        ...

    def put(self, key: bytes, payload: bytes | memoryview) -> bool:
        """Store `payload` under `key`; False (counted) when the tier cannot take it."""
        ...

    def lease(self, lease_id: str, keys: Sequence[bytes], counted: bool = True) -> int:
        """Keep `keys` from eviction under `lease_id` until released or expired; returns how
        many leading keys the tier holds. `counted=False` keeps it out of the lease metrics."""
        ...

    def release(self, lease_id: str) -> None:
        """Release `lease_id`; an unknown id is a counted no-op."""
        ...

    def residency_bytes(self) -> int:
        """Bytes the tier holds now."""
        ...

    def close(self) -> None:
        """Release resources; the tier is unusable afterwards."""
        ...


@runtime_checkable
class ChainTier(Tier, Protocol):
    """A tier that keeps chains prefix-closed: it learns each chunk's parent when it is stored
    and is told which runs lookups used, so it can evict leaves first (memory, disk)."""

    def put(self, key: bytes, payload: bytes | memoryview, parent: bytes = b"") -> bool:
        """Store `payload` under `key`, the chunk after `parent` (b"": a head or not known)."""
        ...

    def touch(self, keys: Sequence[bytes]) -> None:
        """A lookup used the run `keys` (leading chunks in chain order): reference them
        tail-first."""
        ...
