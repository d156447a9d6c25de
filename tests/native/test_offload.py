"""The native engine with kvtier: restore from the tier, TP quorum, failures that recompute."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvtier.config import KVTierConfig
from kvtier.native import Engine, EngineConfig
from kvtier.native.offload import connector_spec
from tests.native.conftest import GREEDY


def kvtier_engine(model: Path, tmp_path: Path, tp: int = 1, **cfg) -> Engine:
    cfg.setdefault("chunk_size", 64)
    cfg.setdefault("memory_bytes", "64MiB")
    cfg.setdefault("load_gate", False)
    spec = connector_spec(KVTierConfig(**cfg), model, run_dir=tmp_path / f"run-tp{tp}")
    return Engine(model, EngineConfig(num_threads=1, tensor_parallel_size=tp, num_blocks=256), spec)


def scheduler_metric(eng: Engine, name: str, **labels: str) -> float:
    return eng.connector.metrics.value(name, **labels)


def rank_total(eng: Engine, name: str) -> float:
    """Sum of a kvtier counter over every rank, read from the merged /metrics collector."""
    total = 0.0
    for fam in eng.connector.collector.collect():
        for s in fam.samples:
            if s.name == f"kvtier_{name}" and s.labels.get("rank") not in (None, "scheduler"):
                total += s.value
    return total


@pytest.mark.parametrize("tp", [1, 2])
def test_two_pass_restore(tiny_model, tmp_path, prompts, baseline, tp, caplog):
    caplog.set_level(logging.INFO, logger="kvtier")
    with kvtier_engine(tiny_model, tmp_path, tp=tp) as eng:
        first = eng.generate(prompts, GREEDY)
        assert [o.output_token_ids for o in first] == baseline
        eng.reset_prefix_cache()
        before = eng.stats()
        second = eng.generate(prompts, GREEDY)
        after = eng.stats()
        assert [o.output_token_ids for o in second] == baseline
        prompt_tokens = sum(len(p) for p in prompts)
        ext = after["external_prefix_cache_hits"] - before["external_prefix_cache_hits"]
        assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == 0
        # 304-token prompts in 64-token chunks: 4 whole chunks (256 tokens) per prompt
        assert ext == 8 * 256
        assert ext >= 0.84 * prompt_tokens
        # identities on the drained engine
        assert (
            after["prefix_cache_queries"] - after["prefix_cache_hits"]
            == after["external_prefix_cache_queries"]
        )
        assert rank_total(eng, "retrieved_tokens_total") / tp == after["external_prefix_cache_hits"]
    retrieved = [r.getMessage() for r in caplog.records if "Retrieved" in r.getMessage()]
    if tp == 1:
        assert len(retrieved) == 8
    assert f"kvtier: lookup client on ranks {list(range(tp))} (world={tp})" in caplog.text
