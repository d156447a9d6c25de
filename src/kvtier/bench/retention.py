"""`kvtier bench retention`: conversations that come back, with and without the client's hints.

Round-robin conversations, more than the host-memory tier holds, pass through a native server
with kvtier; a few of them (the "agents") belong to a client that knows it will come back. One
arm sends no hints; the other sends OpenAI's `prompt_cache_key` + `prompt_cache_retention` on
the agents' turns. Same prompts, same order, one at a time (so both arms run the same batch
shapes), same capacity. Reported: TTFT p50 of the agents' returning turns in both arms and
their ratio (target <= 0.6), the other conversations' TTFT (what the budget cost them),
prompt tokens served from cache, what the budget granted, and whether outputs are equal.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from kvtier.bench.analysis import percentile
from kvtier.bench.arms import ServerConfig
from kvtier.bench.client import completion_body
from kvtier.bench.e2e import ensure_model, model_config
from kvtier.bench.table import Report, Row, Target, write_json
from kvtier.bench.workload import RequestSpec

TTFT_TARGET = 0.6
CHUNK = 256
BYTES_PER_TOKEN = 4 * 2 * 2 * 64 * 4  # the tiny preset: 4 layers, K and V, 2 heads x 64, fp32
UNHINTED = "no hints"
HINTED = "hints"


@dataclass(frozen=True)
class Plan:
    """The workload and the capacity both arms share."""

    conversations: int = 16
    agents: int = 4  # the first `agents` conversations belong to the hinting client
    turns: int = 4
    first_tokens: int = 1536
    turn_tokens: int = 256
    tier_chunks: int = 96
    max_tokens: int = 4
    seed: int = 0


QUICK = Plan(conversations=8, agents=2, turns=3, first_tokens=1024, tier_chunks=24)
_BLOCK = 16


def hbm_blocks(plan: Plan) -> int:
    """An HBM pool that holds the longest request and little more: the conversations' history
    lives in the tier or nowhere."""
    longest = plan.first_tokens + (plan.turns - 1) * plan.turn_tokens + plan.max_tokens
    return -(-longest // _BLOCK) + 4


@dataclass
class Sent:
    """One request's outcome."""

    conversation: int
    turn: int
    ttft_s: float
    cached: int
    prompt_tokens: int
    tokens: list[int] = field(default_factory=list)
    retention: dict[str, Any] | None = None


def prompts(plan: Plan, vocab: int) -> list[tuple[int, int, list[int]]]:
    """(conversation, turn, prompt) in round-robin order: every turn t before any t + 1."""
    rng = np.random.default_rng([plan.seed, 28])
    convs = [rng.integers(3, vocab, plan.first_tokens).tolist() for _ in range(plan.conversations)]
    out = []
    for t in range(plan.turns):
        for c in range(plan.conversations):
            if t:
                convs[c] = convs[c] + rng.integers(3, vocab, plan.turn_tokens).tolist()
            out.append((c, t, list(convs[c])))
    return out


def _send(http: httpx.Client, body: dict[str, Any]) -> tuple[float, list[int], dict[str, Any]]:
    """Stream one completion: seconds to the first token, the tokens, the final usage."""
    t0 = time.perf_counter()
    first: float | None = None
    tokens: list[int] = []
    usage: dict[str, Any] = {}
    with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"request failed with {r.status_code}: {r.read()[:500]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            doc = json.loads(line[6:])
            for choice in doc.get("choices") or []:
                ids = choice.get("token_ids") or []
                if ids and first is None:
                    first = time.perf_counter() - t0
                tokens.extend(ids)
            if doc.get("usage"):
                usage = doc["usage"]
    if first is None:
        raise RuntimeError("the stream ended without a token")
    return first, tokens, usage


def run_arm(
    arm: str, plan: Plan, model: Path, out_dir: Path, say: Callable[[str], None]
) -> list[Sent]:
    """One server, the whole workload; hints on the agents' turns in the hinted arm."""
    env = {
        "KVTIER_CHUNK_SIZE": str(CHUNK),
        "KVTIER_MEMORY_BYTES": str(plan.tier_chunks * CHUNK * BYTES_PER_TOKEN),
        "KVTIER_DISK_BYTES": "0",
        "KVTIER_LOAD_GATE": "false",
    }
    server = ServerConfig(model, 1, hbm_blocks(plan), max_num_seqs=1, env=env)
    proc = server.process(out_dir / f"{arm}.log")
    sent: list[Sent] = []
    vocab = model_config(model)["vocab_size"]
    work = prompts(plan, vocab)
    with proc, httpx.Client(base_url=proc.base_url, timeout=120.0) as http:
        say(f"[{arm}] {len(work)} requests, one at a time")
        for c, t, prompt in work:
            body = completion_body(RequestSpec(0, HINTED, tuple(prompt), plan.max_tokens))
            if arm == HINTED and c < plan.agents:
                body["prompt_cache_key"] = f"agent-{c}"
                body["prompt_cache_retention"] = "in_memory"
            ttft, tokens, usage = _send(http, body)
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            sent.append(
                Sent(c, t, ttft, cached, usage.get("prompt_tokens", len(prompt)), tokens,
                     usage.get("kvtier_retention"))
            )  # fmt: skip
    return sent


def _p50(values: Sequence[float]) -> float:
    return percentile(values, 50) if values else 0.0


def run(
    *,
    quick: bool = False,
    model_dir: Path | None = None,
    json_path: Path | None = None,
    progress: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Both arms, then the report (also written as JSON)."""
    plan = QUICK if quick else Plan()
    model = ensure_model(model_dir, "tiny")
    out_dir = Path("runs") / "bench-retention"
    out_dir.mkdir(parents=True, exist_ok=True)
    arms = {arm: run_arm(arm, plan, model, out_dir, progress) for arm in (UNHINTED, HINTED)}
    report = _report(plan, arms)
    doc = report.to_json()
    write_json(json_path or Path("runs") / "bench-retention.json", doc)
    return doc


def _report(plan: Plan, arms: dict[str, list[Sent]]) -> Report:
    r = Report("retention", "kvtier bench retention: conversations that come back, hinted or not")
    base, hinted = arms[UNHINTED], arms[HINTED]

    def ttft(sent: list[Sent], agents: bool) -> list[float]:
        return [
            s.ttft_s * 1e3 for s in sent if s.turn > 0 and (s.conversation < plan.agents) == agents
        ]

    def cached_share(sent: list[Sent], agents: bool) -> float:
        picked = [s for s in sent if s.turn > 0 and (s.conversation < plan.agents) == agents]
        return 100.0 * sum(s.cached for s in picked) / max(1, sum(s.prompt_tokens for s in picked))

    n = r.note(
        f"{plan.conversations} conversations x {plan.turns} turns in round-robin order "
        f"({plan.first_tokens} tokens, then {plan.turn_tokens} more a turn; {plan.max_tokens} "
        f"output tokens), one request at a time; host-memory tier {plan.tier_chunks} chunks of "
        f"{CHUNK} tokens, no disk, HBM {hbm_blocks(plan)} blocks: the conversations do not fit. "
        f"The first {plan.agents} are an agent's, whose client sends prompt_cache_key and "
        "prompt_cache_retention=in_memory in the hinted arm"
    )
    a_base, a_hint = _p50(ttft(base, True)), _p50(ttft(hinted, True))
    r.add(Row("agents.ttft", f"agents' returning turns: TTFT p50, hints (raw: none) {n}", a_hint,
              "ms", raw=a_base, target=Target("ratio", "<=", TTFT_TARGET)))  # fmt: skip
    o_base, o_hint = _p50(ttft(base, False)), _p50(ttft(hinted, False))
    r.add(Row("others.ttft", "other conversations' returning turns: TTFT p50, hints (raw: none)",
              o_hint, "ms", raw=o_base))  # fmt: skip
    r.add(Row("agents.cached", "agents' returning turns: prompt tokens from cache, hints",
              cached_share(hinted, True), "%",
              detail={"no_hints": cached_share(base, True)}))  # fmt: skip
    r.add(Row("others.cached", "other conversations' returning turns: prompt tokens from cache, "
              "hints", cached_share(hinted, False), "%",
              detail={"no_hints": cached_share(base, False)}))  # fmt: skip
    granted = [s.retention["status"] for s in hinted if s.retention]
    statuses = {g: granted.count(g) for g in set(granted)}
    r.add(Row("granted", "hints granted in full (retained), of those sent",
              float(granted.count("retained")), "hints",
              detail={"sent": len(granted), "statuses": statuses}))  # fmt: skip
    equal = sum(a.tokens == b.tokens for a, b in zip(base, hinted, strict=True))
    r.add(Row("outputs.equal", "outputs equal between the arms (greedy)", float(equal),
              "requests", target=Target("value", ">=", float(len(base)))))  # fmt: skip
    r.meta["plan"] = plan.__dict__
    return r
