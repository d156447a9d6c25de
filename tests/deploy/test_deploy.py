"""deploy/: the Grafana dashboard and the Prometheus alert rules are well formed, and every
metric they use is exported by the native server and by vLLM with KVTierConnector (both read
after the tier served a hit), so no panel stays empty and no alert watches a name nobody sends."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import httpx
import pytest
import yaml

from kvtier.config import KVTierConfig
from kvtier.native import Engine, EngineConfig
from kvtier.native.offload import connector_spec
from kvtier.native.server import EngineServer
from tests.native.conftest import make_prompts

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "kvtier-dashboard.json"
ALERTS = DEPLOY / "prometheus" / "kvtier-alerts.yaml"
NAME = re.compile(r"\b(vllm:[a-zA-Z0-9_:]+|kvtier_[a-zA-Z0-9_]+)")
TIER_PANELS = ("Tier residency", "Cached prompt tokens by source", "Retrieved / stored",
               "Failures", "Lookups", "Skipped loads by reason")  # fmt: skip
ALERT_CLASSES = ("KVTierWrittenNeverRead", "KVTierVerifyFailures", "KVTierEngineWedged",
                 "KVTierBreakerOpen", "KVTierStatesNeverStored")  # fmt: skip


def dashboard_exprs() -> dict[str, list[str]]:
    doc = json.loads(DASHBOARD.read_text())
    return {p["title"]: [t["expr"] for t in p["targets"]] for p in doc["panels"] if "targets" in p}


def alert_rules() -> list[dict]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def used_names() -> set[str]:
    exprs = [e for es in dashboard_exprs().values() for e in es]
    exprs += [r["expr"] for r in alert_rules()]
    return {m for e in exprs for m in NAME.findall(e)}


def exported(text: str) -> set[str]:
    """Sample names a /metrics page carries, including families declared without samples yet
    (a labelled counter before its first increment) and a histogram's derived series."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            names.add(name)
            if kind == "histogram":
                names.update(f"{name}_{s}" for s in ("bucket", "sum", "count"))
            if kind == "counter" and not name.endswith("_total"):
                names.add(f"{name}_total")
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return names


@pytest.fixture(scope="module")
def native_metrics(tiny_vllm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """/metrics of a native server with kvtier after a two-pass run (the tier served hits)."""
    config = KVTierConfig(chunk_size=64, memory_bytes="64MiB", load_gate=False)
    spec = connector_spec(config, tiny_vllm_model, run_dir=tmp_path_factory.mktemp("deploy-run"))
    prompts = make_prompts(2, 200, seed=9)

    async def go(srv: EngineServer) -> str:
        transport = httpx.ASGITransport(app=srv.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvtier") as c:
            for _ in range(2):
                for p in prompts:
                    r = await c.post("/v1/completions", json={"prompt": p, "max_tokens": 2})
                    assert r.status_code == 200, r.text
                assert srv.loop.wait_idle(30.0)
                await c.post("/reset_prefix_cache")
            return (await c.get("/metrics")).text

    config_ = EngineConfig(num_threads=1, num_blocks=128, dtype="bfloat16")
    engine = Engine(tiny_vllm_model, config_, spec)
    with EngineServer(engine, model_name="tiny") as srv:
        return asyncio.run(go(srv))


def test_the_dashboard_and_the_alert_rules_are_well_formed():
    doc = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in doc["panels"] if p["type"] != "row"]
    assert len(ids) == len(set(ids)) >= 20
    panels = dashboard_exprs()
    for title in TIER_PANELS:
        assert title in panels, title
    assert "Time to first token" in panels and "Scheduler state" in panels
    for expr in [e for es in panels.values() for e in es] + [r["expr"] for r in alert_rules()]:
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
    rules = alert_rules()
    assert [r["alert"] for r in rules] == list(ALERT_CLASSES)
    for r in rules:
        assert r["labels"]["severity"] in ("warning", "critical") and r["annotations"]["summary"]


def test_every_metric_the_deploy_files_use_is_exported_by_both_hosts(native_metrics, vllm_served):
    names = used_names()
    assert {"vllm:prompt_tokens_cached_by_source_total", "kvtier_tier_residency_bytes",
            "kvtier_verify_failures_total", "kvtier_breaker_open"} <= names  # fmt: skip
    missing_native = sorted(names - exported(native_metrics))
    assert not missing_native, f"not exported by the native server: {missing_native}"
    missing_vllm = sorted(names - exported(vllm_served["metrics_text"]))
    assert not missing_vllm, f"not exported by vLLM with KVTierConnector: {missing_vllm}"
