"""The native engine and its server under a careless or hostile client, as they meet the
KV tier. After each scenario the engine serves a normal request correctly, its block pool is
whole again, no memory-tier slot stays leased or read, the offload core holds no request state,
and the counters close (external hits == retrieved tokens of first admissions)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from kvtier.native import Engine, EngineConfig, SamplingParams
from kvtier.native.sequence import SequenceStatus
from kvtier.native.server import EngineServer
from tests.native.conftest import make_prompts
from tests.native.faults_connector import (
    FaultyLoadWorkerHalf,
    kvtier_engine,
    local_worker,
    wait_until,
)

CHUNK = 64
LEN = 320  # 5 whole chunks
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ASYNC = {"sync_load_fraction": 0}  # every load parks its request on the load lane


@pytest.fixture(scope="module")
def lc_prompts() -> list[list[int]]:
    return make_prompts(6, LEN, seed=4242)


@pytest.fixture(scope="module")
def lc_ref(tiny_model: Path, lc_prompts) -> dict[tuple[int, ...], list[int]]:
    """Each prompt's greedy tokens without the tier, each run alone: the batch shape of the
    single requests they are compared with (numerics differ between batch shapes)."""
    with Engine(tiny_model, EngineConfig(num_threads=1, num_blocks=256)) as eng:
        return {tuple(p): eng.generate([p], GREEDY)[0].output_token_ids for p in lc_prompts}


# ---- helpers ------------------------------------------------------------------------------------


def _rank_value(eng: Engine, name: str) -> float:
    return local_worker(eng).metrics.value(name)


def assert_clean(eng: Engine) -> None:
    """Nothing of any request is left: blocks, offload state, leases, readers."""
    assert not eng.has_unfinished_requests()
    bm = eng.block_manager
    assert bm.num_free_blocks() == bm.num_blocks, "KV blocks leaked"
    assert all(c == 0 for c in bm.ref_counts)
    core = eng.connector.core
    assert core._reqs == {}, f"offload state left: {list(core._reqs)}"
    assert not core.has_pending_work()
    assert not core._inflight._loading and not core._inflight._saving
    mem = local_worker(eng).stack.memory

    def settled() -> bool:
        s = mem.stats()
        return s.leases == 0 and s.reserved == 0 and sum(mem._readers) == 0

    wait_until(settled, 10.0, "memory-tier leases/readers returning to zero")
    assert _rank_value(eng, "lease_expiries_total") == 0, "a lease was left to expire"


def serve_one(eng: Engine, prompt: list[int], ref: dict, params=GREEDY) -> Any:
    eng.reset_prefix_cache()
    (out,) = eng.generate([prompt], params, timeout_s=30.0)
    assert out.output_token_ids == ref[tuple(prompt)][: params.max_tokens]
    return out


def step_until(eng: Engine, cond, what: str, timeout_s: float = 10.0) -> list:
    outs: list = []
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s}s"
        outs += eng.step()
        if eng.last_step_tokens == 0:
            local_worker(eng).wait_loads(0.05)
    return outs


def counters_close(eng: Engine) -> None:
    st = eng.stats()
    retrieved = _rank_value(eng, "retrieved_tokens_total")
    readmitted = _rank_value(eng, "readmitted_retrieved_tokens_total")
    assert retrieved == st["external_prefix_cache_hits"], (retrieved, st)
    assert readmitted == st["preempted_external_hits"], (readmitted, st)
    assert (
        st["prefix_cache_queries"] - st["prefix_cache_hits"] == st["external_prefix_cache_queries"]
    )


# ---- engine-level scenarios ---------------------------------------------------------------------


def test_abort_while_async_load_in_flight_leaks_nothing_and_counters_close(
    tiny_model, tmp_path, lc_prompts, lc_ref
):
    p = lc_prompts[0]
    with kvtier_engine(tiny_model, tmp_path / "run", **ASYNC) as eng:
        serve_one(eng, p, lc_ref)  # stored
        eng.reset_prefix_cache()
        rid = eng.add_request(p, GREEDY)
        step_until(eng, lambda: rid in eng.scheduler.parked, "the request parking on its load")
        assert eng.abort(rid)
        eng.drain(timeout_s=20.0)
        assert_clean(eng)
        # a request with no tier hit: its first step's meta tells the ranks the aborted
        # load's terminal. The aborted load's tokens are no external hit (the engine threw
        # its blocks away), so they must not count as retrieved either.
        serve_one(eng, lc_prompts[1], lc_ref)
        assert eng.stats()["external_prefix_cache_hits"] == 0
        counters_close(eng)
        out = serve_one(eng, p, lc_ref)
        assert out.num_external_tokens == LEN - 1
        assert_clean(eng)
        counters_close(eng)


def test_abort_between_lookup_and_load_releases_the_lease(tiny_model, tmp_path, lc_prompts, lc_ref):
    """lookup_wait_ms=0: the admission's first ask finds the lookup in flight (it holds a lease
    once the rank answers); the client aborts before the answer is taken."""
    p = lc_prompts[1]
    with kvtier_engine(tiny_model, tmp_path / "run", lookup_wait_ms=0, **ASYNC) as eng:
        serve_one(eng, p, lc_ref)
        core = eng.connector.core
        caught = 0
        for _ in range(20):
            eng.reset_prefix_cache()
            rid = eng.add_request(p, GREEDY)
            eng.step()
            st = core._reqs.get(rid)
            if st is not None and st.lookup is not None:
                caught += 1
                # let the rank answer (and lease) before the abort reaches it
                wait_until(lambda: local_worker(eng).stack.memory.stats().leases > 0, 5.0,
                           "the rank leasing the lookup's chunks")  # fmt: skip
            assert eng.abort(rid)
            eng.drain(timeout_s=20.0)
            assert_clean(eng)
            if caught >= 3:
                break
        assert caught, "never caught a lookup in flight"
        serve_one(eng, p, lc_ref)
        assert_clean(eng)
        counters_close(eng)


def test_identical_prompts_arriving_step_by_step_race_loads_and_saves(
    tiny_model, tmp_path, lc_prompts, lc_ref
):
    """One prefix, 8 requests arriving one per step with the HBM cache reset before each: the
    later ones find the earlier ones' saves and loads of the same chunks in flight."""
    p = lc_prompts[2]
    with Engine(tiny_model, EngineConfig(num_threads=1, num_blocks=256)) as plain:
        # the same arrivals and batches without the tier: the tokens to compare with
        staggered = _staggered(plain, p, 8)
        burst = [o.output_token_ids for o in plain.generate([p] * 6, GREEDY)]
    with kvtier_engine(tiny_model, tmp_path / "run", **ASYNC) as eng:
        assert _staggered(eng, p, 8) == staggered
        assert_clean(eng)
        counters_close(eng)
        # a burst of 6 at once from the tier (one prefix: one load, the others behind it)
        eng.reset_prefix_cache()
        outs = eng.generate([p] * 6, GREEDY, timeout_s=30.0)
        assert [o.output_token_ids for o in outs] == burst
        assert_clean(eng)
        counters_close(eng)


def _staggered(eng: Engine, p: list[int], n: int) -> list[list[int]]:
    """`n` requests of `p`, one added per step with the HBM cache reset before each; their
    tokens in arrival order."""
    done: dict[str, list[int]] = {}
    rids = []
    for _ in range(n):
        eng.reset_prefix_cache()
        rids.append(eng.add_request(p, GREEDY))
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.output_token_ids
    for o in step_until(eng, lambda: not eng.has_unfinished_requests(), "drain", 30.0):
        if o.finished:
            done[o.request_id] = o.output_token_ids
    return [done[r] for r in rids]


@pytest.mark.parametrize("max_tokens", [1, 4])
def test_prompt_filling_the_whole_context_with_a_tier_hit(tiny_model, tmp_path, max_tokens):
    """max_model_len == prompt length (5 whole chunks): the tier restores 319 tokens, one is
    computed, one token is sampled and the request ends on 'length'."""
    prompt = make_prompts(1, LEN, seed=77)[0]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with Engine(tiny_model, EngineConfig(num_threads=1, num_blocks=64, max_model_len=LEN)) as e:
        (ref,) = e.generate([prompt], params)
    assert ref.output_token_ids and ref.finish_reason == "length"
    from kvtier.config import KVTierConfig
    from kvtier.native.offload import connector_spec

    spec = connector_spec(
        KVTierConfig(chunk_size=CHUNK, memory_bytes="64MiB", load_gate=False,
                     lookup_timeout_ms=2000, sync_load_fraction=0),
        tiny_model, run_dir=tmp_path / "run",
    )  # fmt: skip
    cfg = EngineConfig(num_threads=1, num_blocks=64, max_model_len=LEN)
    with Engine(tiny_model, cfg, spec) as eng:
        for i in range(3):
            eng.reset_prefix_cache()
            (out,) = eng.generate([prompt], params, timeout_s=30.0)
            assert out.output_token_ids == ref.output_token_ids, i
            assert out.finish_reason == "length"
            if i:
                assert out.num_external_tokens == LEN - 1
        assert_clean(eng)
        counters_close(eng)


def test_tier_hit_then_preemption_then_abort_of_the_preempted_request(
    tiny_model, tmp_path, lc_prompts, lc_ref
):
    """60 blocks: three 20-block prompts loaded from the tier, decode forces preemptions; one
    preempted request is aborted while it waits to be re-admitted."""
    ps = lc_prompts[3:6]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    with Engine(tiny_model, EngineConfig(num_threads=1, num_blocks=256)) as e:
        ref = [o.output_token_ids for o in e.generate(ps, params)]
    with kvtier_engine(tiny_model, tmp_path / "run", num_blocks=60) as eng:
        for p in ps:
            eng.generate([p], params)
        eng.reset_prefix_cache()
        rids = [eng.add_request(p, params) for p in ps]
        done: dict[str, list[int]] = {}
        aborted = None

        def preempted_waiting() -> bool:
            return any(s.preempted and s.status is SequenceStatus.WAITING
                       for s in eng.scheduler.waiting)  # fmt: skip

        for o in step_until(eng, preempted_waiting, "a preemption after the load", 30.0):
            if o.finished:
                done[o.request_id] = o.output_token_ids
        victim = next(s for s in eng.scheduler.waiting if s.preempted)
        aborted = victim.request_id
        assert eng.abort(aborted)
        for o in step_until(eng, lambda: not eng.has_unfinished_requests(), "drain", 60.0):
            if o.finished:
                done[o.request_id] = o.output_token_ids
        for rid, r in zip(rids, ref, strict=True):
            if rid != aborted:
                assert done[rid] == r
        assert eng.stats()["num_preemptions"] > 0
        assert_clean(eng)
        counters_close(eng)
        serve_one(eng, ps[0], {tuple(ps[0]): ref[0]}, params)
        assert_clean(eng)


# ---- server-level scenarios ---------------------------------------------------------------------


class RawClient:
    """One ASGI HTTP request driven by hand: the test decides when the client disconnects and
    whether it reads the response (a `send` that blocks is a client that never reads)."""

    def __init__(self, app: Any, path: str, body: dict[str, Any], *, read: bool = True):
        self.app = app
        self.path = path
        self.body = json.dumps(body).encode()
        self.read = read
        self.disconnect = asyncio.Event()
        self.started = asyncio.Event()
        self.chunks: list[bytes] = []
        self.unblock = asyncio.Event()
        self._sent_body = False

    async def _receive(self) -> dict[str, Any]:
        if not self._sent_body:
            self._sent_body = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.disconnect.wait()
        return {"type": "http.disconnect"}

    async def _send(self, msg: dict[str, Any]) -> None:
        if msg["type"] == "http.response.start":
            self.status = msg["status"]
            self.started.set()
            return
        if not self.read:  # a client that never reads: the transport's buffer is full
            await self.unblock.wait()
        self.chunks.append(msg.get("body", b""))

    async def run(self) -> None:
        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1", "method": "POST", "scheme": "http", "path": self.path,
            "raw_path": self.path.encode(), "query_string": b"", "root_path": "",
            "headers": [(b"content-type", b"application/json"),
                        (b"content-length", str(len(self.body)).encode())],
            "client": ("127.0.0.1", 1), "server": ("kvtier", 80),
        }  # fmt: skip
        await self.app(scope, self._receive, self._send)


def _on_loop(srv: EngineServer, fn) -> Any:
    return srv.loop.call(fn).result(timeout=10.0)


def _server_clean(srv: EngineServer) -> None:
    assert srv.loop.wait_idle(30.0)
    _on_loop(srv, assert_clean)


def _completion(prompt: list[int], **kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **kw}  # fmt: skip


async def _post(srv: EngineServer, body: dict[str, Any]) -> dict[str, Any]:
    import httpx

    transport = httpx.ASGITransport(app=srv.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://kvtier") as c:
        r = await c.post("/v1/completions", json=body, timeout=30.0)
    assert r.status_code == 200, r.text
    return r.json()


def test_stream_disconnect_while_its_load_is_stuck_frees_everything(
    tiny_model, tmp_path, lc_prompts, lc_ref
):
    """A streaming client goes away while its prompt's KV is being read from the tier (the
    read hangs until the per-load deadline): the request is aborted, its blocks are held
    until the load ends, then freed; another client is served meanwhile and after."""
    p, other = lc_prompts[0], lc_prompts[1]
    fault = {"fault": "stuck", "fail_rank": 0, "fail_loads": 1}
    eng = kvtier_engine(tiny_model, tmp_path / "run", fault=fault, lease_ttl_s=1.0, **ASYNC)
    with EngineServer(eng, model_name="tiny") as srv:
        half = eng.executor.runner.connector
        assert isinstance(half, FaultyLoadWorkerHalf)

        async def go() -> None:
            await _post(srv, _completion(p, max_tokens=8))  # stored
            _on_loop(srv, lambda e: e.reset_prefix_cache())
            c = RawClient(srv.app, "/v1/completions", _completion(p, max_tokens=8, stream=True))
            task = asyncio.ensure_future(c.run())
            # the load is stuck reading
            await asyncio.wait_for(asyncio.to_thread(half.fired.wait, 10.0), 15.0)
            assert half.fired.is_set(), "the tier read never started"
            c.disconnect.set()
            await asyncio.wait_for(task, 10.0)
            # meanwhile another client is served correctly
            r = await _post(srv, _completion(other, max_tokens=8))
            assert r["choices"][0]["token_ids"] == lc_ref[tuple(other)]

        asyncio.run(go())
        half.release.set()
        wait_until(lambda: _on_loop(srv, lambda e: e.stats()["requests_aborted"]) == 1, 10.0,
                   "the disconnected stream's abort")  # fmt: skip
        _server_clean(srv)

        async def after() -> None:
            _on_loop(srv, lambda e: e.reset_prefix_cache())
            r = await _post(srv, _completion(p, max_tokens=8))
            assert r["choices"][0]["token_ids"] == lc_ref[tuple(p)]

        asyncio.run(after())
        _server_clean(srv)


def test_a_stream_nobody_reads_does_not_block_the_engine(tiny_model, tmp_path, lc_prompts, lc_ref):
    """A client sends a streaming request and never reads: the engine loop keeps serving
    others; once the client goes away its request ends and nothing is left."""
    p, other = lc_prompts[2], lc_prompts[3]
    eng = kvtier_engine(tiny_model, tmp_path / "run")
    with EngineServer(eng, model_name="tiny") as srv:

        async def go() -> None:
            await _post(srv, _completion(p, max_tokens=4))  # stored: the stuck one has a hit
            _on_loop(srv, lambda e: e.reset_prefix_cache())
            stuck = RawClient(srv.app, "/v1/completions",
                              _completion(p, max_tokens=200, stream=True), read=False)  # fmt: skip
            task = asyncio.ensure_future(stuck.run())
            await asyncio.wait_for(stuck.started.wait(), 10.0)
            t0 = time.monotonic()
            r = await asyncio.wait_for(_post(srv, _completion(other, max_tokens=8)), 20.0)
            # served beside the unread stream's decode (another batch shape than the reference
            # run alone, so the count is checked, not the tokens)
            assert len(r["choices"][0]["token_ids"]) == 8
            assert time.monotonic() - t0 < 20.0
            stuck.disconnect.set()
            stuck.unblock.set()
            await asyncio.wait_for(task, 10.0)

        asyncio.run(go())
        _server_clean(srv)


def test_max_tokens_0_and_1_with_a_tier_hit_over_http(tiny_model, tmp_path, lc_prompts, lc_ref):
    """max_tokens=0 (with echo: the prompt only, as vLLM) and 1 on a prompt the tier holds:
    the right tokens, no leak; max_tokens=0 without echo is a 400 that never reaches the engine."""
    p = lc_prompts[4]
    eng = kvtier_engine(tiny_model, tmp_path / "run")
    with EngineServer(eng, model_name="tiny") as srv:

        async def go() -> None:
            await _post(srv, _completion(p, max_tokens=2))  # stored
            _on_loop(srv, lambda e: e.reset_prefix_cache())
            r = await _post(srv, _completion(p, max_tokens=1))
            assert r["choices"][0]["token_ids"] == lc_ref[tuple(p)][:1]
            assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == LEN - 1
            _on_loop(srv, lambda e: e.reset_prefix_cache())
            r = await _post(srv, _completion(p, max_tokens=0, echo=True))
            assert r["choices"][0]["token_ids"] == []
            assert r["usage"]["completion_tokens"] == 0
            import httpx

            transport = httpx.ASGITransport(app=srv.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://kvtier") as c:
                bad = await c.post("/v1/completions", json=_completion(p, max_tokens=0))
            assert bad.status_code == 400, bad.text

        asyncio.run(go())
        _server_clean(srv)
        st = _on_loop(srv, lambda e: e.stats())
        assert st["requests_finished"] == 3 and st["requests_aborted"] == 0


def test_abort_mid_chunked_prefill_with_saves_in_flight_then_the_saved_prefix_is_exact(
    tiny_model, tmp_path, lc_prompts, lc_ref
):
    """A 64-token step budget: the prompt is prefilled one chunk per step and each chunk is
    saved as it completes; the client aborts after 3 chunks. The chunks it saved are served to
    the next request with the same prompt, which must equal a recompute."""
    from kvtier.config import KVTierConfig
    from kvtier.native.offload import connector_spec

    p = lc_prompts[5]
    spec = connector_spec(
        KVTierConfig(chunk_size=CHUNK, memory_bytes="64MiB", load_gate=False,
                     lookup_timeout_ms=2000),
        tiny_model, run_dir=tmp_path / "run",
    )  # fmt: skip
    cfg = EngineConfig(num_threads=1, num_blocks=128, max_num_batched_tokens=CHUNK)
    with Engine(tiny_model, cfg, spec) as eng:
        rid = eng.add_request(p, GREEDY)
        step_until(eng, lambda: eng.scheduler.get(rid).num_computed_tokens >= 3 * CHUNK,
                   "three prefill chunks")  # fmt: skip
        assert eng.abort(rid)
        eng.drain(timeout_s=20.0)
        assert_clean(eng)
        eng.reset_prefix_cache()
        (out,) = eng.generate([p], GREEDY, timeout_s=30.0)
        assert out.output_token_ids == lc_ref[tuple(p)]
        assert out.num_external_tokens >= 2 * CHUNK
        assert_clean(eng)
