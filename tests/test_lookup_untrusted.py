"""kvtier's inter-process surfaces on one host: what a process that is not the engine can do
to the lookup channel, the TP workers' start and the retention admin routes. Each test states
the threat it holds, and each failed before its fix (a flood of junk on a squatted port held
the scheduler's lookup wait for seconds; a peer without the engine key could open a zmq
message on a TCP rank that never ends, buffered whole; a TP worker imported a module planted
in the working directory; a huge integer TTL raised OverflowError)."""

from __future__ import annotations

import contextlib
import shutil
import socket
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from kvtier.bench.ports import free_port
from kvtier.lookup import LookupClient, LookupServer, endpoint_for, make_run_dir
from kvtier.lookup.keyfile import engine_key
from kvtier.metrics import Metrics
from kvtier.store.registry import order
from tests.lookup_helpers import FakeBackend, engine_side, make_keys

TIER_ORDER = order()
KEYS = make_keys(4, salt="review")
DEADLINE_S = 10.0


def _wait(cond: Callable[[], bool], what: str, limit_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + limit_s
    while not cond():
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} not within {limit_s}s")
        time.sleep(0.005)


@pytest.fixture
def run_dir() -> Iterator[Path]:
    d = make_run_dir(base="/tmp")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _client(ep: str, timeout_ms: int) -> LookupClient:
    """The engine's lookup client of rank 0 at `ep`."""
    return LookupClient({0: ep}, Metrics("scheduler"), chunk_size=16, world=1,
                        timeout_ms=timeout_ms, tier_order=TIER_ORDER)  # fmt: skip


def _squat(
    ctx: zmq.Context, kind: int = zmq.DEALER, key: bytes | None = None
) -> tuple[zmq.Socket, int]:
    """Another local user binding a lookup rank's tcp port (before the rank binds it, or while
    the rank is down): loopback ports belong to whoever binds them first. With `key`, one that
    holds the engine's CURVE keys for rank 0 (past the handshake, as a faulty rank would be)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)  # queue without limit on the squatter's side
    if key is not None:
        engine_side(sock, key, server=True)
    sock.bind("tcp://127.0.0.1:*")
    port = int(sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
    return sock, port


# -- 1. a squatter's flood of unauthenticated replies holds the scheduler's poll ---------------


def test_a_flood_from_a_squatted_rank_port_never_holds_poll_past_its_wait(run_dir: Path) -> None:
    """`poll(p, wait_ms)` is what the scheduler loop calls with `lookup_wait_ms`; the wait must
    stay bounded whatever arrives on a rank's socket. A peer past the TCP handshake (one that
    holds the engine's keys: a faulty rank; outsiders are stopped at the handshake, below) can
    send junk faster than the client checks MACs: the client drained a readable socket to
    empty before it looked at its deadline again (`Peers.received` /
    `LookupClient._gather`), so a steady flood kept the scheduler inside one poll for as long
    as the flood lasted."""
    ctx = zmq.Context.instance()
    squatter, port = _squat(ctx, key=engine_key(run_dir))
    ep = endpoint_for(0, transport="tcp", run_dir=run_dir, base_port=port)
    client = _client(ep, timeout_ms=50)
    try:
        assert client.wait_connected(DEADLINE_S) == []
        # the squatter queues its flood (its own memory, not the engine's) before the lookup.
        # One frame a message: a socket closed while its I/O thread is halfway through sending
        # a multipart message aborts the whole process in libzmq 4.3.5 (session_base.cpp:233),
        # which this test did to its pytest worker about once in 30 runs
        junk = bytes(96)
        for _ in range(300_000):
            squatter.send(junk, zmq.NOBLOCK)
        pending = client.begin(KEYS, "lk-flood", lease=True)
        t0 = time.perf_counter()
        result = client.poll(pending, wait_ms=5)
        held_s = time.perf_counter() - t0
        # 5 ms asked, 50 ms deadline: even a loaded CI host answers well inside 0.3 s
        assert held_s < 0.3, (
            f"poll(wait_ms=5) with a 50 ms lookup deadline held the caller {held_s:.2f}s "
            f"draining a squatter's unauthenticated frames (result {result})"
        )
    finally:
        client.close()
        squatter.close()


# -- 2. a peer without the engine key on a TCP rank's port --------------------------------------


def _zmtp_null(port: int) -> tuple[socket.socket, bytes]:
    """A raw ZMTP 3.0 peer offering the NULL mechanism (what any local user can write to a tcp
    lookup port, byte by byte); returns it and as much of the rank's 64-byte greeting as the
    rank sent before it hung up."""
    s = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S)
    greeting = b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\0")
    s.sendall(greeting + b"\0" + bytes(31))
    got = b""
    while len(got) < 64:
        chunk = s.recv(64 - len(got))
        if not chunk:  # the rank hung up during the greeting
            break
        got += chunk
    return s, got


def _hung_up(s: socket.socket) -> bool:
    """Whether the rank closed `s` (EOF or reset) within the deadline, reading what it sent."""
    s.settimeout(DEADLINE_S)
    try:
        while s.recv(65536):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


@pytest.fixture
def tcp_rank(run_dir: Path) -> Iterator[tuple[LookupServer, Metrics, LookupClient, int]]:
    """Rank 0 serving on loopback TCP, and the engine's own client of it."""
    port = free_port()
    ep = endpoint_for(0, transport="tcp", run_dir=run_dir, base_port=port)
    metrics = Metrics(0)
    server = LookupServer(0, FakeBackend(0, KEYS), ep, metrics).start()
    client = _client(ep, timeout_ms=2000)
    try:
        client.wait_ready(DEADLINE_S)
        yield server, metrics, client, port
    finally:
        client.close()
        server.close()


def test_a_peer_without_the_engine_key_cannot_open_a_message_on_a_tcp_rank(
    tcp_rank: tuple[LookupServer, Metrics, LookupClient, int],
) -> None:
    """zmq's limits are per frame: a peer that was let in could send one message of endless
    parts (each under MAXMSGSIZE), which the rank buffers whole until its last part. Under the
    handshake the rank answers a NULL greeting with its CURVE one and hangs up: not one byte
    of a message is read, and the engine's own client is served as before."""
    server, _metrics, client, port = tcp_rank
    s, greeting = _zmtp_null(port)
    try:
        # a NULL rank would send its whole greeting, then its READY, and wait for parts
        assert greeting[12:32].rstrip(b"\0") in (b"CURVE", b""), greeting
        ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
        part = b"\x03" + struct.pack(">Q", 1 << 20)  # a long frame with more to come
        with contextlib.suppress(OSError):  # the rank may hang up while we write
            s.sendall(b"\x04" + bytes([len(ready)]) + ready + part + bytes(1 << 16))
        assert _hung_up(s), "the rank kept a connection that offered no engine key"
    finally:
        s.close()
    assert (server.served, server.released) == (0, 0)
    assert client.lookup(KEYS, "lk1").hit_chunks == len(KEYS)


def test_a_curve_peer_without_the_engine_key_gets_no_frame_through(
    tcp_rank: tuple[LookupServer, Metrics, LookupClient, int],
) -> None:
    """A peer speaking CURVE with keys of its own cannot seal its HELLO to the rank's server
    key (derived from the engine key, written nowhere): libzmq drops it at the handshake, so
    nothing it sends is handled, counted or answered, and the engine's client is served."""
    server, metrics, client, port = tcp_rank
    public, secret = zmq.curve_keypair()
    foreign = zmq.Context.instance().socket(zmq.DEALER)
    foreign.setsockopt(zmq.LINGER, 0)
    foreign.setsockopt(zmq.CURVE_SERVERKEY, zmq.curve_keypair()[0])  # a guess at the rank's
    foreign.setsockopt(zmq.CURVE_PUBLICKEY, public)
    foreign.setsockopt(zmq.CURVE_SECRETKEY, secret)
    foreign.connect(f"tcp://127.0.0.1:{port}")
    try:
        foreign.send(b"x" * 32 + b"junk", zmq.NOBLOCK)  # queued on its own side
        assert client.lookup(KEYS, "lk1").hit_chunks == len(KEYS)
        assert foreign.poll(300) == 0, "the rank answered a peer without the engine key"
        assert (server.served, server.rejected) == (1, 0)
        assert metrics.value("rejected_frames_total", reason="auth") == 0
    finally:
        foreign.close()


@pytest.mark.parametrize("mechanism", ["NULL", "CURVE"])
def test_the_client_never_queues_a_frame_to_a_squatter_without_the_engine_key(
    run_dir: Path, mechanism: str
) -> None:
    """Whoever binds a rank's port first gets the client's connection, but not past the
    handshake: a plain socket is refused for its mechanism, a CURVE server of its own keys
    cannot prove the rank's, so the client's lookups to it are never sent (a timeout, 0 hits)
    and never read, and nothing it sends reaches the client."""
    squatter = zmq.Context.instance().socket(zmq.ROUTER)
    squatter.setsockopt(zmq.LINGER, 0)
    if mechanism == "CURVE":
        squatter.setsockopt(zmq.CURVE_SERVER, 1)
        squatter.setsockopt(zmq.CURVE_SECRETKEY, zmq.curve_keypair()[1])
    squatter.bind("tcp://127.0.0.1:*")
    port = int(squatter.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
    ep = endpoint_for(0, transport="tcp", run_dir=run_dir, base_port=port)
    client = _client(ep, timeout_ms=200)
    try:
        assert client.wait_connected(0.3) == [0], "the client took the squatter for rank 0"
        res = client.lookup(KEYS, "lk0")
        assert (res.hit_chunks, res.timed_out) == (0, (0,))
        assert squatter.poll(0) == 0, "a lookup frame reached the squatter"
    finally:
        client.close()
        squatter.close()


def test_a_ttl_of_a_huge_integer_is_refused_as_a_bad_value_not_an_overflow() -> None:
    """Invariant 19: a TTL a client sends must be a finite number of seconds, answered 400
    naming `ttl_s` otherwise. JSON integers have no size limit: `positive_seconds` calls
    `math.isfinite` on a 400-digit int, which raises OverflowError (not a bool, not a
    ValueError), so the admin route answers 500 with a traceback in the log, and vLLM's
    `hint_from_params` (documented to raise ValueError, which the request view catches)
    raises it out of a scheduler hook (a counted hook error, the request quarantined)."""
    from kvtier.native.protocol import APIError
    from kvtier.native.retention_routes import _target
    from kvtier.offload.retention import hint_from_params

    huge = b"1" + b"0" * 400
    try:
        _target(b'{"prompt_cache_key": "c", "ttl_s": ' + huge + b"}", None)  # type: ignore[arg-type]
    except APIError as e:
        assert e.status == 400 and "ttl_s" in str(e)
    except Exception as e:  # noqa: BLE001 - the finding
        pytest.fail(f"the admin body's ttl_s={huge[:8].decode()}... raised {e!r}, not a 400")
    with pytest.raises(ValueError):
        hint_from_params({"retain_ttl_s": int(huge)})


# -- 5. a TP worker imports from the engine's working directory --------------------------------


def test_a_tp_worker_never_imports_modules_planted_in_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each TP rank is `python -c <cmd>`, and `-c` puts the working directory first on
    sys.path, ahead of kvtier, torch and the standard library. An engine started (as the
    `kvtier` console script, whose own sys.path has no cwd) in a directory another user can
    write, /tmp or a shared project dir, runs that user's `kvtier/__init__.py` in every rank:
    code inside the process that holds the KV cache and the lookup key."""
    from kvtier.native.config import EngineConfig
    from kvtier.native.connector import ConnectorSpec
    from kvtier.native.tp import MultiprocExecutor, WorkerError

    marker = tmp_path / "planted-code-ran"
    planted = tmp_path / "kvtier"
    planted.mkdir()
    (planted / "__init__.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nraise SystemExit(3)\n"
    )
    monkeypatch.chdir(tmp_path)
    cfg = EngineConfig(tensor_parallel_size=1, startup_timeout_s=60.0)
    with pytest.raises(WorkerError):  # the model dir does not exist: the rank fails either way
        MultiprocExecutor(str(tmp_path / "no-model"), cfg, ConnectorSpec("kvtier.x:y"))
    assert not marker.exists(), (
        f"a TP worker ran {planted / '__init__.py'} from the engine's working directory"
    )
