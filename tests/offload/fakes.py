"""Test doubles for the offload core: a scriptable lookup port and plain request views."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class FakeResult:
    hit_chunks: int
    limiting_rank: int | None = None
    timed_out: tuple[int, ...] = ()
    per_rank: dict[int, int] = field(default_factory=dict)
    tier: str = ""
    runs: tuple[tuple[str, int], ...] = ()


@dataclass
class FakeAnswer:
    count: int | None
    error: str | None


@dataclass
class FakePending:
    """A fake lookup in flight: answered (`ready`) at once unless a test holds it back."""

    lookup_id: str
    result: FakeResult
    ready: bool = True


class FakeLookup:
    """Answers `hits` chunks (capped by the keys asked) and records leases and releases."""

    def __init__(
        self,
        hits: int = 0,
        timed_out: tuple[int, ...] = (),
        runs: tuple[tuple[str, int], ...] = (),
    ) -> None:
        self.hits = hits
        self.timed_out = timed_out
        self.runs = runs  # (tier, chunks) per run of the hit, as a real lookup answers
        self.leased: list[str] = []
        self.released: list[str] = []
        # (op, keys, until, waited) of every admin request, in order
        self.admins: list[tuple[str, list[bytes], float, bool]] = []
        # the `ends` of every lookup begun (None: any chunk may end the run)
        self.ends: list[list[bytes] | None] = []

    def lookup(self, keys: Sequence[bytes], lookup_id: str, lease: bool = True) -> FakeResult:
        n = min(self.hits, len(keys))
        if lease and n:
            self.leased.append(lookup_id)
        runs, left = [], n
        for tier, chunks in self.runs:
            if left:
                runs.append((tier, min(chunks, left)))
                left -= runs[-1][1]
        tier = runs[-1][0] if runs else ""
        return FakeResult(n, timed_out=self.timed_out, tier=tier, runs=tuple(runs))

    def release(self, lookup_ids: Sequence[str]) -> None:
        self.released.extend(lookup_ids)

    def begin(
        self,
        keys: Sequence[bytes],
        lookup_id: str,
        lease: bool = True,
        ends: Sequence[bytes] | None = None,
    ) -> FakePending:
        self.ends.append(list(ends) if ends is not None else None)
        return FakePending(lookup_id, self.lookup(keys, lookup_id, lease))

    def poll(self, pending: FakePending, wait_ms: float = 0.0) -> FakeResult | None:
        return pending.result if pending.ready else None

    def cancel(self, pending: FakePending) -> None:
        self.release([pending.lookup_id])

    def admin(
        self, op: str, keys: Sequence[bytes], until: float = 0.0, *, timeout_ms: int | None = None
    ) -> dict[int, FakeAnswer]:
        self.admins.append((op, list(keys), until, True))
        return {0: FakeAnswer(len(keys), None)}

    def admin_send(self, op: str, keys: Sequence[bytes], until: float = 0.0) -> None:
        self.admins.append((op, list(keys), until, False))

    def outstanding(self) -> set[str]:
        return set(self.leased) - set(self.released)


class SlotView:
    """A `__slots__` request view: the core must only read it."""

    __slots__ = ("_block_ids", "_computed", "_id", "_prompt")

    def __init__(
        self, req_id: str, prompt: Sequence[int], computed: int = 0, block_ids: Sequence[int] = ()
    ) -> None:
        self._id = req_id
        self._prompt = list(prompt)
        self._computed = computed
        self._block_ids = list(block_ids)

    @property
    def request_id(self) -> str:
        return self._id

    @property
    def prompt_token_ids(self) -> Sequence[int]:
        return self._prompt

    @property
    def num_computed_tokens(self) -> int:
        return self._computed

    @property
    def block_ids(self) -> Sequence[int]:
        return self._block_ids

    def advance(self, computed: int, block_ids: Sequence[int]) -> None:
        self._computed = computed
        self._block_ids = list(block_ids)
