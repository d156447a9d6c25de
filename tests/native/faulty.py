"""A kvtier connector for tests whose worker half on one rank corrupts a chunk it is about to
load, so that rank's load fails verification while the other ranks' loads succeed."""

from __future__ import annotations

from typing import Any

from kvtier.native.connector import ConnectorContext, ConnectorRole
from kvtier.native.offload import WorkerHalf
from kvtier.native.offload import build as build_kvtier


class CorruptingWorkerHalf(WorkerHalf):
    """Flips bytes of the first memory-tier chunk of each load of one step, once."""

    armed = True

    def start_load_kv(self) -> None:
        stack = self.worker.stack
        assert stack is not None
        if self.armed and self._meta.loads:
            for op in self._meta.loads:
                keys = [op.chunks[0].key]
                stack.memory.lease("test-corrupt", keys)
                for key in keys:
                    view = stack.memory.view(key)
                    if view is not None:
                        view[:64] ^= 0xFF
                stack.memory.release("test-corrupt")
            self.armed = False
        super().start_load_kv()


def build(role: ConnectorRole, context: ConnectorContext, **args: Any) -> Any:
    """Like kvtier.native.offload.build, with a corrupting worker half on `fail_rank`."""
    fail_rank = args.pop("fail_rank")
    half = build_kvtier(role, context, **args)
    if role is ConnectorRole.WORKER and context.tp_rank == fail_rank:
        half.__class__ = CorruptingWorkerHalf
    return half
