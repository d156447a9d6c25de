"""Where the shared tier lives: one parse of `remote_url` for config validation and the store.

`redis://` and `rediss://` name one server, `redis+cluster://` and `rediss+cluster://` a Valkey /
Redis Cluster through one or more comma-separated seed nodes (the client discovers the rest),
`unix://` a server on a local socket. Messages never quote the URL: callers add the masked form.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import parse_qs, unquote

SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")
DEFAULT_PORT = 6379
URL_FORMS = (
    "use redis://host:6379/0, rediss://host:6380/0, redis+cluster://host1:7000,host2:7001 "
    "or unix:///path/to/redis.sock"
)


@dataclass(frozen=True, slots=True)
class RemoteEndpoint:
    """The parts of a `remote_url` (credentials as given in the URL, None when absent)."""

    scheme: str
    seeds: tuple[tuple[str, int], ...]  # (host, port) of each server or cluster seed
    socket_path: str | None  # unix:// only
    db: int
    username: str | None
    password: str | None

    @property
    def cluster(self) -> bool:
        """True for a Valkey/Redis Cluster URL (slot-aware routing)."""
        return self.scheme.endswith("+cluster")

    @property
    def tls(self) -> bool:
        """True when the connection is TLS (`rediss://`, `rediss+cluster://`)."""
        return self.scheme.startswith("rediss")

    @property
    def unix(self) -> bool:
        """True for a local socket (`unix://`)."""
        return self.scheme == "unix"


def parse(url: str) -> RemoteEndpoint:
    """Split `url` into a `RemoteEndpoint`; raises ValueError naming the bad part and the fix
    (never the URL itself, which may hold a password)."""
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    forms = ", ".join(SCHEMES)
    # what precedes '://' is quoted only when it has a scheme's shape: a URL missing it (or
    # holding '://' later) would be quoted whole, password and all
    if not sep or not re.fullmatch(r"[a-z][a-z0-9+.-]{0,15}", scheme):
        raise ValueError(f"has no scheme ('://' is missing); start it with one of {forms}")
    if scheme not in SCHEMES:
        raise ValueError(f"scheme {scheme!r} is not one of {forms}")
    if scheme == "unix":
        return _parse_unix(url)
    # the userinfo ends at the URL's last '@' (no host, path or query holds one), so a password
    # may hold '/', '?', '#', '@' or ':' unescaped
    userinfo, at, after = rest.rpartition("@")
    username, password = _userinfo(userinfo) if at else (None, None)
    cut = min((i for i in (after.find("/"), after.find("?"), after.find("#")) if i != -1),
              default=len(after))  # fmt: skip
    hosts, tail = after[:cut], after[cut:]
    if "?" in tail or "#" in tail:
        raise ValueError(
            "query options are not read for TCP URLs; set TLS and timeouts with the "
            "remote_tls_* and remote_*timeout* keys and credentials with remote_username / "
            "remote_password"
        )
    seeds = tuple(_seed(part) for part in hosts.split(","))
    if not _is_cluster(scheme) and len(seeds) > 1:
        raise ValueError(
            f"{len(seeds)} hosts are given but {scheme}:// names one server; use "
            f"{scheme}+cluster:// for a cluster's seed nodes"
        )
    db = _db(tail.lstrip("/"))
    if _is_cluster(scheme) and db != 0:
        raise ValueError(f"database {db} is asked of a cluster, which has only database 0")
    return RemoteEndpoint(scheme, seeds, None, db, username, password)


def _is_cluster(scheme: str) -> bool:
    return scheme.endswith("+cluster")


def _parse_unix(url: str) -> RemoteEndpoint:
    rest = url.partition("://")[2]
    username = password = None
    if not rest.startswith("/"):
        # unix://user:secret@/path: the path starts with '/', so the userinfo ends at the first
        # '@/' (a password may hold '/', '?', '#' or '@' unescaped)
        userinfo, at, path_query = rest.partition("@/")
        if not at:
            raise ValueError("names no socket path (unix:///path/to/redis.sock)")
        username, password = _userinfo(userinfo)
        rest = "/" + path_query
    path, _, query_text = rest.partition("?")
    if not path:
        raise ValueError("names no socket path")
    # a socket is served by redis-py, which reads these two from the query as well
    query = parse_qs(query_text.partition("#")[0], keep_blank_values=True)
    other = sorted(set(query) - {"db", "password"})
    if other:
        raise ValueError(f"query options {other} are not read; use kvtier's remote_* config keys")
    db = _db(query["db"][-1]) if "db" in query else 0
    if "password" in query:
        password = query["password"][-1]
    return RemoteEndpoint("unix", (), unquote(path), db, username, password)


def _userinfo(userinfo: str) -> tuple[str | None, str | None]:
    user, colon, secret = userinfo.partition(":")
    if not colon:
        # a lone userinfo is how people write a password (redis://secret@host)
        return None, unquote(user) or None
    return unquote(user) or None, unquote(secret) or None


def _seed(part: str) -> tuple[str, int]:
    part = part.strip()
    if not part:
        raise ValueError("names no host (an empty entry in the host list)")
    if part.startswith("["):
        host, _, port_text = part[1:].partition("]")
        port_text = port_text.removeprefix(":")
    else:
        host, _, port_text = part.rpartition(":") if ":" in part else (part, "", "")
    if not host:
        raise ValueError(f"host entry {part!r} names no host")
    if not port_text:
        return host, DEFAULT_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"host entry {part!r} has port {port_text!r}, not 1..65535")
    return host, int(port_text)


def _db(path: str) -> int:
    if not path:
        return 0
    if not path.isdigit():
        raise ValueError(f"path /{path} is not a database number; use /0")
    return int(path)
