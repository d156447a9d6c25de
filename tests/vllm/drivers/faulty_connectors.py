"""Test-only KVTierConnector subclasses that fault the worker side on purpose.

`CorruptingKVTierConnector` corrupts, in the memory tier, the first chunk of the first load a
worker sees, right before queueing it: with `verify_memory_reads: true` the read fails its
checksum, the load fails and vLLM must recompute the request's blocks.
`GatedKVTierConnector` holds every load until the driver sets `GatedKVTierConnector.gate`, so
a driver can act (abort) while a load is in flight.
`HookFaultKVTierConnector` raises inside one kvtier hook, chosen at run time through
`HookFaultKVTierConnector.fault` (in-process engines only): for its victim request, or once.

Loaded through `kv_connector_module_path="tests.vllm.drivers.faulty_connectors"`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from kvtier.vllm import KVTierConnector
from kvtier.vllm.connector import register_by_name

log = logging.getLogger("kvtier")


class CorruptingKVTierConnector(KVTierConnector):
    """Flips bytes of one stored chunk before the first load of this rank, once."""

    armed = True
    # which record of the load: its first chunk, or (a state hybrid) its boundary's state
    target_state = False

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        worker = self.offload_worker
        meta = self._worker.meta if self._worker is not None else None
        if self.armed and worker is not None and meta is not None and meta.loads:
            stack = worker.stack
            assert stack is not None
            chunks = meta.loads[0].chunks
            key = next(c for c in chunks if c.part >= 0).key if self.target_state else chunks[0].key
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


class CorruptingStateKVTierConnector(CorruptingKVTierConnector):
    """Flips bytes of the first load's boundary-state record (part 0), once."""

    target_state = True


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


class InjectedFault(RuntimeError):
    """Raised by HookFaultKVTierConnector (a defect of kvtier's own, as vLLM sees it)."""


# hook -> (half, object, method, the victim's request id from the call's args; None: once)
HOOK_POINTS: dict[str, tuple[str, str, str, Callable[..., str] | None]] = {
    "get_num_new_matched_tokens": ("scheduler", "core", "_matched", lambda req, n: req.request_id),
    "update_state_after_alloc": ("scheduler", "core", "_after_alloc",
                                 lambda req, *a: req.request_id),
    "build_meta_load": ("scheduler", "core.load_planner", "emit", lambda st, load: st.req_id),
    "build_meta_save": ("scheduler", "core.planner", "emit", lambda st, item: st.req_id),
    "build_connector_meta": ("scheduler", "side", "_scheduled_new", lambda out, new: new.req_id),
    "request_finished": ("scheduler", "core", "_finished", lambda req: req.request_id),
    "start_load_kv": ("worker", "worker", "_dispatch_load", lambda p, *rest: p.op.req_id),
    "save": ("worker", "worker", "_save", lambda job, batch: job.op.req_id),
    "get_finished": ("worker", "worker", "_drain_report", None),
    "build_connector_worker_meta": ("worker", "worker", "_encode_report", None),
}  # fmt: skip


class HookFaultKVTierConnector(KVTierConnector):
    """kvtier with `fault = {"hook": name, "victim": request id prefix}` raising in that hook
    (read at every call, so a driver switches it between passes)."""

    fault: dict[str, str] = {}
    fired: set[str] = set()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for hook, (half, owner_name, method, req_id) in HOOK_POINTS.items():
            side = self._scheduler if half == "scheduler" else self._worker
            if side is None:
                continue
            owner = side
            for name in () if owner_name == "side" else owner_name.split("."):
                owner = getattr(owner, name)
            setattr(owner, method, self._wrap(hook, getattr(owner, method), req_id))

    @classmethod
    def _wrap(cls, hook: str, inner: Callable[..., Any], req_id: Callable[..., str] | None) -> Any:
        def wrapped(*args: Any) -> Any:
            if cls.fault.get("hook") == hook:
                if req_id is None:
                    if hook not in cls.fired:
                        cls.fired.add(hook)
                        raise InjectedFault(f"injected fault in {hook}")
                elif req_id(*args).startswith(cls.fault["victim"]):
                    raise InjectedFault(f"injected fault in {hook} for {req_id(*args)}")
            return inner(*args)

        return wrapped


# MultiConnector finds its children's stats classes by name
register_by_name(
    "CorruptingKVTierConnector", "tests.vllm.drivers.faulty_connectors", "CorruptingKVTierConnector"
)
