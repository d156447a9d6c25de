"""RemoteTier against a real redis-server: verified records, batching, TTL, AUTH, and degrading
(never breaking) when the server is slow, dead or comes back."""

from __future__ import annotations

import logging
import re
import socket
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from kvtier.bench.throttle import ThrottledProxy
from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError, StartupError
from kvtier.metrics import Metrics
from kvtier.store import record
from kvtier.store.breaker import ShardBreakers, State
from kvtier.store.factory import build_stack
from kvtier.store.remote import STARTUP_PATIENCE_S, RemoteTier, mask_url
from kvtier.store.remote_transport import Timeouts
from tests import redis_local
from tests.record_key import RECORD_KEY, codec_for_tests
from tests.redis_local import RedisServer, RedisServerError, loaded_timeouts

from .conftest import FakeClock, key_of, payload_of

CODEC = codec_for_tests(bytes(16))

PASSWORD = "hunter2-Zq9"
ACL_USER = "kvuser"
ACL_PASSWORD = "acl-pw-Xy7"
LOGGER = "kvtier.store.remote"

MakeTier = Callable[..., RemoteTier]


# ---- fixtures ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def shared_server() -> Iterator[RedisServer]:
    """One server for the tests that neither kill it nor need AUTH."""
    with RedisServer() as srv:
        yield srv


@pytest.fixture
def server(shared_server: RedisServer) -> RedisServer:
    """The shared server, emptied for this test."""
    admin = shared_server.client()
    admin.flushall()
    admin.close()
    return shared_server


@pytest.fixture(scope="module")
def auth_server() -> Iterator[RedisServer]:
    """A server with `requirepass` and an ACL user."""
    with RedisServer(password=PASSWORD, acl_user=ACL_USER, acl_password=ACL_PASSWORD) as srv:
        yield srv


@pytest.fixture
def own_server() -> Iterator[RedisServer]:
    """A server this test may kill and restart."""
    with RedisServer() as srv:
        yield srv


@pytest.fixture
def make_tier(metrics: Metrics, namespace: bytes) -> Iterator[MakeTier]:
    """Builds tiers (default namespace and metrics) and closes them after the test."""
    made: list[RemoteTier] = []

    def make(url: str, **kwargs: object) -> RemoteTier:
        ns = kwargs.pop("namespace", namespace)
        m = kwargs.pop("metrics", metrics)
        kwargs.setdefault("codec", codec_for_tests(ns, str(kwargs.get("tenant", ""))))
        kwargs = loaded_timeouts(kwargs)
        tier = RemoteTier(url, ns, m, **kwargs)  # type: ignore[arg-type]
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


def _breaker_open_warnings(caplog: pytest.LogCaptureFixture) -> int:
    return sum(
        1
        for r in caplog.records
        if r.name == LOGGER and r.levelno == logging.WARNING and "breaker open" in r.getMessage()
    )


def _read_failures(metrics: Metrics) -> float:
    """Reads counted as failed by an outage (a dead server times out or refuses connections)."""
    return sum(
        metrics.value("store_failures_total", tier="remote", reason=f"read_{r}")
        for r in ("timeout", "connection")
    )


def _write_failures(metrics: Metrics) -> float:
    return sum(
        metrics.value("store_failures_total", tier="remote", reason=r)
        for r in ("timeout", "connection")
    )


def _closed_infos(caplog: pytest.LogCaptureFixture) -> int:
    return sum(
        1
        for r in caplog.records
        if r.name == LOGGER and r.levelno == logging.INFO and "breaker closed" in r.getMessage()
    )


# ---- data path --------------------------------------------------------------------------


def test_round_trip_bytes(server: RedisServer, make_tier: MakeTier, namespace: bytes) -> None:
    tier = make_tier(server.url)
    payloads = {key_of(i): payload_of(i, size) for i, size in enumerate((1, 4096, 100_003))}
    assert tier.get(key_of(0)) is None
    assert not tier.contains(key_of(0))
    for key, payload in payloads.items():
        assert tier.put(key, memoryview(payload))
    for key, payload in payloads.items():
        got = tier.get(key)
        assert got is not None and bytes(got) == payload
        assert tier.contains(key)
    # what sits in the server is exactly the record, under the documented key
    admin = server.client()
    key = key_of(1)
    rkey = f"kvtier::{namespace.hex()}:{key.hex()}".encode()  # the default tenant: empty
    assert tier.redis_key(key) == rkey
    # the stored value is the sealed record: its header, then the payload as it was
    stored = admin.get(rkey)
    assert stored[record.HEADER_BYTES :] == bytes(payloads[key])
    assert codec_for_tests(namespace).open(stored, key) == bytes(payloads[key])
    assert admin.ttl(rkey) == -1  # no expiry by default
    expected = sum(record.HEADER_BYTES + len(p) for p in payloads.values())
    assert tier.residency_bytes() == expected
    # a rewrite of a held chunk is not counted twice
    assert tier.put(key, payloads[key])
    assert tier.residency_bytes() == expected
    assert tier._m.value("tier_residency_bytes", tier="remote") == expected


def _count_batches(monkeypatch: pytest.MonkeyPatch, client: object) -> list[int]:
    """Sizes of the batches `client` (a glide client) executes from now on."""
    sizes: list[int] = []
    real = client.exec  # type: ignore[attr-defined]

    def counting(batch: object, *a: object, **kw: object) -> object:
        sizes.append(len(batch.commands))  # type: ignore[attr-defined]
        return real(batch, *a, **kw)

    monkeypatch.setattr(client, "exec", counting)
    return sizes


def test_get_many_reads_with_one_batch(
    server: RedisServer, make_tier: MakeTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier(server.url)
    for i in (0, 2, 3):
        assert tier.put(key_of(i), payload_of(i, 512))
    admin = server.client()
    admin.config_resetstat()
    batches = _count_batches(monkeypatch, tier._transport._reader.client)
    got = tier.get_many([key_of(i) for i in range(4)])
    assert [None if g is None else bytes(g) for g in got] == [
        payload_of(0, 512),
        None,
        payload_of(2, 512),
        payload_of(3, 512),
    ]
    assert batches == [4]  # one round trip carrying a GET per key
    assert admin.info("commandstats")["cmdstat_get"]["calls"] == 4
    assert tier.get_many([]) == []


def test_lookup_prefix_counts_leading_run_in_one_batch(
    server: RedisServer, make_tier: MakeTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier(server.url)
    for i in (0, 1, 2, 3, 5):
        assert tier.put(key_of(i), payload_of(i, 64))
    keys = [key_of(i) for i in range(7)]
    admin = server.client()
    admin.config_resetstat()
    batches = _count_batches(monkeypatch, tier._transport._presence.client)
    assert tier.lookup_prefix(keys) == 4
    # one round trip carrying one EXISTS per key, nothing sent outside it
    assert batches == [7]
    stats = admin.info("commandstats")
    assert stats["cmdstat_exists"]["calls"] == 7
    assert set(stats) == {"cmdstat_exists", "cmdstat_config|resetstat"}
    assert tier.lookup_prefix(keys[1:]) == 3
    assert tier.lookup_prefix([key_of(4), key_of(0)]) == 0
    assert tier.lookup_prefix([]) == 0
    # lease only counts (Redis cannot pin), in one batch too; release is a no-op
    assert tier.lease("req-1", keys) == 4
    tier.release("req-1")
    tier.release("never-leased")
    assert tier.lookup_prefix(keys) == 4
    assert batches == [7, 6, 2, 7, 7]


def test_ttl_is_set_when_configured(server: RedisServer, make_tier: MakeTier) -> None:
    tier = make_tier(server.url, ttl_s=60)
    assert tier.put(key_of(0), payload_of(0, 128))
    ttl = server.client().ttl(tier.redis_key(key_of(0)))
    assert 0 < ttl <= 60


def test_corrupted_value_is_a_counted_miss_and_deleted(
    server: RedisServer, make_tier: MakeTier, metrics: Metrics
) -> None:
    tier = make_tier(server.url)
    admin = server.client()
    key = key_of(7)
    payload = payload_of(7, 1000)
    assert tier.put(key, payload)
    rkey = tier.redis_key(key)
    raw = bytearray(admin.get(rkey))
    raw[record.HEADER_BYTES + 10] ^= 0xFF
    admin.set(rkey, bytes(raw))
    assert tier.get(key) is None
    assert metrics.value("verify_failures_total", tier="remote", reason="tag_mismatch") == 1
    assert admin.exists(rkey) == 0
    assert tier.residency_bytes() == 0
    # a truncated value found through the batched read is handled the same way
    assert tier.put(key, payload)
    admin.set(rkey, bytes(raw[:20]))
    assert tier.get_many([key]) == [None]
    assert metrics.value("verify_failures_total", tier="remote", reason="truncated") == 1
    assert admin.exists(rkey) == 0


def test_other_namespace_reads_as_miss(
    server: RedisServer,
    make_tier: MakeTier,
    metrics: Metrics,
    namespace: bytes,
    other_namespace: bytes,
) -> None:
    mine = make_tier(server.url, namespace=namespace)
    theirs = make_tier(server.url, namespace=other_namespace)
    key = key_of(3)
    assert theirs.put(key, payload_of(3, 256))
    # separate key spaces: a plain miss, nothing to verify
    assert mine.get(key) is None
    assert not mine.contains(key)
    assert mine.lookup_prefix([key]) == 0
    assert metrics.total("verify_failures_total") == 0
    # their record planted under my key is caught by verification
    admin = server.client()
    admin.set(mine.redis_key(key), admin.get(theirs.redis_key(key)))
    assert mine.get(key) is None
    assert metrics.value("verify_failures_total", tier="remote", reason="namespace_mismatch") == 1
    got = theirs.get(key)
    assert got is not None and bytes(got) == payload_of(3, 256)


def test_unix_socket_url(make_tier: MakeTier) -> None:
    with RedisServer(unix=True) as srv:
        tier = make_tier(srv.url)
        assert tier.put(key_of(1), payload_of(1, 300))
        got = tier.get(key_of(1))
        assert got is not None and bytes(got) == payload_of(1, 300)


def test_refusal_by_a_full_server_counts_and_keeps_breaker_closed(
    server: RedisServer,
    make_tier: MakeTier,
    metrics: Metrics,
    caplog: pytest.LogCaptureFixture,
) -> None:
    tier = make_tier(server.url, breakers=ShardBreakers(2, 5.0))
    admin = server.client()
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    admin.config_set("maxmemory", 1)
    try:
        results = [tier.put(key_of(i), payload_of(i, 64)) for i in range(3)]
    finally:
        admin.config_set("maxmemory", 0)
    assert results == [False, False, False]
    assert metrics.value("store_failures_total", tier="remote", reason="oom") == 3
    # the server answered promptly: that is not an outage
    assert tier.breaker.state is State.CLOSED
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "refused" in r.msg]
    assert len(warnings) == 1
    assert tier.put(key_of(0), payload_of(0, 64))


# ---- configuration and credentials ------------------------------------------------------


def test_from_config_reads_remote_and_breaker_fields(
    auth_server: RedisServer, metrics: Metrics, namespace: bytes
) -> None:
    config = KVTierConfig(
        remote_url=auth_server.url,
        remote_password=PASSWORD,
        record_key=RECORD_KEY,
        remote_ttl_s=30,
        remote_timeout_ms=250,
        breaker_failures=2,
        breaker_probe_s=1.5,
    )
    tier = RemoteTier.from_config(config, namespace, metrics)
    try:
        assert tier.breaker.failures == 2 and tier.breaker.probe_s == 1.5
        assert tier.timeouts == Timeouts(presence_s=0.25, read_s=0.25, write_s=1.0)
        assert tier.put(key_of(0), payload_of(0, 10))
        assert 0 < auth_server.client().ttl(tier.redis_key(key_of(0))) <= 30
    finally:
        tier.close()
    with pytest.raises(ConfigError, match="remote_url is not set"):
        RemoteTier.from_config(KVTierConfig(), namespace, metrics)


def test_auth_password_and_acl_user(
    auth_server: RedisServer,
    make_tier: MakeTier,
    metrics: Metrics,
    namespace: bytes,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    port = auth_server.port
    by_arg = make_tier(auth_server.url, password=PASSWORD)
    by_url = make_tier(f"redis://:{PASSWORD}@127.0.0.1:{port}/0")
    by_acl = make_tier(auth_server.url, username=ACL_USER, password=ACL_PASSWORD)
    by_acl_url = make_tier(f"redis://{ACL_USER}:{ACL_PASSWORD}@127.0.0.1:{port}/0")
    assert by_arg.put(key_of(0), payload_of(0, 50))
    for tier in (by_url, by_acl, by_acl_url):
        got = tier.get(key_of(0))
        assert got is not None and bytes(got) == payload_of(0, 50)

    wrong = (
        {"password": "not-the-password"},
        {"username": ACL_USER, "password": "not-the-password"},
        {},  # no credentials at all
    )
    for kwargs in wrong:
        with pytest.raises(StartupError) as info:
            RemoteTier(auth_server.url, namespace, metrics, codec=codec_for_tests(namespace),
                       **kwargs)  # type: ignore[arg-type]  # fmt: skip
        assert auth_server.url in str(info.value)
        assert "remote_password" in str(info.value)
    # a password in the URL shows masked in the error
    with pytest.raises(StartupError) as info:
        RemoteTier(f"redis://{ACL_USER}:wrong-{PASSWORD}@127.0.0.1:{port}/0", namespace, metrics,
                   codec=codec_for_tests(namespace))  # fmt: skip
    assert f"redis://{ACL_USER}:***@127.0.0.1:{port}/0" in str(info.value)

    # no secret anywhere a person or a scraper looks
    shown = [
        caplog.text,
        repr(by_url),
        repr(by_acl_url),
        str(info.value),
        by_acl_url.url,
        *(str(s.labels) for fam in metrics.registry.collect() for s in fam.samples),
    ]
    for text in shown:
        for secret in (PASSWORD, ACL_PASSWORD):
            assert secret not in text


def test_bad_urls_and_arguments(metrics: Metrics, namespace: bytes) -> None:
    with pytest.raises(ConfigError) as info:
        RemoteTier(f"http://u:{PASSWORD}@localhost:1/0", namespace, metrics,
                   codec=codec_for_tests(namespace))  # fmt: skip
    assert PASSWORD not in str(info.value) and "u:***@localhost" in str(info.value)
    with pytest.raises(ValueError, match="namespace must be 16 bytes"):
        RemoteTier("redis://127.0.0.1:1/0", b"short", metrics, codec=CODEC)
    with pytest.raises(ValueError, match="ttl_s=-1"):
        RemoteTier("redis://127.0.0.1:1/0", namespace, metrics, ttl_s=-1,
                   codec=codec_for_tests(namespace))  # fmt: skip
    with pytest.raises(ValueError, match="timeout_ms=0"):
        RemoteTier("redis://127.0.0.1:1/0", namespace, metrics, timeout_ms=0,
                   codec=codec_for_tests(namespace))  # fmt: skip
    with pytest.raises(ValueError, match="write_timeout_ms=50 must be >= timeout_ms=100"):
        RemoteTier("redis://127.0.0.1:1/0", namespace, metrics, write_timeout_ms=50,
                   codec=codec_for_tests(namespace))  # fmt: skip


def test_mask_url() -> None:
    assert mask_url("redis://u:pw@h:1/0") == "redis://u:***@h:1/0"
    assert mask_url("redis://:pw@h:1/0") == "redis://:***@h:1/0"
    assert mask_url("rediss://pw@h:1/0") == "rediss://***@h:1/0"
    # the rest is hidden: a password may hold "&"
    assert mask_url("unix:///tmp/r.sock?password=pw&db=1") == "unix:///tmp/r.sock?password=***"
    assert mask_url("redis://h:1/0") == "redis://h:1/0"
    assert mask_url("redis://u:p/w@h:1/0") == "redis://u:***@h:1/0"
    assert mask_url("unix://:pw@/run/redis.sock?db=0") == "unix://:***@/run/redis.sock?db=0"


def test_closed_tier_and_bad_keys(server: RedisServer, make_tier: MakeTier) -> None:
    tier = make_tier(server.url)
    with pytest.raises(ValueError, match="chunk key must be 16 bytes"):
        tier.get(b"short")
    tier.close()
    with pytest.raises(RuntimeError, match="closed"):
        tier.get(key_of(0))
    with pytest.raises(RuntimeError, match="closed"):
        tier.put(key_of(0), b"x")


# ---- degrade, never break ---------------------------------------------------------------


def test_down_at_construction_opens_breaker_instead_of_raising(
    own_server: RedisServer,
    make_tier: MakeTier,
    metrics: Metrics,
    clock: FakeClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    own_server.kill()
    url = f"redis://:{PASSWORD}@127.0.0.1:{own_server.port}/0"
    t0 = time.monotonic()
    # the default 100 ms: glide itself calls the refusal a timeout within it
    tier = make_tier(url, timeout_ms=100, breakers=ShardBreakers(3, 2.0, clock))
    # nothing listens: no patience spent on it
    assert time.monotonic() - t0 < STARTUP_PATIENCE_S
    assert "connection refused" in caplog.text
    assert tier.breaker.state is State.OPEN
    assert metrics.value("breaker_open", tier="remote") == 1
    assert _breaker_open_warnings(caplog) == 1
    assert "unreachable at startup" in caplog.text and PASSWORD not in caplog.text
    assert not tier.put(key_of(0), b"abc")
    assert tier.get(key_of(0)) is None
    assert metrics.value("dropped_writes_total", tier="remote", reason="breaker_open") == 1
    # the store appears later: the next probe closes the breaker and the tier works
    own_server.start()
    clock.advance(2.0)
    assert tier.put(key_of(0), b"abc")
    assert tier.breaker.state is State.CLOSED
    assert metrics.value("breaker_open", tier="remote") == 0
    assert _closed_infos(caplog) == 1
    got = tier.get(key_of(0))
    assert got is not None and bytes(got) == b"abc"


class _BusyAtStartup(ThrottledProxy):
    """Every answer in the first 0.5 s after the first one comes 0.3 s late (a host busy
    starting the engine), later ones at once."""

    late = 0
    _slow_until: float | None = None

    def _pace(self, n: int, arrived: float) -> None:
        if self._slow_until is None:
            self._slow_until = arrived + 0.5
        slow = arrived < self._slow_until
        self.late += slow
        self.latency_s = 0.3 if slow else 0.0
        super()._pace(n, arrived)


def test_a_store_slow_to_answer_at_startup_is_waited_for_not_shed(
    server: RedisServer, make_tier: MakeTier, metrics: Metrics, caplog: pytest.LogCaptureFixture
) -> None:
    """Startup's PING answered after 3x `timeout_ms` (a host busy starting the engine): the
    store is up, so the breaker stays closed and the first writes land. CI lost every write of
    a run when this opened the breaker: the run ended inside the 5 s before its first probe."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    with _BusyAtStartup(("127.0.0.1", server.port), rate=2e9) as proxy:
        t0 = time.monotonic()
        tier = make_tier(proxy.url(), timeout_ms=100)
        started_s = time.monotonic() - t0
        assert proxy.late > 0  # the check did meet a late answer
        assert tier.breaker.state is State.CLOSED, caplog.text
        assert _breaker_open_warnings(caplog) == 0
        assert tier.put(key_of(6), payload_of(6, 256))
        assert metrics.value("dropped_writes_total", tier="remote", reason="breaker_open") == 0
    assert server.client().exists(tier._rkey(key_of(6))) == 1
    assert started_s < 5.0


def test_a_store_that_never_answers_at_startup_opens_the_breaker_once_patience_is_spent(
    make_tier: MakeTier, caplog: pytest.LogCaptureFixture
) -> None:
    """A listener that accepts and never answers: startup asks it for `STARTUP_PATIENCE_S`,
    then serves without it, the warning saying how long it asked."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    with socket.create_server(("127.0.0.1", 0)) as silent:
        t0 = time.monotonic()
        tier = make_tier(f"redis://127.0.0.1:{silent.getsockname()[1]}/0", timeout_ms=100)
        took = time.monotonic() - t0
    assert tier.breaker.state is State.OPEN
    assert STARTUP_PATIENCE_S <= took < STARTUP_PATIENCE_S + 3.0
    assert _breaker_open_warnings(caplog) == 1
    assert re.search(r"unreachable at startup \(timeout .*; \d+ tries in \d+\.\d s\)", caplog.text)


def test_server_killed_mid_run_then_restarted(
    own_server: RedisServer,
    make_tier: MakeTier,
    metrics: Metrics,
    clock: FakeClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    tier = make_tier(
        own_server.url, timeout_ms=100, breakers=ShardBreakers(3, 5.0, clock), clock=clock
    )
    key, payload = key_of(1), payload_of(1, 2048)
    assert tier.put(key, payload)
    assert tier.get(key) is not None

    own_server.kill()
    calls: list[Callable[[], object]] = [
        lambda: tier.get(key),
        lambda: tier.put(key_of(2), payload),
        lambda: tier.lookup_prefix([key]),
    ]
    # the first calls fail within their own timeouts, counted (a read 0.1s, a write 1s)
    limits = [tier.timeouts.read_s, tier.timeouts.write_s, tier.timeouts.presence_s]
    for call, limit in zip(calls, limits, strict=True):
        t0 = time.monotonic()
        result = call()
        assert time.monotonic() - t0 < limit + 0.4
        assert result in (None, False, 0)
    assert _read_failures(metrics) == 2
    assert _write_failures(metrics) == 1
    assert tier.breaker.state is State.OPEN
    assert metrics.value("breaker_open", tier="remote") == 1

    # open: calls are skipped without touching the network, and nothing more is logged
    for i in range(10):
        assert tier.get(key) is None
        assert not tier.put(key_of(i), payload)
        assert tier.get_many([key]) == [None]
        assert not tier.contains(key)
    assert metrics.value("dropped_writes_total", tier="remote", reason="breaker_open") == 10
    assert _read_failures(metrics) == 2
    assert _breaker_open_warnings(caplog) == 1

    # a probe while the server is still dead re-opens quietly
    clock.advance(5.0)
    assert tier.get(key) is None
    assert _read_failures(metrics) == 3
    assert tier.breaker.state is State.OPEN
    assert _breaker_open_warnings(caplog) == 1

    # back on the same port (empty): the next probe closes the breaker and hits resume
    own_server.start()
    assert tier.get(key) is None  # still within the open period: skipped
    clock.advance(5.0)
    assert tier.put(key, payload)
    assert tier.breaker.state is State.CLOSED
    assert metrics.value("breaker_open", tier="remote") == 0
    assert _closed_infos(caplog) == 1
    got = tier.get(key)
    assert got is not None and bytes(got) == payload
    assert tier.lookup_prefix([key]) == 1


def test_slow_server_times_out_to_a_miss(
    server: RedisServer, make_tier: MakeTier, metrics: Metrics, caplog: pytest.LogCaptureFixture
) -> None:
    tier = make_tier(server.url, timeout_ms=100, write_timeout_ms=150)
    key, payload = key_of(4), payload_of(4, 256)
    assert tier.put(key, payload)

    # the store answers nothing until the block ends, however late a loaded host runs the
    # read and the write below
    with server.paused():
        t0 = time.monotonic()
        got = tier.get(key)
        elapsed = time.monotonic() - t0
        assert got is None
        assert elapsed < 0.1 + 1.0, elapsed  # its 100 ms timeout, never the stall
        assert metrics.value("store_failures_total", tier="remote", reason="read_timeout") == 1
        # glide's own raw "Error executing command: timed out" line gets kvtier's context, once
        said = [r for r in caplog.records if "timed out" in r.getMessage()]
        assert len(said) == 1 and said[0].levelname == "WARNING"
        assert "read timed out" in said[0].getMessage()
        assert "prints 'Error executing command: timed out' on stderr" in said[0].getMessage()
        # a write waits for its own (longer) timeout, then fails the same way
        t0 = time.monotonic()
        assert not tier.put(key_of(5), payload)
        elapsed = time.monotonic() - t0
        assert 0.15 <= elapsed < 0.15 + 1.0, elapsed
        assert metrics.value("store_failures_total", tier="remote", reason="timeout") == 1
        assert tier.breaker.state is State.CLOSED  # two timeouts are below the threshold
    # the timed-out connection was dropped, so no stale reply leaks into the next call
    got = tier.get(key)
    assert got is not None and bytes(got) == payload


def test_two_stacks_share_chunks_through_the_remote_tier(
    server: RedisServer, namespace: bytes
) -> None:
    """Engine A saves through its TierStack; engine B (empty memory) loads A's chunk remotely."""
    slot = 4096
    config = KVTierConfig(memory_bytes=slot * 4, remote_url=server.url, record_key=RECORD_KEY)
    a = build_stack(config, namespace, slot, Metrics(rank=0))
    b_metrics = Metrics(rank=0)
    b = build_stack(config, namespace, slot, b_metrics)
    try:
        assert a.tiers == ["memory", "remote"]
        payload = payload_of(9, slot)
        assert a.put(key_of(9), payload)
        assert a.flush(5.0)
        assert b.lookup([key_of(9), key_of(10)], lease_id="req") == 1
        dst = torch.zeros(slot, dtype=torch.uint8)
        assert b.read_into(key_of(9), dst) == "remote"
        assert bytes(dst.numpy()) == payload
        assert b_metrics.value("tier_hits_total", tier="remote") == 1
        b.release("req")
    finally:
        a.close()
        b.close()


def test_missing_redis_server_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redis_local.shutil, "which", lambda name: None)
    with pytest.raises(RedisServerError, match="apt-get install redis-server"):
        RedisServer()


def test_a_lost_cluster_connection_is_an_outage_that_feeds_the_breaker() -> None:
    # what valkey-glide raises for a read on a master killed mid-run (a CI run saw it instead of
    # a timeout): it was counted a refusal the server answered, so the dead shard's breaker
    # never opened
    from kvtier.store.remote_glide import GlideTransport

    transport = object.__new__(GlideTransport)
    transport.refresh = lambda: None  # type: ignore[method-assign]
    text = ("Received connection error `Cluster: Failed to receive command response from "
            "internal sender. RecvError(())`. Will attempt to reconnect")  # fmt: skip
    error = GlideTransport._error(transport, Exception(text), "127.0.0.1:7001")
    assert (error.reason, error.outage, error.shard) == ("connection", True, "127.0.0.1:7001")
