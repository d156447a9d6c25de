"""The operations a rank has not reported yet, under the one lock the worker's threads share.

The forward's thread queues loads and saves, the lanes finish them and the report drains them:
each op is counted against its request until it reports (a request with none is idle, its
delayed blocks free), an unfinished load keeps its deadline, a running save can be cancelled,
and a load that succeeded here waits for the agreed terminal before its tokens are counted.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Generic, TypeVar

L = TypeVar("L")
S = TypeVar("S")


@dataclass
class RankOps(Generic[L, S]):
    """Per-request op counts, pending loads and running saves by op id, and the loads whose
    success waits for the quorum; `lock` guards them, `idle` is signalled as ops report."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    inflight: Counter[str] = field(default_factory=Counter)  # req id -> ops not yet reported
    pending: dict[str, L] = field(default_factory=dict)  # op id -> load not yet reported
    saving: dict[str, S] = field(default_factory=dict)  # op id -> save not yet reported
    # loads that succeeded here, awaiting the agreed terminal: op id -> (tokens, bytes, readmitted)
    uncounted: dict[str, tuple[int, int, bool]] = field(default_factory=dict)
    idle: threading.Condition = field(init=False)

    def __post_init__(self) -> None:
        self.idle = threading.Condition(self.lock)

    def reported(self, req_id: str) -> None:
        """One op of `req_id` reported (the caller holds `lock`)."""
        self.inflight[req_id] -= 1
        if not self.inflight[req_id]:
            del self.inflight[req_id]
        self.idle.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until no op is queued or running (deadline-bounded)."""
        deadline = time.monotonic() + timeout_s
        with self.idle:
            while any(self.inflight.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.idle.wait(left)
        return True
