"""The model runner of one rank: step messages in, sampled tokens and connector reports out.

`build_step_input` (engine process) flattens a `SchedulerOutput` into a `StepInput`: token ids,
positions, slot mapping and per-sequence block tables. `ModelRunner.execute` (each rank) runs
the worker-side connector hooks around the forward and samples on rank 0. Every executor sends
the step as msgspec bytes, in process (TP=1) or over a pipe (TP>1), so both take one path.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import torch

from kvtier.native.config import EngineConfig
from kvtier.native.connector import (
    ConnectorContext,
    ConnectorRole,
    ConnectorSpec,
    build_connector,
)
from kvtier.native.loader import load_model
from kvtier.native.model import AllReduce, AttentionMetadata, ModelConfig, SeqAttention
from kvtier.native.sampling import SampleOutcome, Sampler, SampleSpec, TokenLogprobs, sample_spec
from kvtier.native.sched_output import SchedulerOutput


class SeqInput(msgspec.Struct, array_like=True):
    """One sequence of the step."""

    req_id: str
    q_len: int
    ctx_len: int
    block_table: list[int]
    sampling: SampleSpec | None  # None: the step does not reach the end of what it knows


class StepInput(msgspec.Struct, tag="step"):
    """Everything a rank needs to run one step."""

    step_id: int
    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    seqs: list[SeqInput]
    connector_meta: bytes
    has_sync_loads: bool
    finished_req_ids: list[str]
    preempted_req_ids: list[str]
    # requests whose latest sampled token the scheduler threw away: their generators rewind
    resampled_req_ids: list[str] = msgspec.field(default_factory=list)


class StepResult(msgspec.Struct, tag="result"):
    """One rank's answer: sampled tokens (rank 0; -1 = no sample) and connector reports.

    `failed` maps a request whose sampling raised to the error (its `sampled` entry is -1);
    `logprobs` is aligned with `sampled` (None where none were asked for).
    """

    rank: int
    step_id: int
    sampled: list[int]
    finished_sending: list[str]
    finished_recving: list[str]
    invalid_block_ids: list[int]
    worker_meta: bytes
    logprobs: list[TokenLogprobs | None] = msgspec.field(default_factory=list)
    failed: dict[str, str] = msgspec.field(default_factory=dict)


_encoder = msgspec.msgpack.Encoder()
_step_decoder = msgspec.msgpack.Decoder(StepInput)
_result_decoder = msgspec.msgpack.Decoder(StepResult)


def encode(msg: msgspec.Struct) -> bytes:
    """msgpack bytes of any message."""
    return _encoder.encode(msg)


def build_step_input(
    out: SchedulerOutput,
    connector_meta: bytes,
    step_id: int,
    block_size: int,
    eos_token_ids: Sequence[int] = (),
) -> StepInput:
    """Flatten the scheduled requests into the step's token-level arrays."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seqs: list[SeqInput] = []
    for sr in out.scheduled:
        seq = sr.seq
        start = seq.num_computed_tokens
        end = start + sr.num_new_tokens
        input_ids.extend(seq.token_ids[start:end])
        positions.extend(range(start, end))
        table = seq.block_ids[: -(-end // block_size)]
        bs = block_size
        slots.extend(table[t // bs] * bs + t % bs for t in range(start, end))
        spec = None
        if end == seq.num_tokens:  # the step reaches the end of what the request knows
            spec = sample_spec(
                seq.request_id, seq.params, seq.seed, seq.token_ids, seq.num_prompt_tokens,
                eos_token_ids,
            )  # fmt: skip
        seqs.append(SeqInput(seq.request_id, sr.num_new_tokens, end, table, spec))
    return StepInput(
        step_id=step_id,
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slots,
        seqs=seqs,
        connector_meta=connector_meta,
        has_sync_loads=out.has_sync_loads,
        finished_req_ids=sorted(out.finished_req_ids),
        preempted_req_ids=sorted(out.preempted_req_ids),
        resampled_req_ids=sorted(out.resampled_req_ids),
    )


def connector_context(
    model_dir: str, mcfg: ModelConfig, config: EngineConfig, rank: int
) -> ConnectorContext:
    """The KV geometry a connector half of `rank` (-1: scheduler) is told about."""
    tp = config.tensor_parallel_size
    return ConnectorContext(
        model_dir=str(model_dir),
        model_type=mcfg.model_type,
        dtype=config.dtype,
        block_size=config.block_size,
        num_blocks=config.num_blocks,
        num_layers=mcfg.num_layers,
        num_kv_heads=mcfg.num_kv_heads,
        num_kv_heads_per_rank=mcfg.num_kv_heads // tp,
        head_dim=mcfg.head_dim,
        tp_size=tp,
        tp_rank=rank,
        device=config.device,
    )


def device_for(config: EngineConfig, rank: int) -> torch.device:
    """TP rank `rank`'s device (`EngineConfig.rank_device`)."""
    return config.rank_device(rank)


class ModelRunner:
    """One rank's model shard, KV cache, sampler and worker-side connector."""

    def __init__(
        self,
        model_dir: str,
        config: EngineConfig,
        mcfg: ModelConfig,
        connector: ConnectorSpec,
        *,
        rank: int = 0,
        all_reduce: AllReduce | None = None,
    ) -> None:
        self.rank = rank
        self.config = config
        self.block_size = config.block_size
        self.device = device_for(config, rank)
        tp = config.tensor_parallel_size
        self.model = load_model(
            model_dir, config.torch_dtype, self.device, tp_rank=rank, tp_size=tp,
            all_reduce=all_reduce, config=mcfg,
        )  # fmt: skip
        # one allocation, layer-major; a block of a layer is the contiguous slice kv[layer][b]
        self.kv_cache = torch.zeros(
            mcfg.num_layers, config.num_blocks, 2, config.block_size,
            mcfg.num_kv_heads // tp, mcfg.head_dim,
            dtype=config.torch_dtype, device=self.device,
        )  # fmt: skip
        self.kv_caches = list(self.kv_cache.unbind(0))
        self.sampler = Sampler()
        ctx = connector_context(model_dir, mcfg, config, rank)
        self.connector = build_connector(connector, ConnectorRole.WORKER, ctx)
        named = {f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(self.kv_caches)}
        self.connector.register_kv_caches(named, config.block_size)
        self._layer_names = list(named)

    def execute(self, step: StepInput) -> StepResult:
        """Run one step: connector hooks around the forward, then sampling on rank 0."""
        conn = self.connector
        conn.bind_connector_metadata(conn.decode_meta(step.connector_meta))
        if step.preempted_req_ids:
            conn.handle_preemptions(set(step.preempted_req_ids))
        if step.has_sync_loads:
            conn.start_load_kv()  # the forward reads what these loads write
        finished = set(step.finished_req_ids)
        # before the forward samples: an id a finished request held may be in use again
        self.sampler.forget(finished)
        self.sampler.rewind(step.resampled_req_ids)
        outcomes = self._forward(step) if step.seqs else []
        if not step.has_sync_loads:
            conn.start_load_kv()
        conn.wait_for_save()
        sending, recving = conn.get_finished(finished)
        invalid = conn.get_block_ids_with_load_errors()
        worker_meta = conn.build_worker_meta()
        conn.clear_connector_metadata()
        # ranks other than 0 sample nothing: their outcomes are empty
        failed = {
            s.req_id: o.error for s, o in zip(step.seqs, outcomes, strict=False) if o and o.error
        }
        return StepResult(
            rank=self.rank,
            step_id=step.step_id,
            sampled=[o.token if o is not None else -1 for o in outcomes],
            finished_sending=sorted(sending or ()),
            finished_recving=sorted(recving or ()),
            invalid_block_ids=sorted(invalid or ()),
            worker_meta=worker_meta or b"",
            logprobs=[o.logprobs if o is not None else None for o in outcomes],
            failed=failed,
        )

    def _forward(self, step: StepInput) -> list[SampleOutcome | None]:
        dev = self.device
        seqs = []
        start = 0
        rows = []
        for s in step.seqs:
            table = torch.tensor(s.block_table, dtype=torch.long, device=dev)
            seqs.append(SeqAttention(start, s.q_len, s.ctx_len, table))
            start += s.q_len
            if s.sampling is not None:
                rows.append(start - 1)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(step.slot_mapping, dtype=torch.long, device=dev),
            seqs=seqs,
            block_size=self.block_size,
        )
        names, conn = self._layer_names, self.connector
        hidden = self.model(
            torch.tensor(step.input_ids, dtype=torch.long, device=dev),
            torch.tensor(step.positions, dtype=torch.long, device=dev),
            self.kv_caches,
            meta,
            lambda i: conn.wait_for_layer_load(names[i]),
        )
        if self.rank != 0:
            return []
        specs = [s.sampling for s in step.seqs if s.sampling is not None]
        outcomes = iter(self.sampler.sample(self.model.compute_logits(hidden[rows]), specs))
        return [next(outcomes) if s.sampling is not None else None for s in step.seqs]

    def shutdown(self) -> None:
        """Stop the worker-side connector."""
        self.connector.shutdown()


class LocalExecutor:
    """TP=1: the runner lives in the engine process; the step still crosses as bytes."""

    world = 1

    def __init__(
        self, model_dir: str, config: EngineConfig, mcfg: ModelConfig, connector: ConnectorSpec
    ) -> None:
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.runner = ModelRunner(model_dir, config, mcfg, connector)
        self.kv_cache_shapes = [list(self.runner.kv_cache.shape)]

    def execute(self, step: StepInput) -> list[StepResult]:
        """Run the step on the single rank."""
        result = self.runner.execute(_step_decoder.decode(encode(step)))
        return [_result_decoder.decode(encode(result))]

    def check_ranks(self) -> None:
        """The one rank lives in this process: nothing can have exited."""

    def close(self) -> None:
        """Shut the worker-side connector down."""
        self.runner.shutdown()
