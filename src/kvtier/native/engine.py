"""Engine: kvtier's reference inference engine (the API the server and the CLI build on).

Usage::

    from kvtier.native import Engine, EngineConfig, SamplingParams

    with Engine("path/to/model", EngineConfig(num_blocks=512)) as engine:
        outs = engine.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=8))
        print(outs[0].text, engine.stats())

Streaming (one thread drives the engine; it is not thread-safe)::

    rid = engine.add_request("Hello there", SamplingParams(max_tokens=32))
    while engine.has_unfinished_requests():
        for out in engine.step():          # RequestOutput per request that sampled a token
            ...                            # out.new_token_ids, out.finished, out.finish_reason

With an offload connector::

    Engine(model_dir, cfg, connector_factory=("kvtier.some.module:make", {"key": "value"}))

The factory is called as `make(role, context, **args)` in the engine process (scheduler half)
and in every TP rank (worker half); see `kvtier.native.connector` for the hook contract.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import msgspec

from kvtier.errors import ConfigError
from kvtier.native.blocks import BlockManager
from kvtier.native.config import EngineConfig
from kvtier.native.connector import (
    CACHE_HIT_SOURCES,
    NULL_CONNECTOR,
    ConnectorRole,
    ConnectorSpec,
    build_connector,
)
from kvtier.native.loader import load_model_config
from kvtier.native.model import ModelConfig
from kvtier.native.runner import LocalExecutor, build_step_input, connector_context
from kvtier.native.sampling import SamplingParams
from kvtier.native.scheduler import RankReport, Scheduler
from kvtier.native.sequence import RequestOutput, Sequence, loggable
from kvtier.native.tokenizer import Tokenizer
from kvtier.native.tp import MultiprocExecutor

Prompt = str | Seq[int]
_SEED_MASK = (1 << 63) - 1


def _check_tp(mcfg: ModelConfig, tp: int) -> None:
    for name, value in (
        ("num_key_value_heads", mcfg.num_kv_heads),
        ("num_attention_heads", mcfg.num_heads),
        ("intermediate_size", mcfg.intermediate_size),
    ):
        if value % tp:
            raise ConfigError(
                f"tensor_parallel_size={tp} does not divide the model's {name}={value}; "
                f"pick a tensor_parallel_size that divides {value}"
            )


class Engine:
    """Continuous-batching engine over a paged KV cache with an optional KV connector."""

    def __init__(
        self,
        model_dir: str | Path,
        config: EngineConfig | None = None,
        connector_factory: ConnectorSpec | tuple[str, dict[str, Any]] | str | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model_dir = str(model_dir)
        self.config = cfg = config or EngineConfig()
        self.clock = clock
        self.model_config = mcfg = load_model_config(model_dir)
        _check_tp(mcfg, cfg.tensor_parallel_size)
        capacity = cfg.num_blocks * cfg.block_size
        if cfg.max_model_len is not None and cfg.max_model_len > capacity:
            raise ConfigError(
                f"max_model_len={cfg.max_model_len} exceeds the KV pool of {cfg.num_blocks} "
                f"blocks x {cfg.block_size} tokens = {capacity}; raise num_blocks"
            )
        self.max_model_len = cfg.max_model_len or min(mcfg.max_position, capacity)
        self._tokenizer: Tokenizer | None = None
        self.has_connector = connector_factory is not None
        spec = ConnectorSpec.of(connector_factory) if self.has_connector else NULL_CONNECTOR
        self._closed = False
        # ranks first: a connector's scheduler half may need its worker halves up (lookups)
        if cfg.tensor_parallel_size == 1:
            self.executor: LocalExecutor | MultiprocExecutor = LocalExecutor(
                self.model_dir, cfg, mcfg, spec
            )
        else:
            self.executor = MultiprocExecutor(self.model_dir, cfg, spec, clock=clock)
        try:
            ctx = msgspec.structs.replace(
                connector_context(self.model_dir, mcfg, cfg, rank=-1),
                max_model_len=self.max_model_len,
            )
            self.connector = build_connector(spec, ConnectorRole.SCHEDULER, ctx)
        except BaseException:
            self.executor.close()
            raise
        self.block_manager = BlockManager(
            cfg.num_blocks, cfg.block_size, enable_prefix_caching=cfg.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager,
            self.connector,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_num_seqs=cfg.max_num_seqs,
            max_model_len=self.max_model_len,
            eos_token_ids=mcfg.eos_token_ids,
            world=cfg.tensor_parallel_size,
            has_connector=self.has_connector,
        )
        self.last_step_tokens = 0  # tokens in the latest step's forward (0: hooks only)
        self.last_scheduled_new: list[str] = []  # requests admitted (or resumed) in that step
        self._arrivals = itertools.count()
        self._step_ids = itertools.count()

    # ---- requests -----------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        """The model directory's tokenizer (loaded on first use)."""
        if self._tokenizer is None:
            self._tokenizer = Tokenizer(self.model_dir)
        return self._tokenizer

    @property
    def kv_cache_shapes(self) -> list[list[int]]:
        """Per rank: `[layers, num_blocks, 2, block_size, kv_heads_per_rank, head_dim]`."""
        return self.executor.kv_cache_shapes

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        retention: object | None = None,
    ) -> str:
        """Queue a request (text, or token ids used as given); returns its id. `retention`: the
        client's hint (`offload.retention.RetentionHint`), for a connector that takes one."""
        self._check_open()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty; pass at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(ids) > self.max_model_len:
            raise ValueError(
                f"prompt of {len(ids)} tokens exceeds max_model_len={self.max_model_len}; "
                "shorten it or raise EngineConfig.max_model_len/num_blocks"
            )
        arrival = next(self._arrivals)
        rid = request_id if request_id is not None else f"req-{arrival}"
        if self.scheduler.get(rid) is not None or rid in self.scheduler.held:
            raise ValueError(f"request id {loggable(rid)} is still in use; pick another id")
        params = params or SamplingParams()
        seed = params.seed if params.seed is not None else (self.config.seed << 20) + arrival
        seq = Sequence(rid, ids, params, seed & _SEED_MASK, arrival)
        seq.retention = retention
        self.scheduler.add(seq)
        return rid

    def abort(self, request_id: str, reason: str = "abort") -> bool:
        """Stop a live request ("stop": the caller matched a stop string); its blocks are freed
        once no transfer touches them."""
        self._check_open()
        return self.scheduler.abort(request_id, reason)

    def has_unfinished_requests(self) -> bool:
        """True while requests wait, run, load, or hold blocks for the connector."""
        return self.scheduler.has_unfinished()

    # ---- stepping -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward on every rank, apply the results.

        Returns one RequestOutput per request that sampled a token in this step. Steps with
        nothing to compute still run the connector hooks (loads and saves progress).
        """
        self._check_open()
        if not self.scheduler.has_unfinished():
            return []
        out = self.scheduler.schedule()
        self.last_step_tokens = out.total_num_scheduled_tokens
        self.last_scheduled_new = [s.request_id for s in out.scheduled if s.is_new]
        meta = self.connector.encode_meta(self.connector.build_connector_meta(out))
        step = build_step_input(
            out, meta, next(self._step_ids), self.config.block_size, self.model_config.eos_token_ids
        )
        results = self.executor.execute(step)
        reports = [
            RankReport(r.finished_sending, r.finished_recving, r.invalid_block_ids, r.worker_meta)
            for r in results
        ]
        first = results[0]
        sampled = first.sampled or [-1] * len(out.scheduled)
        return self.scheduler.update_from_output(
            out, sampled, reports, first.logprobs, first.failed
        )

    def generate(
        self,
        prompts: Seq[Prompt],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        timeout_s: float | None = None,
        idle_poll_s: float = 0.001,
    ) -> list[RequestOutput]:
        """Run `prompts` to completion (and drain the connector); final outputs in order.

        `text` is decoded when the model directory has a tokenizer.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            raise TypeError("generate takes a list of prompts; wrap a single prompt in a list")
        plist = params if isinstance(params, Seq) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} sampling params for {len(prompts)} prompts")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        final: dict[str, RequestOutput] = {}
        wanted = set(ids)
        deadline = None if timeout_s is None else self.clock() + timeout_s
        while self.has_unfinished_requests():
            outs = self.step()
            for o in outs:
                if o.finished and o.request_id in wanted:
                    final[o.request_id] = o
            if deadline is not None and self.clock() > deadline:
                raise TimeoutError(
                    f"generate did not finish within {timeout_s} s; "
                    f"{len(wanted) - len(final)} of {len(wanted)} requests still open"
                )
            if self.last_step_tokens == 0:
                # only transfers in flight (loads, delayed frees): give them the core
                time.sleep(idle_poll_s)
        if (Path(self.model_dir) / "tokenizer.json").is_file():
            for o in final.values():
                o.text = self.tokenizer.decode(o.output_token_ids)
        return [final[i] for i in ids]

    def drain(self, timeout_s: float = 60.0, idle_poll_s: float = 0.001) -> None:
        """Step until nothing is left (requests, loads, delayed frees), or raise TimeoutError."""
        deadline = self.clock() + timeout_s
        while self.has_unfinished_requests():
            self.step()
            if self.last_step_tokens == 0:
                time.sleep(idle_poll_s)
            if self.clock() > deadline:
                raise TimeoutError(f"engine did not drain within {timeout_s} s")

    # ---- cache and stats ----------------------------------------------------------------------

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block in HBM (blocks in use keep their content)."""
        self.block_manager.reset_prefix_cache()

    def stats(self) -> dict[str, float]:
        """vLLM-named counters (monotonic) and a few gauges."""
        s = self.scheduler.stats
        bm = self.block_manager
        return {
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "external_prefix_cache_queries": s.external_prefix_cache_queries,
            "external_prefix_cache_hits": s.external_prefix_cache_hits,
            "external_load_failures": s.external_load_failures,
            # admissions after a preemption, counted apart (vLLM's PrefixCacheStats fields)
            "preempted_queries": bm.preempted_queries,
            "preempted_hits": bm.preempted_hits,
            "preempted_external_queries": s.preempted_external_queries,
            "preempted_external_hits": s.preempted_external_hits,
            "prompt_tokens": s.prompt_tokens,
            "generation_tokens": s.generation_tokens,
            "num_preemptions": s.num_preemptions,
            "requests_finished": s.requests_finished,
            "requests_aborted": s.requests_aborted,
            "requests_failed": s.requests_failed,
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": (
                len(self.scheduler.waiting) + len(self.scheduler.ready) + len(self.scheduler.parked)
            ),
            "num_requests_queued": len(self.scheduler.waiting) + len(self.scheduler.ready),
            "num_requests_loading": len(self.scheduler.parked),
            "kv_cache_usage": bm.usage(),
            # external hits by the tier that served them (vLLM's CacheHitSource values)
            **{
                f"external_hits_{src}": s.external_hits_by_source.get(src, 0)
                for src in CACHE_HIT_SOURCES
                if src != "device"
            },
        }

    # ---- lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the connector halves and the TP workers; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.connector.shutdown()
        finally:
            self.executor.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is closed; create a new Engine")

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
