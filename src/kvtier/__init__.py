"""kvtier: a KV-cache offload tier (host memory, local disk, Valkey/Redis) for LLM serving."""

__version__ = "0.1.0"
