"""kvtier's reference inference engine: a Llama/Qwen2 decoder over a paged KV cache, continuous
batching with chunked prefill, prefix caching, tensor parallelism over worker processes, and the
vLLM-style KV-connector hooks that the offload core plugs into."""

from kvtier.native.config import EngineConfig
from kvtier.native.connector import (
    ConnectorContext,
    ConnectorOutput,
    ConnectorRole,
    ConnectorSpec,
    NullConnector,
)
from kvtier.native.engine import Engine
from kvtier.native.sampling import SamplingParams
from kvtier.native.sequence import RequestOutput, SequenceStatus

__all__ = [
    "ConnectorContext",
    "ConnectorOutput",
    "ConnectorRole",
    "ConnectorSpec",
    "Engine",
    "EngineConfig",
    "NullConnector",
    "RequestOutput",
    "SamplingParams",
    "SequenceStatus",
]
