"""The tests' local redis-server (tests/redis_local.py): a server that failed to start is never
mistaken for another one listening on its port, and a killed server's port waits for its
restart."""

from __future__ import annotations

import socket

import pytest

from tests.redis_local import RedisServer, RedisServerError


def test_a_start_never_adopts_another_server_listening_on_its_port() -> None:
    """Under parallel test workers a killed server's port was taken by another test's server;
    the restart could not bind it, answered PING through the other server, and the test then
    flushed that other test's store."""
    with RedisServer() as other:
        other.client().set("theirs", b"1")
        squatter = RedisServer()
        squatter.port = other.port  # a kept address someone else now listens on
        with pytest.raises(RedisServerError, match="exited with code"):
            squatter.start()
        squatter.stop()
        assert other.client().get("theirs") == b"1"


def test_a_killed_servers_port_is_held_until_its_restart() -> None:
    with RedisServer() as srv:
        srv.client().set("k", b"v")
        srv.kill()
        with socket.socket() as probe:
            with pytest.raises(OSError):
                probe.bind(("127.0.0.1", srv.port))
            # a client finds no server there, as after a crash
            with pytest.raises(ConnectionRefusedError):
                probe.connect(("127.0.0.1", srv.port))
        srv.restart()
        assert srv.client().get("k") is None  # back, empty, on the same address
        assert srv.client().ping()
