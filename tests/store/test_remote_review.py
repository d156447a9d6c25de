"""Review of the shared-store tier against a hostile network and store: a stalled, dripping,
dying or full server, a connection that lost replies, a huge value at a key, close() with
calls in flight. Real redis-server behind a fault-injecting proxy (TCP or unix socket)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
import torch

from kvtier.metrics import Metrics
from kvtier.store.breaker import ShardBreakers, State
from kvtier.store.remote import RemoteTier
from tests.record_key import codec_for_tests
from tests.redis_local import RedisServer, wait_for

from .conftest import key_of, payload_of

SIZE = 4096
NS = bytes(range(16))
_C = TypeVar("_C")


class FaultProxy:
    """Forwards to a server; replies (server to client) depend on `mode`, switchable live:
    forward | blackhole (read and drop them) | drip (`piece` bytes every `gap_s`)."""

    def __init__(self, port: int, unix: bool, piece: int = 64, gap_s: float = 0.02) -> None:
        self.port, self.mode, self.piece, self.gap_s = port, "forward", piece, gap_s
        self.accepted = self.gets_dropped = 0
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self._dir = tempfile.mkdtemp(prefix="kvp", dir="/tmp")  # short: a socket path <= 107
        path = os.path.join(self._dir, "p.sock")
        family, where = (socket.AF_UNIX, path) if unix else (socket.AF_INET, ("127.0.0.1", 0))
        self._lsn = socket.create_server(where, family=family, backlog=128)  # type: ignore[arg-type]
        addr = self._lsn.getsockname()
        self.url = f"unix://{path}" if unix else f"redis://127.0.0.1:{addr[1]}/0"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._lsn.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.port))
            self._socks += [client, server]
            self.accepted += 1
            for src, dst, down in ((client, server, False), (server, client, True)):
                threading.Thread(target=self._pump, args=(src, dst, down), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, down: bool) -> None:
        try:
            while data := src.recv(65536):
                mode = self.mode
                if not down:
                    if mode == "blackhole":
                        # reads: GET, or GETRANGE (read_into's bounded read)
                        self.gets_dropped += data.count(b"$3\r\nGET\r\n") + data.count(
                            b"$8\r\nGETRANGE\r\n"
                        )
                    dst.sendall(data)
                elif mode == "forward":
                    dst.sendall(data)
                elif mode == "drip":
                    for i in range(0, len(data), self.piece):
                        if self._stop.wait(self.gap_s):
                            return
                        dst.sendall(data[i : i + self.piece])
        except OSError:
            pass  # either side went away
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)  # wakes the other direction's pump

    def close(self) -> None:
        self._stop.set()
        self._lsn.close()
        for s in self._socks:
            s.close()
        shutil.rmtree(self._dir, ignore_errors=True)


@pytest.fixture(scope="module")
def srv() -> Iterator[RedisServer]:
    with RedisServer() as s:
        yield s


@pytest.fixture
def store(srv: RedisServer) -> RedisServer:
    srv.flushall()
    return srv


@pytest.fixture
def closing() -> Iterator[Callable[[_C], _C]]:
    """Registers servers, proxies, tiers, clients, callables to end after the test, last first."""
    made: list[object] = []
    yield lambda thing: made.append(thing) or thing  # type: ignore[func-returns-value]
    for thing in reversed(made):  # a server stops, a proxy, tier or client closes
        (getattr(thing, "stop", None) or getattr(thing, "close", None) or thing)()


def _tier(url: str, m: Metrics, failures: int = 100, probe_s: float = 0.2, **kw: object
          ) -> RemoteTier:  # fmt: skip
    return RemoteTier(url, NS, m, codec=codec_for_tests(NS), payload_bytes=SIZE,
                      breakers=ShardBreakers(failures, probe_s), **kw)  # type: ignore[arg-type]  # fmt: skip


def _fill(tier: RemoteTier, n: int) -> None:
    for i in range(n):
        assert tier.put(key_of(i), payload_of(i, SIZE))


def _ok(tier: RemoteTier, i: int) -> bool:
    got = tier.get(key_of(i))
    return got is not None and bytes(got) == payload_of(i, SIZE)


def _run(fn: Callable[[int], object], n: int, join_s: float) -> list[threading.Thread]:
    threads = [threading.Thread(target=fn, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads if join_s else ():
        t.join(join_s)
    return threads


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith(field))


def _failures(m: Metrics, *reasons: str) -> float:
    return sum(m.value("store_failures_total", tier="remote", reason=r) for r in reasons)


@pytest.mark.parametrize("unix", [False, True], ids=["tcp", "unix"])
def test_reply_dripping_byte_by_byte_is_cut_at_the_read_timeout(
    store: RedisServer, closing: Callable, unix: bool
) -> None:
    """Each piece arrives well inside the 100 ms timeout; the whole record takes ~1.4 s."""
    proxy = closing(FaultProxy(store.port, unix))
    m = Metrics(rank=0)
    tier = closing(_tier(proxy.url, m, timeout_ms=100))
    _fill(tier, 1)
    proxy.mode = "drip"
    t0 = time.monotonic()
    got = tier.get(key_of(0))
    elapsed = time.monotonic() - t0
    assert elapsed < tier.timeouts.read_s + 0.5, f"a 100 ms read took {elapsed:.2f} s"
    assert got is None and _failures(m, "read_timeout") == 1


@pytest.mark.parametrize("unix", [False, True], ids=["tcp", "unix"])
def test_close_with_reads_in_flight_returns_and_every_read_is_a_miss(
    store: RedisServer, closing: Callable, unix: bool
) -> None:
    proxy = closing(FaultProxy(store.port, unix))
    tier = closing(_tier(proxy.url, Metrics(rank=0), timeout_ms=3000))
    _fill(tier, 1)
    proxy.mode = "blackhole"
    accepted = proxy.accepted
    results: list[object] = []

    def read(_: int) -> None:
        try:
            results.append(tier.read_into(key_of(0), torch.zeros(SIZE, dtype=torch.uint8)))
        except BaseException as e:  # noqa: BLE001 - asserted below
            results.append(e)

    readers = _run(read, 8, 0)
    # every read is on the wire: its GET dropped by the proxy, or its connection opened
    wait_for(lambda: proxy.gets_dropped + proxy.accepted - accepted >= 8, 10, "8 reads sent")
    t0 = time.monotonic()
    tier.close()
    assert time.monotonic() - t0 < 1.0
    for t in readers:
        t.join(3.0 + 5.0)
    assert not any(t.is_alive() for t in readers)
    assert results == [False] * 8, f"in-flight reads at close() gave {results!r}"


def _desynced(store: RedisServer, closing: Callable, m: Metrics, n: int, **kw: object
              ) -> RemoteTier:  # fmt: skip
    """A tier (glide, TCP) whose connection lost the reply to one GET: the proxy in front of
    the store dropped it (a middlebox failing over, a store shedding what it held)."""
    proxy = closing(FaultProxy(store.port, unix=False))
    tier = closing(_tier(proxy.url, m, timeout_ms=300, **kw))
    _fill(tier, n)
    proxy.mode = "blackhole"
    assert tier.get(key_of(0)) is None
    proxy.mode = "forward"
    return tier


def test_store_that_lost_a_reply_is_found_again_by_the_breaker(
    store: RedisServer, closing: Callable
) -> None:
    tier = _desynced(store, closing, Metrics(rank=0), 4, failures=3, probe_s=0.2)
    # the store answers every request from now on: a probe must find it within seconds
    wait_for(lambda: _ok(tier, 1), 5.0, "the remote tier serving again after one lost reply")
    assert tier.breaker.state is State.CLOSED


def test_mixed_up_replies_never_serve_nor_delete_valid_records(
    store: RedisServer, closing: Callable
) -> None:
    n, m = 48, Metrics(rank=0)
    tier = _desynced(store, closing, m, n, failures=1000, probe_s=5.0)
    wrong: list[int] = []
    start = threading.Barrier(16)

    def read(j: int) -> None:
        dst = torch.zeros(SIZE, dtype=torch.uint8)
        start.wait()
        for i in range(j, n, 16):
            if tier.read_into(key_of(i), dst) and bytes(dst.numpy()) != payload_of(i, SIZE):
                wrong.append(i)

    _run(read, 16, 30.0)
    assert not wrong
    left = closing(store.client()).dbsize()
    # every record in the store is valid: a read handed another key's reply must not delete
    # the record it asked for (from every engine sharing the store)
    assert left == n, f"{n - left} valid records deleted ({m.total('verify_failures_total')})"


@pytest.mark.parametrize("unix", [False, True], ids=["tcp", "unix"])
def test_huge_value_at_a_key_is_a_counted_miss_read_within_a_memory_bound(
    closing: Callable, unix: bool
) -> None:
    s = closing(RedisServer(unix=unix).start())
    m = Metrics(rank=0)
    tier = closing(_tier(s.url, m, timeout_ms=5000))
    closing(s.client(timeout_s=30.0)).set(tier.redis_key(key_of(0)), bytes(96 << 20))
    dst = torch.full((SIZE,), 7, dtype=torch.uint8)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _status("VmRSS:")
    assert not tier.read_into(key_of(0), dst)
    grew = (_status("VmHWM:") - before) >> 10  # MiB
    assert bool((dst == 7).all()) and m.total("verify_failures_total") == 1
    assert m.total("store_failures_total") == 0 and tier.breaker.state is State.CLOSED
    # a 4 KiB record's read may not cost the 96 MiB someone left under its key
    assert grew < 16, f"reading one {SIZE}-byte record took {grew} MiB"


@pytest.mark.parametrize("unix", [False, True], ids=["tcp", "unix"])
def test_hung_store_with_many_readers_bounded_then_breaker_closes(
    closing: Callable, unix: bool
) -> None:
    s = closing(RedisServer(unix=unix).start())
    tier = closing(_tier(s.url, Metrics(rank=0), failures=5, probe_s=0.3, timeout_ms=100))
    _fill(tier, 4)
    base = _status("Threads:")
    times: list[float] = []

    def read(i: int) -> None:
        t0 = time.monotonic()
        if not tier.read_into(key_of(i % 4), torch.zeros(SIZE, dtype=torch.uint8)):
            times.append(time.monotonic() - t0)

    with s.paused():  # accepts connections (the kernel does), answers nothing
        readers = _run(read, 48, 0)
        during = _status("Threads:")
        for t in readers:
            t.join(10.0)
        assert len(times) == 48 and max(times) < 1.5, f"misses {len(times)}/48, {max(times)} s"
        assert during <= base + 48 + 4 and _status("Threads:") <= base + 4  # no thread per call
        assert tier.breaker.state is State.OPEN
    wait_for(lambda: _ok(tier, 1), 8.0, "the breaker closing once the store answers")
    assert tier.breaker.state is State.CLOSED


def test_restart_while_in_use_reconnects_without_a_storm(closing: Callable) -> None:
    s = closing(RedisServer().start())
    m = Metrics(rank=0)
    tier = closing(_tier(s.url, m, failures=3, probe_s=0.2))
    _fill(tier, 1)
    stop = threading.Event()
    closing(stop.set)

    def hammer(j: int) -> None:
        while not stop.is_set():
            tier.get(key_of(j))
            tier.contains_many([key_of(j)])

    readers = _run(hammer, 6, 0)
    s.kill()
    wait_for(lambda: tier.breaker.state is State.OPEN, 10.0, "the breaker opening")
    s.start()  # same port, empty
    wait_for(lambda: tier.put(key_of(0), payload_of(0, SIZE)) and _ok(tier, 0), 10.0,
             "hits again after the restart")  # fmt: skip
    stop.set()
    for t in readers:
        t.join(5.0)
    assert not any(t.is_alive() for t in readers), "a call stuck across the restart"
    conns = closing(s.client()).info("stats")["total_connections_received"]
    assert conns <= 12, f"{conns} connections to the restarted server"
    # open: calls are skipped, so failures stay far below the calls made
    assert 0 < _failures(m, "read_timeout", "read_connection") < 200


def test_full_store_refuses_writes_counted_and_keeps_serving_reads(
    store: RedisServer, closing: Callable
) -> None:
    m = Metrics(rank=0)
    tier = closing(_tier(store.url, m, failures=2))
    admin = closing(store.client())
    _fill(tier, 4)
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", 1)
    closing(lambda: admin.config_set("maxmemory", 0))
    assert not any(tier.put(key_of(10 + i), payload_of(10 + i, SIZE)) for i in range(4))
    assert _failures(m, "oom") == 4
    dst = torch.zeros(SIZE, dtype=torch.uint8)
    assert tier.read_into(key_of(2), dst) and bytes(dst.numpy()) == payload_of(2, SIZE)
    got = tier.get_many([key_of(i) for i in range(4)])
    assert [bytes(g or b"") for g in got] == [payload_of(i, SIZE) for i in range(4)]
    assert tier.lookup_prefix([key_of(i) for i in range(5)]) == 4
    assert tier.breaker.state is State.CLOSED


@pytest.mark.parametrize("unix", [False, True], ids=["tcp", "unix"])
def test_a_bad_record_is_deleted_only_while_the_store_still_holds_those_bytes(
    closing: Callable, unix: bool
) -> None:
    """After the fix of the mixed-up replies: the delete that follows a failed verification
    is a compare-and-delete on the server (`delete_if`, both transports): the bad bytes go, a
    valid record written in their place since stays."""
    s = closing(RedisServer(unix=unix).start())
    tier = closing(_tier(s.url, Metrics(rank=0)))
    admin = closing(s.client())
    _fill(tier, 2)
    bad, good = (tier.redis_key(key_of(i)) for i in range(2))
    raw = bytearray(admin.get(bad))
    raw[-1] ^= 0xFF
    admin.set(bad, bytes(raw))
    assert tier.get(key_of(0)) is None and admin.exists(bad) == 0
    # the store's value changed between the read and the delete: it is not the one found bad
    assert not tier._transport.delete_if(good, b"0" * 40)
    assert admin.exists(good) == 1


def test_a_unix_socket_stores_timeout_warning_names_no_line_its_library_never_prints(
    store: RedisServer, closing: Callable, caplog: pytest.LogCaptureFixture
) -> None:
    """The timeout warning told of glide's raw stderr line for a unix-socket store too, whose
    client (redis-py) prints none."""
    proxy = closing(FaultProxy(store.port, unix=True))
    tier = closing(_tier(proxy.url, Metrics(rank=0), timeout_ms=100))
    _fill(tier, 1)
    proxy.mode = "blackhole"
    caplog.set_level("WARNING", logger="kvtier")
    assert not tier.read_into(key_of(0), torch.zeros(SIZE, dtype=torch.uint8))
    said = [r.getMessage() for r in caplog.records if "read timed out" in r.getMessage()]
    assert len(said) == 1 and "on stderr" not in said[0], said


@pytest.mark.parametrize("replace", ["reconnect", "close"])
def test_clients_replaced_or_closed_mid_call_close_after_the_call_returns(
    store: RedisServer, closing: Callable, monkeypatch: pytest.MonkeyPatch, replace: str
) -> None:
    """glide_sync's close() frees its native client at once: a call another thread had begun
    then ran on freed memory (a double free aborted a pytest worker, 16 readers and a
    reconnect). The client a call is inside closes when that call returns, not before."""
    m = Metrics(rank=0)
    tier = closing(_tier(store.url, m))
    _fill(tier, 1)
    transport = tier._transport
    client = transport._reader.client  # type: ignore[attr-defined]
    inside, release = threading.Event(), threading.Event()
    closed: list[bool] = []
    real_call, real_close = client._execute_command, client.close

    def call(*a: object, **kw: object) -> object:
        inside.set()  # the pointer is read; the native call is about to be made
        release.wait(10.0)
        return real_call(*a, **kw)

    monkeypatch.setattr(client, "_execute_command", call)
    monkeypatch.setattr(client, "close", lambda: closed.append(True) or real_close())
    dst = torch.zeros(SIZE, dtype=torch.uint8)
    got: list[bool] = []
    reader = _run(lambda _: got.append(tier.read_into(key_of(0), dst)), 1, 0)[0]
    assert inside.wait(10.0)
    getattr(transport, replace)()
    assert not closed, "the client was closed with a call inside it"
    release.set()
    reader.join(10.0)
    assert got == [True] and bytes(dst.numpy()) == payload_of(0, SIZE)
    assert closed == [True]  # closed once, by the call that left it last
    if replace == "reconnect":
        assert _ok(tier, 0)  # the fresh clients serve


def test_a_call_that_finds_its_client_replaced_takes_the_new_one_uncounted(
    store: RedisServer, closing: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reconnect (a verify failure on another thread) swaps the clients between a call
    picking its client and entering it: that call is no store failure (16 readers each
    counting one would open a breaker over a store that answers)."""
    m = Metrics(rank=0)
    tier = closing(_tier(store.url, m, failures=1))
    _fill(tier, 1)
    transport = tier._transport
    old = transport._reader  # type: ignore[attr-defined]
    real_enter = old.enter

    def enter() -> bool:
        transport.reconnect()  # another thread's, landing in between
        return real_enter()

    monkeypatch.setattr(old, "enter", enter)
    dst = torch.zeros(SIZE, dtype=torch.uint8)
    assert tier.read_into(key_of(0), dst) and bytes(dst.numpy()) == payload_of(0, SIZE)
    assert transport._reader is not old  # type: ignore[attr-defined]
    assert m.total("store_failures_total") == 0 and tier.breaker.state is State.CLOSED


@pytest.mark.parametrize("unix", [False, True], ids=["tcp", "unix"])
def test_records_planted_under_other_keys_cost_no_connection_storm(
    closing: Callable,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    unix: bool,
) -> None:
    """A read that gets another key's record replaces the connections (a reply out of step is
    fixed so). Another writer of the store (untrusted) planting such copies made every read
    open new connections: two per read, a storm of sockets on the host. At most one
    replacement per second; every planted copy is still a counted miss, never served."""
    s = closing(RedisServer(unix=unix).start())
    m = Metrics(rank=0)
    tier = closing(_tier(s.url, m))
    _fill(tier, 1)
    admin = closing(s.client())
    valid = admin.get(tier.redis_key(key_of(0)))
    n = 40
    for i in range(1, n + 1):
        admin.set(tier.redis_key(key_of(i)), valid)  # chunk 0's record under chunk i's key
    replaced: list[float] = []
    real = tier._transport.reconnect
    monkeypatch.setattr(tier._transport, "reconnect", lambda: replaced.append(1) or real())
    dst = torch.zeros(SIZE, dtype=torch.uint8)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        assert not any(tier.read_into(key_of(i), dst) for i in range(1, n + 1))
    elapsed = time.monotonic() - t0
    assert m.total("verify_failures_total") == n
    assert len(replaced) <= 1 + int(elapsed), f"{len(replaced)} replacements for {n} reads"
    # nor a line each: the counter carries the rate
    lines = [r for r in caplog.records if "failed verification" in r.getMessage()]
    assert len(lines) <= 1 + int(elapsed / 60), f"{len(lines)} log lines for {n} reads"
    assert _ok(tier, 0)  # the valid record stays and serves


def test_replaced_clients_are_freed(store: RedisServer, closing: Callable) -> None:
    """glide_sync's create() registered an at-fork handler per client that held it for good: 6
    KiB per reconnect, one with every breaker probe of a store that is down (a week of it:
    about 700 MB). Replaced clients must be collected."""
    import gc
    import weakref

    tier = closing(_tier(store.url, Metrics(rank=0)))
    _fill(tier, 1)
    transport = tier._transport
    old = []
    for _ in range(20):
        old += [weakref.ref(h.client) for h in (transport._presence, transport._reader,
                                                 transport._writer)]  # fmt: skip
        transport.reconnect()
        assert _ok(tier, 0)
    gc.collect()
    alive = sum(r() is not None for r in old)
    assert alive == 0, f"{alive} of {len(old)} replaced glide clients never freed"


def test_a_forked_child_reads_through_the_parents_tier(store: RedisServer) -> None:
    """With glide's own per-client fork handler gone, the one kvtier registers reconnects each
    live client in a forked child (a child inheriting a client without its runtime hangs)."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        f"""
        import os, sys, torch
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from kvtier.metrics import Metrics
        from tests.store.test_remote_review import _tier, _fill, _ok
        tier = _tier({store.url!r}, Metrics(rank=0))
        _fill(tier, 1)
        pid = os.fork()
        if pid == 0:
            os._exit(0 if _ok(tier, 0) else 3)
        _, status = os.waitpid(pid, 0)
        print("child exit", os.waitstatus_to_exitcode(status), "parent", _ok(tier, 0), flush=True)
        os._exit(0)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert "child exit 0 parent True" in done.stdout, done.stdout + done.stderr[-2000:]
