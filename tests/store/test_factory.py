"""build_stack: a remote database index the server does not have is a startup error naming it
and what the server allows, never a traceback."""

from __future__ import annotations

import pytest

from kvtier.config import KVTierConfig
from kvtier.errors import StartupError
from kvtier.metrics import Metrics
from kvtier.store.factory import build_stack
from tests.record_key import RECORD_KEY
from tests.redis_local import RedisServer


def test_remote_db_beyond_the_servers_databases_is_a_startup_error():
    with RedisServer() as srv:
        base = srv.url.rsplit("/", 1)[0]
        cfg = KVTierConfig(memory_bytes="1MiB", remote_url=f"{base}/99", record_key=RECORD_KEY)
        with pytest.raises(StartupError, match=r"selects database 99, but the server has "
                           r"databases 0\.\.15; use a database index it has"):  # fmt: skip
            build_stack(cfg, bytes(16), 4096, Metrics(rank=0))
        ok = build_stack(
            KVTierConfig(memory_bytes="1MiB", remote_url=f"{base}/15", record_key=RECORD_KEY),
            bytes(16), 4096,
            Metrics(rank=0),
        )  # fmt: skip
        ok.close()
