"""The cache model's cost view: tier hits weighted by the prefill time they save, priced by the
product's own load-or-recompute model, and `kvtier bench cache`'s table of it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.bench import cache, cache_cost
from kvtier.cachemodel import cost_view, workloads
from kvtier.cachemodel.cost_view import Medium, Shape, time_saved
from kvtier.cachemodel.stream import Request
from kvtier.offload.cost import CostModel

# 1 MB a token at 1,000 tokens/s: the break-even is 1 GB/s
SHAPE = Shape("test", 10**6, 1000.0)
CHUNK = 10


def _stream() -> tuple[list[Request], list[int], list[int]]:
    """Three requests whose tier hits are runs of 1, 4 and 8 chunks above an HBM floor of 0."""
    reqs = [Request(tuple(range(i * 100, i * 100 + n + 1)), n + 1) for i, n in enumerate((1, 4, 8))]
    return reqs, [0, 0, 0], [1, 4, 8]


def _saved(medium: Medium) -> cost_view.TimeSaved:
    reqs, floors, leads = _stream()
    return time_saved(reqs, floors, leads, medium=medium, shape=SHAPE, chunk_tokens=CHUNK)


def test_a_tier_faster_than_the_prefill_saves_its_hits_time_under_both_policies() -> None:
    t = _saved(Medium("fast", 10.0, 0.0))
    # 13 chunks of hits of 16 missed: at 10x the break-even each saves 0.9 of its prefill
    assert t.missed_s == pytest.approx(16 * CHUNK / 1000)
    assert t.always_s == pytest.approx(13 * CHUNK / 1000 * 0.9)
    assert t.cost_s == pytest.approx(t.always_s)
    assert (t.runs, t.loaded_runs) == (3, 3)


def test_a_tier_slower_than_the_prefill_costs_time_loaded_and_nothing_recomputed() -> None:
    t = _saved(Medium("slow", 0.5, 0.0))
    # each token reads in twice its prefill time: loading every hit costs 13 chunks' prefill
    assert t.always_s == pytest.approx(-13 * CHUNK / 1000)
    assert t.cost_s == 0.0 and t.loaded_runs == 0


def test_a_high_latency_tier_is_worth_reading_for_long_runs_only() -> None:
    # twice the break-even rate, 25 ms to the first byte: a chunk's prefill is 10 ms, so a run
    # needs > 5 chunks (plus the 10% margin) to win
    t = _saved(Medium("far", 2.0, 0.025))
    assert t.loaded_runs == 1  # the 8-chunk run
    assert t.cost_s == pytest.approx(8 * CHUNK / 1000 * 0.5 - 0.025)
    assert t.cost_s > max(t.always_s, 0.0)


def test_the_view_prices_with_the_products_cost_model(monkeypatch: pytest.MonkeyPatch) -> None:
    # a product margin that turns every load away shows in the view: no copy of the rule
    real = CostModel.__init__

    def strict(self: CostModel, *a: object, **kw: object) -> None:
        real(self, *a, **kw)  # type: ignore[arg-type]
        self.margin = 100.0

    monkeypatch.setattr(CostModel, "__init__", strict)
    t = _saved(Medium("fast", 10.0, 0.0))
    assert t.loaded_runs == 0 and t.cost_s == 0.0 and t.always_s > 0


def test_bench_cache_prints_the_cost_view_and_its_check(tmp_path: Path, capsys) -> None:
    small = [
        cache.Workload(
            "zipf pool", "small", lambda: workloads.prefix_pool(20, n_requests=300, zipf=1.0)
        )
    ]
    doc = cache.run(quick=True, trace=None, json_path=tmp_path / "c.json", workload_list=small)
    rows = doc["meta"]["cost"]
    assert [r["medium"] for r in rows] == [m.name for m in cache_cost.MEDIA]
    fast, slow = rows[0], rows[-1]
    assert fast["read_gbps"] > cache_cost.SHAPE.break_even_gbps() > slow["read_gbps"]
    assert fast["cost"] == pytest.approx(fast["always"]) and fast["cost"] > 0
    assert slow["always"] < 0 and slow["cost"] == 0 and slow["loaded_runs"] == 0
    checks = [r for r in doc["rows"] if r["id"].startswith(cache_cost.PREFIX)]
    assert len(checks) == len(cache_cost.MEDIA) and all(r["pass"] for r in checks)
    cache.print_table(doc)
    printed = capsys.readouterr().out
    assert "cost view: prefill time the hits save" in printed
    assert "target: the cost policy saves at least what loading every hit or none" in printed
