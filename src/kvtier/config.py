"""One validated `KVTierConfig` from a dict (vLLM's `kv_connector_extra_config`), `KVTIER_*`
environment variables or a YAML file. Every bad value raises `ConfigError` naming key, value, fix.

Why one module over 500 lines: it is the one table of settings (each field with its default,
range and help, which docs/configuration.md is generated from) plus the coercion those fields
share; the coercion goes when the config moves onto msgspec (issue 14).
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import yaml

from kvtier import cpus, remote_endpoint
from kvtier.errors import ConfigError

__all__ = [
    "ENV_CONFIG_FILE",
    "ENV_NOT_CONFIG",
    "ENV_PREFIX",
    "RETENTION_FULL_MODES",
    "KVTierConfig",
    "config_environ",
    "format_size",
    "mask_url",
    "parse_size",
]

# the most chunk keys the admission policy remembers (sized from the tiers or set)
MAX_ADMISSION_HISTORY = 1 << 20
ENV_PREFIX = "KVTIER_"
ENV_CONFIG_FILE = "KVTIER_CONFIG"
# KVTIER_* variables that are not config fields: the bench's bearer token and the GPU check's
# device; the config loader passes them by, and `config_environ` leaves them out
ENV_NOT_CONFIG = frozenset({"KVTIER_BENCH_API_KEY", "KVTIER_TEST_DEVICE", "KVTIER_ADMIN_KEY"})
_MASK = "***"
_GiB = 1 << 30
# the largest size or integer a key takes: what a signed 64-bit counter, offset or C argument
# holds (larger ones break later, far from the config: in repr, format_size, ports, timeouts)
_MAX_INT = (1 << 63) - 1
# a size string with more characters in its number, or more than 2 digits in its exponent, is
# out of range: checked before the number is built (1e100000000 would build a 100-million-digit
# integer, and a 5000-digit one trips the interpreter's int-conversion limit)
_MAX_SIZE_DIGITS = 40

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*([+-]?)\s*(\d+(?:\.\d*)?|\.\d+)(?:[eE]([+-]?\d+))?\s*([A-Za-z]*)\s*$")
_SIZE_FIX = "use a byte count or a number with a unit, e.g. 4096, 512MiB, 64GiB, 1.5GB"
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_READ_FROM = ("primary", "replica")
_TLS_FILES = ("remote_tls_ca_file", "remote_tls_cert_file", "remote_tls_key_file")
_TENANT_RE = re.compile(r"^[A-Za-z0-9._-]{0,64}$")
_TRANSPORTS = ("ipc", "tcp")
# values never shown in a message, a log line or to_dict() (unless handed to this engine's
# own processes)
_SECRET_KEYS = frozenset({"remote_password", "record_key"})
_REMOTE_FULL = ("refuse", "warn")
# what a retention hint does when the budget is full (kvtier.offload.retention)
RETENTION_FULL_MODES = ("clip", "soonest")
# the admission policy's modes (kvtier.offload.admission)
ADMISSION_MODES = ("adaptive", "all")
LOAD_POLICIES = ("cost", "always")
_ADMISSION = ADMISSION_MODES
_DISK_CONFLICT = ("refuse", "own_dir")
_MIN_RECORD_KEY_CHARS = 32
# vLLM 0.32 layouts whose per-layer block pages are contiguous (LHBNC and BHLNC split a
# layer's page by head: refused)
_KV_LAYOUTS = ("", "BLHNC", "BLNHC", "LBHNC", "LBNHC")


class KeyedConfigError(ConfigError):
    """A `ConfigError` that remembers which keys it is about, so loaders can name their source."""

    def __init__(self, keys: tuple[str, ...], message: str) -> None:
        super().__init__(message)
        self.keys = keys


def _error(keys: str | tuple[str, ...], message: str) -> KeyedConfigError:
    return KeyedConfigError((keys,) if isinstance(keys, str) else keys, message)


_QUERY_PASSWORD_RE = re.compile(r"(?i)[?&]password=")


def mask_url(url: str) -> str:
    """`url` with its secrets replaced by `***`: the one masking function for every log line,
    error message and shard name that shows a store URL. A query `password=` hides the rest of
    the URL (a password may hold '&' or '#'); the userinfo ends at the URL's last '@' (a
    password may hold '/', '?', '#', '@' or ':'). Over-masking a path is harmless."""
    m = _QUERY_PASSWORD_RE.search(url)
    if m:
        url = url[: m.end()] + _MASK
    at = url.rfind("@")
    if at == -1:
        return url
    sep = url.find("://")
    # a URL without its '://' (`user:pw@host:6379`, `redis:/user:pw@host`) still has userinfo
    # before its last '@': everything from the start (or after '://') up to it is masked
    start = sep + 3 if -1 < sep < at else 0
    user, colon, _secret = url[start:at].partition(":")
    # a lone userinfo (redis://TOKEN@host) is a user name to redis-py, but it is often a token
    shown = f"{user}:{_MASK}" if colon else _MASK
    return f"{url[:start]}{shown}{url[at:]}"


def _brief(value: Any) -> str:
    """`repr(value)` cut to a readable length (a 5000-digit integer has no repr at all)."""
    try:
        text = repr(value)
    except ValueError:  # an int past sys.get_int_max_str_digits()
        return f"<an integer of {value.bit_length()} bits>"
    return text if len(text) <= 200 else f"{text[:120]}...({len(text)} characters)"


def _show(key: str, value: Any) -> str:
    """`key=value` for messages, with secrets masked."""
    if key in _SECRET_KEYS:
        return f"{key}={_MASK}"
    if key == "remote_url" and isinstance(value, str):
        return f"{key}={mask_url(value)!r}"
    return f"{key}={_brief(value)}"


# --------------------------------------------------------------------------------------- sizes


def parse_size(value: Any, key: str) -> int:
    """Byte count from an int or a string with a unit (`512MiB`, `1.5GB`, `4096`).

    KB/MB/GB/TB are decimal, KiB/MiB/GiB/TiB binary, units case-insensitive. Raises ConfigError.
    """
    if isinstance(value, bool):
        raise _error(key, f"{_show(key, value)} is a boolean, not a size; {_SIZE_FIX}")
    if isinstance(value, int):
        amount = Fraction(value)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise _error(key, f"{_show(key, value)} is not a finite size; {_SIZE_FIX}")
        amount = Fraction(value)
    elif isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match is None:
            raise _error(key, f"{_show(key, value)} is not a size; {_SIZE_FIX}")
        sign, number, exponent, unit = match.groups()
        if unit.lower() not in _UNITS:
            raise _error(
                key,
                f"{_show(key, value)} has unknown unit {unit!r}; use one of B, KB, MB, GB, TB "
                "(decimal) or KiB, MiB, GiB, TiB (binary)",
            )
        exp_digits = (exponent or "").lstrip("+-").lstrip("0")
        if len(number) > _MAX_SIZE_DIGITS or len(exp_digits) > 2:
            raise _error(key, _too_large(key, value))
        amount = Fraction(number) * Fraction(10) ** int(exponent or 0) * _UNITS[unit.lower()]
        if sign == "-":
            amount = -amount
    else:
        raise _error(
            key, f"{_show(key, value)} has type {type(value).__name__}, not a size; {_SIZE_FIX}"
        )
    if amount < 0:
        raise _error(key, f"{_show(key, value)} is negative; sizes are >= 0 bytes; {_SIZE_FIX}")
    if amount > _MAX_INT:
        raise _error(key, _too_large(key, value))
    if amount.denominator != 1:
        raise _error(
            key,
            f"{_show(key, value)} is not a whole number of bytes ({float(amount)}); "
            "use a larger unit or a whole byte count",
        )
    return int(amount)


def _too_large(key: str, value: Any) -> str:
    return (
        f"{_show(key, value)} is out of range: sizes are at most {_MAX_INT} bytes (8 EiB); "
        f"{_SIZE_FIX}"
    )


def format_size(n: int) -> str:
    """Short binary-unit rendering of a byte count for logs (`2GiB`, `1.5MiB`, `100B`)."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n}B"


# ------------------------------------------------------------------------------ scalar coercion


def _to_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE:
            return True
        if word in _FALSE:
            return False
    raise _error(
        key, f"{_show(key, value)} is not a boolean; use true/false (or 1/0, yes/no, on/off)"
    )


def _to_int(key: str, value: Any) -> int:
    if isinstance(value, bool):
        raise _error(key, f"{_show(key, value)} is a boolean; {key} takes an integer")
    number: int | None = None
    if isinstance(value, int):
        number = value
    elif isinstance(value, str):
        text = value.strip()
        unsigned = text.lstrip("+-")
        if unsigned.isdecimal() and len(unsigned.lstrip("0")) > 19:
            number = _MAX_INT + 1  # past the range, and past what int() converts (4300 digits)
        else:
            try:
                number = int(text, 10)
            except ValueError:
                number = None
    if number is None:
        raise _error(key, f"{_show(key, value)} is not an integer; give a whole number")
    if abs(number) > _MAX_INT:
        raise _error(
            key,
            f"{_show(key, value)} is out of range; {key} takes a whole number of at most "
            f"{_MAX_INT} (64 bits)",
        )
    return number


def _to_float(key: str, value: Any) -> float:
    if isinstance(value, bool):
        raise _error(key, f"{_show(key, value)} is a boolean; {key} takes a number")
    number: float | None = None
    if isinstance(value, int | float):
        try:
            number = float(value)
        except OverflowError:  # an int past float's range (a JSON 1 followed by 400 zeros)
            number = None
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            number = None
    if number is None or not math.isfinite(number):
        raise _error(key, f"{_show(key, value)} is not a finite number; give e.g. 1.5")
    return number


def _to_str(key: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)  # type: ignore[return-value]
    if key in _SECRET_KEYS:
        # never echo a secret, not even one YAML turned into a number
        raise _error(key, f"{key} must be a string (value not shown); quote it in YAML")
    raise _error(
        key, f"{_show(key, value)} has type {type(value).__name__}; {key} takes a string (quote it)"
    )


def _to_opt_str(key: str, value: Any) -> str | None:
    if value is None:
        return None
    text = _to_str(key, value)
    # an empty env var or YAML '' means "not set"
    return text if text != "" else None


def _to_opt_int(key: str, value: Any) -> int | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
        return None
    return _to_int(key, value)


def _to_scope(key: str, value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    items: list[Any]
    if isinstance(value, str):
        text = value.strip()
        if text.lower() in ("", "all"):
            return None
        items = [part.strip() for part in text.split(",")]
    elif isinstance(value, list | tuple):
        items = list(value)
    else:
        raise _error(
            key,
            f"{_show(key, value)} is not a list of ranks; give e.g. [0, 1, 2, 3] or '0,1,2,3', "
            "or leave it unset to look up on every rank",
        )
    ranks: list[int] = []
    for item in items:
        try:
            rank = _to_int(key, item)
        except ConfigError as e:
            if "out of range" in str(e):
                raise _error(
                    key, f"{_show(key, value)} has a rank out of range; ranks are < 2**63"
                ) from None
            raise _error(
                key,
                f"{_show(key, value)} has a non-integer rank {_brief(item)}; give e.g. '0,1,2,3'",
            ) from None
        if rank < 0:
            raise _error(key, f"{_show(key, value)} has a negative rank {rank}; ranks are >= 0")
        ranks.append(rank)
    if not ranks:
        raise _error(
            key, f"{_show(key, value)} is empty; leave {key} unset to look up on every rank"
        )
    dupes = sorted({r for r in ranks if ranks.count(r) > 1})
    if dupes:
        raise _error(
            key, f"{_show(key, value)} names ranks {dupes} more than once; list each rank once"
        )
    return tuple(ranks)


_COERCE: dict[str, Callable[[str, Any], Any]] = {
    "bool": _to_bool,
    "int": _to_int,
    "opt_int": _to_opt_int,
    "float": _to_float,
    "size": lambda key, value: parse_size(value, key),
    "str": _to_str,
    "opt_str": _to_opt_str,
    "scope": _to_scope,
}


# each chunk in flight holds a staging buffer of chunk bytes per lane on the KV device
_MAX_TRANSFER_DEPTH = 8
_MAX_LOAD_WAVES = 64


def _f(default: Any, kind: str, doc: str) -> Any:
    """A config field with its coercion kind and a one-line meaning."""
    return field(default=default, metadata={"kind": kind, "doc": doc})


# the longest a save may wait for the write-behind to unpin a memory slot: a longer wait stalls
# the save lane for nothing (and past ~1e9 s it overflowed the wait's timeout)
MAX_WRITE_WAIT_MS = 60_000

# ------------------------------------------------------------------------------------- config


@dataclass(frozen=True, repr=False)
class KVTierConfig:
    """Every kvtier setting, coerced and validated on construction; immutable afterwards."""

    enabled: bool = _f(True, "bool", "offload on")
    chunk_size: int = _f(
        256,
        "int",
        "tokens per chunk; a positive multiple of 16 (with vLLM, the default becomes a "
        "multiple of its KV block size where that block does not divide 256, and the block "
        "size for a model with state layers)",
    )
    memory_bytes: int = _f(2 * _GiB, "size", "host-memory tier budget per rank")
    disk_dir: str | None = _f(None, "opt_str", "directory of the disk tier")
    disk_bytes: int = _f(0, "size", "disk tier budget per rank; 0 = no disk tier")
    disk_gc_days: float = _f(
        30.0,
        "float",
        "namespace directories of disk_dir unused for this many days are removed at startup "
        "(old model revisions, other TP sizes); 0 = never",
    )
    disk_conflict: str = _f(
        "refuse",
        "str",
        "when another live process holds this disk namespace: 'refuse' (startup error naming "
        "its pid) or 'own_dir' (this process uses a directory of its own)",
    )
    remote_url: str | None = _f(
        None, "opt_str", "redis://, rediss://, redis+cluster://, rediss+cluster:// or unix:// URL"
    )
    remote_username: str | None = _f(None, "opt_str", "remote store user")
    remote_password: str | None = _f(None, "opt_str", "remote store password (secret)")
    remote_ttl_s: int = _f(0, "int", "expiry of remote entries in seconds; 0 = none")
    remote_timeout_ms: int = _f(100, "int", "per-call timeout of the remote store")
    remote_write_timeout_ms: int = _f(1000, "int", "base timeout of one remote write")
    remote_timeout_gbps: float = _f(
        0.1, "float", "slowest healthy transfer rate: read/write timeouts grow by record bytes"
    )
    remote_read_from: str = _f("primary", "str", "'primary' or 'replica' (cluster reads)")
    remote_tls_ca_file: str | None = _f(None, "opt_str", "PEM CA bundle verifying the store")
    remote_tls_cert_file: str | None = _f(None, "opt_str", "PEM client certificate (mTLS)")
    remote_tls_key_file: str | None = _f(None, "opt_str", "PEM client key (mTLS)")
    remote_tls_insecure: bool = _f(False, "bool", "skip TLS certificate verification")
    tenant: str = _f(
        "",
        "str",
        "tenant of this engine: its own namespace, key prefix and record key on a "
        "shared store (letters, digits, '.', '_', '-')",
    )
    record_key: str | None = _f(
        None,
        "opt_str",
        "deployment secret authenticating (and encrypting) records outside the process, at "
        "least 32 characters (secret; prefer KVTIER_RECORD_KEY or record_key_file); required "
        "with remote_url, generated in disk_dir for a disk tier when unset",
    )
    record_key_file: str | None = _f(
        None, "opt_str", "file holding record_key (readable by its owner only)"
    )
    encrypt_at_rest: bool = _f(
        False, "bool", "AES-GCM-encrypt records on disk and in the shared store (a key per tenant)"
    )
    remote_full: str = _f(
        "refuse",
        "str",
        "a store that evicts nothing (maxmemory-policy noeviction) with remote_ttl_s=0 fills "
        "up and refuses every write: 'refuse' stops startup, 'warn' logs it and serves on",
    )
    lookup_scope: tuple[int, ...] | None = _f(None, "scope", "ranks asked on lookup; None = all")
    lookup_timeout_ms: int = _f(200, "int", "deadline of one lookup across ranks")
    lookup_wait_ms: float = _f(
        5.0, "float", "longest the scheduler loop waits on a lookup before asking next step"
    )
    lookup_transport: str = _f(
        "ipc",
        "str",
        "'ipc' (its socket in the engine's private run directory) or 'tcp' (loopback, CURVE "
        "handshake under keys derived from the engine key: a peer without it is refused)",
    )
    lookup_base_port: int | None = _f(
        None, "opt_int", "tcp: rank r's lookup server listens on this port + r"
    )
    lookup_dir: str | None = _f(
        None, "opt_str", "directory of the engines' run dirs (ipc sockets and the lookup key)"
    )
    lookup_bind_host: str = _f("127.0.0.1", "str", "address lookup servers bind on tcp")
    allow_remote_bind: bool = _f(False, "bool", "permit a non-loopback lookup_bind_host")
    lease_ttl_s: float = _f(30.0, "float", "lease deadline in seconds")
    max_leases: int = _f(65536, "int", "cap on live leases per rank")
    min_load_tokens: int | None = _f(
        None,
        "opt_int",
        "smallest load worth doing; None = one host block (the load gate decides the rest)",
    )
    admission: str = _f(
        "adaptive",
        "str",
        "which computed chunks are written to the tiers: 'adaptive' (those whose kind comes "
        "back in time to be read, learnt from the traffic; write-through while the tier keeps "
        "what returns) or 'all' (write-through)",
    )
    admission_history: int = _f(
        0,
        "int",
        "chunk keys the admission policy remembers to measure what comes back; 0 = 16 x the "
        "tiers' chunks per rank (65536 with a shared store), at most 1048576",
    )
    retention_budget: float = _f(
        0.5,
        "float",
        "share of the tiers' chunks that clients' retention hints may hold (prompt_cache_key "
        "+ prompt_cache_retention, cache_control ttl, kv_transfer_params); hints beyond it are "
        "clipped or rejected; 0 disables retention",
    )
    retention_tenant_share: float = _f(
        1.0,
        "float",
        "share of the retention budget one tenant (the request's user) may hold; below 1 on "
        "a server several tenants share",
    )
    retention_full: str = _f(
        "clip",
        "str",
        "a retention hint that finds the budget full: 'clip' keeps the leading chunks that fit "
        "(what is granted stays granted until its TTL); 'soonest' first takes the room of "
        "retained chunks due back later than it, latest first (closer to the optimum; those "
        "grants end early, counted in kvtier_retention_displaced_chunks)",
    )
    retention_ttl_s: float = _f(
        300.0,
        "float",
        "retention of a hint that names no TTL (OpenAI in_memory, Anthropic's default 5m)",
    )
    retention_max_ttl_s: float = _f(
        86400.0, "float", "longest retention a hint may ask for; longer ones are clipped to it"
    )
    write_queue_depth: int = _f(256, "int", "bound of each write-behind queue")
    write_wait_ms: float = _f(
        500.0,
        "float",
        "how long a save waits for the write-behind to unpin a memory slot when every slot "
        "holds a chunk still being written below (0: the save fails at once)",
    )
    load_gate: bool = _f(
        True, "bool", "false = load_policy 'always' (kept for older configs; prefer load_policy)"
    )
    load_policy: str = _f(
        "cost",
        "str",
        "'cost': each run of hits is loaded from the tier that holds it only where the load is "
        "predicted faster than recomputing it (read and prefill times learnt live); 'always': "
        "every hit is loaded",
    )
    load_margin: float = _f(
        0.1,
        "float",
        "how much faster than recompute a load must be predicted to be chosen (0.1 = 10%)",
    )
    load_probe_s: float = _f(
        10.0,
        "float",
        "a tier the cost policy turns away is still read once per this many seconds, so its "
        "measured speed stays current",
    )
    sync_load_fraction: float = _f(
        0.25,
        "float",
        "a load runs inside its step's forward when predicted to take at most this share of a "
        "step; 0 = every load asynchronous",
    )
    gil_switch_ms: float = _f(
        0.5,
        "float",
        "GIL switch interval set in each process kvtier runs in (lowered, never raised), so its "
        "lookup server and copy lanes wait at most this long for the GIL; 0 = the interpreter's",
    )
    transfer_depth: int = _f(
        2,
        "int",
        "chunks each copy lane keeps in flight (one staging buffer each): the host commits or "
        "unpins the oldest while the next ones cross the link; 1 = one chunk at a time",
    )
    persistent_ring: bool = _f(
        True,
        "bool",
        "each copy lane keeps its transfers in flight across steps: a step's last chunks are "
        "still on the link while the next step's are issued (false: each step's job waits for "
        "all of its chunks before the lane takes the next, as before)",
    )
    load_waves: int = _f(
        4,
        "int",
        "waves a synchronous load lands in, layer by layer, on a host whose forward waits per "
        "layer (the native engine on a GPU or the simulated device; not vLLM, not the CPU): "
        "every chunk's first quarter of the layers, then the next, each layer waiting only for "
        "its own; the forward starts after the first wave. Each wave is one 2-D copy per chunk "
        "and run. 1 = the whole load before the forward",
    )
    lane_cpus: str = _f(
        "auto",
        "str",
        "CPUs of the copy lanes: 'auto' = the cores the host's bound compute threads leave free "
        "(CPU backend; unchanged when fewer than 2 are: a lone free core is the frontend's), "
        "'inherit', or a list such as '2-3'",
    )
    prefill_tokens_per_s: float = _f(2000.0, "float", "seed of the prefill-speed estimate")
    memory_read_gbps: float = _f(5.0, "float", "seed of the memory-tier read-speed estimate")
    disk_read_gbps: float = _f(1.0, "float", "seed of the disk-tier read-speed estimate")
    remote_read_gbps: float = _f(0.5, "float", "seed of the remote-tier read-speed estimate")
    verify_memory_reads: bool = _f(False, "bool", "checksum memory-tier reads too")
    breaker_failures: int = _f(5, "int", "consecutive failures that open a tier's breaker")
    breaker_probe_s: float = _f(5.0, "float", "seconds before an open breaker probes again")
    self_test: bool = _f(True, "bool", "move one chunk through the codec on every rank at startup")
    preferred_kv_layout: str = _f(
        "LBNHC",
        "str",
        "KV layout asked of vLLM ('' = no preference); LBNHC (layer-outer) is one vLLM splits "
        "into kernel blocks; BLHNC (one page per block) only where no kernel split is needed",
    )
    model_revision: str | None = _f(
        None, "opt_str", "folded into the model identity; change it when weights change in place"
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            raw = getattr(self, f.name)
            object.__setattr__(self, f.name, _COERCE[f.metadata["kind"]](f.name, raw))
        self._validate()

    # ------------------------------------------------------------------------------ checks

    def _validate(self) -> None:
        if self.chunk_size <= 0 or self.chunk_size % 16:
            raise _error(
                "chunk_size",
                f"chunk_size={self.chunk_size} is not a positive multiple of 16; "
                "use 256 (the default) or another multiple of 16",
            )
        if self.enabled and self.memory_bytes == 0:
            raise _error(
                "memory_bytes",
                "memory_bytes=0 leaves no host-memory tier while offload is enabled; "
                "set memory_bytes (e.g. 2GiB, the default) or enabled=false",
            )
        if self.preferred_kv_layout not in _KV_LAYOUTS:
            raise _error(
                "preferred_kv_layout",
                f"{_show('preferred_kv_layout', self.preferred_kv_layout)} is not a layout "
                f"kvtier can move whole; use one of {', '.join(_KV_LAYOUTS[1:])}, or '' for no "
                "preference",
            )
        self._validate_disk()
        self._validate_remote()
        self._validate_lookup()
        self._validate_lookup_port()
        self._validate_numbers()

    def _validate_disk(self) -> None:
        if self.disk_bytes > 0 and self.disk_dir is None:
            raise _error(
                ("disk_bytes", "disk_dir"),
                f"disk_bytes={self.disk_bytes} ({format_size(self.disk_bytes)}) asks for a disk "
                "tier but disk_dir is not set; "
                "set disk_dir to a directory, or disk_bytes=0 for no disk tier",
            )
        if self.disk_dir is not None and self.disk_bytes == 0:
            raise _error(
                ("disk_dir", "disk_bytes"),
                f"disk_dir={self.disk_dir!r} is set but disk_bytes=0 means no disk tier; "
                "set disk_bytes (e.g. 64GiB) or unset disk_dir",
            )
        if self.disk_gc_days < 0:
            raise _error(
                "disk_gc_days",
                f"disk_gc_days={self.disk_gc_days:g} is negative; use 0 to never remove old "
                "namespaces, or a number of days",
            )
        if self.disk_conflict not in _DISK_CONFLICT:
            raise _error(
                "disk_conflict",
                f"{_show('disk_conflict', self.disk_conflict)} is not one of "
                f"{', '.join(_DISK_CONFLICT)}",
            )

    def _validate_remote(self) -> None:
        url = self.remote_url
        object.__setattr__(self, "_endpoint", None)
        if url is None:
            for key in ("remote_username", "remote_password", *_TLS_FILES):
                if getattr(self, key) is not None:
                    raise _error(
                        (key, "remote_url"),
                        f"{key} is set but remote_url is not; set remote_url "
                        f"(redis://host:6379/0) or unset {key}",
                    )
        else:
            # parsed here once; the store is handed this endpoint (`store_endpoint`)
            object.__setattr__(self, "_endpoint", self._validate_remote_url(url))
        if not _TENANT_RE.match(self.tenant):
            raise _error(
                "tenant",
                f"{_show('tenant', self.tenant)} is not a valid tenant; use at most 64 letters, "
                "digits, '.', '_' or '-'",
            )
        if self.remote_ttl_s < 0:
            raise _error(
                "remote_ttl_s",
                f"remote_ttl_s={self.remote_ttl_s} is negative; use 0 for no expiry or seconds > 0",
            )
        if self.admission not in _ADMISSION:
            raise _error(
                "admission",
                f"{_show('admission', self.admission)} is not one of {', '.join(_ADMISSION)}",
            )
        if self.load_policy not in LOAD_POLICIES:
            raise _error(
                "load_policy",
                f"{_show('load_policy', self.load_policy)} is not one of "
                f"{', '.join(LOAD_POLICIES)}; use 'cost' (the default) or 'always'",
            )
        if not (math.isfinite(self.load_margin) and 0 <= self.load_margin <= 10):
            raise _error(
                "load_margin",
                f"{_show('load_margin', self.load_margin)} is outside 0..10; use a share such "
                "as 0.1 (a load must be predicted 10% faster than recompute)",
            )
        if not 0 <= self.admission_history <= MAX_ADMISSION_HISTORY:
            # each remembered key costs ~100 bytes of host memory on the scheduler
            raise _error(
                "admission_history",
                f"admission_history={self.admission_history} is outside "
                f"0..{MAX_ADMISSION_HISTORY}; use 0 (sized from the tiers) or a number of "
                "chunk keys up to that",
            )
        if self.retention_full not in RETENTION_FULL_MODES:
            raise _error(
                "retention_full",
                f"{_show('retention_full', self.retention_full)} is not one of "
                f"{', '.join(RETENTION_FULL_MODES)}",
            )
        for name in ("retention_budget", "retention_tenant_share"):
            share = getattr(self, name)
            if not 0.0 <= share <= 1.0:
                raise _error(
                    name, f"{name}={share:g} must lie in [0, 1]; {_DEFAULTS[name]:g} is the default"
                )
        if not self.retention_ttl_s > 0:
            raise _error(
                "retention_ttl_s",
                f"retention_ttl_s={self.retention_ttl_s:g} must be > 0; use seconds such as "
                f"{_DEFAULTS['retention_ttl_s']:g} (the default)",
            )
        if self.retention_ttl_s > self.retention_max_ttl_s:
            raise _error(
                ("retention_ttl_s", "retention_max_ttl_s"),
                f"retention_ttl_s={self.retention_ttl_s:g} (the TTL of a hint that names none) "
                f"is above retention_max_ttl_s={self.retention_max_ttl_s:g}; lower "
                "retention_ttl_s or raise retention_max_ttl_s",
            )
        if self.remote_full not in _REMOTE_FULL:
            raise _error(
                "remote_full",
                f"{_show('remote_full', self.remote_full)} is not one of {', '.join(_REMOTE_FULL)}",
            )
        self._validate_record_key()

    def _validate_record_key(self) -> None:
        if self.record_key is not None and self.record_key_file is not None:
            raise _error(
                ("record_key", "record_key_file"),
                "record_key and record_key_file are both set; keep one (record_key_file, or "
                "KVTIER_RECORD_KEY in the environment, keeps the secret out of logged configs)",
            )
        if self.record_key is not None and len(self.record_key) < _MIN_RECORD_KEY_CHARS:
            raise _error(
                "record_key",
                f"record_key has {len(self.record_key)} characters (value not shown); use at "
                f"least {_MIN_RECORD_KEY_CHARS}, e.g. the output of "
                "`python -c 'import secrets; print(secrets.token_hex(32))'`",
            )
        if self.remote_url is not None and self.record_key is None and self.record_key_file is None:
            raise _error(
                ("record_key", "remote_url"),
                "remote_url is set but no record key is: records in a shared store must be "
                "authenticated, with the same secret on every engine that writes or reads the "
                "store; set KVTIER_RECORD_KEY (at least 32 characters, e.g. `python -c 'import "
                "secrets; print(secrets.token_hex(32))'`) or record_key_file",
            )

    @property
    def store_endpoint(self) -> remote_endpoint.RemoteEndpoint | None:
        """`remote_url` parsed (once, by validation); None without a remote tier."""
        return self.__dict__.get("_endpoint")

    def _validate_remote_url(self, url: str) -> remote_endpoint.RemoteEndpoint:
        fix = remote_endpoint.URL_FORMS
        shown = _show("remote_url", url)
        try:
            endpoint = remote_endpoint.parse(url)
        except ValueError as e:
            if "scheme" in str(e):
                # the parser's message quotes everything before '://', which is the whole URL
                # (password included) when '://' is missing: name the scheme from the masked URL
                scheme, sep, _ = mask_url(url).partition("://")
                what = f"scheme {scheme.lower()!r}" if sep else "no scheme ('://' is missing)"
                raise _error(
                    "remote_url",
                    f"{shown} has {what}, not one of {', '.join(remote_endpoint.SCHEMES)}; {fix}",
                ) from None
            raise _error("remote_url", f"{shown} is not a valid remote URL: {e}; {fix}") from None
        if self.remote_read_from not in _READ_FROM:
            raise _error(
                "remote_read_from",
                f"{_show('remote_read_from', self.remote_read_from)} is not one of "
                f"{', '.join(_READ_FROM)}; use 'primary' (the default) or 'replica'",
            )
        if self.remote_read_from == "replica" and not endpoint.cluster:
            raise _error(
                ("remote_read_from", "remote_url"),
                f"remote_read_from='replica' needs a cluster, but {shown} names one server; "
                "use a redis+cluster:// URL or remote_read_from='primary'",
            )
        tls_keys = [k for k in _TLS_FILES if getattr(self, k) is not None]
        if self.remote_tls_insecure:
            tls_keys.append("remote_tls_insecure")
        if tls_keys and not endpoint.tls:
            raise _error(
                (tls_keys[0], "remote_url"),
                f"{', '.join(tls_keys)} set but {shown} is not a TLS URL; use rediss:// or "
                "rediss+cluster://, or unset the TLS keys",
            )
        if (self.remote_tls_cert_file is None) != (self.remote_tls_key_file is None):
            raise _error(
                ("remote_tls_cert_file", "remote_tls_key_file"),
                "remote_tls_cert_file and remote_tls_key_file go together (mutual TLS); "
                "set both or neither",
            )
        if self.remote_tls_insecure and self.remote_tls_ca_file is not None:
            raise _error(
                ("remote_tls_insecure", "remote_tls_ca_file"),
                "remote_tls_insecure=true skips the verification remote_tls_ca_file is for; "
                "unset one of them",
            )
        if self.remote_write_timeout_ms < self.remote_timeout_ms:
            raise _error(
                ("remote_write_timeout_ms", "remote_timeout_ms"),
                f"remote_write_timeout_ms={self.remote_write_timeout_ms} is below "
                f"remote_timeout_ms={self.remote_timeout_ms}; a write never gets less time "
                "than a read, so raise it (default 1000)",
            )
        return endpoint

    def _validate_lookup(self) -> None:
        if self.lookup_transport not in _TRANSPORTS:
            raise _error(
                "lookup_transport",
                f"{_show('lookup_transport', self.lookup_transport)} is not a transport; "
                "use 'ipc' (the default, one host) or 'tcp'",
            )
        host = self.lookup_bind_host
        if not host:
            raise _error("lookup_bind_host", "lookup_bind_host='' is empty; use 127.0.0.1")
        if not _is_loopback(host) and not self.allow_remote_bind:
            raise _error(
                ("lookup_bind_host", "allow_remote_bind"),
                f"{_show('lookup_bind_host', host)} is not a loopback address, so lookup "
                "servers would listen off this host (every rank of an engine runs on one host, "
                "and only frames under the engine's run-dir key are answered); use 127.0.0.1, "
                "or set allow_remote_bind=true to listen there anyway",
            )

    def _validate_lookup_port(self) -> None:
        port = self.lookup_base_port
        if port is not None and not 0 < port < 65536:
            raise _error(
                "lookup_base_port",
                f"lookup_base_port={port} is outside 1..65535; pick a free port range "
                "(rank r listens on lookup_base_port + r), e.g. 15500",
            )

    def _validate_numbers(self) -> None:
        positive = (
            "remote_timeout_ms",
            "remote_write_timeout_ms",
            "remote_timeout_gbps",
            "lookup_timeout_ms",
            "lease_ttl_s",
            "max_leases",
            "write_queue_depth",
            "prefill_tokens_per_s",
            "memory_read_gbps",
            "disk_read_gbps",
            "remote_read_gbps",
            "breaker_failures",
            "breaker_probe_s",
            "load_probe_s",
        )
        for key in positive:
            value = getattr(self, key)
            if value <= 0:
                default = _DEFAULTS[key]
                raise _error(
                    key, f"{_show(key, value)} must be > 0; use {default!r} (the default) or more"
                )
        if self.write_wait_ms < 0:
            raise _error(
                "write_wait_ms",
                f"{_show('write_wait_ms', self.write_wait_ms)} is negative; use 0 to fail a "
                "save at once when memory is full, or 500 (the default)",
            )
        if self.write_wait_ms > MAX_WRITE_WAIT_MS:
            raise _error(
                "write_wait_ms",
                f"{_show('write_wait_ms', self.write_wait_ms)} is over {MAX_WRITE_WAIT_MS} (a "
                "minute of one save's wait for a slot); use 500 (the default), or raise "
                "memory_bytes instead",
            )
        if self.lookup_wait_ms < 0:
            raise _error(
                "lookup_wait_ms",
                f"{_show('lookup_wait_ms', self.lookup_wait_ms)} is negative; use 0 to never "
                "block the scheduler loop, or a few ms (5, the default)",
            )
        if self.sync_load_fraction < 0:
            raise _error(
                "sync_load_fraction",
                f"{_show('sync_load_fraction', self.sync_load_fraction)} is negative; use 0 "
                "for asynchronous loads only, or a share of a step such as 0.25 (the default)",
            )
        if not 1 <= self.transfer_depth <= _MAX_TRANSFER_DEPTH:
            raise _error(
                "transfer_depth",
                f"{_show('transfer_depth', self.transfer_depth)} is outside 1.."
                f"{_MAX_TRANSFER_DEPTH}; use 2 (the default: one chunk committed while the next "
                "crosses the link) or 3-4 on links the host cannot keep busy",
            )
        if not 1 <= self.load_waves <= _MAX_LOAD_WAVES:
            raise _error(
                "load_waves",
                f"{_show('load_waves', self.load_waves)} is outside 1..{_MAX_LOAD_WAVES}; use 4 "
                "(the default: the forward starts after a quarter of a load) or 1 to land a "
                "load whole before the forward",
            )
        if self.gil_switch_ms < 0:
            raise _error(
                "gil_switch_ms",
                f"{_show('gil_switch_ms', self.gil_switch_ms)} is negative; use 0 to keep the "
                "interpreter's switch interval, or a fraction of a millisecond such as 0.5 "
                "(the default)",
            )
        try:
            cpus.check_setting(self.lane_cpus)
        except ConfigError as e:
            raise _error("lane_cpus", f"{e}; or use 'auto' (the default) or 'inherit'") from None
        if self.min_load_tokens is not None and self.min_load_tokens < 0:
            raise _error(
                "min_load_tokens",
                f"{_show('min_load_tokens', self.min_load_tokens)} is negative; use 0 for no "
                "minimum or leave it unset for one host block",
            )

    # -------------------------------------------------------------------------- derived

    def min_load(self, block_size: int) -> int:
        """Smallest load worth issuing, in tokens: `min_load_tokens`, or one host block when
        unset (less than a chunk is still a whole chunk read, far cheaper than recomputing)."""
        return block_size if self.min_load_tokens is None else self.min_load_tokens

    @property
    def effective_load_policy(self) -> str:
        """`load_policy`, or 'always' where an older config turned `load_gate` off."""
        return self.load_policy if self.load_gate else "always"

    @property
    def memory_only(self) -> bool:
        """True when the ranks keep chunks in host memory alone (no disk, no remote tier)."""
        return not self.disk_bytes and not self.remote_url

    def fitted_to_block(
        self, block_size: int, states: bool = False, chosen: bool = False
    ) -> KVTierConfig:
        """This config with the default chunk size fitted to the host's KV block size: raised
        to a multiple of a block that does not divide it (vLLM raises a state hybrid's block
        until an attention page holds a state page: 640 tokens, say), and one block for a model
        with state layers (`states`: vLLM keeps a state at block boundaries, and kvtier stores
        one only at a chunk boundary). An explicitly chosen chunk size is kept (`chosen`: the
        user set it, even to the default's value), and a host whose block does not divide it is
        told so at startup."""
        default = int(_DEFAULTS["chunk_size"])
        if block_size <= 0 or chosen or self.chunk_size != default:
            return self
        if states:
            chunk = block_size
        elif default % block_size:
            chunk = -(-default // block_size) * block_size
        else:
            return self
        return dataclasses.replace(self, chunk_size=chunk)

    def check_max_model_len(self, max_model_len: int) -> None:
        """Startup check against the host's longest sequence: a chunk no prompt can fill is
        never stored, so offload would do nothing."""
        if self.enabled and self.chunk_size > max_model_len:
            raise ConfigError(
                f"chunk_size={self.chunk_size} is larger than the model's max_model_len="
                f"{max_model_len}: no prompt fills one chunk, so nothing would ever be stored; "
                f"set chunk_size to a multiple of the KV block size no larger than "
                f"{max_model_len}, or raise max_model_len"
            )

    # -------------------------------------------------------------------------- display

    def to_dict(self, secrets: bool = False) -> dict[str, Any]:
        """Plain dict of every field. For logs the password and any URL password are masked;
        `secrets=True` keeps them, to hand the config to another process of this engine."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not secrets and f.name in _SECRET_KEYS and value is not None:
                value = _MASK
            elif not secrets and f.name == "remote_url" and value is not None:
                value = mask_url(value)
            if f.name == "lookup_scope" and value is not None:
                value = list(value)
            out[f.name] = value
        return out

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items())
        return f"KVTierConfig({shown})"

    def describe(self) -> str:
        """One line for startup logs: what is on, how big, and where lookups go."""
        if not self.enabled:
            return "kvtier: offload off"
        disk = f"{format_size(self.disk_bytes)} at {self.disk_dir}" if self.disk_bytes else "off"
        remote = mask_url(self.remote_url) if self.remote_url else "off"
        scope = "all ranks" if self.lookup_scope is None else f"ranks {list(self.lookup_scope)}"
        n = self.min_load_tokens
        min_load = "1 block" if n is None else f"{n} tokens"
        return (
            f"kvtier: offload on; chunk={self.chunk_size} tokens; "
            f"memory={format_size(self.memory_bytes)}/rank; disk={disk}; remote={remote}; "
            f"lookup={self.lookup_transport} over {scope} within {self.lookup_timeout_ms}ms; "
            f"min_load={min_load}; "
            f"load_policy={self.effective_load_policy}; "
            f"sync_load_fraction={self.sync_load_fraction:g}; "
            f"self_test={'on' if self.self_test else 'off'}"
        )

    # ---------------------------------------------------------------------- constructors

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> KVTierConfig:
        """Config from a mapping of field names (vLLM's `kv_connector_extra_config`)."""
        return cls._build(_from_mapping(d, "extra config"))

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> KVTierConfig:
        """Config from a YAML file holding a mapping of field names."""
        return cls._build(_from_yaml(path, "yaml path"))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KVTierConfig:
        """Config from `KVTIER_<FIELD>` variables over the YAML file named by `KVTIER_CONFIG`."""
        return cls.load(None, environ)

    @classmethod
    def load(
        cls,
        extra: Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
        *,
        config_file: str | os.PathLike[str] | None = None,
        config_flag: str = "--config",
    ) -> KVTierConfig:
        """Merge YAML file (`KVTIER_CONFIG`) < `KVTIER_*` variables < `extra`, then validate.
        `config_file` (a command line's `config_flag`) is read instead of `KVTIER_CONFIG`'s
        file, and a message about it names the flag."""
        return cls._build(_merged(extra, environ, config_file, config_flag))

    @staticmethod
    def given(
        extra: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
    ) -> frozenset[str]:
        """The keys `load(extra, environ)` takes from the user (file, variables, `extra`), not
        from the defaults: a value equal to its default may still be a choice."""
        return frozenset(_merged(extra, environ, None, "--config"))

    @classmethod
    def _build(cls, values: Mapping[str, tuple[Any, str]]) -> KVTierConfig:
        try:
            return cls(**{key: value for key, (value, _) in values.items()})
        except KeyedConfigError as exc:
            sources = [f"{key} from {values[key][1]}" for key in exc.keys if key in values]
            if not sources:
                raise
            # the original message is already secret-free; add where each value came from
            raise _error(exc.keys, f"{exc} [{'; '.join(sources)}]") from None


def _merged(
    extra: Mapping[str, Any] | None,
    environ: Mapping[str, str] | None,
    config_file: str | os.PathLike[str] | None,
    config_flag: str,
) -> dict[str, tuple[Any, str]]:
    """YAML file (`config_file`, else `KVTIER_CONFIG`'s) < `KVTIER_*` variables < `extra`:
    each key's value and where it came from."""
    env = os.environ if environ is None else environ
    merged: dict[str, tuple[Any, str]] = {}
    if config_file is not None:
        merged.update(_from_yaml(config_file, config_flag))
    elif yaml_path := env.get(ENV_CONFIG_FILE):
        merged.update(_from_yaml(yaml_path, ENV_CONFIG_FILE))
    merged.update(_from_env(env))
    if extra is not None:
        merged.update(_from_mapping(extra, "extra config"))
    return merged


_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(KVTierConfig))
_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(KVTierConfig)}


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        # a hostname other than localhost may resolve anywhere
        return False


def _unknown(name: str, candidates: tuple[str, ...], where: str) -> ConfigError:
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(candidates)}"
    return _error(name, f"unknown key {name!r} in {where}; {hint}")


def _from_mapping(d: Mapping[str, Any], where: str) -> dict[str, tuple[Any, str]]:
    if not isinstance(d, Mapping):
        raise ConfigError(
            f"{where} is a {type(d).__name__}, not a mapping of kvtier keys; "
            "give e.g. {'chunk_size': 256, 'memory_bytes': '64GiB'}"
        )
    out: dict[str, tuple[Any, str]] = {}
    for raw_key, value in d.items():
        if not isinstance(raw_key, str):
            raise ConfigError(f"key {raw_key!r} in {where} is not a string; use a field name")
        # 'chunk-size' and 'Chunk_Size' name the same field; the canonical spelling is snake_case
        key = raw_key.strip().lower().replace("-", "_")
        if key not in _FIELDS:
            raise _unknown(raw_key, _FIELDS, where)
        if key in out:
            raise _error(key, f"{key} is given twice in {where}; keep one spelling")
        out[key] = (value, where)
    return out


def config_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of `environ` that configure kvtier (`KVTIER_CONFIG`, `KVTIER_<FIELD>`):
    what a bench hands the servers it starts, without its own token."""
    return {
        k: v for k, v in environ.items() if k.startswith(ENV_PREFIX) and k not in ENV_NOT_CONFIG
    }


def _from_env(environ: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    env_names = tuple(ENV_PREFIX + name.upper() for name in _FIELDS)
    out: dict[str, tuple[Any, str]] = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX) or name == ENV_CONFIG_FILE or name in ENV_NOT_CONFIG:
            continue
        if name not in env_names:
            close = difflib.get_close_matches(name, (*env_names, ENV_CONFIG_FILE), n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}?" if close else "unset it"
            raise _error(
                name,
                f"unknown environment variable {name}; {hint} (kvtier reads "
                f"{ENV_CONFIG_FILE} and {ENV_PREFIX}<FIELD> for its config fields)",
            )
        out[name[len(ENV_PREFIX) :].lower()] = (value, f"environment {name}")
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a mapping key given twice (PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice; keep one", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


def _from_yaml(path: str | os.PathLike[str], via: str) -> dict[str, tuple[Any, str]]:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise _error(
            via, f"{via}={str(p)!r} cannot be read ({exc.strerror}); point it at a YAML file"
        ) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: no arbitrary objects
    except yaml.YAMLError as exc:
        # keep only the position: the default message quotes the line, which may hold a secret
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "syntax error"
        raise _error(via, f"{via}={str(p)!r} is not valid YAML{where}: {problem}") from None
    if data is None:
        return {}
    return _from_mapping(data, f"YAML file {str(p)!r}")
