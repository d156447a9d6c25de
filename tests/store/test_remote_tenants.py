"""The shared store against other tenants and a full server, on a real Redis: a tenant's ACL
user reaches its own records only (keys start `kvtier:<tenant>:`), and a server that evicts
nothing is refused at startup, or, once it refuses writes, shows it in /metrics and doctor."""

from __future__ import annotations

import logging

import pytest
import redis

from kvtier.doctor import STORE_FAILURES, Status, diagnose
from kvtier.errors import StartupError
from kvtier.metrics import Metrics
from kvtier.store.remote import RemoteTier
from tests.record_key import codec_for_tests
from tests.redis_local import RedisServer

from .conftest import FakeClock, key_of, payload_of

ADMIN = "admin-pw-Q9"
TENANTS = {"acme": "pw-acme-7", "beta": "pw-beta-3"}


def _tier(srv: RedisServer, user: str, tenant: str, namespace: bytes, metrics: Metrics,
          **kw: object) -> RemoteTier:  # fmt: skip
    url = f"redis://{user}:{TENANTS[user]}@{srv.addr}/0"
    return RemoteTier(url, namespace, metrics, codec=codec_for_tests(namespace, tenant),
                      tenant=tenant, **kw)  # type: ignore[arg-type]  # fmt: skip


def test_each_tenants_acl_user_reaches_its_own_records_only(
    namespace: bytes, metrics: Metrics
) -> None:
    with RedisServer(password=ADMIN) as srv:
        admin = srv.client()
        for user, pw in TENANTS.items():
            admin.execute_command("ACL", "SETUSER", user, "on", f">{pw}", f"~kvtier:{user}:*",
                                  "+@all")  # fmt: skip
        acme = _tier(srv, "acme", "acme", namespace, metrics)
        beta = _tier(srv, "beta", "beta", namespace, metrics)
        try:
            k = key_of(0)
            assert acme.put(k, payload_of(0, 4096)) and beta.put(k, payload_of(1, 4096))
            # each tenant hits its own record under the same chunk key
            assert bytes(acme.get(k) or b"") == payload_of(0, 4096)
            assert bytes(beta.get(k) or b"") == payload_of(1, 4096)
            assert acme.redis_key(k).startswith(b"kvtier:acme:")
            # beta's credentials can neither read nor overwrite acme's record
            as_beta = redis.Redis(host="127.0.0.1", port=srv.port, username="beta",
                                  password=TENANTS["beta"])  # fmt: skip
            with pytest.raises(redis.exceptions.NoPermissionError):
                as_beta.get(acme.redis_key(k))
            with pytest.raises(redis.exceptions.NoPermissionError):
                as_beta.set(acme.redis_key(k), b"forged")
            as_beta.close()
            # a beta engine configured as acme's tenant gets misses, never acme's bytes
            m = Metrics(rank=1)
            posing = _tier(srv, "beta", "acme", namespace, m)
            try:
                assert posing.get(k) is None and not posing.put(key_of(1), payload_of(2, 4096))
                # counted as what it is (glide says PermissionDenied, not NOPERM)
                assert m.value("store_failures_total", tier="remote",
                               reason="read_no_permission") >= 1  # fmt: skip
                assert m.value("store_failures_total", tier="remote", reason="no_permission") >= 1
            finally:
                posing.close()
            assert bytes(acme.get(k) or b"") == payload_of(0, 4096)
        finally:
            acme.close()
            beta.close()
            admin.close()


def test_a_store_that_evicts_nothing_without_a_ttl_is_refused_at_startup(
    namespace: bytes, metrics: Metrics, caplog: pytest.LogCaptureFixture
) -> None:
    with RedisServer() as srv:
        admin = srv.client()
        admin.config_set("maxmemory", "2mb")
        admin.config_set("maxmemory-policy", "noeviction")
        url = srv.url
        with pytest.raises(StartupError) as e:
            RemoteTier(url, namespace, metrics, codec=codec_for_tests(namespace))
        msg = str(e.value)
        assert "maxmemory-policy noeviction" in msg and "remote_ttl_s=0" in msg
        assert "allkeys-lru" in msg and "remote_full: warn" in msg
        # a TTL lets records leave: no refusal
        RemoteTier(url, namespace, metrics, codec=codec_for_tests(namespace), ttl_s=60).close()
        caplog.set_level(logging.WARNING, logger="kvtier")
        RemoteTier(url, namespace, metrics, codec=codec_for_tests(namespace), full="warn").close()
        assert any("evicts nothing" in r.getMessage() for r in caplog.records)
        admin.close()


def test_a_store_that_fills_up_and_refuses_writes_shows_in_metrics_and_doctor(
    namespace: bytes,
) -> None:
    metrics = Metrics(rank=0)
    clock = FakeClock()
    with RedisServer() as srv:
        admin = srv.client()
        admin.config_set("maxmemory", "2mb")
        admin.config_set("maxmemory-policy", "noeviction")
        tier = RemoteTier(srv.url, namespace, metrics, codec=codec_for_tests(namespace),
                          full="warn", clock=clock)  # fmt: skip
        try:
            stored = 0
            for i in range(64):
                if not tier.put(key_of(i), payload_of(i, 256 * 1024)):
                    break
                stored += 1
            assert 0 < stored < 64, "the store never filled up"
            clock.advance(90.0)
            assert not tier.put(key_of(100), payload_of(100, 256 * 1024))
            gauge = metrics.value("tier_writes_refused_seconds", tier="remote")
            assert gauge == pytest.approx(90.0)
            page = _page(metrics)
            check = {c.name: c for c in diagnose(page, "", 1)}[STORE_FAILURES]
            assert check.status is Status.FAIL
            assert "remote tier writes refused for 90 s" in check.detail
            # the operator makes room: the next write goes in and the streak ends
            admin.config_set("maxmemory-policy", "allkeys-lru")
            assert tier.put(key_of(101), payload_of(101, 256 * 1024))
            assert metrics.value("tier_writes_refused_seconds", tier="remote") == 0
            assert "writes refused" not in {c.name: c for c in diagnose(_page(metrics), "", 1)}[
                STORE_FAILURES
            ].detail
        finally:
            tier.close()
            admin.close()


def _page(metrics: Metrics) -> str:
    from prometheus_client import generate_latest

    return generate_latest(metrics.registry).decode()

