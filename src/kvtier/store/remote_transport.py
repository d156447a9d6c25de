"""What the remote tier asks of a Valkey/Redis client library, in kvtier's own terms.

A transport speaks to one server or one cluster. It raises (or returns, per key in a batch) only
`StoreError`, so the tier never sees a library's exception types; each error names the shard it
came from, so the tier's breakers work per shard. Batches are one round trip per shard.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class StoreError(Exception):
    """A call the store did not complete. `outage` errors (timeouts, broken or refused
    connections) feed the shard's breaker; the others are prompt refusals by a live server."""

    def __init__(self, reason: str, outage: bool, shard: str, detail: str) -> None:
        super().__init__(f"{reason} on {shard}: {detail}")
        self.reason = reason
        self.outage = outage
        self.shard = shard


class CredentialsRefused(Exception):
    """The store answered but rejected the credentials (raised only by `Transport.check`)."""


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Seconds a call may take: presence checks, one record read, one record write."""

    presence_s: float
    read_s: float
    write_s: float


class Transport(Protocol):
    """One server or cluster, addressed by full server-side keys."""

    # what the client library prints on stderr itself for each timed-out call ("": nothing)
    timeout_stderr: str

    @property
    def epoch(self) -> int:
        """A number that changes whenever the known topology (shard owners) does."""
        ...

    def shard_of(self, rkey: bytes) -> str:
        """The shard (owner address) a key lives on, as the transport knows the topology."""
        ...

    def shards(self) -> list[str]:
        """Every shard of the current topology."""
        ...

    def check(self) -> None:
        """PING every shard once; raises CredentialsRefused or StoreError."""
        ...

    def max_value_bytes(self) -> int | None:
        """The smallest `proto-max-bulk-len` over the shards; None when the server does not
        say (CONFIG refused)."""
        ...

    def memory_policies(self) -> list[tuple[int, str]]:
        """(`maxmemory` bytes, `maxmemory-policy`) of every primary, from INFO memory (which
        managed services answer where they refuse CONFIG); [] when nobody says."""
        ...

    def exists(self, rkeys: Sequence[bytes]) -> list[bool | StoreError]:
        """Presence of each key, one batch (one round trip per shard)."""
        ...

    def get(self, rkey: bytes, limit: int | None = None) -> bytes | None:
        """The value of `rkey` or None; raises StoreError. With `limit`, at most its first
        `limit` bytes (GETRANGE: no more crosses the wire); size it one byte past any valid
        value to tell a longer one."""
        ...

    def get_into(self, rkey: bytes, buf: memoryview) -> int | None:
        """Read at most `buf.nbytes` bytes of `rkey`'s value into `buf` (no more crosses the
        wire); how many, or None on a miss. A value that fills `buf` may be longer: size `buf`
        one byte past any valid value to tell."""
        ...

    def get_many(
        self, rkeys: Sequence[bytes], limit: int | None = None
    ) -> list[bytes | None | StoreError]:
        """Values of `rkeys`, one batch (one round trip per shard, shards in parallel); with
        `limit`, at most the first `limit` bytes of each (a batch of GETRANGE), as `get`."""
        ...

    def put(self, rkey: bytes, value: memoryview, ttl_s: int) -> bool:
        """SET `rkey` (EX `ttl_s` when > 0); whether the key existed before. Raises StoreError."""
        ...

    def expire(self, rkey: bytes, ttl_s: int) -> bool:
        """Make `rkey` expire in `ttl_s` seconds; whether it exists. Raises StoreError."""
        ...

    def delete(self, rkey: bytes) -> bool:
        """DEL `rkey`; whether it existed. Raises StoreError."""
        ...

    def delete_if(self, rkey: bytes, sha1_hex: bytes, longer_than: int | None = None) -> bool:
        """DEL `rkey` only while it holds the value whose SHA-1 is `sha1_hex`, or (with
        `longer_than`) a value of more than `longer_than` bytes (one script, so atomic on the
        server); whether it deleted. Raises StoreError."""
        ...

    def refresh(self) -> None:
        """Re-read the topology (after an outage or a redirect); a no-op on one server."""
        ...

    def reconnect(self) -> None:
        """Drop every connection and open new ones lazily (when a breaker opens or a probe
        fails): a connection that lost a reply would hand each later request the one before's."""
        ...

    def close(self) -> None:
        """Drop every connection."""
        ...


def parse_info_memory(text: bytes | str) -> tuple[int, str] | None:
    """(maxmemory, maxmemory_policy) from an INFO memory reply; None when it lacks them."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    try:
        return int(fields["maxmemory"].strip()), fields["maxmemory_policy"].strip()
    except (KeyError, ValueError):
        return None


# DEL a key only while it holds the value a read found bad: a reply that answered another
# request (a connection out of step) or a record rewritten since is never deleted with it.
# A bounded read (GETRANGE) of a longer value hashes only its first bytes, never the value's
# SHA-1: such a value goes only while the store holds more than ARGV[2] bytes under the key
# (STRLEN, checked first, so a huge value is not copied into the script to be hashed either),
# longer than any valid record and so bad whatever its bytes; a valid record written since is
# not that long and stays. Without ARGV[2], the SHA-1 alone decides.
DELETE_IF_SCRIPT = (
    "if ARGV[2] and redis.call('STRLEN', KEYS[1]) > tonumber(ARGV[2]) then "
    "return redis.call('DEL', KEYS[1]) end "
    "if redis.sha1hex(redis.call('GET', KEYS[1]) or '') == ARGV[1] then "
    "return redis.call('DEL', KEYS[1]) end return 0"
)
