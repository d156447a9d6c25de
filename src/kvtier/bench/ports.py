"""Free TCP ports for servers a benchmark or a test starts: picked outside the kernel's
ephemeral range, so an outgoing connection cannot take one between the check and the bind."""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# below this are the well-known and registered ports that daemons on the host may claim
LOWEST = 10000
ATTEMPTS = 200


def ephemeral_range(path: Path = EPHEMERAL_RANGE) -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux's default without /proc)."""
    try:
        low, high = (int(x) for x in path.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _candidates(low: int, high: int, count: int) -> list[int]:
    """Ports p with p .. p + count - 1 inside [LOWEST, 65535] and outside [low, high]."""
    spans = [(LOWEST, low - count), (high + 1, 65536 - count)]
    return [p for a, b in spans if a < b for p in random.sample(range(a, b), min(ATTEMPTS, b - a))]


def free_port(host: str = "127.0.0.1", count: int = 1) -> int:
    """A port p with p .. p + count - 1 bindable on `host` now, none of them ephemeral."""
    low, high = ephemeral_range()
    for port in _candidates(low, high, count):
        if all(_bindable(host, port + i) for i in range(count)):
            return port
    # a host whose ephemeral range covers every port: let the kernel pick, and hope
    for _ in range(ATTEMPTS):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port + count <= 65536 and all(_bindable(host, port + i) for i in range(count)):
            return port
    raise OSError(f"no {count} consecutive free TCP port(s) on {host}")
