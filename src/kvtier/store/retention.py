"""Retention on a rank: the chunks a client asked to keep, and until when.

A retained chunk is not a victim in the memory or disk tier while its deadline lies ahead (the
tiers ask `holds` inside their eviction); past the deadline it is an ordinary chunk again. The
table is bounded: the scheduler sizes hints to a budget (`offload/retention.py`), and this bound
is the rank's own backstop, so no sender can pin the whole tier. Deadlines are wall-clock
seconds so a disk tier restarted keeps what was retained (`save` / `load`).
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from kvtier.numbers import finite_number

log = logging.getLogger("kvtier")

# the table's file in a disk tier's namespace directory, and the prefix of its temp files
RETENTION_FILE = "retention.json"
RETENTION_TEMP_PREFIX = ".retention.json."

# A saved table larger than this is not read (each entry is ~60 bytes of JSON).
_MAX_FILE_BYTES = 64 << 20
_KEY_BYTES = 16


class RetentionTable:
    """Chunk key -> retention deadline (`clock` seconds), at most `limit` live entries."""

    def __init__(self, limit: int, clock: Callable[[], float] = time.time) -> None:
        if limit < 0:
            raise ValueError(f"retention limit={limit} must be >= 0 chunks")
        self.limit = limit
        self._clock = clock
        self._until: dict[bytes, float] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._until)

    def retain(self, keys: Sequence[bytes], until: float) -> int:
        """Keep `keys` until `until` (a later deadline already held stays); how many of them are
        retained now. Keys past `limit` are refused, deepest last, so a prefix stays whole.
        Raises ValueError for a deadline that is not a finite number (Infinity would never
        expire; NaN would never compare, neither held nor dropped)."""
        if finite_number(until) is None:
            raise ValueError(
                f"retention deadline until={until!r} is not a finite number of seconds; send "
                "the wall-clock time the retention ends"
            )
        now = self._clock()
        kept = 0
        with self._lock:
            if len(self._until) + len(keys) > self.limit:
                self._drop_expired(now)
            for key in keys:
                old = self._until.get(key)
                if old is None and len(self._until) >= self.limit:
                    break
                if old is None or old < until:
                    self._until[key] = until
                kept += 1
        return kept

    def release(self, keys: Iterable[bytes]) -> int:
        """Stop retaining `keys`; how many were retained."""
        with self._lock:
            return sum(self._until.pop(k, None) is not None for k in keys)

    def holds(self, key: bytes) -> bool:
        """Whether `key` is retained now (an expired entry is dropped on the way)."""
        with self._lock:
            until = self._until.get(key)
            if until is None:
                return False
            if until > self._clock():
                return True
            del self._until[key]
            return False

    def until(self, key: bytes) -> float | None:
        """The live deadline of `key`, or None."""
        with self._lock:
            until = self._until.get(key)
        return until if until is not None and until > self._clock() else None

    def live(self) -> dict[bytes, float]:
        """Every live entry (expired ones dropped)."""
        with self._lock:
            self._drop_expired(self._clock())
            return dict(self._until)

    def save(self, path: Path) -> None:
        """Write the live entries to `path` (a private file, replaced atomically)."""
        entries = {k.hex(): v for k, v in self.live().items()}
        tmp = path.with_name(f"{RETENTION_TEMP_PREFIX}{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"version": 1, "until": entries}, f)
        os.replace(tmp, path)

    def load(self, path: Path) -> int:
        """Take the live entries a previous process saved at `path`; how many. The file is
        untrusted input: anything malformed is logged and ignored, never raised."""
        try:
            st = path.stat(follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
                # whoever else could write it could pin this rank's tiers
                log.warning(
                    "kvtier: retention file %s is not a private file of ours; ignored", path
                )
                return 0
            if st.st_size > _MAX_FILE_BYTES:
                log.warning(
                    "kvtier: retention file %s is over %d bytes; ignored", path, _MAX_FILE_BYTES
                )
                return 0
            doc = json.loads(path.read_bytes())
        except FileNotFoundError:
            return 0
        except (OSError, ValueError, RecursionError) as e:  # nesting too deep for the parser
            log.warning("kvtier: retention file %s unreadable (%s); ignored", path, e)
            return 0
        raw = doc.get("until") if isinstance(doc, dict) else None
        if not isinstance(raw, dict):
            log.warning("kvtier: retention file %s has no 'until' table; ignored", path)
            return 0
        now = self._clock()
        taken = 0
        with self._lock:
            for hexkey, until in raw.items():
                if len(self._until) >= self.limit:
                    break
                key = _parse_key(hexkey)
                deadline = finite_number(until)
                if key is None or deadline is None or deadline <= now:
                    continue
                self._until[key] = max(deadline, self._until.get(key, 0.0))
                taken += 1
        return taken

    def _drop_expired(self, now: float) -> None:
        for key in [k for k, u in self._until.items() if u <= now]:
            del self._until[key]


def _parse_key(hexkey: object) -> bytes | None:
    if not isinstance(hexkey, str) or len(hexkey) != 2 * _KEY_BYTES:
        return None
    try:
        return bytes.fromhex(hexkey)
    except ValueError:
        return None
