"""A second process holding a DiskTier, for tests/store/test_disk_lock.py.

Run as `python -m tests.store.disk_holder DISK_DIR NAMESPACE_HEX CONFLICT`. It opens the tier
and prints `ready <pid> <directory>` (or `refused <message>` on a StartupError and exits 3),
then answers each stdin line `put <key hex>` / `get <key hex>` with `ok` or `no` (a get is `ok`
only when the bytes read back are the ones `payload_of(key)` wrote), until stdin closes.
"""

from __future__ import annotations

import os
import sys

from kvtier.errors import StartupError
from kvtier.metrics import Metrics
from kvtier.store.disk import DiskTier

TIER_BYTES = 1 << 20


def payload_of(key: bytes) -> bytes:
    """The bytes every process of these tests stores under `key`."""
    return key * 64


def main(argv: list[str]) -> int:
    """Hold the tier until stdin closes; see the module docstring for the protocol."""
    disk_dir, ns_hex, conflict = argv
    # the default is left implicit so this helper runs against a DiskTier without the keyword
    kwargs = {} if conflict == "refuse" else {"conflict": conflict}
    try:
        tier = DiskTier(disk_dir, TIER_BYTES, bytes.fromhex(ns_hex), Metrics(rank=0), **kwargs)
    except StartupError as e:
        print("refused", " ".join(str(e).split()), flush=True)
        return 3
    print("ready", os.getpid(), tier.directory, flush=True)
    for line in sys.stdin:
        cmd, key_hex = line.split()
        key = bytes.fromhex(key_hex)
        if cmd == "put":
            ok = tier.put(key, payload_of(key))
        elif cmd == "get":
            got = tier.get(key)
            ok = got is not None and bytes(got) == payload_of(key)
        else:
            raise ValueError(f"unknown command {cmd!r}; use put or get")
        print("ok" if ok else "no", flush=True)
    tier.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
