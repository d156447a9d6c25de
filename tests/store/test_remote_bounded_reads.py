"""The remote tier's `get` and `get_many` read at most one byte past the largest record.

Another process with write access to the store is not trusted: a value of tens of MiB left
under a chunk's key must not cross the wire (or land in memory, times the batch size) before
verification turns it away. With `payload_bytes` known every read is GETRANGE 0..HEADER+payload,
so a longer value fills the read and fails verification by length. Measured on the server
(INFO stats `total_net_output_bytes`), over both transports (glide over TCP, redis-py over a
unix socket)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import redis

from kvtier.metrics import Metrics
from kvtier.store.breaker import ShardBreakers, State
from kvtier.store.record import HEADER_BYTES
from kvtier.store.remote import RemoteTier
from tests.record_key import codec_for_tests
from tests.redis_local import RedisServer

from .conftest import key_of, payload_of

SIZE = 4096
NS = bytes(range(16))
HUGE = 64 << 20
# what a bounded read may cost on the wire: a few records, replies and the INFO asking
BOUND = 1 << 20


@pytest.fixture(params=[False, True], ids=["tcp", "unix"])
def server(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    with RedisServer(unix=request.param) as s:
        yield s


@pytest.fixture
def admin(server: RedisServer) -> Iterator[redis.Redis]:
    client = server.client(timeout_s=30.0)
    yield client
    client.close()


@pytest.fixture
def tiers() -> Iterator[Callable[..., RemoteTier]]:
    made: list[RemoteTier] = []

    def make(url: str, m: Metrics, payload_bytes: int | None = SIZE) -> RemoteTier:
        tier = RemoteTier(url, NS, m, codec=codec_for_tests(NS), payload_bytes=payload_bytes,
                          timeout_ms=5000, breakers=ShardBreakers(100, 0.2))  # fmt: skip
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


def _sent(admin: redis.Redis) -> int:
    return int(admin.info("stats")["total_net_output_bytes"])


def _record(tier: RemoteTier, admin: redis.Redis, i: int) -> bytes:
    assert tier.put(key_of(i), payload_of(i, SIZE))
    raw = admin.get(tier.redis_key(key_of(i)))
    assert raw is not None and len(raw) == HEADER_BYTES + SIZE
    return raw


def _missed_within_the_bound(
    tier: RemoteTier, admin: redis.Redis, rkey: bytes, value: bytes
) -> None:
    """`value` planted under chunk 0's key reads as a miss that cost the wire under BOUND."""
    admin.set(rkey, value)
    before = _sent(admin)
    assert tier.get(key_of(0)) is None
    sent = _sent(admin) - before
    assert sent < BOUND, f"get of one {SIZE}-byte record sent {sent} bytes"


def _length_failures(m: Metrics) -> float:
    return m.value("verify_failures_total", tier="remote", reason="length_mismatch")


def test_get_of_a_huge_junk_value_is_a_miss_that_never_crosses_the_wire(
    server: RedisServer, admin: redis.Redis, tiers: Callable[..., RemoteTier]
) -> None:
    m = Metrics(rank=0)
    tier = tiers(server.url, m)
    rkey = tier.redis_key(key_of(0))
    _missed_within_the_bound(tier, admin, rkey, bytes(HUGE))
    assert m.total("verify_failures_total") == 1 and m.total("store_failures_total") == 0
    assert tier.breaker.state is State.CLOSED
    # longer than any record of the namespace: provably bad, so deleted unread
    assert admin.exists(rkey) == 0


def test_get_of_a_record_with_a_huge_tail_fails_by_length_within_the_bound(
    server: RedisServer, admin: redis.Redis, tiers: Callable[..., RemoteTier]
) -> None:
    m = Metrics(rank=0)
    tier = tiers(server.url, m)
    rkey = tier.redis_key(key_of(0))
    _missed_within_the_bound(tier, admin, rkey, _record(tier, admin, 0) + bytes(HUGE))
    assert _length_failures(m) == 1
    assert admin.exists(rkey) == 0


def test_one_byte_past_a_record_is_a_miss_and_a_whole_record_a_hit(
    server: RedisServer, admin: redis.Redis, tiers: Callable[..., RemoteTier]
) -> None:
    m = Metrics(rank=0)
    tier = tiers(server.url, m)
    _record(tier, admin, 1)
    got = tier.get(key_of(1))
    assert got is not None and bytes(got) == payload_of(1, SIZE)
    rkey = tier.redis_key(key_of(0))
    admin.set(rkey, _record(tier, admin, 0) + b"x")
    assert tier.get(key_of(0)) is None and tier.get_many([key_of(0)]) == [None]
    assert _length_failures(m) == 1 and admin.exists(rkey) == 0


def test_get_many_with_huge_values_reads_a_record_bound_per_key(
    server: RedisServer, admin: redis.Redis, tiers: Callable[..., RemoteTier]
) -> None:
    """Hits, misses and two oversized values in one batch: the hits read whole, the rest miss,
    and the batch costs a few records on the wire, not 2 x 64 MiB."""
    m = Metrics(rank=0)
    tier = tiers(server.url, m)
    for i in (0, 2, 5):
        _record(tier, admin, i)
    junk = tier.redis_key(key_of(1))
    tail = tier.redis_key(key_of(4))
    admin.set(junk, bytes(HUGE))
    admin.set(tail, _record(tier, admin, 4) + bytes(HUGE))
    before = _sent(admin)
    got = tier.get_many([key_of(i) for i in range(6)])
    sent = _sent(admin) - before
    assert [None if g is None else bytes(g) for g in got] == [
        payload_of(0, SIZE), None, payload_of(2, SIZE), None, None, payload_of(5, SIZE)
    ]  # fmt: skip
    assert sent < BOUND, f"a batch of 6 {SIZE}-byte records sent {sent} bytes"
    assert m.total("verify_failures_total") == 2 and _length_failures(m) == 1
    assert m.total("store_failures_total") == 0 and tier.breaker.state is State.CLOSED
    assert admin.exists(junk, tail) == 0
    assert admin.exists(*(tier.redis_key(key_of(i)) for i in (0, 2, 5))) == 3


def test_a_bad_record_of_a_valid_length_is_still_compared_before_its_delete(
    server: RedisServer, admin: redis.Redis, tiers: Callable[..., RemoteTier]
) -> None:
    """A read bounded to a record's length reads a record-sized value whole: the delete is
    still the compare-and-delete of the bytes found bad."""
    m = Metrics(rank=0)
    tier = tiers(server.url, m)
    rkey = tier.redis_key(key_of(0))
    raw = bytearray(_record(tier, admin, 0))
    raw[-1] ^= 0xFF
    admin.set(rkey, bytes(raw))
    assert tier.get_many([key_of(0)]) == [None]
    assert m.value("verify_failures_total", tier="remote", reason="tag_mismatch") == 1
    assert admin.exists(rkey) == 0


def test_without_a_payload_size_reads_stay_whole(
    server: RedisServer, admin: redis.Redis, tiers: Callable[..., RemoteTier]
) -> None:
    """No `payload_bytes`, no bound to read to: get and get_many read whole records as before."""
    m = Metrics(rank=0)
    tier = tiers(server.url, m, payload_bytes=None)
    big = 3 * SIZE
    assert tier.put(key_of(0), payload_of(0, big))
    got = tier.get(key_of(0))
    assert got is not None and bytes(got) == payload_of(0, big)
    many = tier.get_many([key_of(0), key_of(1)])
    assert many[1] is None and bytes(many[0] or b"") == payload_of(0, big)
    assert m.total("verify_failures_total") == 0


def test_a_record_over_the_tiers_payload_size_is_never_written(
    server: RedisServer, admin: redis.Redis, tiers: Callable[..., RemoteTier]
) -> None:
    """Reads stop one byte past the longest record and delete a longer value, so writing one
    would only feed every reader a miss: refused and counted as too_large instead."""
    m = Metrics(rank=0)
    tier = tiers(server.url, m)
    key = key_of(7)
    assert tier.put(key, bytes(SIZE + 1)) is False
    assert admin.exists(tier.redis_key(key)) == 0
    assert m.value("dropped_writes_total", tier="remote", reason="too_large") == 1
    assert tier.put(key, payload_of(7, SIZE)) and tier.get(key) == payload_of(7, SIZE)
