"""No hook failure and no request id ends the engine (invariant 18), on the native engine with
kvtier: a request id of any length or content restores from the tier, and an exception raised
inside each kvtier hook in turn costs the victim request its tier hit (it recomputes, with the
right tokens) while every other request keeps its hits and the engine keeps serving."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvtier.config import KVTierConfig
from kvtier.native import Engine, EngineConfig
from kvtier.native.connector import ConnectorSpec
from kvtier.native.offload import connector_spec
from tests.native.conftest import GREEDY, make_prompts
from tests.native.hook_faults import SCHEDULER, WORKER

PROMPTS = make_prompts(4, 192, seed=21)  # three whole 64-token chunks each
ODD_IDS = ["x" * 300, "a#lk1", "line\nbreak\x1b[2J", "ünïcødé-" * 40]


def _engine(model: Path, tmp: Path, connector: dict[str, str] | None = None) -> Engine:
    config = KVTierConfig(chunk_size=64, memory_bytes="64MiB", load_gate=False,
                          lookup_timeout_ms=2000)  # fmt: skip
    spec = connector_spec(config, model, run_dir=tmp / "run")
    if connector is not None:
        spec = ConnectorSpec("tests.native.hook_faults:build", {**spec.args, **connector})
    return Engine(model, EngineConfig(num_threads=1, num_blocks=256), spec)


def _run(eng: Engine, ids: list[str]) -> dict[str, list[int]]:
    """The prompts under `ids`, to completion: their greedy tokens by id."""
    for rid, prompt in zip(ids, PROMPTS, strict=True):
        eng.add_request(prompt, GREEDY, request_id=rid)
    done: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.output_token_ids
    return done


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> list[list[int]]:
    with Engine(tiny_model, EngineConfig(num_threads=1)) as eng:
        return [o.output_token_ids for o in eng.generate(PROMPTS, GREEDY)]


def test_request_ids_of_any_length_or_content_restore_from_the_tier(
    tiny_model: Path, tmp_path: Path, reference: list[list[int]], caplog: pytest.LogCaptureFixture
) -> None:
    """A 300-character request id (a client's X-Request-Id) ended the engine: the lookup id
    was built from it and the lookup client refuses ids over 256 characters."""
    caplog.set_level(logging.INFO, logger="kvtier")
    with _engine(tiny_model, tmp_path) as eng:
        first = _run(eng, ODD_IDS)
        eng.reset_prefix_cache()
        before = eng.stats()["external_prefix_cache_hits"]
        second = _run(eng, ODD_IDS)
        hits = eng.stats()["external_prefix_cache_hits"] - before
    assert [first[i] for i in ODD_IDS] == [second[i] for i in ODD_IDS] == reference
    assert hits == 4 * 191  # every prompt but its last token came from the tier
    # client text never reaches a log line raw: no newline or escape sequence from an id
    assert not [r for r in caplog.records if "\x1b" in r.getMessage()]


@pytest.mark.parametrize("hook", [*SCHEDULER, *WORKER])
def test_a_hook_that_raises_costs_one_request_never_the_engine(
    hook: str, tiny_model: Path, tmp_path: Path, reference: list[list[int]]
) -> None:
    victim = "victim"
    ids = ["r0", victim, "r2", "r3"]
    # saves fail in pass 1 (the victim's chunks never reach the tier), loads in pass 2
    with _engine(tiny_model, tmp_path, {"fail_hook": hook, "victim": victim}) as eng:
        first = _run(eng, ids)
        eng.reset_prefix_cache()
        before = eng.stats()["external_prefix_cache_hits"]
        second = _run(eng, [f"{i}-2" if i != victim else victim for i in ids])
        hits = eng.stats()["external_prefix_cache_hits"] - before
        # the engine serves on: a third pass, every request answered
        third = _run(eng, ["t0", "t1", "t2", "t3"])
        # the scheduler's and the rank's counters, as /metrics shows them merged
        errors = sum(
            s.value
            for fam in eng.connector.collector.collect()
            for s in fam.samples
            if s.name == "kvtier_hook_errors_total"
        )
    # every request got the right tokens, the victim included (it recomputed)
    assert list(first.values()) and sorted(first) == sorted(ids)
    assert [first[i] for i in ids] == reference
    assert [second[k] for k in sorted(second)] == [reference[i] for i in (0, 2, 3, 1)]
    assert [third[i] for i in ("t0", "t1", "t2", "t3")] == reference
    assert errors >= 1, "the failure was not counted"
    # the other requests kept their hits (a rank that degraded serves on without the tier)
    if hook not in ("get_finished", "build_connector_worker_meta"):
        assert hits >= 3 * 191, hits
