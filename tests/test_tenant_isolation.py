"""Tenant isolation and the retention control path, against clients and tenants that do not
trust each other: what enters a chunk key (a vLLM request whose KV depends on more than its
token ids must never share keys with one that does not), who pays for and who can let go of a
retained chunk, how much per-request state the retention ledger keeps, and what the native
server's admin API acts on.

Each test states the contract it checks; none sleeps (clocks are injected)."""

from __future__ import annotations

import gc
import tracemalloc
import types
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from kvtier.config import KVTierConfig
from kvtier.keys import chain_keys, key_seed
from kvtier.metrics import Metrics
from kvtier.native.server import EngineServer
from kvtier.offload import messages
from kvtier.offload.messages import OpResult, WorkerReport
from kvtier.offload.retention import (
    _SESSIONS,
    RETAINED,
    RetentionHint,
    RetentionLedger,
    hint_from_params,
)
from kvtier.offload.retention_api import run_admin
from kvtier.offload.scheduler import OffloadScheduler
from tests.native.admin_server import admin_server, call, held_chunks
from tests.native.conftest import make_prompts
from tests.native.conftest import tiny_model as tiny_model  # the session fixture
from tests.offload.fakes import FakeLookup
from tests.offload.test_scheduler import BLOCK, CHUNK, blocks, make, prompt
from tests.offload.test_scheduler_contract import (
    _Blocks,
    _connector_output,
    _out,
    _side,
    _vllm_request,
)
from tests.offload.test_scheduler_contract import vllm_side as vllm_side  # the fixture
from tests.offload.test_scheduler_retention import make as make_retention
from tests.store.conftest import FakeClock

# ---- helpers -------------------------------------------------------------------------------------


class KeyedLookup(FakeLookup):
    """A lookup port that answers the truth about what was saved: the leading keys of a lookup
    that some earlier save stored (as the ranks' tiers would)."""

    def __init__(self) -> None:
        super().__init__(0)
        self.stored: set[bytes] = set()
        self.asked: list[list[bytes]] = []

    def lookup(self, keys: Sequence[bytes], lookup_id: str, lease: bool = True) -> Any:
        self.asked.append(list(keys))
        n = 0
        for k in keys:
            if k not in self.stored:
                break
            n += 1
        self.hits = n
        return super().lookup(keys, lookup_id, lease)


def _keyed_scheduler(**cfg: Any) -> tuple[OffloadScheduler, KeyedLookup]:
    lookup = KeyedLookup()
    sched = OffloadScheduler(
        KVTierConfig(chunk_size=CHUNK, load_gate=False, **cfg),
        lookup,
        model_id="m",
        block_size=BLOCK,
        world=1,
        metrics=Metrics(rank=0),
        cold_misses=False,
    )
    return sched, lookup


def _decode(meta: Any) -> messages.OffloadMeta:
    return messages.decode_meta(meta.data) if meta.data else messages.OffloadMeta()


def _key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def _ledger(budget: int = 100, share: float = 0.1, clock: Any = None) -> RetentionLedger:
    return RetentionLedger(
        budget, tenant_share=share, default_ttl_s=60, max_ttl_s=86400, clock=clock or FakeClock()
    )


# ---- 1. vLLM: what the tier keys a request by ---------------------------------------------------


def _embeds_request(req_id: str, tokens: list[int], embeds: object) -> SimpleNamespace:
    """A vLLM 0.32 `Request` of a chat message with `prompt_embeds` content parts
    (`--enable-prompt-embeds`): vLLM's renderer (`renderers/hf.py`
    `_apply_prompt_embeds_to_prompt`) keeps `prompt_token_ids` (the placeholder token expanded
    to the embedding's length) beside `prompt_embeds` and the `prompt_is_token_ids` mask; the
    model reads the embeddings at the masked positions, so the KV there depends on them."""
    req = _vllm_request(req_id, tokens)
    req.prompt_embeds = embeds
    req.prompt_is_token_ids = [i >= CHUNK * 2 for i in range(len(tokens))]
    return req


def test_vllm_a_prompt_embeds_request_never_shares_tier_keys_with_another(
    vllm_side: types.ModuleType,
) -> None:
    """docs/vllm.md: "Requests whose KV depends on more than their token ids (multimodal
    inputs, LoRA, a `cache_salt`) and prompt-embeds requests bypass the tier." vLLM hashes the
    embeddings into its own block hashes (`_gen_prompt_embeds_extra_hash_keys`), so two
    requests with the same placeholder ids and different embeddings never share HBM blocks.
    kvtier's chunk keys are the token ids alone: a mixed embeds request that reaches the tier
    is saved under its placeholder ids, and a second client's request with other embeddings
    finds those chunks and loads KV computed from the first client's embeddings."""
    sched, lookup = _keyed_scheduler()
    side = _side(vllm_side, sched)
    tokens = prompt(4 * CHUNK + 1)  # the placeholder ids are the same for equal-length embeds
    alice = _embeds_request("alice", tokens, embeds=object())
    ids = blocks(len(tokens))

    n, _ = side.get_num_new_matched_tokens(alice, 0)
    side.update_state_after_alloc(alice, _Blocks(ids), n)
    meta = _decode(side.build_connector_meta(_out(new=[("alice", ids, 0, len(tokens))])))
    for save in meta.saves:
        lookup.stored.update(c.key for c in save.chunks)  # the ranks stored alice's KV
    done = [OpResult(s.op_id, True) for s in meta.saves]
    side.update_connector_output(_connector_output(vllm_side, [WorkerReport(0, done)]))
    alice.num_computed_tokens = len(tokens)
    side.request_finished(alice)

    mallory = _embeds_request("mallory", tokens, embeds=object())
    got, _ = side.get_num_new_matched_tokens(mallory, 0)
    assert lookup.stored == set() and got == 0, (
        f"a prompt-embeds request was saved ({len(lookup.stored)} chunks keyed by its "
        f"placeholder token ids) and another request with different embeddings was promised "
        f"{got} tokens of it: kvtier.vllm.scheduler_side._offloadable checks "
        "prompt_token_ids is not None but never prompt_embeds"
    )


@pytest.mark.parametrize(
    "extra",
    [{"cache_salt": "tenant-b"}, {"lora_request": object()}, {"mm_features": [object()]}],
    ids=["cache_salt", "lora", "multimodal"],
)
def test_vllm_a_request_whose_kv_is_not_its_tokens_is_neither_looked_up_saved_nor_retained(
    vllm_side: types.ModuleType, extra: dict[str, object]
) -> None:
    """A `cache_salt` request (vLLM's per-tenant prefix-cache separation), a LoRA or a
    multimodal one never reaches the tier: no lookup of its keys, no view, no save, and its
    kv_transfer_params retention hint neither retains nor tags a conversation (its prompt's
    unsalted keys would otherwise be retained or named under the conversation, and a later
    forget of that key would delete another tenant's unsalted chunks)."""
    sched, lookup = _keyed_scheduler()
    side = _side(vllm_side, sched)
    tokens = prompt(4 * CHUNK + 1)
    lookup.stored.update(sched.planner.keys_for(tokens))  # an unsalted tenant's chunks
    salted = _vllm_request("s", tokens)
    for name, value in extra.items():
        setattr(salted, name, value)
    salted.kv_transfer_params = {
        "prompt_cache_key": "conv", "user": "b", "prompt_cache_retention": "24h",
    }  # fmt: skip
    assert side.get_num_new_matched_tokens(salted, 0) == (0, False)
    ids = blocks(len(tokens))
    side.update_state_after_alloc(salted, _Blocks(ids), 0)
    meta = _decode(side.build_connector_meta(_out(new=[("s", ids, 0, len(tokens))])))
    assert (meta.saves, meta.loads) == ([], [])
    assert lookup.asked == [] and lookup.admins == []
    assert sched.planner.keys_for(session="conv", tenant="b") == []
    assert sched.planner.retention.retained_chunks() == 0
    assert side.retention_params("s") is None and side.request_finished(salted) is False
    # the plain request with the same tokens still hits
    plain = _vllm_request("p", tokens)
    assert side.get_num_new_matched_tokens(plain, 0)[0] == 4 * CHUNK


def test_vllm_retention_hint_user_must_be_a_bounded_string() -> None:
    """`user` in kv_transfer_params is the tenant every retained chunk is charged to and
    part of the key a conversation is remembered under (with prompt_cache_key, which is
    capped at 256 characters). A tenant name of megabytes is kept by the ledger (see the
    ledger tests below): it must be refused as prompt_cache_key is."""
    with pytest.raises(ValueError, match="user"):
        hint_from_params({"prompt_cache_key": "c", "user": "u" * (1 << 20)})


@pytest.mark.parametrize("bad", [["24h"], {"ttl": "24h"}])
def test_vllm_a_malformed_hint_is_ignored_not_a_hook_failure(
    vllm_side: types.ModuleType, bad: object
) -> None:
    """docs/vllm.md: "A malformed hint is logged (`retention hint ignored: ...`) and the request
    served without it." kv_transfer_params is client JSON: a `prompt_cache_retention` that is a
    list or an object makes `hint_from_params` raise TypeError (its `not in OPENAI_RETENTION`
    hashes it), which VLLMRequestView.retention does not catch: the hook fails, the request is
    quarantined (no tier hit, no save) and `kvtier_hook_errors_total` (a kvtier defect to
    doctor and the alerts) moves at every such request."""
    sched, lookup = _keyed_scheduler()
    side = _side(vllm_side, sched)
    tokens = prompt(4 * CHUNK + 1)
    lookup.stored.update(sched.planner.keys_for(tokens))
    req = _vllm_request("r", tokens)
    req.kv_transfer_params = {"prompt_cache_retention": bad, "prompt_cache_key": "c"}
    got = side.get_num_new_matched_tokens(req, 0)
    errors = sched._m.total("hook_errors_total")
    assert got[0] == 4 * CHUNK and errors == 0, (
        f"a malformed client hint cost the request its tier hit ({got}) and counted {errors} "
        "kvtier hook error(s)"
    )


# ---- 2. the retention ledger: who pays, who lets go, what is remembered ----------------------


def test_a_tenant_that_released_a_shared_chunk_stops_paying_for_it() -> None:
    """Retained chunks count against a tenant's share (`retention_tenant_share`). A chunk two
    tenants retain (a common system prompt) is charged to whichever retained it first; when
    that tenant lets go (release by its conversation) the chunk stays retained for the other,
    yet it stays charged to the first tenant and keeps the first tenant's deadline. So
    tenant B holds chunks on A's budget and A's later hints are refused for `tenant_budget`
    although A retains nothing, for as long as B keeps renewing them."""
    clock = FakeClock()
    ledger = _ledger(budget=100, share=0.1, clock=clock)  # 10 chunks per tenant
    system = [_key(i) for i in range(10)]
    d, _, _ = ledger.decide(system, RetentionHint(ttl_s=3600, session="a", tenant="alice"), 1)
    assert d.status == RETAINED
    d, _, _ = ledger.decide(system, RetentionHint(ttl_s=60, session="b", tenant="bob"), 1)
    assert d.status == RETAINED
    # alice lets go of her conversation; bob still holds the chunks
    assert ledger.release(system, ("alice", "a")) == []
    assert ledger.retained_chunks() == 10
    per_tenant = ledger.stats()["per_tenant"]
    mine, _, _ = ledger.decide(
        [_key(100 + i) for i in range(4)], RetentionHint(ttl_s=60, session="a2", tenant="alice"), 1
    )
    assert per_tenant.get("alice", 0) == 0 and mine.status == RETAINED, (
        f"after alice released, bob's hold is charged to alice ({per_tenant}) and alice's new "
        f"hint is {mine.status} ({mine.reason})"
    )


def test_a_released_holders_deadline_does_not_outlive_it() -> None:
    """Once the holder with the later deadline lets go, a shared chunk is retained until the
    remaining holders' deadlines, not the released one's (the ranks get the release then)."""
    clock = FakeClock()
    ledger = _ledger(budget=100, share=1.0, clock=clock)
    shared = [_key(1), _key(2)]
    ledger.decide(shared, RetentionHint(ttl_s=86400, session="a", tenant="alice"), 1)
    ledger.decide(shared, RetentionHint(ttl_s=60, session="b", tenant="bob"), 1)
    ledger.release(shared, ("alice", "a"))
    clock.advance(120)  # bob's 60 s are over; alice let go
    assert ledger.retained_chunks() == 0, (
        "the chunks stay retained (and pinned on the ranks) for alice's 24 h after alice "
        "released them and bob's hold expired"
    )


def test_a_namespace_reset_gives_the_retention_budget_back() -> None:
    """After `reset()` (vLLM's reset_prefix_cache, a weight update) every chunk stored before is
    unreachable, so what was retained before cannot serve anyone. The ledger keeps those keys
    (and their tenants' charges, and the ranks keep protecting them) until their TTL, up to
    `retention_max_ttl_s`: a hint for the very same prompt after the reset is refused for
    `budget` / `tenant_budget`. An RL loop that resets every iteration has no retention at all
    after the first one."""
    sched, lookup, _ = make_retention(chunks=16, retention_budget=0.5, retention_tenant_share=1.0)
    tokens = prompt(8 * CHUNK + 1)
    hint = RetentionHint(ttl_s=3600, session="agent", tenant="alice")
    assert sched.planner.hint("r1", sched.planner.keys_for(tokens), hint) == 8
    sched.reset()
    granted = sched.planner.hint("r2", sched.planner.keys_for(tokens), hint)
    decision = sched.planner.retention_decision("r2")
    released = [keys for op, keys, _, _ in lookup.admins if op in ("release", "forget")]
    assert granted == 8, (
        f"after a reset the same prompt's hint is {decision.status} ({decision.reason}): the "
        f"budget is held by {sched.planner.retention.retained_chunks()} unreachable chunks of "
        f"the old epoch (ranks told to release: {released})"
    )


def _hold_memory(fn: Any) -> int:
    """Bytes still allocated after `fn()` ran and its garbage was collected."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        fn()
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    return sum(s.size_diff for s in after.compare_to(before, "filename"))


def test_expired_tenants_leave_no_state_behind() -> None:
    """Every hint of a new tenant (`user`, free text from the client) adds an entry to the
    ledger's per-tenant counts that is never removed, even when nothing is retained for that
    tenant any more: a client cycling `user` grows the scheduler's memory without bound, by the
    length of each `user` string (up to the 16 MiB body on the native server)."""
    clock = FakeClock()
    ledger = _ledger(budget=1 << 20, share=1.0, clock=clock)
    n, width = 2000, 1024

    def flood() -> None:
        for i in range(n):
            user = f"{i:08d}".ljust(width, "x")
            ledger.decide([_key(i)], RetentionHint(ttl_s=1, tenant=user), 1)
        clock.advance(10)  # every grant is over
        assert ledger.retained_chunks() == 0

    held = _hold_memory(flood)
    assert held < n * width // 4, (
        f"{held} bytes stay in the ledger after {n} one-second grants to distinct users all "
        f"expired (RetentionLedger._per_tenant keeps {len(ledger._per_tenant)} tenants at 0)"
    )


def test_holders_of_a_renewed_chunk_do_not_accumulate_without_bound() -> None:
    """A chunk kept retained by one hint after another (a shared system prompt, each request
    with its own `user` and no prompt_cache_key) remembers every holder that ever held it, each
    with its `user` string, although each holder's deadline passed long ago: memory grows with
    the number of requests, not with what is retained (the conversations the ledger remembers
    are capped at 65536; holders are not)."""
    clock = FakeClock()
    ledger = _ledger(budget=100, share=1.0, clock=clock)
    system = [_key(7)]
    n = 20_000

    def flood() -> None:
        for i in range(n):
            ledger.decide(system, RetentionHint(ttl_s=2, tenant=f"user-{i:06d}"), 1)
            clock.advance(1)  # each grant outlives the previous one by a second
        assert ledger.retained_chunks() == 1

    held = _hold_memory(flood)
    holders = len(ledger._holders.get(system[0], {}))
    assert holders <= 2 and held < 256 << 10, (
        f"one retained chunk keeps {holders} holders ({held} bytes) after {n} hints, all but "
        "the last expired"
    )


def test_a_flood_of_another_tenants_conversations_does_not_unname_a_victims() -> None:
    """ "kvtier remembers which chunks it [a conversation] owns (to prefetch or forget it by that
    key)". The ledger keeps the last 65536 conversations of all tenants together: another
    client sending 65536 requests with fresh prompt_cache_keys (prompts of one token are
    enough) evicts the victim's conversation, and the victim's "delete my conversation"
    (forget by key) then covers no chunk, answers 200 as if done, while the victim's chunks
    stay in every tier."""
    sched, lookup, _ = make(world=1)
    victim = prompt(3 * CHUNK + 1)
    sched.planner.hint("v", sched.planner.keys_for(victim),
                       RetentionHint(session="diary", tenant="alice", retain=False))  # fmt: skip
    assert len(sched.planner.keys_for(session="diary", tenant="alice")) == 3
    for i in range(_SESSIONS):  # each a one-token request with a fresh prompt_cache_key
        sched.planner.hint(f"m{i}", [], RetentionHint(session=f"spam-{i}", tenant="mallory",
                                                       retain=False))  # fmt: skip
    out = run_admin(sched.planner, "forget", session="diary", tenant="alice")
    assert out["keys"] == 3 or "unanswered" in out or "error" in out, (
        f"forget of alice's conversation after mallory's flood answered {out}: alice's 3 "
        "chunks were not deleted and nothing says so"
    )


# ---- 3. the native server: requests and the admin API -------------------------------------------

ADMIN = "tenant-admin-key"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
GREEDY = {"model": "tiny", "max_tokens": 1, "temperature": 0}
NCHUNK = 64


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    run_dir = tmp_path_factory.mktemp("tenant-run")
    with admin_server(tiny_model, run_dir, ADMIN, chunk_size=NCHUNK, memory_bytes="64MiB") as srv:
        yield srv


def complete(srv: EngineServer, tokens: list[int], **fields: Any) -> httpx.Response:
    r = call(srv, "POST", "/v1/completions", {**GREEDY, "prompt": tokens, **fields})
    assert srv.loop.wait_idle(30.0)
    return r


def test_native_conversation_keys_are_scoped_by_user(server: EngineServer) -> None:
    """Two users who name their conversations alike (`prompt_cache_key` "chat") own two
    conversations: forgetting alice's deletes her chunks only, releasing alice's leaves bob's
    retention alone, and bob's chunks still serve a hit."""
    pa = make_prompts(1, 2 * NCHUNK + 3, seed=501)[0]
    pb = make_prompts(1, 3 * NCHUNK + 3, seed=502)[0]
    for p, user in ((pa, "alice"), (pb, "bob")):
        r = complete(server, p, prompt_cache_key="chat", user=user,
                     prompt_cache_retention="in_memory")  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["kvtier_retention"]["status"] == "retained"
    assert (held_chunks(server, pa), held_chunks(server, pb)) == (2, 3)
    rel = call(server, "POST", "/kvtier/release", {"prompt_cache_key": "chat", "user": "alice"},
               headers=AUTH)  # fmt: skip
    assert rel.status_code == 200 and rel.json()["keys"] == 2, rel.text
    stats = call(server, "GET", "/kvtier/retention", headers=AUTH).json()
    assert stats["per_tenant"].get("bob") == 3 and "alice" not in stats["per_tenant"]
    gone = call(server, "POST", "/kvtier/forget", {"prompt_cache_key": "chat", "user": "alice"},
                headers=AUTH)  # fmt: skip
    assert gone.status_code == 200 and gone.json()["keys"] == 2 and gone.json()["ranks"] == {"0": 2}
    assert (held_chunks(server, pa), held_chunks(server, pb)) == (0, 3)
    # without `user` the key names the anonymous conversation "chat" (none): nothing happens
    none = call(server, "POST", "/kvtier/forget", {"prompt_cache_key": "chat"}, headers=AUTH)
    assert none.json()["keys"] == 0 and held_chunks(server, pb) == 3


def test_native_request_user_is_bounded_like_prompt_cache_key(server: EngineServer) -> None:
    """`user` names the tenant a hint is charged to and scopes the conversation key; the
    server caps prompt_cache_key at 256 characters (400 over it) but takes a `user` of any
    length and the ledger keeps it: a request of one token with a 1 MiB `user` leaves a
    megabyte in the scheduler after it finished."""
    r = complete(server, [5, 6, 7], prompt_cache_key="k", user="u" * (1 << 20))
    assert r.status_code == 400 and r.json()["error"]["param"] == "user", (
        f"a 1 MiB user was accepted ({r.status_code}) and is kept by the retention ledger"
    )


def test_native_forget_all_needs_a_user(server: EngineServer) -> None:
    """docs/native-server.md: `"all": true` *with* `user` forgets every conversation of that
    user. A body with `"all": true` and no `user` (a caller whose user id came out empty)
    forgets every conversation of every client that sent no `user` at all."""
    p1 = make_prompts(1, 2 * NCHUNK + 1, seed=511)[0]
    p2 = make_prompts(1, 2 * NCHUNK + 1, seed=512)[0]
    assert complete(server, p1, prompt_cache_key="client-1").status_code == 200
    assert complete(server, p2, prompt_cache_key="client-2").status_code == 200
    assert (held_chunks(server, p1), held_chunks(server, p2)) == (2, 2)
    r = call(server, "POST", "/kvtier/forget", {"all": True}, headers=AUTH)
    after = (held_chunks(server, p1), held_chunks(server, p2))
    assert r.status_code == 400, (
        f"forget {{'all': true}} without a user answered {r.status_code} {r.text} and left "
        f"hits {after} (two anonymous clients' conversations deleted)"
    )


def test_native_salt_and_transfer_params_are_refused(server: EngineServer) -> None:
    """The native server keys the tier by token ids only: a salted request (which a client
    sends to keep its prefix apart from other tenants') is refused, never served from (or
    saved into) the shared tier, and so is vLLM's kv_transfer_params channel."""
    p = make_prompts(1, 2 * NCHUNK + 1, seed=521)[0]
    assert complete(server, p).status_code == 200
    assert held_chunks(server, p) == 2
    for field, value in (("cache_salt", "tenant-b"), ("kv_transfer_params", {"user": "x"})):
        r = complete(server, p, **{field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_native_same_prompt_keys_do_not_depend_on_user_or_key(server: EngineServer) -> None:
    """The chunk keys of a prompt are its tokens under the engine's seed (model, chunk size,
    epoch) and nothing a client names: `user` and `prompt_cache_key` scope the retention
    ledger only, so the keys the admin API acts on for a prompt are exactly the ones a lookup
    of it asks for."""

    def keys(engine: Any, tokens: list[int]) -> list[bytes]:
        return engine.connector.core.planner.keys_for(tokens)

    p = make_prompts(1, 3 * NCHUNK, seed=531)[0]
    got = server.loop.call(lambda e: keys(e, p)).result(timeout=30)
    model_id = server.loop.call(lambda e: e.connector.core.keys.model_id).result(timeout=30)
    assert got == chain_keys(p, NCHUNK, key_seed(model_id, NCHUNK))
