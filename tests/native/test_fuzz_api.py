"""The native server's HTTP API fuzzed from its own OpenAPI document (schemathesis): every
operation, with bodies that fit the schema and bodies that do not. No answer may be a 5xx
(nor carry a 5xx error event inside a 200 stream), none may be larger than `MAX_RESPONSE`, and
afterwards the server is healthy and serves a plain completion. Bounded in examples and in
time (`BUDGET_S`), on the tiny float32 model."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from kvtier.native import Engine
from kvtier.native.chat_template import RESERVED
from kvtier.native.openai_requests import ServerLimits
from kvtier.native.server import EngineServer

BUDGET_S = 20.0  # generation stops here; the whole test stays under 30 s on 2 cores
MAX_RESPONSE = 4 * 2**20
EXAMPLES = {"POST": 50, "GET": 5}  # per operation and generation mode (deterministic)
FUZZED = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]


@pytest.fixture
def fuzz_server(make_engine: Callable[..., Engine]) -> Iterator[EngineServer]:
    """A server whose limits keep any request short: 256-token context, 32 queued sequences."""
    limits = ServerLimits(max_queued_seqs=32)
    engine = make_engine(num_blocks=16, max_num_seqs=8)
    with EngineServer(engine, model_name="tiny", limits=limits) as srv:
        yield srv


def server_errors(response: Any) -> list[str]:
    """5xx statuses, and 5xx error events inside a stream, of one response."""
    found = []
    if response.status_code >= 500:
        found.append(f"status {response.status_code}: {response.text[:300]}")
    content_type = (response.headers.get("content-type") or [""])[0]
    if content_type.startswith("text/event-stream"):
        for block in response.text.split("\n\n"):
            payload = block.removeprefix("data: ").strip()
            if payload.startswith("{"):
                code = json.loads(payload).get("error", {}).get("code", 0)
                if isinstance(code, int) and code >= 500:
                    found.append(f"stream event {payload[:300]}")
    return found


def _servable_completion(case: Any) -> Any:
    if isinstance(case.body, dict):
        case.body = {**case.body, "model": "tiny", "prompt": "ka ro mi"}
    return case


def _servable_chat(case: Any) -> Any:
    if isinstance(case.body, dict):
        messages = [{"role": "user", "content": "ka ro mi"}]
        case.body = {**case.body, "model": "tiny", "messages": messages}
    return case


SERVABLE = {"/v1/completions": _servable_completion, "/v1/chat/completions": _servable_chat}
# names worth trying as chat_template_kwargs keys: the renderer's own, and common ones
KWARG_NAMES = sorted(RESERVED | {"enable_thinking", "date_string", "custom_tools"})


def _with_kwarg(case: Any, name: str) -> Any:
    case = _servable_chat(case)
    if isinstance(case.body, dict):
        case.body = {**case.body, "chat_template_kwargs": {name: True}}
    return case


def fuzz(
    operation: Any, mode: GenerationMode, deadline: float, seen: dict[str, int],
    failures: list[str],
) -> None:  # fmt: skip
    """Run one operation's examples of one generation mode; counts statuses into `seen`."""
    label = f"{operation.method.upper()} {operation.path}"
    cases = operation.as_strategy(generation_mode=mode)
    if mode is GenerationMode.POSITIVE and operation.path in SERVABLE:
        # half the cases get a prompt this model can serve, so the fuzz reaches the engine
        servable = [cases.map(SERVABLE[operation.path])]
        if operation.path == "/v1/chat/completions":
            servable.append(st.builds(_with_kwarg, cases, st.sampled_from(KWARG_NAMES)))
        cases = st.one_of(cases, *servable)

    @settings(
        max_examples=EXAMPLES.get(operation.method.upper(), 5), deadline=None, database=None,
        phases=[Phase.generate], derandomize=True, suppress_health_check=list(HealthCheck),
    )  # fmt: skip
    @given(case=cases)
    def run(case: Any) -> None:
        if time.monotonic() > deadline:
            return  # the time budget is spent: the remaining examples pass untried
        response = case.call()
        key = f"{label} {response.status_code}"
        seen[key] = seen.get(key, 0) + 1
        failures.extend(f"{label}: {problem}" for problem in server_errors(response))
        if len(response.content) > MAX_RESPONSE:
            failures.append(f"{key}: {len(response.content)} bytes")

    run()


def test_the_api_fuzzed_from_its_schema_never_answers_5xx(fuzz_server: EngineServer):
    srv = fuzz_server
    schema = schemathesis.openapi.from_asgi("/openapi.json", srv.app)
    doc = srv.app.openapi()
    for path in FUZZED:  # the bodies the routes parse themselves are in the document
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert ref["$ref"].split("/")[-1] in doc["components"]["schemas"], path
    deadline = time.monotonic() + BUDGET_S
    seen: dict[str, int] = {}
    failures: list[str] = []

    for result in schema.get_all_operations():
        operation = result.ok()
        # bodies that break the schema exist only where there is a body
        has_body = operation.method.upper() == "POST" and operation.path in FUZZED
        modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
        for mode in modes if has_body else modes[:1]:
            fuzz(operation, mode, deadline, seen, failures)

    assert not failures, failures[:10]
    # the fuzz reached the engine and the validators, and the server lives on
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert seen.get(f"POST {path} 200", 0) >= 5, seen
        assert seen.get(f"POST {path} 400", 0) >= 5, seen
    assert srv.loop.health() is None
    from starlette.testclient import TestClient

    with TestClient(srv.app) as c:
        assert c.get("/health").status_code == 200
        plain = c.post("/v1/completions", json={"prompt": "ka ro", "max_tokens": 4,
                                                "temperature": 0, "ignore_eos": True})
    assert plain.status_code == 200, plain.text
    assert plain.json()["usage"]["completion_tokens"] == 4
    assert srv.loop.queued == 0
