"""A replicated layout (every TP rank holds the same bytes: MLA, the DSA indexer) is stored
once below memory: rank 0 writes the disk and remote copy under a rank-independent namespace,
every rank reads it; a per-rank layout never shares keys across ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from prometheus_client import CollectorRegistry

from kvtier.config import KVTierConfig
from kvtier.metrics import Metrics
from kvtier.offload.messages import ChunkRef, OffloadMeta, SaveOp
from kvtier.offload.pages import KVCacheDescription
from kvtier.offload.worker import OffloadWorker
from tests.offload.vllm_views import build, mla
from tests.record_key import RECORD_KEY
from tests.redis_local import RedisServer

NB, BS, CHUNK = 8, 16, 32
KEY = b"k" * 16


def workers(tmp: Path, url: str, replicated: bool) -> list[OffloadWorker]:
    config = KVTierConfig.from_dict(
        {
            "memory_bytes": "4MiB", "chunk_size": CHUNK, "disk_dir": str(tmp / "disk"),
            "disk_bytes": "64MiB", "remote_url": url,
            "record_key": RECORD_KEY,
        }
    )  # fmt: skip
    out = []
    for rank in (0, 1):
        _, views = build(mla(block_size=BS, indexer=True), NB, "LBHNC")
        w = OffloadWorker(
            config, rank=rank, world=2, model_id="m",
            metrics=Metrics(rank=rank, registry=CollectorRegistry()), lookup_endpoint=None,
        )  # fmt: skip
        w.register_kv_caches(KVCacheDescription(views, NB, BS, "LBHNC", replicated=replicated))
        out.append(w)
    return out


def save(w: OffloadWorker) -> None:
    w.wait_for_save(OffloadMeta(saves=[SaveOp("sv", "r", [ChunkRef(KEY, [2, 3])], CHUNK)]))
    assert w.wait_idle(30.0) and w.take_report().results[0].ok
    assert w.stack is not None and w.stack.flush(30.0)


def records_on_disk(tmp: Path) -> int:
    return sum(1 for p in (tmp / "disk").rglob("*.kvr") if p.name.startswith(KEY.hex()))


@pytest.mark.parametrize("replicated", [True, False])
def test_one_copy_below_memory_for_a_replicated_layout(tmp_path: Path, replicated: bool) -> None:
    with RedisServer() as srv:
        w0, w1 = workers(tmp_path, srv.url, replicated)
        try:
            save(w0)
            assert w1.stack is not None
            if replicated:
                # rank 1 never saved it and finds it below its own memory: rank 0's copy
                assert w1.stack.lookup([KEY], "lk") == 1 and w1.stack.holder(KEY) != "memory"
                w1.stack.release("lk")
                save(w1)  # its save commits to its memory only
                assert records_on_disk(tmp_path) == 1
                keys = redis.Redis.from_url(srv.url).keys(f"kvtier:*{KEY.hex()}*")
                assert len(keys) == 1
            else:
                assert w1.stack.lookup([KEY], "lk") == 0
                w1.stack.release("lk")
                save(w1)
                assert records_on_disk(tmp_path) == 2
        finally:
            w0.close()
            w1.close()
