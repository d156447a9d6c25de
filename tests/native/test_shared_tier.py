"""The shared tier at engine level: one engine writes behind to Valkey/Redis, a fresh process
restores the prefix from it; corrupted records and records of another namespace read as misses
(counted), never as KV bytes, and every request still gets the output of a run without offload.
Through a Redis Cluster (3 masters + 3 replicas) two engines share a prefix, and a master killed
mid-run costs hits only until its replica is promoted.

Run as a module (`python -m tests.native.test_shared_tier '<json>'`) this file is the driver of
the fresh engine process: it prints one `KVTIER_RESULT {json}` line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.native import Engine, EngineConfig
from kvtier.store import record
from kvtier.store.remote import RemoteTier
from tests.native.conftest import GREEDY, make_prompts
from tests.native.faults_connector import kvtier_engine, local_worker, rank_values
from tests.record_key import codec_for_tests
from tests.redis_cluster import flush, redis_cluster  # noqa: F401
from tests.redis_local import LocalCluster, RedisServer

REPO = Path(__file__).resolve().parents[2]
RESULT_PREFIX = "KVTIER_RESULT "
CHUNK = 64
PROMPT_LEN = 320  # 5 whole chunks: a full hit loads 319 tokens from all 5
CHUNKS = PROMPT_LEN // CHUNK
DRIVER_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def redis_module() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


@pytest.fixture
def store(redis_module: RedisServer) -> RedisServer:
    """The module's redis-server, emptied for this test."""
    admin = redis_module.client()
    admin.flushall()
    admin.close()
    return redis_module


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(4, PROMPT_LEN, seed=41)


@pytest.fixture(scope="module")
def reference(tiny_model: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy outputs of `prompts` on an engine without offload."""
    with Engine(tiny_model, EngineConfig(num_threads=1, num_blocks=256)) as eng:
        return [o.output_token_ids for o in eng.generate(prompts, GREEDY)]


def _remote(eng: Engine) -> RemoteTier:
    stack = local_worker(eng).stack
    assert stack is not None
    remote = stack.lower[-1]
    assert isinstance(remote, RemoteTier)
    return remote


def _prefix(remote: RemoteTier) -> bytes:
    """`kvtier:<namespace hex>:`, the server-side key prefix of `remote`'s namespace."""
    return remote.redis_key(bytes(record.KEY_BYTES))[: -2 * record.KEY_BYTES]


def _write(model: Path, run_dir: Path, url: str, prompts: list[list[int]]) -> list[list[int]]:
    """Serve `prompts` on a fresh engine writing to `url`; returns the outputs once every chunk
    was written behind (the engine is closed afterwards)."""
    with kvtier_engine(model, run_dir, remote_url=url) as eng:
        outs = [o.output_token_ids for o in eng.generate(prompts, GREEDY)]
        stack = local_worker(eng).stack
        assert stack is not None and stack.flush(10.0), "write-behind did not drain"
        assert _remote(eng).breaker.is_open is False
    return outs


# ---- a fresh process restores from the shared store -----------------------------------------


def test_fresh_process_restores_a_prefix_another_engine_wrote_to_the_shared_store(
    tiny_model, tmp_path, store, prompts, reference
):
    assert _write(tiny_model, tmp_path / "run-a", store.url, prompts) == reference
    admin = store.client()
    # every chunk of every prompt, plus the startup self-test chunk
    assert admin.dbsize() == len(prompts) * CHUNKS + 1
    admin.close()

    args = {
        "model": str(tiny_model),
        "run_dir": str(tmp_path / "run-b"),
        "remote_url": store.url,
        "prompts": prompts,
    }
    # another interpreter with another hash seed: the keys must still agree (invariant 3)
    env = {**os.environ, "PYTHONHASHSEED": "4242"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.native.test_shared_tier", json.dumps(args)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=DRIVER_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    assert len(lines) == 1, proc.stdout[-4000:]
    got = json.loads(lines[0][len(RESULT_PREFIX) :])

    assert got["pid"] != os.getpid()
    assert got["memory_chunks_at_start"] == 1  # only its own self-test chunk
    assert got["outputs"] == reference  # greedy outputs equal a recompute
    # every external hit came from the remote tier, on the engine's rank
    assert got["tier_hits"] == {"memory": 0, "remote": len(prompts) * CHUNKS}
    assert got["rank_remote_hits"] == {"0": len(prompts) * CHUNKS}
    stats = got["stats"]
    assert stats["external_prefix_cache_hits"] == len(prompts) * (PROMPT_LEN - 1)
    assert stats["prefix_cache_hits"] == 0
    assert stats["external_load_failures"] == 0


# ---- what must never reach a KV cache --------------------------------------------------------


def test_corrupted_remote_record_is_a_counted_miss_and_is_rewritten(
    tiny_model, tmp_path, store, prompts, reference
):
    two = prompts[:2]
    assert _write(tiny_model, tmp_path / "run-a", store.url, two) == reference[:2]
    admin = store.client()
    rkeys = list(admin.scan_iter(match="kvtier:*"))
    assert len(rkeys) == 2 * CHUNKS + 1
    for rkey in rkeys:  # one flipped payload byte per record
        at = record.HEADER_BYTES + 100
        byte = admin.getrange(rkey, at, at)
        admin.setrange(rkey, at, bytes([byte[0] ^ 0xFF]))

    with kvtier_engine(tiny_model, tmp_path / "run-b", remote_url=store.url) as eng:
        outs = [o.output_token_ids for o in eng.generate(two, GREEDY)]
        assert outs == reference[:2]
        m = local_worker(eng).metrics
        # each load stops at its first chunk, which fails verification: a miss, never KV bytes
        assert m.value("verify_failures_total", tier="remote", reason="tag_mismatch") == 2
        assert m.value("tier_hits_total", tier="remote") == 0
        assert eng.connector.metrics.value("load_failures_total", reason="miss") == 2
        assert rank_values(eng, "verify_failures_total", tier="remote") == {"0": 2.0}
        assert eng.stats()["external_prefix_cache_hits"] == 0
        # the recompute saved the chunks again: the store holds only good records now
        stack = local_worker(eng).stack
        assert stack is not None and stack.flush(10.0)
        rkeys = list(admin.scan_iter(match="kvtier:*"))
        assert len(rkeys) == 2 * CHUNKS + 1
        for rkey in rkeys:
            data = admin.get(rkey)
            head = record.decode_header(data)
            codec_for_tests(head.namespace).open(data, head.key)
    admin.close()


def test_records_of_another_namespace_read_as_misses(
    tiny_model, tmp_path, store, prompts, reference
):
    two = prompts[:2]
    _write(tiny_model, tmp_path / "run-a", store.url, two)
    admin = store.client()
    with kvtier_engine(tiny_model, tmp_path / "run-a2", remote_url=store.url) as eng:
        prefix_a = _prefix(_remote(eng))

    # another tenant on the same store: its keys live under another namespace
    with kvtier_engine(tiny_model, tmp_path / "run-t", remote_url=store.url, tenant="other") as eng:
        remote = _remote(eng)
        prefix_t = _prefix(remote)
        assert prefix_t != prefix_a
        m = local_worker(eng).metrics
        sm = eng.connector.metrics
        self_test_hits = sm.value("lookup_hit_tokens_total")  # the startup self-test's lookup
        (out,) = eng.generate([two[0]], GREEDY)
        assert out.output_token_ids == reference[0]
        assert eng.stats()["external_prefix_cache_hits"] == 0  # plainly separate
        assert sm.value("lookup_hit_tokens_total") == self_test_hits
        stack = local_worker(eng).stack
        assert stack is not None and stack.flush(10.0)

        # a hostile or confused writer copies tenant A's records under this tenant's keys
        copied = 0
        for rkey in admin.scan_iter(match=prefix_a + b"*"):
            # NX: the records this tenant wrote for the first prompt stay its own
            copied += bool(admin.set(prefix_t + rkey[len(prefix_a) :], admin.get(rkey), nx=True))
        assert copied == CHUNKS  # the second prompt's chunks (both tenants wrote the rest)
        eng.reset_prefix_cache()
        (out,) = eng.generate([two[1]], GREEDY)
        assert out.output_token_ids == reference[1]
        # the lookup counts the copies (Redis holds them under this tenant's keys) ...
        assert sm.value("lookup_hit_tokens_total") - self_test_hits == CHUNKS * CHUNK
        # ... but the load's verified read rejects them: a counted miss, never KV bytes
        assert m.value("verify_failures_total", tier="remote", reason="namespace_mismatch") == 1
        assert m.value("tier_hits_total", tier="remote") == 0
        assert sm.value("load_failures_total", reason="miss") == 1
        assert eng.stats()["external_prefix_cache_hits"] == 0
    admin.close()


# ---- through a Redis Cluster ------------------------------------------------------------------


def _remote_hits(eng: Engine) -> float:
    return local_worker(eng).metrics.value("tier_hits_total", tier="remote")


def test_two_engines_share_a_prefix_through_the_cluster(
    tiny_model, tmp_path, redis_cluster, prompts, reference  # noqa: F811
):
    flush(redis_cluster)
    assert _write(tiny_model, tmp_path / "run-a", redis_cluster.url, prompts) == reference
    # the chunks spread over every shard (no hash tag pins a prefix on one)
    held = [redis_cluster.node(m).client().dbsize() for m in redis_cluster.masters()]
    assert sum(held) == len(prompts) * CHUNKS + 1 and all(n > 0 for n in held), held

    with kvtier_engine(tiny_model, tmp_path / "run-b", remote_url=redis_cluster.url) as eng:
        outs = [o.output_token_ids for o in eng.generate(prompts, GREEDY)]
        assert outs == reference
        assert _remote_hits(eng) == len(prompts) * CHUNKS
        stats = eng.stats()
        assert stats["external_prefix_cache_hits"] == len(prompts) * (PROMPT_LEN - 1)
        assert stats["external_load_failures"] == 0
        assert not _remote(eng).breaker.is_open


def test_master_killed_mid_run_costs_hits_until_its_replica_is_promoted(
    tiny_model, tmp_path, redis_cluster: LocalCluster, prompts, reference  # noqa: F811
):
    """Runs last in the module: it leaves the cluster with a promoted replica."""
    flush(redis_cluster)
    _write(tiny_model, tmp_path / "run-a", redis_cluster.url, prompts)
    redis_cluster.sync_replicas()
    cfg = {"remote_url": redis_cluster.url, "breaker_failures": 2, "breaker_probe_s": 0.2}
    with kvtier_engine(tiny_model, tmp_path / "run-b", **cfg) as eng:
        m = local_worker(eng).metrics
        # B is up (its self-test went through the cluster) when one master dies
        victim = redis_cluster.masters()[0]
        redis_cluster.node(victim).kill()
        outs = [o.output_token_ids for o in eng.generate(prompts, GREEDY)]
        # requests complete with the outputs of a recompute; only the dead shard cost hits
        assert outs == reference
        assert _remote_hits(eng) < len(prompts) * CHUNKS
        assert m.total("store_failures_total", tier="remote") > 0
        assert set(_remote(eng).breaker.open_shards()) <= {victim}
        assert eng.stats()["external_load_failures"] == m.total("load_failures_total")
        promoted = redis_cluster.fail_master(victim)
        assert promoted != victim

    # after promotion a fresh engine finds every chunk: nothing was lost, hits resume
    with kvtier_engine(tiny_model, tmp_path / "run-c", **cfg) as eng:
        outs = [o.output_token_ids for o in eng.generate(prompts, GREEDY)]
        assert outs == reference
        assert _remote_hits(eng) == len(prompts) * CHUNKS
        assert eng.stats()["external_load_failures"] == 0
        assert not _remote(eng).breaker.is_open


# ---- the fresh process ------------------------------------------------------------------------


def main() -> None:
    """Driver: serve the prompts on a fresh TP=1 engine (empty memory, no disk, the shared
    remote) and print outputs, stats and tier hits as one result line."""
    args: dict[str, Any] = json.loads(sys.argv[1])
    eng = kvtier_engine(Path(args["model"]), Path(args["run_dir"]), remote_url=args["remote_url"])
    try:
        stack = local_worker(eng).stack
        assert stack is not None
        m = local_worker(eng).metrics
        memory_chunks = len(stack.memory)
        # the startup self-test read its chunk from memory: count only what serving adds
        before = {tier: m.value("tier_hits_total", tier=tier) for tier in stack.tiers}
        outs = [o.output_token_ids for o in eng.generate(args["prompts"], GREEDY)]
        result = {
            "pid": os.getpid(),
            "memory_chunks_at_start": memory_chunks,
            "outputs": outs,
            "tier_hits": {t: m.value("tier_hits_total", tier=t) - n for t, n in before.items()},
            # what /metrics shows per rank
            "rank_remote_hits": rank_values(eng, "tier_hits_total", tier="remote"),
            "stats": eng.stats(),
        }
    finally:
        eng.close()
    sys.stdout.flush()
    print(RESULT_PREFIX + json.dumps(result, sort_keys=True), flush=True)


if __name__ == "__main__":
    main()
