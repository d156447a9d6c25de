"""Admin requests on the lookup channel: retain, release, prefetch and forget reach every rank's
real TierStack and come back with per-rank counts; a rank that cannot take them says so."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from kvtier.lookup import (
    PROTOCOL_VERSION,
    AdminReply,
    AdminRequest,
    Codec,
    LookupClient,
    LookupServer,
    endpoint_for,
    make_run_dir,
)
from kvtier.metrics import Metrics
from kvtier.store.memory import MemoryTier
from kvtier.store.registry import order
from kvtier.store.stack import TierStack
from tests.lookup_helpers import FakeBackend, make_keys

SIZE = 256

TIER_ORDER = order()  # the registry's tier names, accelerator outwards


@pytest.fixture
def run_dir() -> Iterator[Path]:
    d = make_run_dir(prefix="kvtier-admin-test-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _stack(rank: int) -> TierStack:
    m = Metrics(rank)
    memory = MemoryTier(SIZE, 8 * SIZE, bytes(16), m, pin_memory=False)
    return TierStack(memory, [], m, retention_limit=4)


def test_admin_ops_reach_every_ranks_tiers_with_counts(run_dir: Path) -> None:
    keys = make_keys(3)
    stacks = {r: _stack(r) for r in range(2)}
    for k in keys:
        assert all(s.put(k, k * (SIZE // 16)) for s in stacks.values())
    eps = {r: endpoint_for(r, run_dir=run_dir) for r in stacks}
    servers = [LookupServer(r, s, eps[r], Metrics(r)).start() for r, s in stacks.items()]
    c = LookupClient(
        eps, Metrics(0), chunk_size=16, world=2, timeout_ms=2000, tier_order=TIER_ORDER
    )
    try:
        c.wait_ready(10.0)
        got = c.admin("retain", keys, 4e9)
        assert {r: a.count for r, a in got.items()} == {0: 3, 1: 3}
        assert all(s.retention.holds(keys[0]) for s in stacks.values())
        assert {r: a.count for r, a in c.admin("release", keys[:1]).items()} == {0: 1, 1: 1}
        assert {r: a.count for r, a in c.admin("forget", keys).items()} == {0: 3, 1: 3}
        assert all(s.lookup(keys) == 0 for s in stacks.values())
        with pytest.raises(ValueError, match="admin op 'drop'"):
            c.admin("drop", keys)
    finally:
        c.close()
        for s in servers:
            s.close()
        for st in stacks.values():
            st.close()


def test_a_backend_without_admin_answers_with_an_error_not_a_timeout(run_dir: Path) -> None:
    keys = make_keys(2)
    ep = endpoint_for(0, run_dir=run_dir)
    server = LookupServer(0, FakeBackend(0, keys), ep, Metrics(0)).start()
    c = LookupClient(
        {0: ep}, Metrics(0), chunk_size=16, world=1, timeout_ms=2000, tier_order=TIER_ORDER
    )
    try:
        c.wait_ready(10.0)
        answer = c.admin("forget", keys)[0]
        assert answer.count is None or answer.count == 0
        assert "takes no admin requests" in (answer.error or "")
    finally:
        c.close()
        server.close()


def test_admin_messages_round_trip_and_an_unknown_op_is_a_schema_error() -> None:
    codec = Codec()
    req = AdminRequest(PROTOCOL_VERSION, 5, "prefetch", make_keys(2), 12.5)
    rep = AdminReply(PROTOCOL_VERSION, 5, 1, 2, None)
    assert codec.decode(codec.encode(req)) == req
    assert codec.decode(codec.encode(rep)) == rep
    bad = msgspec.msgpack.encode(["admin", PROTOCOL_VERSION, 6, "drop_all", [], 0.0])
    with pytest.raises(ValueError, match="schema"):
        codec.decode(bad)
