"""A replicated layout (every TP rank holds the same bytes: MLA, the DSA indexer) is stored
once below memory per pipeline stage: the stage's first rank writes the disk and remote copy
under a rank-independent namespace, every rank reads it; a per-rank layout never shares keys
across ranks."""

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


def test_every_pipeline_stage_of_a_replicated_layout_writes_its_copy_below_memory(
    tmp_path: Path,
) -> None:
    """PP=2 x TP=2: stage 1's layers are another layout (another namespace), so its first rank
    (rank 2) writes that stage's copy below memory; rank 0 only writes stage 0's (it used to be
    the only writer: no chunk of a later stage could be served from disk)."""
    config = KVTierConfig.from_dict(
        {"memory_bytes": "4MiB", "chunk_size": CHUNK, "disk_dir": str(tmp_path / "disk"),
         "disk_bytes": "64MiB", "record_key": RECORD_KEY}
    )  # fmt: skip
    ranks = []
    try:
        for rank, first_layer in ((0, 0), (2, 3)):
            _, views = build(mla(num_layers=3, block_size=BS), NB, "LBHNC")
            # stage 1 holds the model's later layers: their names differ from stage 0's
            views = {n.replace(f"layers.{i}.", f"layers.{i + first_layer}."): v
                     for i, (n, v) in enumerate(views.items())}  # fmt: skip
            w = OffloadWorker(
                config, rank=rank, world=4, model_id="m", tp_size=2,
                metrics=Metrics(rank=rank, registry=CollectorRegistry()), lookup_endpoint=None,
            )  # fmt: skip
            w.register_kv_caches(KVCacheDescription(views, NB, BS, "LBHNC", replicated=True))
            ranks.append(w)
            save(w)
        assert records_on_disk(tmp_path) == 2  # one copy per stage
    finally:
        for w in ranks:
            w.close()
