"""A rank's metrics snapshot (what it ships with its reports): the same samples prometheus'
collect() gives, read from the families' values directly, and merged per rank on the other side."""

from __future__ import annotations

import msgspec
from prometheus_client import CollectorRegistry

from kvtier.metrics import FamilySnapshot, MergedCollector, Metrics, snapshot
from kvtier.offload.steps import HookClock


def _touched(rank: int) -> Metrics:
    """A rank's registry with children in every family, histograms included."""
    m = Metrics(rank=rank, registry=CollectorRegistry())
    for fam in vars(m.f).values():
        labels = ["x"] * (len(fam._labelnames) - 1)
        child = fam.labels(str(rank), *labels)
        if hasattr(child, "observe"):
            for v in (0.00003, 0.004, 0.7, 30.0):
                child.observe(v)
        elif hasattr(child, "inc"):
            child.inc(3)
        else:
            child.set(-2.5)
    clock = HookClock(m)
    for hook in ("load", "report"):
        with clock.time(hook):
            pass
    clock.flush()
    m.eviction("memory").inc()
    m.eviction("disk").inc(2)
    return m


def _collected(reg: CollectorRegistry) -> list[tuple[str, str, str, list[tuple]]]:
    return [
        (
            m.name,
            m.type,
            m.documentation,
            [
                (s.name, dict(s.labels), float(s.value))
                for s in m.samples
                if not s.name.endswith("_created")
            ],
        )
        for m in reg.collect()
    ]


def test_the_fast_snapshot_equals_prometheus_collect() -> None:
    m = _touched(1)
    fams = msgspec.msgpack.decode(snapshot(m.registry), type=list[FamilySnapshot])
    got = [
        (f.name, f.type, f.documentation, [(s.name, s.labels, s.value) for s in f.samples])
        for f in fams
    ]
    want = _collected(m.registry)
    assert sorted(got, key=lambda f: f[0]) == sorted(want, key=lambda f: f[0])
    # every family is there, histograms with their buckets
    assert any(f[1] == "histogram" and len(f[3]) > 20 for f in got)


def test_a_merged_collector_serves_a_ranks_snapshot_as_its_own_samples() -> None:
    scheduler = Metrics(rank="scheduler", registry=CollectorRegistry())
    rank = _touched(0)
    merged = MergedCollector(scheduler.registry)
    merged.update("rank0", snapshot(rank.registry))
    served = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for fam in merged.collect() for s in fam.samples}  # fmt: skip
    for _name, _type, _doc, samples in _collected(rank.registry):
        for name, labels, value in samples:
            assert served[(name, tuple(sorted(labels.items())))] == value


def test_a_labelled_child_is_made_once_and_counts_in_the_registry() -> None:
    """The copy lanes count every chunk (`transfer_chunk`, `tier_hit`): the child is looked up
    once per label set, not validated and locked again per chunk, and still counts."""
    m = Metrics(rank=3)
    a = m.transfer_chunk("save", "dma")
    assert m.transfer_chunk("save", "dma") is a
    assert m.transfer_chunk("save", "kernel") is not a
    for _ in range(5):
        m.transfer_chunk("save", "dma").inc()
    m.tier_hit("memory").inc()
    labels = {"rank": "3", "lane": "save", "path": "dma"}
    assert m.value("transfer_chunks_total", lane="save", path="dma") == 5
    assert m.registry.get_sample_value("kvtier_transfer_chunks_total", labels) == 5
    assert m.value("tier_hits_total", tier="memory") == 1
