"""`kvtier bench tier` row for the lookup transports: one rank answering over ipc and over TCP
(CURVE-encrypted and authenticated, `lookup/curve.py`), lookup by lookup interleaved, so the
price of `lookup_transport: tcp` is a ratio measured side by side."""

from __future__ import annotations

import itertools
import shutil
import time
from collections.abc import Callable

import numpy as np

from kvtier.bench.ports import free_port
from kvtier.bench.table import Report, Row
from kvtier.bench.tier_common import Plan, Progress, interleave
from kvtier.keys import digest16
from kvtier.lookup import LookupClient, LookupServer, endpoint_for, make_run_dir
from kvtier.metrics import Metrics
from kvtier.store.memory import MemoryTier
from kvtier.store.registry import order
from kvtier.store.stack import TierStack

_SLOT = 64
_NS = digest16("kvtier.bench.tier.transport", ("ns",))


def bench_transports(
    report: Report, plan: Plan, keys: list[bytes], chunk_tokens: int, say: Progress
) -> None:
    """Add `lookup.tcp_over_ipc`: the p50 of a leased lookup of `keys` over TCP over its p50
    over ipc, one rank served on a thread of this process for each."""
    metrics = Metrics(0)
    memory = MemoryTier(_SLOT, (len(keys) + 16) * _SLOT, _NS, metrics)
    stack = TierStack(memory, (), metrics)
    run_dir = make_run_dir(prefix="kvtier-bench-")
    servers: list[LookupServer] = []
    clients: dict[str, LookupClient] = {}
    try:
        for key in keys:
            if not stack.put(key, bytes(_SLOT)):
                raise RuntimeError("the transport bench's memory tier refused a lookup key")
        for transport in ("ipc", "tcp"):
            ep = endpoint_for(0, transport=transport, run_dir=run_dir, base_port=free_port())
            servers.append(LookupServer(0, stack, ep, metrics).start())
            clients[transport] = LookupClient(
                {0: ep}, Metrics("scheduler"), chunk_size=chunk_tokens, world=1,
                tier_order=order(),
            )  # fmt: skip
            clients[transport].wait_ready(timeout_s=30.0)
        say(f"lookup transports: {plan.lookup_reps} leased lookups each over ipc and tcp")
        ids = itertools.count()
        times = interleave(
            {t: _timed_lookup(c, keys, ids) for t, c in clients.items()},
            plan.lookup_warmup,
            plan.lookup_warmup + plan.lookup_reps,
        )
    finally:
        for c in clients.values():
            c.close()
        for s in servers:
            s.close()
        stack.close()
        shutil.rmtree(run_dir)
    p50 = {t: float(np.percentile(np.asarray(v) * 1e3, 50)) for t, v in times.items()}
    n = report.note(
        f"one rank, {len(keys)} keys, leased then released; served on a thread of the bench "
        "process over ipc and over loopback TCP (CURVE: encrypted, both ends proving the "
        "engine key), lookup by lookup interleaved; info, no target"
    )
    report.add(
        Row(
            "lookup.tcp_over_ipc",
            f"lookup over tcp (CURVE) / over ipc: p50 {n}",
            p50["tcp"],
            "ms",
            raw=p50["ipc"],
            detail={"p50_ms": p50, "samples": len(times["tcp"])},
        )
    )


def _timed_lookup(
    client: LookupClient, keys: list[bytes], ids: itertools.count[int]
) -> Callable[[], float]:
    """One leased lookup of every key and its release; seconds the lookup took."""

    def run() -> float:
        lookup_id = f"bench-{next(ids)}"
        t = time.perf_counter()
        res = client.lookup(keys, lookup_id, lease=True)
        dt = time.perf_counter() - t
        client.release([lookup_id])
        if res.hit_chunks != len(keys):
            raise RuntimeError(
                f"lookup found {res.hit_chunks} of {len(keys)} keys (timed out on "
                f"{res.timed_out}); the rank holds every key"
            )
        return dt

    return run
