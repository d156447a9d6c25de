"""A kvtier connector for tests that raises inside one hook (invariant 18): for one victim
request, or once for a rank's own bookkeeping. Built like kvtier.native.offload.build, with
`fail_hook` and `victim` args; the TP=1 engine runs both halves in this process."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvtier.native.connector import ConnectorContext, ConnectorRole
from kvtier.native.offload import build as build_kvtier


class Injected(RuntimeError):
    """What the fault raises (a defect of kvtier's own, as the engine sees it)."""


def _raise_for(victim: str, req_id: Callable[..., str], inner: Callable[..., Any]) -> Any:
    def wrapped(*args: Any) -> Any:
        if req_id(*args) == victim:
            raise Injected(f"injected fault for {victim}")
        return inner(*args)

    return wrapped


def _raise_once(inner: Callable[..., Any]) -> Any:
    fired: list[bool] = []

    def wrapped(*args: Any) -> Any:
        if not fired:
            fired.append(True)
            raise Injected("injected fault")
        return inner(*args)

    return wrapped


# hook -> (role, attribute path on the half, how the victim's request id is read from the args)
SCHEDULER = {
    "get_num_new_matched_tokens": ("core", "_matched", lambda req, n: req.request_id),
    "update_state_after_alloc": ("core", "_after_alloc", lambda req, *a: req.request_id),
    "build_meta_load": ("core.load_planner", "emit", lambda st, load: st.req_id),
    "build_meta_save": ("core.planner", "emit", lambda st, item: st.req_id),
    "update_connector_output": ("core", "_terminal", None),
    "request_finished": ("core", "_finished", lambda req: req.request_id),
}
WORKER = {
    "start_load_kv": ("worker", "_dispatch_load", lambda p, *rest: p.op.req_id),
    "save": ("worker", "_save", lambda job, batch: job.op.req_id),
    "get_finished": ("worker", "_drain_report", None),
    "build_connector_worker_meta": ("worker", "_encode_report", None),
}


def build(role: ConnectorRole, context: ConnectorContext, **args: Any) -> Any:
    """kvtier's connector half, with `fail_hook` raising for `victim` (or once)."""
    hook = args.pop("fail_hook")
    victim = args.pop("victim")
    half = build_kvtier(role, context, **args)
    table = SCHEDULER if role is ConnectorRole.SCHEDULER else WORKER
    if hook not in table:
        return half
    owner_name, method, req_id = table[hook]
    owner = half
    for name in owner_name.split("."):
        owner = getattr(owner, name)
    inner = getattr(owner, method)
    if hook == "update_connector_output":
        ops = owner.ops
        req_id = lambda term: ops.owner(term.op_id)  # noqa: E731 - looked up live
    wrapped = _raise_once(inner) if req_id is None else _raise_for(victim, req_id, inner)
    setattr(owner, method, wrapped)
    return half
