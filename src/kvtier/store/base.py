"""What every tier provides to the `TierStack`: the whole contract, its optional parts declared.

A tier kind is one module with a class that follows `Tier` (most inherit `TierBase` for the
optional parts they lack) and one `TierKind` record in `store/registry.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol

from kvtier.store.policy import NO_PARENT

if TYPE_CHECKING:
    import torch


class Tier(Protocol):
    """One storage tier holding verified chunk payloads under 16-byte chunk keys.

    A tier is built for one namespace fingerprint (model, layout, dtype, chunk size, TP size and
    rank); records written under another namespace never read back as hits. The members after
    `close` are optional capabilities: a tier without one declares so through its flag or takes
    `TierBase`'s default, and the stack never probes for a member.
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

    def put(self, key: bytes, payload: bytes | memoryview, parent: bytes = NO_PARENT) -> bool:
        """Store `payload` under `key`, the chunk after `parent` (b"": a head or not known);
        False (counted) when the tier cannot take it."""
        ...

    def lease(self, lease_id: str, keys: Sequence[bytes], counted: bool = True) -> int:
        """Keep `keys` from eviction under `lease_id` until released or expired; returns how
        many leading keys the tier holds. `counted=False` keeps it out of the lease metrics."""
        ...

    def release(self, lease_id: str) -> None:
        """Release `lease_id`; an unknown id is a counted no-op."""
        ...

    def delete(self, key: bytes) -> bool:
        """Drop `key` (an admin `forget`); True if the tier held it."""
        ...

    def residency_bytes(self) -> int:
        """Bytes the tier holds now."""
        ...

    def close(self) -> None:
        """Release resources; the tier is unusable afterwards."""
        ...

    # ---- optional capabilities (TierBase: absent) ----------------------------------------

    # False: `lease` cannot pin (a shared store), so the batched presence check is the answer
    pins: ClassVar[bool]
    # True: `read_into` fills a host tensor from the tier's own buffer (else the stack `get`s)
    reads_into: ClassVar[bool]
    # True: the tier calls `listener(change, key)` on its stores and drops (else the stack
    # reports its stores, and its evictions go unreported)
    reports_evictions: ClassVar[bool]
    listener: Callable[[str, bytes], None] | None
    # where a tier persists on this host (the retention table lives beside the first one)
    directory: Path | None

    def read_into(self, key: bytes, dst: torch.Tensor) -> bool:
        """Fill the flat uint8 host tensor `dst` with `key`'s verified payload; False on a miss
        (only called where `reads_into`)."""
        ...

    def touch(self, keys: Sequence[bytes]) -> None:
        """A lookup used the run `keys` (leading chunks in chain order): reference them
        tail-first, so the tier evicts leaves first."""
        ...

    def protect(self, retained: Callable[[bytes], bool]) -> None:
        """Never evict a key `retained` says yes to (a tier that evicts on its own)."""
        ...

    def protect_until(self, until: Callable[[bytes], float | None]) -> None:
        """Keep a key past its expiry up to the wall-clock second `until` gives (a tier whose
        records expire)."""
        ...

    def extend_ttl(self, keys: Sequence[bytes], until: float) -> int:
        """Make `keys` live at least until the wall-clock second `until`; how many it extended."""
        ...


class TierBase:
    """The optional half of `Tier`, each capability absent: a tier overrides what it has."""

    name: str
    pins: ClassVar[bool] = True
    reads_into: ClassVar[bool] = False
    reports_evictions: ClassVar[bool] = False
    listener: Callable[[str, bytes], None] | None = None
    directory: Path | None = None

    def read_into(self, key: bytes, dst: torch.Tensor) -> bool:
        raise NotImplementedError(
            f"tier {self.name!r} declares reads_into=False; the stack reads it with get()"
        )

    def touch(self, keys: Sequence[bytes]) -> None:
        """No recency of its own to keep."""

    def protect(self, retained: Callable[[bytes], bool]) -> None:
        """Evicts nothing on its own."""

    def protect_until(self, until: Callable[[bytes], float | None]) -> None:
        """Its records do not expire."""

    def extend_ttl(self, keys: Sequence[bytes], until: float) -> int:
        """No expiry to extend."""
        return 0
