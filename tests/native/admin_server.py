"""A native engine server with the retention admin API on, and the calls the retention tests
make of it: an HTTP request, and how many chunks of a prompt every rank holds."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from kvtier.config import KVTierConfig
from kvtier.native import Engine, EngineConfig
from kvtier.native.offload import connector_spec
from kvtier.native.server import EngineServer
from tests.native.test_server import client


@contextmanager
def admin_server(
    model: Path, run_dir: Path, admin_key: str, **config: Any
) -> Iterator[EngineServer]:
    """A one-thread engine of `model` serving with `admin_key`; kvtier configured by `config`
    (a quick load gate off, lookups allowed 2 s)."""
    cfg = KVTierConfig(**{"load_gate": False, "lookup_timeout_ms": 2000, **config})
    spec = connector_spec(cfg, model, run_dir=run_dir)
    engine = Engine(model, EngineConfig(num_threads=1, num_blocks=256), spec)
    try:
        srv = EngineServer(engine, model_name="tiny", admin_key=admin_key)
    except BaseException:
        engine.close()
        raise
    with srv:
        yield srv


def call(srv: EngineServer, method: str, path: str, body: Any = None, **kw: Any) -> httpx.Response:
    """One HTTP request to `srv`."""

    async def go() -> httpx.Response:
        async with client(srv) as c:
            return await c.request(method, path, json=body, **kw)

    return asyncio.run(go())


def held_chunks(srv: EngineServer, prompt: list[int]) -> int:
    """Chunks of `prompt` every rank's tiers hold now (a probe: no lease)."""

    def probe(engine: Any) -> int:
        keys = engine.connector.core.planner.keys_for(prompt)
        return engine.connector.client.lookup(keys, "probe", lease=False).hit_chunks

    return srv.loop.call(probe).result(timeout=30)
