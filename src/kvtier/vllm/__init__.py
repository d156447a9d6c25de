"""kvtier's vLLM host adapter: `KVTierConnector`, a vLLM v1 KV connector over the offload core.

Load it with `kv_connector="KVTierConnector"`, `kv_connector_module_path="kvtier.vllm"`.
`KVTierConnector` is imported on first access (vLLM's factory does `getattr(module, name)`),
so the vLLM-free helpers (`request_view`, `rundir`) import without vLLM installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.vllm.connector import KVTierConnector

__all__ = ["KVTierConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVTierConnector":
        from kvtier.vllm.connector import KVTierConnector

        return KVTierConnector
    raise AttributeError(f"module 'kvtier.vllm' has no attribute {name!r}")
