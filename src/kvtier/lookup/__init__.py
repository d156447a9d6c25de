"""The lookup service: scheduler-side `LookupClient`, per-rank `LookupServer`, endpoints, wire.

The client asks every rank in the lookup scope at once, under a deadline, how many leading
chunks of a key list it holds; each server answers from its TierStack and leases what it
counted under the lookup id. The answer is the minimum over ranks, with the limiting rank.
Every frame carries a MAC under the engine's key, kept in the engine's run dir: a frame
without it is never answered, never leases and never releases.
"""

from kvtier.lookup.auth import MAC_BYTES, FrameMac
from kvtier.lookup.client import AdminAnswer, LookupClient, format_client_line
from kvtier.lookup.endpoints import IPC_PATH_MAX, LookupEndpoint, endpoint_for, make_run_dir
from kvtier.lookup.keyfile import ENGINE_KEY_BYTES, KEY_FILE, endpoint_key, engine_key
from kvtier.lookup.messages import (
    ADMIN_FORGET,
    ADMIN_OPS,
    ADMIN_PREFETCH,
    ADMIN_RELEASE,
    ADMIN_RETAIN,
    DEFAULT_MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    AdminReply,
    AdminRequest,
    Codec,
    FrameError,
    LookupReply,
    LookupRequest,
    Message,
    Ping,
    Pong,
    ReleaseRequest,
)
from kvtier.lookup.result import LookupResult
from kvtier.lookup.server import AdminBackend, LookupBackend, LookupServer, serve_until

__all__ = [
    "ADMIN_FORGET",
    "ADMIN_OPS",
    "ADMIN_PREFETCH",
    "ADMIN_RELEASE",
    "ADMIN_RETAIN",
    "AdminAnswer",
    "AdminBackend",
    "AdminReply",
    "AdminRequest",
    "DEFAULT_MAX_FRAME_BYTES",
    "ENGINE_KEY_BYTES",
    "IPC_PATH_MAX",
    "KEY_FILE",
    "MAC_BYTES",
    "PROTOCOL_VERSION",
    "Codec",
    "FrameError",
    "FrameMac",
    "LookupBackend",
    "LookupClient",
    "LookupEndpoint",
    "LookupReply",
    "LookupRequest",
    "LookupResult",
    "LookupServer",
    "Message",
    "Ping",
    "Pong",
    "ReleaseRequest",
    "endpoint_for",
    "endpoint_key",
    "engine_key",
    "format_client_line",
    "make_run_dir",
    "serve_until",
]
