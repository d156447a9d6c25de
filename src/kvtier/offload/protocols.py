"""What a host must give the offload core. The core reads these views and never writes them,
so a host may hand it frozen or `__slots__` adapters over its own request objects."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class RequestView(Protocol):
    """A host request as the scheduler core sees it."""

    @property
    def request_id(self) -> str:
        """Stable id of the request for its whole lifecycle."""
        ...

    @property
    def prompt_token_ids(self) -> Sequence[int]:
        """The prompt; only its whole chunks are ever looked up or saved."""
        ...

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV is in the host's cache now (after allocation: the HBM floor)."""
        ...

    @property
    def block_ids(self) -> Sequence[int]:
        """The request's KV block table, one id per `block_size` tokens."""
        ...

    # Optional: a `retention` attribute (an `offload.retention.RetentionHint` or None) carries
    # the client's retention hint; hosts without hints leave it out.


@dataclass(frozen=True, slots=True)
class StepRequest:
    """A request scheduled in this step and the tokens it will have computed after the step."""

    view: RequestView
    computed_after_step: int
    # tokens computed when the step started (None: the view's num_computed_tokens); a hybrid
    # host frees sliding-window blocks below this count's window before the step runs
    computed_before_step: int | None = None


class LookupResultLike(Protocol):
    """The answer of an all-rank lookup."""

    hit_chunks: int
    limiting_rank: int | None
    timed_out: tuple[int, ...]
    tier: str  # the deepest tier of the counted run ("" when unknown)
    runs: tuple[tuple[str, int], ...]  # (tier, chunks) per run; empty when unknown


class PendingLookupLike(Protocol):
    """A lookup sent to the ranks and not yet settled."""

    lookup_id: str


class LookupPort(Protocol):
    """The scheduler's handle on every rank's tier (a `kvtier.lookup.LookupClient`)."""

    def lookup(self, keys: Sequence[bytes], lookup_id: str, lease: bool = True) -> LookupResultLike:
        """Ask every rank in scope how many leading chunks it holds; lease them."""
        ...

    def begin(
        self,
        keys: Sequence[bytes],
        lookup_id: str,
        lease: bool = True,
        ends: Sequence[bytes] | None = None,
    ) -> PendingLookupLike:
        """Send the lookup to every rank and return at once; with `ends`, a rank's run may end
        only after a chunk `i` whose `ends[i]` it holds (a hybrid model's boundary states)."""
        ...

    def poll(self, pending: Any, wait_ms: float = 0.0) -> LookupResultLike | None:
        """The result once settled (waiting at most `wait_ms`), else None."""
        ...

    def cancel(self, pending: Any) -> None:
        """Stop waiting for a lookup and release whatever it leased."""
        ...

    def release(self, lookup_ids: Sequence[str]) -> None:
        """Release leases on every rank; never raises for a dead rank."""
        ...

    def admin(
        self, op: str, keys: Sequence[bytes], until: float = 0.0, *, timeout_ms: int | None = None
    ) -> Mapping[int, Any]:
        """Retain, release, prefetch or forget `keys` on every rank; per rank an answer with
        `.count` (None when it did not answer) and `.error`."""
        ...

    def admin_send(self, op: str, keys: Sequence[bytes], until: float = 0.0) -> None:
        """`admin` without waiting for answers (from inside a hook); never raises for a rank."""
        ...
