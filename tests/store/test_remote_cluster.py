"""RemoteTier against a real Redis Cluster (3 masters + 3 replicas on loopback): chunks spread
over every shard, batches are one round trip, replicas serve reads when asked, a slot migration
costs nothing, a dead master sheds only its own shard until its replica takes over, and a record
over the server's size limit is refused at startup."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from kvtier.errors import StartupError
from kvtier.metrics import Metrics
from kvtier.store import record
from kvtier.store.breaker import ShardBreakers, State
from kvtier.store.remote import RemoteTier
from tests.record_key import codec_for_tests
from tests.redis_cluster import command_calls, flush, redis_cluster, reset_stats  # noqa: F401
from tests.redis_local import LocalCluster, loaded_timeouts, wait_for

from .conftest import FakeClock, key_of, payload_of

SIZE = 4096
N = 60

MakeTier = Callable[..., RemoteTier]


@pytest.fixture
def cluster(redis_cluster: LocalCluster) -> LocalCluster:  # noqa: F811
    """The module's cluster, emptied for this test."""
    flush(redis_cluster)
    return redis_cluster


@pytest.fixture
def make_tier(metrics: Metrics, namespace: bytes) -> Iterator[MakeTier]:
    made: list[RemoteTier] = []

    def make(url: str, **kwargs: object) -> RemoteTier:
        kwargs.setdefault("codec", codec_for_tests(namespace))
        kwargs = loaded_timeouts(kwargs)
        tier = RemoteTier(url, namespace, kwargs.pop("metrics", metrics), **kwargs)  # type: ignore[arg-type]
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


def _fill(tier: RemoteTier, n: int = N) -> list[bytes]:
    keys = [key_of(i) for i in range(n)]
    for i, key in enumerate(keys):
        assert tier.put(key, payload_of(i, SIZE))
    return keys


def test_chunks_spread_over_every_shard_and_a_lookup_is_one_batch(
    cluster: LocalCluster, make_tier: MakeTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier(cluster.url, payload_bytes=SIZE)
    keys = _fill(tier)
    masters = cluster.masters()
    assert len(masters) == 3
    # no hash tag pins a prefix on one shard: every master holds some of its chunks
    held = {m: cluster.node(m).client().dbsize() for m in masters}
    assert sum(held.values()) == N and all(n > 0 for n in held.values()), held
    assert {tier.shard_of(k) for k in keys} == set(masters)

    reset_stats(cluster)
    batches: list[int] = []
    real = tier._transport._presence.client.exec

    def counting(batch: object, *a: object, **kw: object) -> object:
        batches.append(len(batch.commands))  # type: ignore[attr-defined]
        return real(batch, *a, **kw)

    monkeypatch.setattr(tier._transport._presence.client, "exec", counting)
    assert tier.lookup_prefix([*keys, key_of(999)]) == N
    # one batch: each master answered for its own keys, nothing sent per key outside it
    assert batches == [N + 1]
    assert sum(command_calls(cluster, m, "exists") for m in masters) == N + 1
    assert all(command_calls(cluster, m, "exists") > 0 for m in masters)

    got = tier.get_many(keys[:10])
    assert [bytes(g) if g is not None else None for g in got] == [
        payload_of(i, SIZE) for i in range(10)
    ]
    dst = torch.zeros(SIZE, dtype=torch.uint8)
    assert tier.read_into(keys[7], dst)
    assert bytes(dst.numpy()) == payload_of(7, SIZE)
    assert not tier.read_into(key_of(999), dst)
    assert not tier.breaker.is_open


def test_reads_go_to_replicas_when_configured(
    cluster: LocalCluster, make_tier: MakeTier, metrics: Metrics
) -> None:
    writer = make_tier(cluster.url, payload_bytes=SIZE)
    keys = _fill(writer, 12)
    cluster.sync_replicas()
    reader = make_tier(cluster.url, payload_bytes=SIZE, read_from="replica", metrics=Metrics(0))
    dst = torch.zeros(SIZE, dtype=torch.uint8)
    reset_stats(cluster)
    for i, key in enumerate(keys):
        assert reader.read_into(key, dst)
        assert bytes(dst.numpy()) == payload_of(i, SIZE)
    replicas = [r for m in cluster.masters() for r in cluster.replicas_of(m)]
    assert sum(command_calls(cluster, r, "getrange") for r in replicas) == len(keys)
    assert sum(command_calls(cluster, m, "getrange") for m in cluster.masters()) == 0
    # writes still go to the masters
    assert reader.put(key_of(500), payload_of(500, SIZE))
    assert sum(command_calls(cluster, m, "set") for m in cluster.masters()) == 1


def test_slot_migration_mid_run_costs_no_hits(
    cluster: LocalCluster, make_tier: MakeTier, metrics: Metrics
) -> None:
    tier = make_tier(cluster.url, payload_bytes=SIZE)
    keys = _fill(tier)
    slot_of = {k: _slot(tier, k) for k in keys}
    key = keys[0]
    slot, source = slot_of[key], tier.shard_of(key)
    target = next(m for m in cluster.masters() if m != source)
    # halfway: the slot's keys are split between source and target (ASK redirects)
    moved = cluster.migrate_slot(slot, target, finish=False)
    dst = torch.zeros(SIZE, dtype=torch.uint8)
    for i, k in enumerate(keys):
        assert tier.read_into(k, dst), f"chunk {i} missed mid-migration"
        assert bytes(dst.numpy()) == payload_of(i, SIZE)
    assert tier.lookup_prefix(keys) == N
    cluster.finish_migration(slot, target)
    cluster.wait_healthy()
    # MOVED now: the client follows it and the tier's map learns the new owner
    assert tier.lookup_prefix(keys) == N
    for i, k in enumerate(keys):
        assert tier.read_into(k, dst) and bytes(dst.numpy()) == payload_of(i, SIZE)
    assert tier.put(key, payload_of(0, SIZE))

    def learned() -> bool:
        tier._transport.refresh()
        return tier.shard_of(key) == target

    wait_for(learned, 10.0, "the tier's slot map naming the new owner")
    assert len(moved) <= sum(1 for k in keys if slot_of[k] == slot)
    assert metrics.total("store_failures_total") == 0
    assert metrics.total("verify_failures_total") == 0
    assert not tier.breaker.is_open


def test_value_over_the_size_limit_is_refused_at_startup_and_never_trips_the_breaker(
    cluster: LocalCluster, make_tier: MakeTier, metrics: Metrics, namespace: bytes
) -> None:
    limit = 1 << 20  # the smallest proto-max-bulk-len a server accepts
    _set_limit(cluster, limit)
    try:
        with pytest.raises(StartupError) as info:
            RemoteTier(cluster.url, namespace, Metrics(0), payload_bytes=limit,
                       codec=codec_for_tests(namespace))  # fmt: skip
        msg = str(info.value)
        assert "proto-max-bulk-len=1048576" in msg
        assert f"{limit + record.HEADER_BYTES} bytes" in msg
        assert "lower chunk_size" in msg
        # a tier built for small chunks refuses a bigger record without sending it
        tier = make_tier(cluster.url, payload_bytes=SIZE, breakers=ShardBreakers(1, 5.0))
        assert tier.max_value_bytes == limit
        for i in range(3):
            assert not tier.put(key_of(i), payload_of(i, limit))
        assert metrics.value("dropped_writes_total", tier="remote", reason="too_large") == 3
        assert metrics.total("store_failures_total") == 0
        assert tier.breaker.state is State.CLOSED
        assert tier.put(key_of(9), payload_of(9, SIZE))
    finally:
        _set_limit(cluster, 512 << 20)


def test_dead_master_sheds_only_its_shard_and_hits_resume_after_promotion(
    cluster: LocalCluster, make_tier: MakeTier, metrics: Metrics, clock: FakeClock
) -> None:
    """Runs last: it leaves the module's cluster with a promoted replica."""
    tier = make_tier(
        cluster.url,
        payload_bytes=SIZE,
        breakers=ShardBreakers(2, 1.0, clock),
        clock=clock,
    )
    keys = _fill(tier)
    cluster.sync_replicas()
    victim = tier.shard_of(keys[0])
    on_victim = [k for k in keys if tier.shard_of(k) == victim]
    elsewhere = [k for k in keys if tier.shard_of(k) != victim]
    cluster.node(victim).kill()

    dst = torch.zeros(SIZE, dtype=torch.uint8)
    # the dead shard's calls fail (counted) until its breaker opens ...
    for k in on_victim[:2]:
        assert not tier.read_into(k, dst)
    assert tier.breaker.open_shards() == [victim]
    assert metrics.value("breaker_open", tier="remote") == 1
    # ... then are shed without touching the network, while the other shards serve
    assert tier.contains_many(on_victim) == [False] * len(on_victim)
    assert all(tier.contains_many(elsewhere))
    i = keys.index(elsewhere[0])
    assert tier.read_into(elsewhere[0], dst) and bytes(dst.numpy()) == payload_of(i, SIZE)

    promoted = cluster.fail_master(victim)
    assert promoted != victim
    # the next probe finds the promoted replica: hits resume, and nothing was lost
    clock.advance(1.0)
    for k in on_victim:
        assert tier.read_into(k, dst), "a chunk of the failed-over shard was lost"
        assert bytes(dst.numpy()) == payload_of(keys.index(k), SIZE)
    assert tier.lookup_prefix(keys) == N
    assert not tier.breaker.is_open
    assert metrics.value("breaker_open", tier="remote") == 0
    assert tier.shard_of(on_victim[0]) == promoted


def _slot(tier: RemoteTier, key: bytes) -> int:
    from redis.crc import key_slot

    return key_slot(tier.redis_key(key))


def _set_limit(cluster: LocalCluster, limit: int) -> None:
    for node in cluster.live():
        admin = node.client()
        try:
            admin.config_set("proto-max-bulk-len", limit)
        finally:
            admin.close()
