"""Log lines for events an outsider can repeat at will (frames refused, records failing
verification): a flood of them may not fill the log. The first line of each kind at once,
then at most one per interval, saying how many were left out between."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

# an outsider's flood: one line per kind per minute, the counter carries the rate
EVERY_S = 60.0


class ThrottledLog:
    """WARNING lines keyed by kind: the first at once, then at most one per `every_s` of
    `clock` per kind, the next line counting those left out. Thread-safe."""

    def __init__(
        self,
        log: logging.Logger,
        every_s: float = EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = log
        self._every = every_s
        self._clock = clock
        self._lock = threading.Lock()
        self._next: dict[str, float] = {}
        self._quiet: dict[str, int] = {}

    def warning(self, kind: str, msg: str, *args: object) -> None:
        """Log `msg % args` (or count it for the next line of `kind`)."""
        now = self._clock()
        with self._lock:
            if now < self._next.get(kind, float("-inf")):
                self._quiet[kind] = self._quiet.get(kind, 0) + 1
                return
            self._next[kind] = now + self._every
            quiet = self._quiet.pop(kind, 0)
        more = f" ({quiet} more since the last line)" if quiet else ""
        self._log.warning(msg + "%s", *args, more)
