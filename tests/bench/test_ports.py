"""kvtier.bench.ports: a server's port is never one an outgoing connection can take first.

CI failed once when vLLM's KV-event publisher could not bind the port a test had picked: the
kernel had picked it from the ephemeral range, and a client socket took it in between."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kvtier.bench.ports import LOWEST, ephemeral_range, free_port


def test_a_free_port_lies_outside_the_kernels_ephemeral_range() -> None:
    low, high = ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert all(LOWEST <= p and not low <= p <= high for p in ports), (low, high, ports)
    assert len(set(ports)) > 1  # picked at random: two servers starting together rarely collide


def test_the_ports_it_returns_can_be_bound_by_a_server() -> None:
    base = free_port(count=3)
    held = []
    try:
        for i in range(3):
            s = socket.socket()
            s.bind(("127.0.0.1", base + i))
            s.listen()
            held.append(s)
        # a listening port is not free: the picker never returns it
        assert all(not 0 <= base - p < 3 for p in (free_port() for _ in range(100)))
    finally:
        for s in held:
            s.close()


def test_the_range_is_read_from_proc_and_defaults_to_linuxs(tmp_path: Path) -> None:
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert ephemeral_range(f) == (40000, 50000)
    f.write_text("garbage")
    assert ephemeral_range(f) == (32768, 60999)
    assert ephemeral_range(tmp_path / "missing") == (32768, 60999)


def test_a_host_whose_ephemeral_range_is_every_port_still_gets_a_free_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("kvtier.bench.ports.ephemeral_range", lambda: (1, 65535))
    port = free_port(count=2)
    for p in (port, port + 1):
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
