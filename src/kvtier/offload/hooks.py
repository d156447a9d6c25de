"""A failure inside a kvtier hook costs one request, never the engine (invariant 18).

Hosts call kvtier from their scheduler loop and their forward: an exception escaping a hook
ends vLLM's EngineCore or the native engine loop for every user. `HookGuard` turns one into a
counted, logged event (`kvtier_hook_errors_total{hook}`) and the caller's safe answer for that
request: no external hit, a load that fails so the host recomputes, a save not made. Request
ids are client text: `shown_id` escapes and bounds them for log lines.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import TypeVar

from kvtier.metrics import Metrics

log = logging.getLogger("kvtier")

T = TypeVar("T")

# the load and save failure reason of ops a failed hook cost (kvtier_load_failures_total)
HOOK_ERROR = "hook_error"

_SHOWN_ID_CHARS = 80
# a defect that repeats every step (or a client that triggers one at will) must not flood the
# log: one line per hook per interval, the rest counted in the next line and the counter
_LOG_EVERY_S = 1.0


def shown_id(req_id: object) -> str:
    """A host request id as a log line may carry it: escaped (no newline or control character
    reaches the log) and cut to a bounded length that says how much was left out."""
    text = repr(str(req_id))[1:-1]
    if len(text) <= _SHOWN_ID_CHARS:
        return text
    return f"{text[:_SHOWN_ID_CHARS]}...(+{len(text) - _SHOWN_ID_CHARS} chars)"


class HookGuard:
    """Runs hook bodies so an exception becomes a counter, one log line and a fallback."""

    def __init__(
        self, metrics: Metrics, tag: str = "kvtier", clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.metrics = metrics
        self.tag = tag
        self.clock = clock
        self._traced: set[str] = set()  # hooks whose first failure was logged with its trace
        self._logged_at: dict[str, float] = {}
        self._unlogged: Counter[str] = Counter()

    def run(
        self,
        hook: str,
        req_id: str | None,
        body: Callable[[], T],
        fallback: Callable[[], T],
    ) -> T:
        """`body()`; if it raises an Exception, `fallback()` after counting and logging it (a
        fallback that raises too is a defect of kvtier's own and propagates)."""
        try:
            return body()
        except Exception as exc:  # noqa: BLE001 - the request loses the tier, the engine lives
            self.failed(hook, req_id, exc)
        return fallback()

    def failed(self, hook: str, req_id: str | None, exc: BaseException) -> None:
        """Count and log one hook failure (its traceback once per hook, so a repeating defect
        is diagnosable without flooding the log)."""
        self.metrics.hook_error(hook).inc()
        now = self.clock()
        last = self._logged_at.get(hook)
        if last is not None and now - last < _LOG_EVERY_S:
            self._unlogged[hook] += 1
            return
        self._logged_at[hook] = now
        more = self._unlogged.pop(hook, 0)
        who = f" for request {shown_id(req_id)}" if req_id is not None else ""
        first = hook not in self._traced
        self._traced.add(hook)
        log.error(
            "%s: hook %s failed%s (%s: %s); %s%s",
            self.tag,
            hook,
            who,
            type(exc).__name__,
            shown_id(exc),
            "the request goes on without the tier" if req_id is not None else "see the counter",
            f" ({more} more failures of this hook since its last line)" if more else "",
            exc_info=exc if first else None,
        )
