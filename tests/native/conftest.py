"""Shared fixtures for the native engine tests, and `DictConnector`: a test-only KV connector
that saves the full prompt blocks of finished requests into a dict and loads them back."""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from kvtier.native import Engine, EngineConfig, SamplingParams
from kvtier.native.connector import ConnectorContext, ConnectorOutput, ConnectorRole, ConnectorSpec
from kvtier.native.modelgen import init_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


# ---- the tiny model and prompts ------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama (float32 weights), generated once per test session."""
    return init_model(tmp_path_factory.mktemp("tiny") / "model", dtype="float32")


def make_prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    """`n` distinct random prompts of `length` tokens (no special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 2048) for _ in range(length)] for _ in range(n)]


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    """8 prompts of 304 tokens (19 full blocks of 16)."""
    return make_prompts(8, 304)


@pytest.fixture(scope="session")
def baseline(tiny_model: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy outputs of `prompts` on a TP=1 engine without connector."""
    with Engine(tiny_model, EngineConfig(num_threads=1)) as eng:
        return [o.output_token_ids for o in eng.generate(prompts, GREEDY)]


@pytest.fixture
def make_engine(tiny_model: Path) -> Iterator[Callable[..., Engine]]:
    """Engines on the tiny model (1 thread each), closed at teardown."""
    engines: list[Engine] = []

    def make(connector: Any = None, **cfg: Any) -> Engine:
        cfg.setdefault("num_threads", 1)
        eng = Engine(tiny_model, EngineConfig(**cfg), connector_factory=connector)
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        eng.close()


# ---- DictConnector --------------------------------------------------------------------------


def chain_hashes(token_ids: list[int], block_size: int) -> list[bytes]:
    """sha256 chain over full blocks; independent of the engine's own prefix hashes."""
    out: list[bytes] = []
    parent = b"dict-connector"
    for i in range(len(token_ids) // block_size):
        block = token_ids[i * block_size : (i + 1) * block_size]
        parent = hashlib.sha256(parent + repr(block).encode()).digest()
        out.append(parent)
    return out


class Transfer(msgspec.Struct, array_like=True):
    """Blocks of one request to load or save: (hash, block id) pairs."""

    req_id: str
    blocks: list[tuple[bytes, int]]


class DictMeta(msgspec.Struct):
    """Scheduler -> worker metadata of one step."""

    step: int
    loads: list[Transfer]
    saves: list[Transfer]
    is_async: bool


class DictConnector:
    """Both halves of a dict-backed connector; args tune faults and delays for the tests.

    load_async: park loading requests (True) or load inside the step (False)
    fail_load_block: index, within every load, of a block whose load fails (and is poisoned)
    recv_delay / send_delay: {rank (str): steps} before a rank reports a finished load / save
    """

    def __init__(
        self,
        role: ConnectorRole,
        context: ConnectorContext,
        *,
        load_async: bool = True,
        fail_load_block: int | None = None,
        recv_delay: dict[str, int] | None = None,
        send_delay: dict[str, int] | None = None,
    ) -> None:
        self.role = role
        self.ctx = context
        self.bs = context.block_size
        self.load_async = load_async
        self.fail_load_block = fail_load_block
        self.calls: Counter[str] = Counter()
        # scheduler half
        self.stored: set[bytes] = set()
        self._loads: list[Transfer] = []
        self._saves: list[Transfer] = []
        self._inflight: dict[str, list[bytes]] = {}
        self.step = 0
        self.outputs: list[ConnectorOutput] = []
        self.finished: dict[str, list[int]] = {}
        self.preempted: list[str] = []
        # worker half
        rank = str(max(context.tp_rank, 0))
        self.recv_delay = (recv_delay or {}).get(rank, 0)
        self.send_delay = (send_delay or {}).get(rank, 0)
        self.store: dict[bytes, list[torch.Tensor]] = {}
        self.kv: list[torch.Tensor] = []
        self.meta: DictMeta | None = None
        self.order: list[str] = []  # worker hook order of the latest step
        self._recv_due: dict[str, int] = {}
        self._send_due: dict[str, int] = {}
        self._invalid: set[int] = set()
        self.loaded_blocks = 0

    # ---- scheduler half ----

    def get_num_new_matched_tokens(self, request: Any, hbm_tokens: int) -> tuple[int, bool]:
        self.calls["get_num_new_matched_tokens"] += 1
        n = 0
        for h in chain_hashes(request.prompt_token_ids, self.bs):
            if h not in self.stored:
                break
            n += 1
        hit = min(n * self.bs, request.num_tokens - 1)
        return max(0, hit - hbm_tokens), self.load_async

    def update_state_after_alloc(self, request: Any, block_ids: list[int], n_ext: int) -> None:
        self.calls["update_state_after_alloc"] += 1
        if n_ext <= 0:
            return
        floor = request.num_computed_tokens
        assert floor % self.bs == 0, "the HBM floor is whole blocks"
        hashes = chain_hashes(request.prompt_token_ids, self.bs)
        idx = range(floor // self.bs, -(-(floor + n_ext) // self.bs))
        self._loads.append(Transfer(request.request_id, [(hashes[i], block_ids[i]) for i in idx]))

    def build_connector_meta(self, scheduler_output: Any) -> DictMeta:
        self.calls["build_connector_meta"] += 1
        self.step += 1
        meta = DictMeta(self.step, self._loads, self._saves, self.load_async)
        for t in self._saves:
            self._inflight[t.req_id] = [h for h, _ in t.blocks]
        self._loads, self._saves = [], []
        return meta

    def encode_meta(self, meta: object) -> bytes:
        return msgspec.msgpack.encode(meta)

    def update_connector_output(self, output: ConnectorOutput) -> None:
        self.calls["update_connector_output"] += 1
        self.outputs.append(output)
        for rid in output.finished_sending:
            self.stored.update(self._inflight.pop(rid, []))

    def request_finished(self, request: Any, block_ids: list[int]) -> bool:
        self.calls["request_finished"] += 1
        self.finished[request.request_id] = list(block_ids)
        full = min(request.num_computed_tokens, len(request.prompt_token_ids)) // self.bs
        hashes = chain_hashes(request.prompt_token_ids, self.bs)[:full]
        todo = [(h, block_ids[i]) for i, h in enumerate(hashes) if h not in self.stored]
        if not todo:
            return False
        self._saves.append(Transfer(request.request_id, todo))
        return True

    def request_preempted(self, request: Any) -> None:
        self.preempted.append(request.request_id)

    # ---- worker half ----

    def _hook(self, name: str) -> None:
        self.order.append(name)
        self.calls[name] += 1

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], block_size: int) -> None:
        self.kv = list(kv_caches.values())
        assert block_size == self.bs

    def decode_meta(self, data: bytes) -> DictMeta:
        return msgspec.msgpack.decode(data, type=DictMeta)

    def bind_connector_metadata(self, meta: object) -> None:
        assert isinstance(meta, DictMeta)
        self.meta = meta
        self.order = []
        self._hook("bind_connector_metadata")

    def handle_preemptions(self, preempted_req_ids: set[str]) -> None:
        self._hook("handle_preemptions")

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Its loads are copied in start_load_kv: nothing to wait for (not recorded: the hook
        order the tests compare is per step)."""

    def start_load_kv(self) -> None:
        self._hook("start_load_kv")
        assert self.meta is not None
        for t in self.meta.loads:
            for i, (h, b) in enumerate(t.blocks):
                saved = self.store.get(h)
                if saved is None or i == self.fail_load_block:
                    for layer in self.kv:  # poison: only a recompute can give the right output
                        layer[b].fill_(1000.0)
                    self._invalid.add(b)
                    continue
                for layer, block in zip(self.kv, saved, strict=True):
                    layer[b].copy_(block)
                self.loaded_blocks += 1
            if self.meta.is_async:
                self._recv_due[t.req_id] = self.recv_delay

    def wait_for_save(self) -> None:
        self._hook("wait_for_save")
        assert self.meta is not None
        for t in self.meta.saves:
            for h, b in t.blocks:
                self.store[h] = [layer[b].clone() for layer in self.kv]
            self._send_due[t.req_id] = self.send_delay

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        self._hook("get_finished")
        return _count_down(self._send_due), _count_down(self._recv_due)

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._hook("get_block_ids_with_load_errors")
        out, self._invalid = self._invalid, set()
        return out

    def build_worker_meta(self) -> bytes:
        self._hook("build_worker_meta")
        return msgspec.msgpack.encode([self.ctx.tp_rank, len(self.store)])

    def clear_connector_metadata(self) -> None:
        self._hook("clear_connector_metadata")
        self.meta = None

    def shutdown(self) -> None:
        self.calls["shutdown"] += 1


def _count_down(due: dict[str, int]) -> set[str]:
    ready = {rid for rid, left in due.items() if left <= 0}
    for rid in list(due):
        if rid in ready:
            del due[rid]
        else:
            due[rid] -= 1
    return ready


def dict_connector(**args: Any) -> ConnectorSpec:
    """A spec that builds DictConnector halves (importable by TP worker processes)."""
    return ConnectorSpec(f"{DictConnector.__module__}:DictConnector", args)
