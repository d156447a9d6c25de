"""A test-only planted cost (tests/bench/test_tier_cost_verdict.py): every server process
started with this directory on PYTHONPATH makes each rank's save hook sleep for
PLANTED_COST_SHARE (a fraction, e.g. 0.1) of the time since the previous step's hook, so
kvtier costs that share of every step. Nothing in kvtier reads the variable."""

from __future__ import annotations

import os
import time

_SHARE = float(os.environ.get("PLANTED_COST_SHARE", "0"))

if _SHARE > 0:
    from kvtier.offload import worker as _worker
    from kvtier.offload.steps import SAVE

    _real = _worker.OffloadWorker.wait_for_save
    _last: list[float] = []

    def _wait_for_save(self: _worker.OffloadWorker, meta: object) -> None:
        now = time.perf_counter()
        if _last:
            # inside the save hook's clock, as kvtier's own work on the step would be
            with self.clock.time(SAVE):
                time.sleep(_SHARE * (now - _last[0]) / (1 - _SHARE))
        _last[:] = [time.perf_counter()]
        _real(self, meta)  # type: ignore[arg-type]

    _worker.OffloadWorker.wait_for_save = _wait_for_save  # type: ignore[method-assign]
