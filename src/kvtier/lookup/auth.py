"""Frame authentication: every lookup frame travels with a keyed BLAKE3 MAC under the engine key.

The key never travels: each side proves it holds the key by the MAC over the frame's bytes.
Requests and replies are MAC'd under keys derived from the engine key per direction and per
rank, so a frame of one direction is never taken for the other, and a frame the engine sent to
one rank (read by whoever holds that rank's TCP port) is refused by every other rank. A frame
whose MAC does not match is dropped before it is decoded: it is never answered, never leases
and never releases.

Not covered: replay of a frame to the rank it was sent to (its port is held by that rank, or by
whoever recorded it: then the rank is not there to receive it), and root, who can read the key
file.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable
from typing import Final

import blake3

from kvtier.errors import ConfigError
from kvtier.lookup.keyfile import ENGINE_KEY_BYTES
from kvtier.throttled_log import EVERY_S, ThrottledLog

MAC_BYTES: Final = 32
# BLAKE3 key-derivation contexts: globally unique, fixed forever for this wire format
REQUESTS: Final = "kvtier 2026-05 lookup request frames"
REPLIES: Final = "kvtier 2026-05 lookup reply frames"


def check_key(key: object) -> bytes:
    """`key` if it is an engine key (32 bytes), else ConfigError naming the fix."""
    if not isinstance(key, bytes) or len(key) != ENGINE_KEY_BYTES:
        size = len(key) if isinstance(key, bytes | bytearray) else "?"
        raise ConfigError(
            f"lookup key is {type(key).__name__} of length {size}; it must be the engine's "
            f"{ENGINE_KEY_BYTES}-byte key (kvtier.lookup.engine_key(run_dir))"
        )
    return key


def rank_key(key: bytes, context: str, rank: int) -> bytes:
    """A 32-byte key of `rank`, derived from the engine key under the BLAKE3 `context`."""
    if rank < 0:
        raise ValueError(f"rank {rank} must be >= 0")
    per_context = blake3.blake3(check_key(key), derive_key_context=context).digest()
    return blake3.blake3(b"rank %d" % rank, key=per_context).digest()


class FrameMac:
    """MACs of one direction's frames (`REQUESTS` or `REPLIES`) to or from one rank, under an
    engine key."""

    def __init__(self, key: bytes, direction: str, rank: int) -> None:
        if direction not in (REQUESTS, REPLIES):
            raise ValueError(f"direction {direction!r} is not REQUESTS or REPLIES")
        self._key = rank_key(key, direction, rank)

    def of(self, body: bytes) -> bytes:
        """The MAC of `body`."""
        return blake3.blake3(body, key=self._key).digest()

    def matches(self, mac: bytes, body: bytes) -> bool:
        """Whether `mac` is `body`'s MAC (compared in constant time)."""
        return len(mac) == MAC_BYTES and hmac.compare_digest(mac, self.of(body))

    def seal(self, body: bytes) -> bytes:
        """The one zmq frame `body` travels as: its MAC, then the body."""
        return self.of(body) + body

    def opened(self, frame: bytes) -> bytes | None:
        """The body of a frame `seal` made under this key; None for any other frame."""
        mac, body = frame[:MAC_BYTES], frame[MAC_BYTES:]
        return body if self.matches(mac, body) else None


class RefusalLog:
    """Refused frames logged without letting a flood of them fill the log: the first at once,
    then at most one line per `every_s` of `clock`, counting the ones in between."""

    def __init__(
        self,
        log: logging.Logger,
        what: str,
        every_s: float = EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._lines = ThrottledLog(log, every_s, clock)
        self._what = what

    def refused(self, detail: str) -> None:
        """Log (or count for the next line) one refused frame."""
        self._lines.warning("frame", "kvtier: %s refused a frame: %s", self._what, detail)
