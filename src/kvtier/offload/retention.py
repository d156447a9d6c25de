"""Retention on the scheduler: clients' hints sized to a budget, and which keys a conversation
owns (so it can be retained, prefetched or forgotten by its key).

A hint asks to keep a prompt's chunks (up to a marked message) for a TTL. The ledger grants it
within the budget: retained chunks at most `budget` chunks live at once, one tenant at most
`tenant_share` of that. A hint that fits is `retained`; one whose deepest chunks or TTL do not
fit is `clipped` (the leading chunks are kept: a prefix is what a later turn reads); one of
which nothing fits is `rejected`. The ranks enforce their own bound too (`store/retention.py`),
so a ledger that is wrong costs hits, never the tiers' room for unretained traffic beyond the
budget. Thread-safe: hooks and an admin API share one ledger.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvtier.config import RETENTION_FULL_MODES
from kvtier.numbers import finite_number

# what a hint finds when the budget is full: `clip` keeps what fits; `soonest` first takes
# room from retained chunks due back later than it (latest first), as the optimum would
CLIP, SOONEST = RETENTION_FULL_MODES
FULL_MODES = RETENTION_FULL_MODES

RETAINED = "retained"
CLIPPED = "clipped"
REJECTED = "rejected"
STATUSES = (RETAINED, CLIPPED, REJECTED)

# conversations and keys remembered for forget / prefetch by key; the oldest go first
_SESSIONS = 65536
_KEYS_PER_SESSION = 1 << 16
# conversations one tenant keeps named: a flood of fresh keys evicts the flooder's own first
_SESSIONS_PER_TENANT = 4096
# conversations retaining one chunk at once (a shared system prompt): the soonest due go first
_HOLDERS_PER_KEY = 256
# chunk keys remembered over every conversation at once (~100 bytes each); past it the least
# recently noted conversations go first (the two caps above alone allow 2^32 keys)
_KEYS_TOTAL = 1 << 22
# chunks the ledger retains at once whatever the budget: a budget it cannot size (chunk bytes
# unknown) is left to the ranks' bound, and must not let hints grow the ledger without end
_MAX_RETAINED = 1 << 22


@dataclass(frozen=True, slots=True)
class RetentionHint:
    """A client's ask: keep the prompt (its first `upto_tokens`, all when None) `ttl_s` seconds
    (the default when None); `session` is its prompt_cache_key, `tenant` its owner."""

    ttl_s: float | None = None
    upto_tokens: int | None = None
    session: str = ""
    tenant: str = ""
    retain: bool = True  # False: only tag the conversation (a key without a retention ask)


@dataclass(frozen=True, slots=True)
class RetentionDecision:
    """What the ledger granted: `status`, the prompt tokens retained, for how long, and why it
    granted less than asked (`budget`, `tenant_budget`, `ttl`, `disabled`, `unknown`: an admin
    retain of a conversation the ledger does not know; "" when all)."""

    status: str
    tokens: int
    ttl_s: float
    reason: str = ""

    def as_dict(self) -> dict[str, object]:
        """The response field clients read (native usage, vLLM kv_transfer_params)."""
        out: dict[str, object] = {
            "status": self.status,
            "retained_tokens": self.tokens,
            "ttl_s": self.ttl_s,
        }
        if self.reason:
            out["reason"] = self.reason
        return out


@dataclass(frozen=True, slots=True)
class AdminCount:
    """One rank's answer to an admin call: keys acted on (None: no answer) and why not."""

    count: int | None
    error: str | None


# OpenAI's prompt_cache_retention values (older SDKs sent "in-memory"); None: the default TTL
OPENAI_RETENTION: dict[str, float | None] = {"in_memory": None, "in-memory": None, "24h": 86400.0}
MAX_SESSION_CHARS = 256


def positive_seconds(value: object) -> bool:
    """A number of seconds a deadline can be made of: finite and > 0 (JSON parsers accept
    NaN and Infinity literals; a bool is not a number here)."""
    seconds = finite_number(value)
    return seconds is not None and seconds > 0


def hint_from_params(params: Mapping[str, object]) -> RetentionHint | None:
    """A hint from a request's parameters in OpenAI's names (`prompt_cache_key`,
    `prompt_cache_retention`, `user`) plus kvtier's `retain_ttl_s` and `retain_tokens`; None
    when they ask nothing. Raises ValueError naming a bad value."""
    key = params.get("prompt_cache_key")
    retention = params.get("prompt_cache_retention")
    ttl = params.get("retain_ttl_s")
    upto = params.get("retain_tokens")
    user = params.get("user") or ""
    if key is not None and (not isinstance(key, str) or len(key) > MAX_SESSION_CHARS):
        raise ValueError(f"prompt_cache_key must be a string of at most {MAX_SESSION_CHARS} chars")
    if retention is not None and (not isinstance(retention, str) or retention not in
                                  OPENAI_RETENTION):  # fmt: skip
        raise ValueError(f"prompt_cache_retention is {retention!r}; use 'in_memory' or '24h'")
    if ttl is not None and not positive_seconds(ttl):
        raise ValueError(f"retain_ttl_s is {ttl!r}; use a finite number of seconds > 0")
    if upto is not None and (isinstance(upto, bool) or not isinstance(upto, int) or upto < 0):
        raise ValueError(f"retain_tokens is {upto!r}; use a number of prompt tokens >= 0")
    if not isinstance(user, str) or len(user) > MAX_SESSION_CHARS:
        raise ValueError(f"user must be a string of at most {MAX_SESSION_CHARS} chars")
    if key is None and retention is None and ttl is None and upto is None:
        return None
    if retention is None and ttl is None and upto is None:
        return RetentionHint(session=key or "", tenant=user, retain=False)
    seconds = float(ttl) if ttl is not None else OPENAI_RETENTION.get(str(retention))
    return RetentionHint(ttl_s=seconds, upto_tokens=upto, session=key or "", tenant=user)


class RetentionLedger:
    """Retained keys with deadlines and tenants, and the keys each conversation owns."""

    def __init__(
        self,
        budget: int,
        *,
        tenant_share: float,
        default_ttl_s: float,
        max_ttl_s: float,
        full: str = CLIP,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if full not in FULL_MODES:
            raise ValueError(f"retention full mode {full!r} is not one of {', '.join(FULL_MODES)}")
        if budget < 0 or not 0.0 <= tenant_share <= 1.0:
            raise ValueError(
                f"retention budget={budget} must be >= 0 and tenant_share={tenant_share} in [0, 1]"
            )
        self.budget = min(budget, _MAX_RETAINED)
        self.tenant_cap = int(self.budget * tenant_share)
        self.default_ttl_s = default_ttl_s
        self.max_ttl_s = max_ttl_s
        self.full = full
        self._clock = clock
        # (-deadline, -depth, key) of every deadline set, latest and then deepest first, for
        # `soonest` (a chain loses its tail before its head); stale entries are skipped; and
        # the keys displaced since the last `take_displaced`
        self._latest: list[tuple[float, int, bytes]] = []
        self._displaced: list[bytes] = []
        self._lock = threading.Lock()
        self._until: dict[bytes, tuple[float, str]] = {}  # key -> (deadline, tenant)
        # key -> who retains it ((tenant, session) -> deadline): a chunk several conversations
        # share (a system prompt) stays retained until the last of them lets it go
        self._holders: dict[bytes, dict[tuple[str, str], float]] = {}
        self._per_tenant: dict[str, int] = {}
        # (deadline, key) of every deadline set, oldest first; stale once the key moved on
        self._deadlines: list[tuple[float, bytes]] = []
        # (tenant, session) -> its keys in prompt order (a dict as an ordered set)
        self._sessions: OrderedDict[tuple[str, str], dict[bytes, None]] = OrderedDict()
        # tenant -> its sessions, least recently noted first (the per-tenant cap)
        self._tenant_sessions: dict[str, OrderedDict[str, None]] = {}
        self._noted = 0  # keys over every conversation in `_sessions` (the `_KEYS_TOTAL` cap)
        # keys whose deadline a holder's release made earlier, and the new deadline (the
        # ranks keep the later of two deadlines: they are told by a release, then a retain)
        self._shortened: dict[bytes, float] = {}

    def decide(
        self, keys: Sequence[bytes], hint: RetentionHint, chunk: int
    ) -> tuple[RetentionDecision, list[bytes], float]:
        """Grant `hint` for a prompt of chunk `keys`: the decision, the keys to retain and
        their deadline. The conversation's keys are remembered either way."""
        want = len(keys) if hint.upto_tokens is None else min(len(keys), hint.upto_tokens // chunk)
        ttl = self.default_ttl_s if hint.ttl_s is None else hint.ttl_s
        if not positive_seconds(ttl):
            # a deadline that never comes (NaN) would sit atop the deadline heap and stop every
            # later one from expiring: one request would hold every tenant's budget for good
            return RetentionDecision(REJECTED, 0, 0.0, "ttl"), [], 0.0
        reason = ""
        if ttl > self.max_ttl_s:
            ttl, reason = self.max_ttl_s, "ttl"
        with self._lock:
            self._note(hint.tenant, hint.session, keys)
            if self.budget == 0:
                return RetentionDecision(REJECTED, 0, 0.0, "disabled"), [], 0.0
            now = self._clock()
            self._expire(now)
            until = now + ttl
            room = self.budget - len(self._until)
            if self.full == SOONEST:
                need = sum(1 for k in keys[:want] if k not in self._until)
                room += self._displace(need, room, until, set(keys[:want]), hint.tenant)
            tenant_room = self.tenant_cap - self._per_tenant.get(hint.tenant, 0)
            granted = 0
            for key in keys[:want]:
                if key not in self._until:
                    if room <= 0 or tenant_room <= 0:
                        reason = "budget" if room <= 0 else "tenant_budget"
                        break
                    room -= 1
                    tenant_room -= 1
                granted += 1
            holder = (hint.tenant, hint.session)
            for depth, key in enumerate(keys[:granted]):
                held = self._holders.setdefault(key, {})
                held[holder] = max(held.get(holder, 0.0), until)
                self._prune_holders(held, now)
                old = self._until.get(key)
                if old is None:
                    self._charge(hint.tenant)
                    self._until[key] = (until, hint.tenant)
                elif old[0] < until:
                    self._until[key] = (until, self._payer(key, old[1], held))
                else:
                    self._until[key] = (old[0], self._payer(key, old[1], held))
                    continue
                self._schedule(key, until, depth)
        if granted == 0 and want > 0:
            return RetentionDecision(REJECTED, 0, 0.0, reason or "budget"), [], 0.0
        status = RETAINED if granted == want and not reason else CLIPPED
        return RetentionDecision(status, granted * chunk, ttl, reason), list(keys[:granted]), until

    def _schedule(self, key: bytes, until: float, depth: int) -> None:
        """`key` is due at `until` now (the heaps' older entries for it go stale)."""
        heapq.heappush(self._deadlines, (until, key))
        if self.full == SOONEST:
            heapq.heappush(self._latest, (-until, -depth, key))

    def _prune_holders(self, held: dict[tuple[str, str], float], now: float) -> None:
        """Drop a key's holders whose deadline passed, and past the cap the soonest due (a
        chunk renewed by conversation after conversation keeps only the live ones)."""
        for h in [h for h, u in held.items() if u <= now]:
            del held[h]
        if len(held) > _HOLDERS_PER_KEY:
            for h in sorted(held, key=held.__getitem__)[: len(held) - _HOLDERS_PER_KEY]:
                del held[h]

    def _charge(self, tenant: str) -> None:
        self._per_tenant[tenant] = self._per_tenant.get(tenant, 0) + 1

    def _uncharge(self, tenant: str) -> None:
        left = self._per_tenant.get(tenant, 0) - 1
        if left > 0:
            self._per_tenant[tenant] = left
        else:
            # a tenant with nothing retained leaves nothing behind (`user` is client text)
            self._per_tenant.pop(tenant, None)

    def _payer(self, key: bytes, charged: str, held: dict[tuple[str, str], float]) -> str:
        """The tenant a retained key is charged to: `charged` while one of its conversations
        still holds it, else the tenant of the holder due last (the charge moves)."""
        if not held or any(t == charged for t, _ in held):
            return charged
        payer = max(held, key=held.__getitem__)[0]
        self._uncharge(charged)
        self._charge(payer)
        return payer

    def take_shortened(self) -> dict[bytes, float]:
        """Keys whose deadline moved earlier since the last call (a holder let go), and the
        new deadline: the ranks release and retain them again."""
        with self._lock:
            out, self._shortened = self._shortened, {}
            return out

    def take_displaced(self) -> list[bytes]:
        """The keys `soonest` took room from since the last call (the ranks release them)."""
        with self._lock:
            out, self._displaced = self._displaced, []
            return out

    def _displace(self, need: int, room: int, until: float, keep: set[bytes], tenant: str) -> int:
        """Drop retained keys due later than `until`, latest first (never one of `keep`), while
        the budget (`room` free now) keeps `tenant`'s hint from taking its `need` new keys; how
        many went. Another tenant's key is taken only while the budget, not `tenant`'s share,
        is what limits the hint: room the share refuses would be lost to its holder for
        nothing."""
        gone = own = 0
        tenant_room = self.tenant_cap - self._per_tenant.get(tenant, 0)
        skipped: list[tuple[float, int, bytes]] = []
        while self._latest:
            free, share = room + gone, tenant_room + own
            if free >= need:
                break  # the budget no longer limits the hint
            neg, depth, key = self._latest[0]
            entry = self._until.get(key)
            if entry is None or entry[0] != -neg:
                heapq.heappop(self._latest)  # stale: released, expired or extended since
                continue
            if -neg <= until:
                break  # nothing left is due later than this hint
            heapq.heappop(self._latest)
            mine = entry[1] == tenant
            if key in keep or (not mine and free >= share):
                skipped.append((neg, depth, key))
                continue
            self._drop(key)
            self._displaced.append(key)
            gone += 1
            own += mine
        for entry in skipped:
            heapq.heappush(self._latest, entry)
        return gone

    def note(self, keys: Sequence[bytes], session: str, tenant: str = "") -> None:
        """Remember that conversation `session` of `tenant` owns `keys` (no retention)."""
        with self._lock:
            self._note(tenant, session, keys)

    def release(
        self, keys: Sequence[bytes], holder: tuple[str, str | None] | None = None
    ) -> list[bytes]:
        """Let `holder` ((tenant, session); session None: any of the tenant's; None: everyone)
        stop retaining `keys`; the keys nobody retains any more, which the ranks may release."""
        with self._lock:
            now = self._clock()
            gone = []
            for key in keys:
                held = self._holders.get(key)
                if held is None:
                    continue
                if holder is not None:
                    tenant, session = holder
                    for h in [h for h in held if h[0] == tenant and session in (None, h[1])]:
                        del held[h]
                    self._prune_holders(held, now)
                    if held:
                        self._rehold(key, held)
                        continue
                if self._drop(key):
                    gone.append(key)
            return gone

    def _rehold(self, key: bytes, held: dict[tuple[str, str], float]) -> None:
        """After a holder let go: the key is due when its last holder's hold ends and is
        charged to a tenant still holding it."""
        entry = self._until.get(key)
        if entry is None:
            return
        until = max(held.values())
        payer = self._payer(key, entry[1], held)
        if until < entry[0]:
            self._shortened[key] = until
            self._schedule(key, until, 0)
        else:
            until = entry[0]
        self._until[key] = (until, payer)

    def keys_of(self, session: str | None, tenant: str) -> list[bytes]:
        """The keys conversation `session` of `tenant` owns, or with `session` None every key
        of the tenant's conversations."""
        with self._lock:
            if session is not None:
                return list(self._sessions.get((tenant, session), {}))
            out: dict[bytes, None] = {}
            for (t, _), keys in self._sessions.items():
                if t == tenant:
                    out.update(keys)
            return list(out)

    def forget(self, session: str | None, tenant: str) -> None:
        """Drop the conversation (every one of the tenant's with `session` None): its chunks
        are deleted from the tiers, so nobody retains them any more."""
        with self._lock:
            for sk in [sk for sk in self._sessions if sk[0] == tenant]:
                if session is None or sk[1] == session:
                    for k in self._pop_session(sk):
                        self._drop(k)

    def known(self, session: str, tenant: str) -> bool:
        """Whether conversation `session` of `tenant` is remembered (one evicted or never
        seen is not: a forget or prefetch of it covers nothing, and says so)."""
        with self._lock:
            return (tenant, session) in self._sessions

    def reset(self) -> list[bytes]:
        """A new epoch (vLLM's reset_prefix_cache, new weights): every key retained so far is
        unreachable; drop them all, and the conversations; the keys, which the ranks release."""
        with self._lock:
            gone = list(self._until)
            self._until.clear()
            self._holders.clear()
            self._per_tenant.clear()
            self._deadlines.clear()
            self._latest.clear()
            self._shortened.clear()
            self._sessions.clear()
            self._tenant_sessions.clear()
            self._noted = 0
            return gone

    def stats(self) -> dict[str, object]:
        """Retained chunks now, the budget, per tenant, and conversations remembered."""
        with self._lock:
            self._expire(self._clock())
            return {
                "retained_chunks": len(self._until),
                "budget_chunks": self.budget,
                "tenant_cap_chunks": self.tenant_cap,
                "per_tenant": {t or "-": n for t, n in self._per_tenant.items() if n},
                "conversations": len(self._sessions),
            }

    def retained_chunks(self) -> int:
        """Chunks retained now (expired ones dropped)."""
        with self._lock:
            self._expire(self._clock())
            return len(self._until)

    def _note(self, tenant: str, session: str, keys: Sequence[bytes]) -> None:
        if not session:
            return
        sk = (tenant, session)
        owned = self._sessions.pop(sk, None) or {}
        before = len(owned)
        for k in keys:
            if len(owned) >= _KEYS_PER_SESSION:
                break
            owned[k] = None
        self._noted += len(owned) - before
        self._sessions[sk] = owned
        mine = self._tenant_sessions.setdefault(tenant, OrderedDict())
        mine.pop(session, None)
        mine[session] = None
        while len(mine) > _SESSIONS_PER_TENANT:
            self._pop_session((tenant, next(iter(mine))))
        # the one just noted is the most recent, and alone within the total (a session's cap)
        while len(self._sessions) > _SESSIONS or (
            self._noted > _KEYS_TOTAL and len(self._sessions) > 1
        ):
            self._pop_session(next(iter(self._sessions)))

    def _pop_session(self, sk: tuple[str, str]) -> dict[bytes, None]:
        """Stop remembering conversation `sk`; the keys it owned."""
        self._unname(sk)
        owned = self._sessions.pop(sk)
        self._noted -= len(owned)
        return owned

    def _unname(self, sk: tuple[str, str]) -> None:
        """Take conversation `sk` out of its tenant's list (`_pop_session` drops it from
        `_sessions`)."""
        mine = self._tenant_sessions.get(sk[0])
        if mine is not None:
            mine.pop(sk[1], None)
            if not mine:
                del self._tenant_sessions[sk[0]]

    def _drop(self, key: bytes) -> bool:
        self._holders.pop(key, None)
        self._shortened.pop(key, None)
        entry = self._until.pop(key, None)
        if entry is None:
            return False
        self._uncharge(entry[1])
        return True

    def _expire(self, now: float) -> None:
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            until, key = heapq.heappop(heap)
            entry = self._until.get(key)
            if entry is not None and entry[0] == until:
                self._drop(key)
        if len(heap) > 2 * len(self._until) + 1024:
            # released keys leave their deadlines behind: rebuild from the live entries
            self._deadlines = [(u, k) for k, (u, _) in self._until.items()]
            heapq.heapify(self._deadlines)
        if len(self._latest) > 2 * len(self._until) + 1024:
            # depths are not kept per key: a rebuilt heap orders equal deadlines by key
            self._latest = [(-u, 0, k) for k, (u, _) in self._until.items()]
            heapq.heapify(self._latest)
