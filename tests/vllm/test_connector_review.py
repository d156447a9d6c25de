"""Review of the vLLM host's scheduler half (`kvtier.vllm.scheduler_side`) in the scenarios where
a request waits forever for a load nobody sends, the engine dies of an exception out of a hook,
or a client's field costs more than its own request. Driven without vLLM: the few vLLM names
the adapter imports are stubbed for one test (`tests/offload/test_scheduler_contract.py`'s
harness), and vLLM 0.32's own calls are replayed in the order its `Scheduler` makes them.
Deterministic, no sleeps; each test asserts what vLLM would get (loads, block ids, delayed
frees, returned values)."""

from __future__ import annotations

import importlib
import logging
import sys
import types
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from kvtier.config import KVTierConfig
from kvtier.metrics import Metrics
from kvtier.offload.groups import FULL, SLIDING, ChunkGroups, GroupSpec
from kvtier.offload.messages import OpResult, WorkerReport
from kvtier.offload.scheduler import OffloadScheduler
from kvtier.vllm.request_view import VLLMRequestView
from tests.offload.fakes import FakeLookup
from tests.offload.test_scheduler_contract import (
    _Blocks,
    _connector_output,
    _decode,
    _out,
    _side,
    _stub_modules,
    _vllm_request,
)

BS = 16
CHUNK = 256  # 16 blocks
# gpt-oss-shaped: a 128-token sliding window next to full attention
SW = GroupSpec(SLIDING, BS, ("sw.0",), reach=127)
FA = GroupSpec(FULL, BS, ("fa.0",))


@pytest.fixture
def vllm_side(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """`kvtier.vllm.scheduler_side` over stubbed vLLM modules (as test_scheduler_contract's)."""
    for name, mod in _stub_modules().items():
        monkeypatch.setitem(sys.modules, name, mod)
    for name in ("kvtier.vllm.scheduler_side", "kvtier.vllm.events", "kvtier.vllm.metadata",
                 "kvtier.vllm.stats"):  # fmt: skip
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield importlib.import_module("kvtier.vllm.scheduler_side")
    for name in list(sys.modules):
        if name.startswith("kvtier.vllm.") and name not in (
            "kvtier.vllm.request_view", "kvtier.vllm.rundir", "kvtier.vllm.state_block",
        ):  # fmt: skip
            sys.modules.pop(name, None)


def _tokens(n: int) -> list[int]:
    return [(i * 7) % 1000 for i in range(n)]


class _GroupBlocks:
    """vLLM's KVCacheBlocks of a hybrid model as update_state_after_alloc reads it."""

    def __init__(self, tables: list[list[int]]) -> None:
        self.tables = tables

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple(list(t) for t in self.tables)


def _hybrid_side(module: types.ModuleType, hits: int) -> tuple[Any, OffloadScheduler]:
    groups = ChunkGroups([FA, SW], CHUNK)
    core = OffloadScheduler(
        KVTierConfig(chunk_size=CHUNK, load_gate=False, sync_load_fraction=0),
        FakeLookup(hits), model_id="m", block_size=BS, world=1,
        metrics=Metrics(rank="scheduler"), cold_misses=False, groups=groups,
    )  # fmt: skip
    side = _side(module, core)
    side.hybrid = groups
    return side, core


def _tables(n_tokens: int) -> list[list[int]]:
    n = -(-n_tokens // BS)
    return [list(range(100, 100 + n)), list(range(500, 500 + n))]


def _raise_once(core: OffloadScheduler) -> list[int]:
    """Make `core.blocks_allocated` raise at its next call only; the blocks it was handed."""
    real = core.blocks_allocated
    seen: list[int] = []

    def broken(block_ids: Any) -> None:
        core.blocks_allocated = real  # type: ignore[method-assign]
        seen.extend(block_ids)
        raise RuntimeError("injected: kvtier's own bookkeeping failed")

    core.blocks_allocated = broken  # type: ignore[method-assign]
    return seen


def _hybrid_out(new: list[tuple[str, list[list[int]], int, int]] = (),  # type: ignore[assignment]
                copies: tuple[int, ...] = ()) -> SimpleNamespace:  # fmt: skip
    out = _out()
    out.scheduled_new_reqs = [
        SimpleNamespace(req_id=r, block_ids=tuple(t), num_computed_tokens=c) for r, t, c, _ in new
    ]
    out.num_scheduled_tokens = {r: n for r, _, _, n in new}
    out.kv_cache_block_copies = [SimpleNamespace(dst_block_id=b) for b in copies]
    return out


# ---- 1. a counted load whose host-side bookkeeping failed: the request must not park forever ----


def _async_load_of_two_chunks(vllm_side: types.ModuleType) -> tuple[Any, Any, Any, int, list[int]]:
    """A one-group core and its vLLM side with request "a" (two chunks and a token) promised
    two chunks asynchronously: (core, side, the vLLM request, tokens promised, its block ids)."""
    core = OffloadScheduler(
        KVTierConfig(chunk_size=CHUNK, load_gate=False, sync_load_fraction=0), FakeLookup(2),
        model_id="m", block_size=BS, world=1, metrics=Metrics(rank="scheduler"),
        cold_misses=False,
    )  # fmt: skip
    side = _side(vllm_side, core)
    tokens = _tokens(2 * CHUNK + 1)
    req = _vllm_request("a", tokens)
    n, is_async = side.get_num_new_matched_tokens(req, 0)
    assert (n, is_async) == (2 * CHUNK, True)
    return core, side, req, n, list(range(100, 100 + -(-len(tokens) // BS)))


def test_a_hybrid_alloc_failure_after_vllm_counted_the_load_still_sends_it_to_fail(
    vllm_side: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Invariant 18 / 5: vLLM counts the promised tokens once update_state_after_alloc is
    called and parks an async load's request in WAITING_FOR_REMOTE_KVS until the ranks name it
    in finished_recving. When kvtier's bookkeeping fails inside that hook, the guard must still
    send the ranks a load they fail at once (the request is recomputed). A hybrid model's
    tables were learned, but a failure before the flat table was noted handed the core no
    blocks: the promise was dropped, no load was ever sent, and the request waited forever
    holding its blocks."""
    side, core = _hybrid_side(vllm_side, hits=2)
    tokens = _tokens(2 * CHUNK + 1)
    req = _vllm_request("a", tokens)
    n, is_async = side.get_num_new_matched_tokens(req, 0)
    assert (n, is_async) == (2 * CHUNK, True)
    tables = _tables(len(tokens))

    def broken(self: VLLMRequestView, groups: Any) -> None:
        raise RuntimeError("injected: learning the tables failed")

    monkeypatch.setattr(VLLMRequestView, "set_group_block_ids", broken)
    side.update_state_after_alloc(req, _GroupBlocks(tables), n)
    monkeypatch.undo()
    meta = _decode(side.build_connector_meta(_hybrid_out()))
    loads = [op for op in meta.loads if op.req_id == "a"]
    assert len(loads) == 1, (
        "vLLM counted the load and parks the request until finished_recving, but no load was "
        "sent to the ranks: nobody will ever report it (the request hangs holding its blocks)"
    )
    (load,) = loads
    assert load.fail, "a load whose bookkeeping failed must be failed by the ranks (recompute)"
    # over the blocks vLLM allocated for it: every group's table as vLLM handed it
    full = [b for c in load.chunks for b in c.block_ids if b >= 0]
    assert full and set(full) <= set(tables[0]) | set(tables[1])


def test_a_dense_alloc_failure_after_the_table_was_read_still_sends_the_load_to_fail(
    vllm_side: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same hook on a one-group model: a failure after vLLM's block table was read (here
    learning it into the view) must still hand the core that table, so the ranks fail the
    counted load over exactly those blocks (vLLM recomputes them) instead of the request
    waiting for a finished_recving nobody sends."""
    core, side, req, n, ids = _async_load_of_two_chunks(vllm_side)

    def broken(self: VLLMRequestView, block_ids: Any) -> None:
        raise RuntimeError("injected: learning the table failed")

    monkeypatch.setattr(VLLMRequestView, "set_block_ids", broken)
    side.update_state_after_alloc(req, _Blocks(ids), n)
    monkeypatch.undo()
    meta = _decode(side.build_connector_meta(_out()))
    loads = [op for op in meta.loads if op.req_id == "a"]
    assert len(loads) == 1, "the counted load was dropped: the parked request waits forever"
    (load,) = loads
    assert load.fail
    # the ranks report these blocks invalid: exactly the promised ones, none below the floor
    assert [b for c in load.chunks for b in c.block_ids if b >= 0] == ids[: 2 * CHUNK // BS]


# ---- 2. a failure in the step hook's own bookkeeping never escapes it -------------------------


def test_cow_bookkeeping_failure_never_escapes_build_connector_meta_and_cancels_saves(
    vllm_side: types.ModuleType,
) -> None:
    """Invariant 18: an exception escaping build_connector_meta ends vLLM's EngineCore for
    every user. A hybrid model's copy-on-write targets were handed to the core outside any
    guard. The safe answer when that bookkeeping fails is to cancel every save in flight (a
    cancelled save commits nothing): one of them may read a window block vLLM just reused,
    and nobody could tell which."""
    side, core = _hybrid_side(vllm_side, hits=0)
    tokens = _tokens(2 * CHUNK + 1)
    req = _vllm_request("a", tokens)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    tables = _tables(len(tokens))
    side.update_state_after_alloc(req, _GroupBlocks(tables), 0)
    meta = _decode(side.build_connector_meta(_hybrid_out(new=[("a", tables, 0, len(tokens))])))
    saves = [op.op_id for op in meta.saves if op.req_id == "a"]
    assert saves, "the prompt's two chunks are saved after its prefill step"
    seen = _raise_once(core)
    # next step: vLLM copies a block on write into block 7 (a block a save may read)
    meta = _decode(side.build_connector_meta(_hybrid_out(copies=(7,))))
    assert seen == [7]
    assert set(saves) <= set(meta.cancel_saves), (
        "the reused blocks could not be checked against the saves in flight, yet no save was "
        "cancelled: a save reading a reused window block would commit another request's KV"
    )
    assert core._m.value("hook_errors_total", hook="build_connector_meta") == 1


# ---- 3. a client's retention hint costs a bounded log line -------------------------------------


def test_a_malformed_retention_hint_is_logged_in_a_bounded_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """kv_transfer_params is the client's: a bad hint is logged and ignored, but the line held
    the client's whole value (a 1 MiB `prompt_cache_retention` made a 1 MiB log line per
    request, unthrottled). The line names the field and stays bounded."""
    huge = "x" * (1 << 20)
    for params in ({"prompt_cache_retention": huge}, {"retain_ttl_s": huge},
                   {"retain_tokens": [0] * 100_000}):  # fmt: skip
        req = SimpleNamespace(request_id="r" * 5000, prompt_token_ids=[1, 2, 3],
                              num_computed_tokens=0, kv_transfer_params=params)  # fmt: skip
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvtier"):
            assert VLLMRequestView(req).retention is None
        (record,) = caplog.records
        line = record.getMessage()
        assert "retention hint ignored" in line and next(iter(params)) in line
        assert len(line) < 1024, f"{len(line)} characters logged for one request's hint"


def test_a_good_retention_hint_is_read_and_a_non_dict_is_none() -> None:
    def view(params: object) -> VLLMRequestView:
        return VLLMRequestView(
            SimpleNamespace(
                request_id="r",
                prompt_token_ids=[1],
                num_computed_tokens=0,
                kv_transfer_params=params,
            )
        )

    hint = view({"prompt_cache_key": "s", "retain_ttl_s": 60, "user": "t"}).retention
    assert hint is not None and (hint.session, hint.tenant, hint.ttl_s) == ("s", "t", 60.0)
    for params in (None, [], "x", 5, {"unrelated": 1}):
        assert view(params).retention is None


# ---- 4. pinned: an abort while an async load is on the ranks ------------------------------------


def test_abort_during_async_load_leaves_the_free_to_vllm_and_never_sends_finished_sending(
    vllm_side: types.ModuleType,
) -> None:
    """vLLM 0.32 holds a WAITING_FOR_REMOTE_KVS request's blocks itself until finished_recving
    and then frees them; a finished_sending for it afterwards hits vLLM's
    `assert req_id in self.requests` and ends the engine. So request_finished answers False
    for a request whose async load is in flight, the core's delayed free never reaches the
    ranks, and the request's state is gone once the load ends."""
    core, side, req, n, ids = _async_load_of_two_chunks(vllm_side)
    side.update_state_after_alloc(req, _Blocks(ids), n)
    (load,) = _decode(side.build_connector_meta(_out())).loads
    assert not load.sync and [b for c in load.chunks for b in c.block_ids] == ids[:32]
    # the client aborts while the ranks copy
    assert side.request_finished(req) is False
    assert _decode(side.build_connector_meta(_out())).delayed_free == []
    # the load ends: vLLM frees the blocks on finished_recving
    side.update_connector_output(_connector_output(
        vllm_side, [WorkerReport(0, [OpResult(load.op_id, True)], finished_recving=["a"])],
        recving=["a"]))  # fmt: skip
    assert _decode(side.build_connector_meta(_out())).delayed_free == []
    assert "a" not in side._loading and not side.views
    assert core.pending_load("a") is None and core.saved_frontier("a") is None


def test_a_window_check_failing_at_alloc_cancels_every_save_and_the_load_goes_on(
    vllm_side: types.ModuleType,
) -> None:
    """The new blocks of an admission are checked against the saves in flight (a save reading
    one as a window block must not commit). When that check fails, every save in flight is
    cancelled instead, and the admission's own load is sent as usual (its blocks are known)."""
    side, core = _hybrid_side(vllm_side, hits=0)
    tokens = _tokens(2 * CHUNK + 1)
    a = _vllm_request("a", tokens)
    assert side.get_num_new_matched_tokens(a, 0) == (0, False)
    tables = _tables(len(tokens))
    side.update_state_after_alloc(a, _GroupBlocks(tables), 0)
    meta = _decode(side.build_connector_meta(_hybrid_out(new=[("a", tables, 0, len(tokens))])))
    saves = [op.op_id for op in meta.saves]
    assert saves
    core._lookup.hits = 2  # type: ignore[attr-defined]
    b = _vllm_request("b", [t + 1 for t in _tokens(2 * CHUNK + 1)])  # another prompt
    n, _ = side.get_num_new_matched_tokens(b, 0)
    assert n == 2 * CHUNK
    seen = _raise_once(core)
    other = [[t + 1000 for t in table] for table in tables]
    side.update_state_after_alloc(b, _GroupBlocks(other), n)
    assert seen, "b's new blocks were handed to the check"
    meta = _decode(side.build_connector_meta(_hybrid_out()))
    assert set(saves) <= set(meta.cancel_saves)
    (load,) = [op for op in meta.loads if op.req_id == "b"]
    assert not load.fail
