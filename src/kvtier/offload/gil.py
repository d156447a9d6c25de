"""The GIL switch interval of a process kvtier runs in.

kvtier's lookup server and copy lanes are threads inside the host's processes. CPython hands the
GIL to a waiting thread only when its holder blocks or after the switch interval (5 ms by
default), so a lookup answered in microseconds can wait milliseconds behind a host thread that
runs Python between kernels, longer than the scheduler's `lookup_wait_ms`. A shorter interval
bounds that wait; it costs nothing while no thread waits.
"""

from __future__ import annotations

import logging
import sys

from kvtier.config import KVTierConfig

log = logging.getLogger("kvtier")


def apply_switch_interval(config: KVTierConfig, who: str) -> float | None:
    """Lower the process's switch interval to `config.gil_switch_ms` (never raise it; 0 leaves
    it); returns the previous interval in seconds when it changed, else None."""
    want = config.gil_switch_ms / 1000.0
    before = sys.getswitchinterval()
    if want <= 0 or want >= before:
        return None
    sys.setswitchinterval(want)
    log.info(
        "kvtier: %s: GIL switch interval %.2f -> %.2f ms (gil_switch_ms), so lookups and copies "
        "get the GIL within that of asking",
        who,
        before * 1000.0,
        sys.getswitchinterval() * 1000.0,
    )
    return before
