"""Test-only KVTierConnector subclasses that fault the worker side on purpose.

`CorruptingKVTierConnector` corrupts, in the memory tier, the first chunk of the first load a
worker sees, right before queueing it: with `verify_memory_reads: true` the read fails its
checksum, the load fails and vLLM must recompute the request's blocks.
`GatedKVTierConnector` holds every load until the driver sets `GatedKVTierConnector.gate`, so
a driver can act (abort) while a load is in flight.

Loaded through `kv_connector_module_path="tests.vllm.drivers.faulty_connectors"`.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from kvtier.vllm import KVTierConnector
from kvtier.vllm.connector import register_by_name

log = logging.getLogger("kvtier")


class CorruptingKVTierConnector(KVTierConnector):
    """Flips bytes of one stored chunk before the first load of this rank, once."""

    armed = True

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        worker = self.offload_worker
        meta = self._worker.meta if self._worker is not None else None
        if self.armed and worker is not None and meta is not None and meta.loads:
            stack = worker.stack
            assert stack is not None
            key = meta.loads[0].chunks[0].key
            stack.memory.lease("test-corrupt", [key])
            try:
                view = stack.memory.view(key)
                if view is None:
                    raise AssertionError("the chunk to corrupt is not in the memory tier")
                view[:64] ^= 0xFF
            finally:
                stack.memory.release("test-corrupt")
            log.info("test: corrupted chunk %s of load %s", key.hex(), meta.loads[0].op_id)
            type(self).armed = False
        super().start_load_kv(forward_context, **kwargs)


class GatedKVTierConnector(KVTierConnector):
    """Queues each step's loads only once `gate` is set (in-process engines only)."""

    gate = threading.Event()
    gate_timeout_s = 120.0

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        worker = self.offload_worker
        meta = self._worker.meta if self._worker is not None else None
        if worker is None or meta is None or not meta.loads or self.gate.is_set():
            super().start_load_kv(forward_context, **kwargs)
            return

        def release() -> None:
            if not self.gate.wait(self.gate_timeout_s):
                log.error("test: load gate never opened; loads %s stay unsent", meta.loads)
                return
            worker.start_load_kv(meta)

        log.info("test: holding loads %s", [op.op_id for op in meta.loads])
        threading.Thread(target=release, name="test-load-gate", daemon=True).start()


# MultiConnector finds its children's stats classes by name
register_by_name(
    "CorruptingKVTierConnector", "tests.vllm.drivers.faulty_connectors", "CorruptingKVTierConnector"
)
