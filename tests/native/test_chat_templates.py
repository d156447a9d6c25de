"""Chat templates on the native server: a request's own `chat_template` is refused with vLLM's
words unless the server trusts request templates; `chat_template_kwargs` may set only what
the template reads; every template renders under a time and a size limit, and a template
that hits one gets a 400 naming it while the server keeps serving."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from kvtier.native import Engine
from kvtier.native.chat_template import RenderLimits, TemplateLimitError
from kvtier.native.openai_requests import UNTRUSTED_TEMPLATE, ServerLimits
from kvtier.native.server import EngineServer
from kvtier.native.tokenizer import Tokenizer
from tests.native.test_server import assert_openai_error, client

MESSAGES = [{"role": "user", "content": "ka ro mi"}]
HUGE = "{{ 'x' * 100000000 }}"  # 100 MB of output
# 10^10 loop turns: before, a worker thread ran it for hours, and a few of them blocked
# every endpoint that renders or parses on the thread pool
NESTED = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"
FLAG_SIZE = "--max-chat-template-chars"
FLAG_TIME = "--chat-template-timeout"


@pytest.fixture
def make_server(make_engine: Callable[..., Engine]) -> Iterator[Callable[..., EngineServer]]:
    """Servers (TP=1, no connector) with the given limits, closed at teardown."""
    servers: list[EngineServer] = []

    def make(**limits: object) -> EngineServer:
        srv = EngineServer(
            make_engine(num_blocks=64), model_name="tiny", limits=ServerLimits(**limits)
        ).start()
        servers.append(srv)
        return srv

    yield make
    for srv in servers:
        srv.close()


def chat(template: str | None = None, **extra: object) -> dict:
    body: dict = {"messages": MESSAGES, "max_tokens": 2, **extra}
    if template is not None:
        body["chat_template"] = template
    return body


def test_request_templates_are_refused_unless_trusted(make_server):
    untrusted = make_server()
    trusted = make_server(trust_request_chat_template=True)
    simple = "{% for m in messages %}{{ m['content'] }}{% endfor %}"

    async def go(srv: EngineServer) -> list[httpx.Response]:
        async with client(srv) as c:
            return [
                await c.post("/v1/chat/completions", json=chat(simple)),
                await c.post(
                    "/v1/chat/completions",
                    json=chat(chat_template_kwargs={"chat_template": simple}),
                ),
                await c.post("/tokenize", json={"messages": MESSAGES, "chat_template": simple}),
                await c.post("/v1/chat/completions", json=chat()),  # the model's own template
            ]

    body, kwarg, tokenize, own = asyncio.run(go(untrusted))
    assert assert_openai_error(body, 400, "chat_template") == UNTRUSTED_TEMPLATE
    assert assert_openai_error(kwarg, 400, "chat_template_kwargs") == UNTRUSTED_TEMPLATE
    assert assert_openai_error(tokenize, 400, "chat_template") == UNTRUSTED_TEMPLATE
    assert own.status_code == 200, own.text
    body, _, tokenize, _ = asyncio.run(go(trusted))
    assert body.status_code == 200, body.text
    assert body.json()["usage"]["prompt_tokens"] == len(
        trusted.tokenizer.encode("ka ro mi", add_special_tokens=False)
    )
    assert tokenize.json()["tokens"] == trusted.tokenizer.encode("ka ro mi", False)


RESERVED_KWARGS = ["messages", "bos_token", "add_generation_prompt", "tools", "documents",
                   "eos_token", "raise_exception", "range"]  # fmt: skip


def test_chat_template_kwargs_set_only_what_the_template_reads(make_server):
    # before: a reserved key was a duplicate keyword inside the renderer, a 500 with a traceback
    srv = make_server(trust_request_chat_template=True)
    reads = "{{ bos_token }}{% if think %}<think>{% endif %}{{ messages[0]['content'] }}"

    async def go() -> tuple[list[httpx.Response], list[httpx.Response], httpx.Response]:
        async with client(srv) as c:
            reserved = [
                await c.post("/v1/chat/completions",
                             json=chat(reads, chat_template_kwargs={key: "x"}))
                for key in RESERVED_KWARGS
            ]  # fmt: skip
            unknown = [
                await c.post("/v1/chat/completions", json=chat(reads, chat_template_kwargs=kw))
                for kw in ({"nothing_reads_this": 1}, {"x" * 5000: 1})
            ]
            tok = await c.post("/tokenize", json={
                "messages": MESSAGES, "chat_template": reads,
                "chat_template_kwargs": {"think": True},
            })  # fmt: skip
            return reserved, unknown, tok

    reserved, unknown, tok = asyncio.run(go())
    for key, r in zip(RESERVED_KWARGS, reserved, strict=True):
        message = assert_openai_error(r, 400, "chat_template_kwargs")
        assert f"sets {key!r}, which the server passes" in message, message
    message = assert_openai_error(unknown[0], 400, "chat_template_kwargs")
    assert "'nothing_reads_this', which the chat template does not read (it reads: think)" in (
        message
    )
    assert len(assert_openai_error(unknown[1], 400, "chat_template_kwargs")) < 400
    assert tok.status_code == 200, tok.text
    assert tok.json()["tokens"] == srv.tokenizer.encode("<s><think>ka ro mi", False)


def test_templates_over_the_limits_get_400_in_time_and_the_server_serves_on(make_server):
    srv = make_server(
        trust_request_chat_template=True, render=RenderLimits(timeout_s=1.0, max_chars=2**20)
    )
    plain = {"prompt": "ka ro", "max_tokens": 2, "temperature": 0}

    async def go() -> tuple[list[httpx.Response], list[httpx.Response], float, float]:
        async with client(srv) as c:
            t0 = time.monotonic()
            huge = await asyncio.wait_for(c.post("/v1/chat/completions", json=chat(HUGE)), 10)
            huge_s = time.monotonic() - t0
            # more nested loops at once than the server has cores, plus plain work beside them
            t0 = time.monotonic()
            slow = [
                c.post("/v1/chat/completions", json=chat(NESTED)) for _ in range(3)
            ] + [c.post("/tokenize", json={"messages": MESSAGES, "chat_template": NESTED})]
            beside = [
                c.post("/v1/completions", json=plain),
                c.post("/tokenize", json={"prompt": "ka ro"}),
                c.post("/v1/chat/completions", json=chat()),
            ]
            out = await asyncio.wait_for(asyncio.gather(*slow, *beside), 30)
            return [huge, *out[:4]], out[4:], huge_s, time.monotonic() - t0

    refused, served, huge_s, slow_s = asyncio.run(go())
    huge, *nested = refused
    assert FLAG_SIZE in assert_openai_error(huge, 400, "messages") and huge_s < 5
    for r in nested:
        message = assert_openai_error(r, 400, "messages")
        assert FLAG_TIME in message and "within 1 s" in message
    assert slow_s < 15  # each stopped at its deadline: no thread left running the loops
    assert [r.status_code for r in served] == [200, 200, 200], [r.text for r in served]
    assert srv.loop.health() is None


@pytest.mark.parametrize(
    ("template", "kind"),
    [
        (HUGE, "size"),
        (NESTED, "time"),
        ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
         "{% endfor %}{{ ns.s }}", "size"),
        ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
         "{% endfor %}{{ ns.s }}", "size"),
        ("{{ 'x' | center(1000000000) }}", "size"),
        ("{{ 'x'.ljust(1000000000) }}", "size"),
        ("{{ '{:>1000000000}'.format('x') }}", "size"),
        ("{{ '%1000000000s' % 'x' }}", "size"),
        ("{{ 2 ** 1000000000 }}", "size"),
        ("{{ [['x' * 1000] * 1000] * 1000 }}", "size"),
        ("{{ ([('x' * 100000)] * 1000) | join }}", "size"),
        ("{{ ([['x' * 1000] * 1000] * 1000) | tojson }}", "size"),
        ("{{ ('x' * 100000) | replace('x', 'yyyyyyyyyyyyyyyyyyyyyyyyyyyyyy') }}", "size"),
        ("{% set s %}{% for i in range(100000) %}" + "a" * 100 + "{% endfor %}{% endset %}"
         "{{ s | length }}", "size"),
        ("{% macro m(n) %}{{ m(n) }}{% endmacro %}{{ m(1) }}", "recursion"),
    ],
)  # fmt: skip
def test_the_renderer_stops_every_blowup_at_its_limit(tiny_model, template, kind):
    tok = Tokenizer(tiny_model)
    limits = RenderLimits(timeout_s=0.5, max_chars=2**20)
    t0 = time.monotonic()
    with pytest.raises(Exception) as caught:
        tok.apply_chat_template(MESSAGES, chat_template=template, limits=limits)
    elapsed = time.monotonic() - t0
    message = str(caught.value)
    if kind == "recursion":
        assert "recursed too deeply" in message
    else:
        assert isinstance(caught.value, TemplateLimitError), message
        assert (FLAG_SIZE if kind == "size" else FLAG_TIME) in message
    assert elapsed < 3.0


def test_the_models_own_template_renders_under_the_limits_too(tiny_model):
    tok = Tokenizer(tiny_model)
    many = [{"role": "user", "content": f"message {i}"} for i in range(5000)]
    prompt = tok.apply_chat_template(many, limits=RenderLimits(timeout_s=5.0, max_chars=2**20))
    assert prompt.startswith("<s>User: message 0\n") and prompt.endswith("Assistant:")
    with pytest.raises(TemplateLimitError, match=FLAG_SIZE):
        tok.apply_chat_template(many, limits=RenderLimits(max_chars=10_000))
