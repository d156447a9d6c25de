"""The retention admin calls any host can expose: retain, release, prefetch or forget a prompt,
a conversation (its prompt_cache_key) or every conversation of a tenant, and the ledger's stats.

Each call answers a JSON-able dict naming what it did: how many chunk keys it covered and each
rank's count (keys retained, released, brought into memory, or deleted from some tier), with
the ranks that did not answer listed apart, so a partial result never looks like a whole one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from kvtier.offload.retention import REJECTED, RetentionDecision, RetentionHint, RetentionLedger

OPS = ("retain", "release", "prefetch", "forget", "stats")


class RetentionCore(Protocol):
    """What the calls need of a scheduler (`OffloadScheduler.planner` has it)."""

    retention: RetentionLedger

    def keys_for(
        self, prompt: Sequence[int] | None = None, session: str | None = None, tenant: str = ""
    ) -> list[bytes]: ...

    def retain(self, prompt: Sequence[int], hint: RetentionHint) -> RetentionDecision: ...

    def retain_keys(self, keys: Sequence[bytes], hint: RetentionHint) -> RetentionDecision: ...

    def admin(
        self, op: str, keys: Sequence[bytes], holder: tuple[str, str | None] | None = None
    ) -> dict[int, Any]: ...


def run_admin(
    core: RetentionCore,
    op: str,
    *,
    prompt: Sequence[int] | None = None,
    session: str | None = None,
    tenant: str = "",
    ttl_s: float | None = None,
    whole_tenant: bool = False,
) -> dict[str, Any]:
    """Carry out `op` on one target: `prompt` (token ids), `session`, or with `whole_tenant`
    every conversation of `tenant`. Raises ValueError naming a bad target."""
    if op not in OPS:
        raise ValueError(f"retention op {op!r} is not one of {', '.join(OPS)}")
    if op == "stats":
        return {"op": op, **core.retention.stats()}
    given = sum((prompt is not None, session is not None, whole_tenant))
    if given != 1:
        raise ValueError(
            "name exactly one target: a prompt (text, messages or token ids), a "
            "prompt_cache_key, or all of a user's conversations"
        )
    if whole_tenant and op == "retain":
        raise ValueError("retain needs a prompt or a prompt_cache_key, not a whole user")
    keys = core.keys_for(prompt, None if whole_tenant else session, tenant)
    out: dict[str, Any] = {"op": op, "keys": len(keys)}
    if session is not None and not core.retention.known(session, tenant):
        # never seen, or evicted from the ledger's memory: nothing done must not look done
        out["error"] = (
            f"conversation {session!r} of user {tenant!r} is not known (never seen, or no "
            "longer remembered): name its prompt instead"
        )
        if op == "retain":
            # a grant of no keys would read "retained" (and the ledger would start an empty
            # conversation under a name the caller made up)
            out["retention"] = RetentionDecision(REJECTED, 0, 0.0, "unknown").as_dict()
            return out
    if op == "retain":
        hint = RetentionHint(ttl_s=ttl_s, session=session or "", tenant=tenant)
        decision = core.retain_keys(keys, hint)
        out["retention"] = decision.as_dict()
        return out
    if not keys:
        out["ranks"] = {}
        return out
    # a release by conversation or tenant lets go of what no other conversation retains
    holder = None if prompt is not None else (tenant, None if whole_tenant else session)
    answers = core.admin(op, keys, holder) if op == "release" else core.admin(op, keys)
    out["ranks"] = {str(r): a.count for r, a in answers.items()}
    missing = {str(r): a.error or "no answer" for r, a in answers.items() if a.count is None}
    errors = {str(r): a.error for r, a in answers.items() if a.error and a.count is not None}
    if missing:
        out["unanswered"] = missing
    if errors:
        out["errors"] = errors
    if op == "forget" and prompt is None and not missing:
        # only once every rank deleted: a rank that did not answer may still hold the chunks,
        # and the caller's retry by the same prompt_cache_key must still find them
        core.retention.forget(None if whole_tenant else session, tenant)
    return out
