"""The lookup service: scheduler-side `LookupClient`, per-rank `LookupServer`, endpoints, wire.

The client asks every rank in the lookup scope at once, under a deadline, how many leading
chunks of a key list it holds; each server answers from its TierStack and leases what it
counted under the lookup id. The answer is the minimum over ranks, with the limiting rank.
"""

from kvtier.lookup.client import LookupClient, format_client_line
from kvtier.lookup.endpoints import IPC_PATH_MAX, endpoint_for, make_run_dir
from kvtier.lookup.messages import (
    DEFAULT_MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
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
from kvtier.lookup.server import LookupBackend, LookupServer, serve_until

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "IPC_PATH_MAX",
    "PROTOCOL_VERSION",
    "Codec",
    "FrameError",
    "LookupBackend",
    "LookupClient",
    "LookupReply",
    "LookupRequest",
    "LookupResult",
    "LookupServer",
    "Message",
    "Ping",
    "Pong",
    "ReleaseRequest",
    "endpoint_for",
    "format_client_line",
    "make_run_dir",
    "serve_until",
]
