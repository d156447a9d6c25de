"""Clients' retention hints in their own dialects, read from a request body.

* OpenAI: `prompt_cache_key` names the conversation (kvtier remembers which chunks it owns, to
  prefetch or forget them by that key); `prompt_cache_retention` asks to keep the prompt:
  `"in_memory"` for `retention_ttl_s` (default 300 s), `"24h"` for a day.
* Anthropic: `cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}` on a message or on one
  of its content parts keeps the prompt up to the end of that message (the last one marked)
  for its TTL (5 minutes when it names none).

The budget decides what is granted (`offload/retention.py`); the response says what was.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvtier.native.protocol import APIError
from kvtier.offload.retention import MAX_SESSION_CHARS, OPENAI_RETENTION, RetentionHint

ANTHROPIC_TTL: dict[str, float] = {"5m": 300.0, "1h": 3600.0}
MAX_KEY_CHARS = MAX_SESSION_CHARS


def cache_mark(messages: Sequence[Mapping[str, Any]]) -> tuple[int, float] | None:
    """(index, TTL seconds) of the last message marked with Anthropic's `cache_control`, on
    the message or on a content part; None when none is. Raises APIError for a bad mark."""
    mark = None
    for i, msg in enumerate(messages):
        controls = [msg.get("cache_control")]
        content = msg.get("content")
        if isinstance(content, list):
            controls += [p.get("cache_control") for p in content if isinstance(p, Mapping)]
        for cc in controls:
            if cc is None:
                continue
            ttl = _anthropic_ttl(cc, i)
            if mark is None or i >= mark[0]:
                mark = (i, max(ttl, mark[1]) if mark is not None and mark[0] == i else ttl)
    return mark


def _anthropic_ttl(cc: object, i: int) -> float:
    where = f"messages[{i}].cache_control"
    if not isinstance(cc, Mapping) or cc.get("type") != "ephemeral":
        raise APIError(
            400, f"{where} is {cc!r}; use {{\"type\": \"ephemeral\"}} with an optional "
            "\"ttl\" of \"5m\" or \"1h\"", "messages",
        )  # fmt: skip
    ttl = cc.get("ttl", "5m")
    if ttl not in ANTHROPIC_TTL:
        raise APIError(400, f'{where}.ttl is {ttl!r}; use "5m" or "1h"', "messages")
    return ANTHROPIC_TTL[ttl]


def hint_of(
    req: Any, upto: Callable[[int], int] | None = None, mark: tuple[int, float] | None = None
) -> RetentionHint | None:
    """The request's hint (None without one). `mark` is the chat's cache_control mark and
    `upto(i)` the prompt tokens through message i."""
    key = getattr(req, "prompt_cache_key", None)
    retention = getattr(req, "prompt_cache_retention", None)
    if key is not None and (not isinstance(key, str) or len(key) > MAX_KEY_CHARS):
        raise APIError(
            400, f"prompt_cache_key must be a string of at most {MAX_KEY_CHARS} characters",
            "prompt_cache_key",
        )  # fmt: skip
    if retention is not None and (not isinstance(retention, str) or retention not in
                                  OPENAI_RETENTION):  # fmt: skip
        raise APIError(
            400, f"prompt_cache_retention is {retention!r}; use \"in_memory\" or \"24h\"",
            "prompt_cache_retention",
        )  # fmt: skip
    if key is None and retention is None and mark is None:
        return None
    tenant = getattr(req, "user", None) or ""
    if len(tenant) > MAX_KEY_CHARS:
        # it names the conversation in the ledger, kept for as long as the conversation is
        raise APIError(
            400, f"user must be at most {MAX_KEY_CHARS} characters with a retention hint", "user"
        )
    if retention is None and mark is None:
        return RetentionHint(session=key or "", tenant=tenant, retain=False)
    ttl: float | None = None if retention is None else OPENAI_RETENTION[retention]
    upto_tokens = None
    if mark is not None:
        ttl = mark[1] if ttl is None else max(ttl, mark[1])
        if upto is not None:
            upto_tokens = upto(mark[0])
    return RetentionHint(ttl_s=ttl, upto_tokens=upto_tokens, session=key or "", tenant=tenant)
