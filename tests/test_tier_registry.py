"""The tier registry: a tier kind defined in this module alone, registered here, is built from the
config, written behind and loaded back through a real OffloadWorker; the stack probes no tier
capability; no table of tier names lives outside the registry."""

from __future__ import annotations

import ast
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from kvtier.config import KVTierConfig
from kvtier.lookup.result import deepest_tier
from kvtier.metrics import Metrics
from kvtier.offload.messages import ChunkRef, LoadOp, OffloadMeta, SaveOp
from kvtier.offload.pages import KVCacheDescription, manager_view
from kvtier.offload.worker import OffloadWorker
from kvtier.store import registry
from kvtier.store.base import TierBase
from tests.offload.vllm_views import build, gqa

SRC = Path(__file__).resolve().parents[1] / "src" / "kvtier"
NB, BS, CHUNK = 12, 16, 32
KEY = b"o" * 16
WAIT_S = 30.0


class ObjectTier(TierBase):
    """An object store as a dict: the least a tier kind must provide."""

    name = "object"

    def __init__(self, bucket: str) -> None:
        self.bucket = bucket
        self.objects: dict[bytes, bytes] = {}
        self.reads = 0
        self._lock = threading.Lock()

    def contains(self, key: bytes) -> bool:
        return key in self.objects

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        return [k in self.objects for k in keys]

    def get(self, key: bytes) -> bytes | None:
        with self._lock:
            self.reads += 1
            return self.objects.get(key)

    def put(self, key: bytes, payload: bytes | memoryview, parent: bytes = b"") -> bool:
        with self._lock:
            self.objects[key] = bytes(payload)
        return True

    def lease(self, lease_id: str, keys: Sequence[bytes], counted: bool = True) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.objects:
            n += 1
        return n

    def release(self, lease_id: str) -> None:
        return None

    def delete(self, key: bytes) -> bool:
        return self.objects.pop(key, None) is not None

    def residency_bytes(self) -> int:
        return sum(map(len, self.objects.values()))

    def close(self) -> None:
        return None


BUILT: list[ObjectTier] = []


def _build(ctx: registry.TierContext, section: dict[str, Any]) -> ObjectTier:
    tier = ObjectTier(section["bucket"])
    BUILT.append(tier)
    return tier


OBJECT = registry.TierKind(
    "object", 30, lambda config: {"bucket": "kv"}, _build, lambda config: 0.2
)


@pytest.fixture
def object_kind() -> Iterator[registry.TierKind]:
    BUILT.clear()
    with registry.registered(OBJECT) as kind:
        yield kind


def _bytes_of(views: dict[str, torch.Tensor], ids: list[int]) -> list[torch.Tensor]:
    return [manager_view(v, NB)[b].clone().view(torch.uint8) for v in views.values() for b in ids]


def test_a_kind_registered_here_is_written_behind_and_loaded_through_the_worker(
    object_kind: registry.TierKind,
) -> None:
    raw, views = build(gqa(block_size=BS), NB, "LBNHC")
    g = torch.Generator().manual_seed(3)
    raw.copy_(torch.randint(-60, 60, raw.shape, generator=g, dtype=torch.int8))
    metrics = Metrics(rank=0, registry=CollectorRegistry())
    config = KVTierConfig.from_dict({"memory_bytes": "8MiB", "chunk_size": CHUNK})
    worker = OffloadWorker(
        config, rank=0, world=1, model_id="m", metrics=metrics, lookup_endpoint=None
    )
    try:
        worker.register_kv_caches(KVCacheDescription(views, NB, BS, "LBNHC"))
        stack = worker.stack
        assert stack is not None and stack.tiers == ["memory", "object"]
        (tier,) = BUILT
        want = _bytes_of(views, [3, 4])
        save = SaveOp("r1#sv", "r1", [ChunkRef(KEY, [3, 4])], CHUNK)
        worker.wait_for_save(OffloadMeta(saves=[save]))
        assert worker.wait_idle(WAIT_S) and stack.flush(WAIT_S)
        assert KEY in tier.objects
        # only the new kind holds the chunk now: the load must read it from there
        assert stack.memory.delete(KEY)
        run = stack.lookup_run([KEY], "lk1")
        assert (run.chunks, run.tier) == (1, "object")
        load = LoadOp("r2#ld", "r2", "lk1", [ChunkRef(KEY, [9, 8])], CHUNK)
        worker.start_load_kv(OffloadMeta(loads=[load]))
        assert worker.wait_idle(WAIT_S)
        report = worker.take_report()
        assert report.finished_recving == ["r2"] and all(r.ok for r in report.results)
        got = _bytes_of(views, [9, 8])
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        assert tier.reads >= 1
        assert metrics.value("tier_hits_total", tier="object") == 1
    finally:
        worker.close()


def test_the_registry_orders_kinds_and_tells_hosts_what_each_is(
    object_kind: registry.TierKind,
) -> None:
    assert registry.order() == ("memory", "disk", "remote", "object")
    assert deepest_tier(["object", "memory"], registry.order()) == "object"
    assert deepest_tier(["disk", "memory", ""], registry.order()) == "disk"
    assert [registry.hit_source(t) for t in ("memory", "disk", "remote", "object", "?")] == [
        "host", "disk", "external_unspecified", "external_unspecified", "external_unspecified"
    ]  # fmt: skip
    media = {k.name: (k.medium, k.locality) for k in registry.kinds()}
    assert media == {
        "memory": ("CPU", "LOCAL"), "disk": ("STORAGE", "LOCAL"),
        "remote": ("STORAGE", "REMOTE"), "object": ("STORAGE", "LOCAL"),
    }  # fmt: skip
    seeds = registry.read_seeds(KVTierConfig(disk_read_gbps=2.0))
    assert seeds == {"memory": 5.0, "disk": 2.0, "remote": 0.5, "object": 0.2}


def test_a_name_or_depth_already_taken_is_refused_by_name(
    object_kind: registry.TierKind,
) -> None:
    for clash in (
        registry.TierKind("object", 40, OBJECT.section, _build, OBJECT.read_gbps),
        registry.TierKind("bucket", 30, OBJECT.section, _build, OBJECT.read_gbps),
    ):
        with pytest.raises(ValueError, match="clashes with registered kind 'object'"):
            registry.register(clash)
    assert registry.order()[-1] == "object"


def test_the_kind_is_gone_once_unregistered() -> None:
    assert "object" not in registry.order()


def _source_files() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if "__pycache__" not in p.parts)


def test_the_stack_probes_no_tier_capability() -> None:
    """Every capability the stack uses is declared by `Tier`; none is looked up at run time."""
    for name in ("stack.py", "factory.py"):
        tree = ast.parse((SRC / "store" / name).read_text())
        probes = [
            f"{name}:{node.lineno}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
        ]
        assert probes == []


BUILT_IN = {"memory", "disk", "remote"}


def test_no_table_of_tier_names_outside_the_registry() -> None:
    """A dict, tuple, list or set naming two tier kinds is a second registry: derive it from
    `store/registry.py` instead (the tools' model of a cache and bench arms aside)."""
    allowed = {SRC / "store" / "registry.py"}
    outside_product = ("bench", "cachemodel")
    tables = []
    for path in _source_files():
        if path in allowed or path.relative_to(SRC).parts[0] in outside_product:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            items: list[ast.expr | None] = []
            if isinstance(node, ast.Dict):
                items = list(node.keys)
            elif isinstance(node, ast.Tuple | ast.List | ast.Set):
                items = list(node.elts)
            names = {
                i.value for i in items if isinstance(i, ast.Constant) and i.value in BUILT_IN
            }
            if len(names) >= 2:
                tables.append(f"{path.relative_to(SRC)}:{node.lineno} {sorted(names)}")
    assert tables == []
