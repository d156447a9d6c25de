"""Retention on the native server, in the clients' own words: OpenAI's prompt_cache_key and
prompt_cache_retention, Anthropic's cache_control on a chat message; the response says what the
budget granted; the admin API retains, reports and forgets a conversation from every tier."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvtier.native.server import EngineServer
from tests.native.admin_server import admin_server, call, held_chunks
from tests.native.conftest import make_prompts
from tests.native.test_server import client

CHUNK = 64
ADMIN = "s3cret-admin"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
GREEDY = {"model": "tiny", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    run_dir = tmp_path_factory.mktemp("retention-run")
    disk = str(tmp_path_factory.mktemp("retention-disk"))
    with admin_server(tiny_model, run_dir, ADMIN, chunk_size=CHUNK, memory_bytes="64MiB",
                      disk_bytes="64MiB", disk_dir=disk) as srv:  # fmt: skip
        yield srv


def test_openai_retention_is_granted_and_reported_in_usage(server: EngineServer) -> None:
    prompt = make_prompts(1, 3 * CHUNK + 10, seed=41)[0]
    body = {**GREEDY, "prompt": prompt, "prompt_cache_key": "conv-a", "user": "alice",
            "prompt_cache_retention": "24h"}  # fmt: skip
    r = call(server, "POST", "/v1/completions", body)
    assert r.status_code == 200, r.text
    granted = r.json()["usage"]["kvtier_retention"]
    assert granted == {"status": "retained", "retained_tokens": 3 * CHUNK, "ttl_s": 86400.0}
    stats = call(server, "GET", "/kvtier/retention", headers=AUTH).json()
    assert stats["retained_chunks"] >= 3 and stats["per_tenant"]["alice"] >= 3
    # a request without a hint gets OpenAI's usage object exactly
    plain = call(server, "POST", "/v1/completions", {**GREEDY, "prompt": prompt[:50]})
    assert "kvtier_retention" not in plain.json()["usage"]


def test_anthropic_cache_control_retains_up_to_the_marked_message(server: EngineServer) -> None:
    system = " ".join(["You are a careful assistant who answers in one line."] * 30)
    messages = [
        {"role": "system", "content": [
            {"type": "text", "text": system, "cache_control": {"type": "ephemeral", "ttl": "1h"}}
        ]},
        {"role": "user", "content": "What is the capital of France? " * 20},
    ]  # fmt: skip
    head = call(
        server, "POST", "/tokenize", {"messages": messages[:1], "add_generation_prompt": False}
    ).json()["count"]
    whole = call(server, "POST", "/tokenize", {"messages": messages}).json()["count"]
    assert whole > head >= CHUNK
    r = call(server, "POST", "/v1/chat/completions", {**GREEDY, "messages": messages})
    assert r.status_code == 200, r.text
    granted = r.json()["usage"]["kvtier_retention"]
    assert granted["status"] == "retained" and granted["ttl_s"] == 3600.0
    assert granted["retained_tokens"] == (head // CHUNK) * CHUNK < (whole // CHUNK) * CHUNK


@pytest.mark.parametrize(
    ("field", "value"),
    [("prompt_cache_retention", "forever"), ("prompt_cache_key", "k" * 300)],
)
def test_a_bad_openai_hint_is_a_400_naming_it(server: EngineServer, field: str, value: str) -> None:
    r = call(server, "POST", "/v1/completions", {**GREEDY, "prompt": [1, 2, 3], field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field


def test_a_bad_cache_control_is_a_400_naming_the_message(server: EngineServer) -> None:
    messages = [{"role": "user", "content": "hi", "cache_control": {"type": "ephemeral",
                                                                    "ttl": "2d"}}]  # fmt: skip
    r = call(server, "POST", "/v1/chat/completions", {**GREEDY, "messages": messages})
    assert r.status_code == 400 and "messages[0].cache_control.ttl" in r.json()["error"]["message"]


def test_the_admin_api_needs_its_key(server: EngineServer) -> None:
    assert call(server, "POST", "/kvtier/forget", {"prompt_cache_key": "x"}).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert call(server, "GET", "/kvtier/retention", headers=wrong).status_code == 401
    bad = call(server, "POST", "/kvtier/forget", {}, headers=AUTH)
    assert bad.status_code == 400 and "exactly one target" in bad.json()["error"]["message"]


def test_forget_deletes_a_conversation_from_every_tier(server: EngineServer) -> None:
    turn1 = make_prompts(1, 2 * CHUNK + 5, seed=43)[0]
    turn2 = [*turn1, *make_prompts(1, 2 * CHUNK, seed=44)[0]]
    for p in (turn1, turn2):
        body = {**GREEDY, "prompt": p, "prompt_cache_key": "conv-f", "user": "bob"}
        assert call(server, "POST", "/v1/completions", body).status_code == 200
    assert server.loop.wait_idle(30.0)
    assert held_chunks(server, turn2) == 4  # saved in memory and disk
    other = make_prompts(1, 2 * CHUNK + 1, seed=45)[0]
    assert call(server, "POST", "/v1/completions", {**GREEDY, "prompt": other}).status_code == 200
    assert server.loop.wait_idle(30.0)
    r = call(server, "POST", "/kvtier/forget", {"prompt_cache_key": "conv-f", "user": "bob"},
             headers=AUTH)  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["keys"] == 4 and r.json()["ranks"] == {"0": 4}
    assert held_chunks(server, turn1) == 0 and held_chunks(server, turn2) == 0
    assert held_chunks(server, other) == 2  # another conversation is untouched
    # the key no longer names anything
    again = call(server, "POST", "/kvtier/forget", {"prompt_cache_key": "conv-f", "user": "bob"},
                 headers=AUTH)  # fmt: skip
    assert again.json()["keys"] == 0


def test_admin_retain_and_prefetch_of_a_prompt(server: EngineServer) -> None:
    prompt = make_prompts(1, 2 * CHUNK + 3, seed=47)[0]
    r = call(server, "POST", "/kvtier/retain", {"prompt": prompt, "ttl_s": 60}, headers=AUTH)
    assert r.json()["retention"] == {"status": "retained", "retained_tokens": 2 * CHUNK,
                                     "ttl_s": 60.0}  # fmt: skip
    assert call(server, "POST", "/v1/completions", {**GREEDY, "prompt": prompt}).status_code == 200
    assert server.loop.wait_idle(30.0)
    p = call(server, "POST", "/kvtier/prefetch", {"prompt": prompt}, headers=AUTH).json()
    assert p["keys"] == 2 and p["ranks"] == {"0": 0}  # already in host memory: nothing to move


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b"{not json", "not JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"prompt": [1, true, 3]}', "token ids"),
        (b'{"prompt": [1, 99999999]}', "outside the vocabulary"),
        (b'{"prompt": [1, 2], "ttl_s": -5}', "ttl_s"),
        (b'{"prompt_cache_key": 7}', "must be strings"),
        (b'{"all": true}', "name it in user"),
        (b'{"all": true, "user": "u"}', "retain needs a prompt"),
        (b'{"all": "false", "user": "u"}', "send true or false"),
    ],
)
def test_a_hostile_admin_body_is_a_400_naming_it_and_the_server_serves_on(
    server: EngineServer, body: bytes, words: str
) -> None:
    async def go() -> httpx.Response:
        async with client(server) as c:
            return await c.post("/kvtier/retain", content=body, headers=AUTH)

    r = asyncio.run(go())
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    ok = call(server, "POST", "/v1/completions", {**GREEDY, "prompt": [5, 6, 7]})
    assert ok.status_code == 200
