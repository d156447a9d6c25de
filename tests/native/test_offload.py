"""The native engine with kvtier: restore from the tier, TP quorum, failures that recompute."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.native import Engine, EngineConfig
from kvtier.native.offload import connector_spec
from kvtier.offload.selftest import SELF_TEST_KEY
from tests.native.conftest import GREEDY, make_prompts
from tests.record_key import RECORD_KEY


def kvtier_engine(model: Path, tmp_path: Path, tp: int = 1, **cfg) -> Engine:
    cfg.setdefault("chunk_size", 64)
    if "remote_url" in cfg:
        cfg.setdefault("record_key", RECORD_KEY)
    cfg.setdefault("memory_bytes", "64MiB")
    cfg.setdefault("load_gate", False)
    # exact hit counts below: on 2 oversubscribed cores a rank's lookup thread can miss 200 ms
    cfg.setdefault("lookup_timeout_ms", 2000)
    spec = connector_spec(KVTierConfig(**cfg), model, run_dir=tmp_path / f"run-tp{tp}")
    return Engine(model, EngineConfig(num_threads=1, tensor_parallel_size=tp, num_blocks=256), spec)


def rank_samples(eng: Engine, sample: str) -> dict[str, float]:
    """Per-rank values of one sample from the merged /metrics collector."""
    out = {}
    for fam in eng.connector.collector.collect():
        for s in fam.samples:
            if s.name == sample and s.labels.get("rank") != "scheduler":
                out[s.labels["rank"]] = s.value
    return out


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


@pytest.fixture(scope="module")
def whole_chunk_prompts() -> list[list[int]]:
    """8 prompts of 5 whole 64-token chunks: pass 2 can restore all but the last token."""
    return make_prompts(8, 320, seed=5)


@pytest.fixture(scope="module")
def whole_chunk_baseline(tiny_model, whole_chunk_prompts) -> list[list[int]]:
    with Engine(tiny_model, EngineConfig(num_threads=1)) as eng:
        return [o.output_token_ids for o in eng.generate(whole_chunk_prompts, GREEDY)]


@pytest.mark.parametrize("tp", [1, 2])
def test_two_pass_restore(
    tiny_model, tmp_path, whole_chunk_prompts, whole_chunk_baseline, tp, caplog, capfd
):
    caplog.set_level(logging.INFO, logger="kvtier")
    prompts, baseline = whole_chunk_prompts, whole_chunk_baseline
    with kvtier_engine(tiny_model, tmp_path, tp=tp) as eng:
        first = eng.generate(prompts, GREEDY)
        assert [o.output_token_ids for o in first] == baseline
        eng.reset_prefix_cache()
        before = eng.stats()
        second = eng.generate(prompts, GREEDY)
        after = eng.stats()
        # greedy outputs equal a run with offload off, token for token
        assert [o.output_token_ids for o in second] == baseline
        prompt_tokens = sum(len(p) for p in prompts)
        ext = after["external_prefix_cache_hits"] - before["external_prefix_cache_hits"]
        assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == 0
        assert ext == 8 * 319  # a full-prompt hit still computes the last token
        assert ext >= 0.99 * prompt_tokens
        # identities on the drained engine
        assert (
            after["prefix_cache_queries"] - after["prefix_cache_hits"]
            == after["external_prefix_cache_queries"]
        )
        assert rank_total(eng, "retrieved_tokens_total") / tp == after["external_prefix_cache_hits"]
    if tp == 1:
        retrieved = [r.getMessage() for r in caplog.records if "Retrieved" in r.getMessage()]
    else:  # TP ranks log in their own processes, onto the stderr they share with the engine
        retrieved = [ln for ln in capfd.readouterr().err.splitlines() if "Retrieved" in ln]
    for r in range(tp):
        mine = [m for m in retrieved if f"kvtier[rank {r}/{tp}]: Retrieved" in m]
        assert len(mine) == 8, retrieved
        assert all("Retrieved 319 of 319 required tokens" in m for m in mine)
    assert f"kvtier: lookup client on ranks {list(range(tp))} (world={tp})" in caplog.text


def _worker(eng: Engine):
    """The in-process OffloadWorker of a TP=1 engine."""
    return eng.executor.runner.connector.worker


def test_tp2_both_ranks_retrieve_evenly(tiny_model, tmp_path, prompts, baseline):
    with kvtier_engine(tiny_model, tmp_path, tp=2) as eng:
        eng.generate(prompts, GREEDY)
        eng.reset_prefix_cache()
        assert [o.output_token_ids for o in eng.generate(prompts, GREEDY)] == baseline
        per_rank = {}
        loads = {}
        for fam in eng.connector.collector.collect():
            for s in fam.samples:
                if s.labels.get("rank") == "scheduler":
                    continue
                if s.name == "kvtier_retrieved_tokens_total":
                    per_rank[s.labels["rank"]] = s.value
                if s.name == "kvtier_load_seconds_count":
                    loads[s.labels["rank"]] = s.value
        assert per_rank == {"0": 8 * 256, "1": 8 * 256}
        assert loads == {"0": 8, "1": 8}


def test_corrupted_tier_bytes_are_detected_counted_and_recomputed(
    tiny_model, tmp_path, prompts, baseline
):
    with kvtier_engine(tiny_model, tmp_path, verify_memory_reads=True) as eng:
        eng.generate(prompts, GREEDY)
        memory = _worker(eng).stack.memory
        keys = list(memory._index)  # every chunk stored by pass 1 (and the self-test chunk)
        memory.lease("test", keys)
        for key in keys:
            memory.view(key)[100:164] ^= 0x5A
        memory.release("test")
        eng.reset_prefix_cache()
        outs = eng.generate(prompts, GREEDY)
        assert [o.output_token_ids for o in outs] == baseline
        m = _worker(eng).metrics
        assert m.value("verify_failures_total", tier="memory", reason="checksum_mismatch") == 8
        assert scheduler_metric(eng, "load_failures_total", reason="miss") == 8
        assert eng.stats()["external_prefix_cache_hits"] == 0


def test_lookup_server_killed_mid_run_costs_hits_not_requests(
    tiny_model, tmp_path, prompts, baseline
):
    with kvtier_engine(tiny_model, tmp_path, lookup_timeout_ms=50) as eng:
        eng.generate(prompts[:4], GREEDY)
        _worker(eng).server.close()  # rank 0's lookup server dies
        eng.reset_prefix_cache()
        outs = eng.generate(prompts, GREEDY)
        assert [o.output_token_ids for o in outs] == baseline
        # the 4 prompts saved before ask the ranks and time out on rank 0; the 8 never saved
        # are misses known without asking (a memory-only tier has no other writer)
        assert scheduler_metric(eng, "lookup_timeouts_total", target="0") == 4
        assert scheduler_metric(eng, "skipped_loads_total", reason="lookup_timeout") == 4
        assert scheduler_metric(eng, "cold_lookups_total") == 8
        assert eng.stats()["requests_finished"] == 12


def test_load_failing_on_one_rank_fails_the_op_recomputes_and_saves_again(
    tiny_model, tmp_path, prompts, baseline
):
    # exact hit counts, as kvtier_engine's: a loaded host's rank can miss 200 ms
    config = KVTierConfig(
        chunk_size=64,
        memory_bytes="64MiB",
        load_gate=False,
        verify_memory_reads=True,
        lookup_timeout_ms=2000,
    )
    base = connector_spec(config, tiny_model, run_dir=tmp_path / "run")
    spec = ("tests.native.faulty:build", {**base.args, "fail_rank": 1})
    cfg = EngineConfig(num_threads=1, tensor_parallel_size=2, num_blocks=256)
    with Engine(tiny_model, cfg, spec) as eng:
        eng.generate(prompts[:1], GREEDY)
        eng.reset_prefix_cache()
        (out,) = eng.generate(prompts[:1], GREEDY)
        assert out.output_token_ids == baseline[0]
        assert scheduler_metric(eng, "load_failures_total", reason="miss") == 1
        assert eng.stats()["external_prefix_cache_hits"] == 0
        stored = rank_samples(eng, "kvtier_stored_tokens_total")
        assert stored["1"] == 256 + 64  # the corrupted chunk, dropped on read, saved again
        # the recompute saved the chunk again: a third pass loads everything on every rank
        eng.reset_prefix_cache()
        (out,) = eng.generate(prompts[:1], GREEDY)
        assert out.output_token_ids == baseline[0]
        assert eng.stats()["external_prefix_cache_hits"] == 256
        # rank 0's half-successful load of pass 2 is not counted: the identity still closes
        assert rank_total(eng, "retrieved_tokens_total") / 2 == 256


def test_a_codec_that_cannot_move_a_block_stops_startup(
    tiny_model, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvtier.errors import StartupError
    from kvtier.offload.codec import PageCodec

    monkeypatch.setattr(PageCodec, "scatter", lambda self, src, block_ids: 0)
    with pytest.raises(StartupError, match=r"rank 0/1\]: self-test failed on device cpu"):
        kvtier_engine(tiny_model, tmp_path)


def _other_weights(model: Path, dest: Path) -> Path:
    """A copy of `model` under the same directory name and config.json, with perturbed weights."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = dest / model.name
    shutil.copytree(model, out)
    g = torch.Generator().manual_seed(99)
    weights = load_file(str(out / "model.safetensors"))
    perturbed = {
        k: v + 0.5 * v.std() * torch.randn(v.shape, generator=g) for k, v in weights.items()
    }
    save_file(perturbed, str(out / "model.safetensors"))
    return out


def test_other_weights_under_the_same_config_and_dir_name_miss_a_shared_disk_tier(
    tiny_model, tmp_path, whole_chunk_prompts, whole_chunk_baseline
):
    # issue 10 item 2: a persistent disk tier outlives the weights it was written with
    other = _other_weights(tiny_model, tmp_path / "b")
    assert (other / "config.json").read_bytes() == (tiny_model / "config.json").read_bytes()
    prompts = whole_chunk_prompts[:4]
    disk = {"disk_dir": str(tmp_path / "disk"), "disk_bytes": "64MiB"}
    with kvtier_engine(tiny_model, tmp_path / "a", **disk) as eng:
        assert [o.output_token_ids for o in eng.generate(prompts, GREEDY)] == (
            whole_chunk_baseline[:4]
        )
        assert eng.executor.runner.connector.worker.stack.flush(10.0)
    with Engine(other, EngineConfig(num_threads=1)) as plain:
        expected = [o.output_token_ids for o in plain.generate(prompts, GREEDY)]
    assert expected != whole_chunk_baseline[:4]  # the weights really differ
    with kvtier_engine(other, tmp_path / "b", **disk) as eng:
        out = eng.generate(prompts, GREEDY)
        assert [o.output_token_ids for o in out] == expected
        assert eng.stats()["external_prefix_cache_hits"] == 0
        assert all(o.num_external_tokens == 0 for o in out)
    # the first weights still find their own chunks on the same disk
    with kvtier_engine(tiny_model, tmp_path / "c", **disk) as eng:
        eng.generate(prompts, GREEDY)
        assert eng.stats()["external_prefix_cache_hits"] == 4 * (320 - 1)


def test_chunk_larger_than_the_engines_max_model_len_is_a_startup_error(tiny_model, tmp_path):
    spec = connector_spec(KVTierConfig(chunk_size=512), tiny_model, run_dir=tmp_path / "run")
    cfg = EngineConfig(num_threads=1, num_blocks=64, max_model_len=256)
    with pytest.raises(ConfigError, match=r"chunk_size=512 is larger than .*max_model_len=256"):
        Engine(tiny_model, cfg, spec)


def test_tcp_lookups_listen_on_lookup_base_port(tiny_model, tmp_path, prompts, baseline):
    from kvtier.bench.ports import free_port

    port = free_port()
    with kvtier_engine(tiny_model, tmp_path, lookup_transport="tcp", lookup_base_port=port) as eng:
        assert _worker(eng).lookup_endpoint == f"tcp://127.0.0.1:{port}"
        eng.generate(prompts[:2], GREEDY)
        eng.reset_prefix_cache()
        assert [o.output_token_ids for o in eng.generate(prompts[:2], GREEDY)] == baseline[:2]
        assert eng.stats()["external_prefix_cache_hits"] == 2 * 256


# a share no load exceeds: every load after the first measured step runs inside its forward
ALWAYS_SYNC = {"sync_load_fraction": 1e9}


def test_sync_loads_finish_inside_the_forward_of_their_step(
    tiny_model, tmp_path, whole_chunk_prompts, whole_chunk_baseline, caplog
):
    caplog.set_level(logging.INFO, logger="kvtier")
    prompts = whole_chunk_prompts
    with kvtier_engine(tiny_model, tmp_path, **ALWAYS_SYNC) as eng:
        eng.generate(prompts, GREEDY)
        eng.reset_prefix_cache()
        before = eng.stats()
        second = eng.generate(prompts, GREEDY)
        after = eng.stats()
        assert [o.output_token_ids for o in second] == whole_chunk_baseline
        ext = after["external_prefix_cache_hits"] - before["external_prefix_cache_hits"]
        assert ext == 8 * 319
        # every load ran in its request's first step: none parked it, each counted once
        assert scheduler_metric(eng, "sync_loads_total") == 8
        assert scheduler_metric(eng, "load_parked_steps_count") == 8
        assert scheduler_metric(eng, "load_parked_steps_sum") == 0
        assert rank_total(eng, "retrieved_tokens_total") == after["external_prefix_cache_hits"]
    lines = [r.getMessage() for r in caplog.records if "Retrieved" in r.getMessage()]
    assert len(lines) == 8
    assert all("Retrieved 319 of 319" in m and m.endswith("in the forward)") for m in lines)


def test_a_failed_sync_load_is_recomputed_in_the_next_step(tiny_model, tmp_path, prompts, baseline):
    with kvtier_engine(tiny_model, tmp_path, verify_memory_reads=True, **ALWAYS_SYNC) as eng:
        eng.generate(prompts, GREEDY)
        memory = _worker(eng).stack.memory
        keys = list(memory._index)
        memory.lease("test", keys)
        for key in keys:
            memory.view(key)[100:164] ^= 0x5A
        memory.release("test")
        eng.reset_prefix_cache()
        outs = eng.generate(prompts, GREEDY)
        # the forward of the failed loads' step read bad blocks; the engine threw that step's
        # work for them away and recomputed from the first bad block: same greedy outputs
        assert [o.output_token_ids for o in outs] == baseline
        assert scheduler_metric(eng, "sync_loads_total") == 8
        assert scheduler_metric(eng, "load_failures_total", reason="miss") == 8
        assert eng.stats()["external_prefix_cache_hits"] == 0
        assert eng.stats()["external_load_failures"] == 8
        assert rank_total(eng, "retrieved_tokens_total") == 0


def test_an_encrypted_disk_tier_restores_exactly_and_holds_no_plaintext(
    tiny_model, tmp_path, whole_chunk_prompts, whole_chunk_baseline
):
    """encrypt_at_rest: the disk tier holds AES-GCM records only (no chunk's KV bytes appear in
    any file), restores pass 2 from them token for token, and a record altered on disk is a
    counted miss that recomputes."""
    prompts = whole_chunk_prompts[:4]
    disk = tmp_path / "disk"
    # a memory tier of a few chunks: most of pass 2 comes from the disk
    with kvtier_engine(tiny_model, tmp_path, memory_bytes="1MiB", disk_dir=str(disk),
                       disk_bytes="64MiB", encrypt_at_rest=True) as eng:  # fmt: skip
        first = [o.output_token_ids for o in eng.generate(prompts, GREEDY)]
        stack = _worker(eng).stack
        assert stack is not None and stack.flush(30.0)
        memory = stack.memory
        sample = next(k for k in memory._index if k != SELF_TEST_KEY)
        plain = bytes(memory.get(sample) or b"")
        files = sorted(disk.rglob("*.kvr"))
        assert files and len(plain) > 4096
        for f in files:
            assert plain[1024:1088] not in f.read_bytes()  # ciphertext only on disk
        eng.reset_prefix_cache()
        second = [o.output_token_ids for o in eng.generate(prompts, GREEDY)]
        m = _worker(eng).metrics
        assert m.value("tier_hits_total", tier="disk") > 0
        # an altered record of a chunk only the disk holds: its tag fails, a counted miss
        only_disk = [f for f in files if bytes.fromhex(f.stem) not in memory._index]
        assert only_disk
        for f in only_disk:
            raw = bytearray(f.read_bytes())
            raw[-1] ^= 0x01
            f.write_bytes(raw)
        eng.reset_prefix_cache()
        third = [o.output_token_ids for o in eng.generate(prompts, GREEDY)]
        assert m.value("verify_failures_total", tier="disk", reason="tag_mismatch") >= 1
    assert first == second == third == whole_chunk_baseline[:4]
