"""kvtier.lookup: all-rank minimum, leases, deadlines, stale replies, hostile frames, endpoints."""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import shutil
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from kvtier.errors import ConfigError, StartupError, TopologyError
from kvtier.lookup import (
    PROTOCOL_VERSION,
    Codec,
    LookupClient,
    LookupReply,
    LookupRequest,
    LookupServer,
    Ping,
    Pong,
    ReleaseRequest,
    endpoint_for,
    engine_key,
    format_client_line,
    make_run_dir,
)
from kvtier.lookup.auth import REQUESTS, FrameMac
from kvtier.lookup.result import merged_runs
from kvtier.metrics import Metrics
from kvtier.store.registry import order
from kvtier.store.stack import LookupRun
from tests.lookup_helpers import FakeBackend, make_keys, recv_signed, run_fake_server, signed

CHUNK = 16
HELD = {0: 8, 1: 3, 2: 6, 3: 5}  # leading chunks each rank's backend holds

TIER_ORDER = order()  # the registry's tier names, accelerator outwards


@pytest.fixture
def run_dir() -> Iterator[Path]:
    d = make_run_dir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


class EventLog:
    """Everything the subprocess backends reported, pulled from their queue on demand."""

    def __init__(self, q: Any) -> None:
        self.q = q
        self.seen: list[tuple[Any, ...]] = []

    def wait(self, pred: Callable[[list[tuple[Any, ...]]], bool], timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not pred(self.seen):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"condition not met within {timeout_s}s; seen {self.seen}")
            try:
                self.seen.append(self.q.get(timeout=left))
            except queue.Empty:
                continue

    def of(self, kind: str, lookup_id: str) -> dict[int, tuple[Any, ...]]:
        return {e[1]: e for e in self.seen if e[0] == kind and e[2] == lookup_id}


class Cluster:
    """Four rank servers in four spawned processes, each with a FakeBackend."""

    def __init__(self) -> None:
        self.ctx = multiprocessing.get_context("spawn")
        self.dir = make_run_dir()
        self.endpoints = {r: endpoint_for(r, run_dir=self.dir) for r in HELD}
        self.events = EventLog(self.ctx.Queue())
        self.stops: dict[int, Any] = {}
        self.procs: dict[int, Any] = {}
        for r in HELD:
            self.start(r)

    def start(self, rank: int) -> None:
        # A fresh stop event per process: a process killed while waiting on an event leaves
        # it with a sleeper that never wakes, and setting that event would block forever.
        self.stops[rank] = self.ctx.Event()
        p = self.ctx.Process(
            target=run_fake_server,
            args=(rank, self.endpoints[rank], HELD[rank], self.events.q, self.stops[rank]),
            daemon=True,
        )
        p.start()
        self.procs[rank] = p

    def close(self) -> None:
        for r, p in self.procs.items():
            # a terminated rank's event has that sleeper: setting it would hang this teardown
            # (a test that failed before restarting the rank held its worker 300 s)
            if p.is_alive():
                self.stops[r].set()
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    yield c
    c.close()


@pytest.fixture
def client(cluster: Cluster) -> Iterator[tuple[LookupClient, Metrics]]:
    m = Metrics(0)
    # exact per-rank counts below: on 2 oversubscribed cores a spawned rank can miss 300 ms
    c = LookupClient(
        cluster.endpoints, m, chunk_size=CHUNK, world=4, timeout_ms=2000, tier_order=TIER_ORDER
    )
    c.wait_ready(30.0)
    yield c, m
    c.close()


# -- all ranks, four processes --------------------------------------------------------------


def test_minimum_over_four_processes_leases_and_releases_on_every_rank(
    cluster: Cluster, client: tuple[LookupClient, Metrics]
) -> None:
    c, m = client
    keys = make_keys(10)
    res = c.lookup(keys, "req-1")
    assert res.per_rank == HELD
    assert (res.hit_chunks, res.hit_tokens, res.limiting_rank) == (3, 3 * CHUNK, 1)
    assert res.timed_out == () and res.errors == {}
    assert m.value("lookup_hit_tokens_total") == 3 * CHUNK
    assert m.value("lookup_seconds_count") == 1

    # Every rank leased what it counted, under the lookup id.
    cluster.events.wait(lambda s: len(cluster.events.of("lease", "req-1")) == 4)
    leases = cluster.events.of("lease", "req-1")
    assert {r: e[3] for r, e in leases.items()} == HELD

    c.release(["req-1"])
    cluster.events.wait(lambda s: len(cluster.events.of("release", "req-1")) == 4)
    assert sorted(cluster.events.of("release", "req-1")) == [0, 1, 2, 3]

    # A prompt every rank holds whole has no limiting rank.
    full = c.lookup(keys[:3], "req-2", lease=False)
    assert (full.hit_chunks, full.limiting_rank) == (3, None)
    # lease=False leases nothing: the next leasing lookup's events arrive after its would-be
    # events on each rank (one ordered queue per process), and there are none.
    c.lookup(keys, "req-3")
    cluster.events.wait(lambda s: len(cluster.events.of("lease", "req-3")) == 4)
    assert cluster.events.of("lease", "req-2") == {}
    c.release(["req-3"])

    stats = c.server_stats(2000)
    assert all(p is not None and p.rank == r for r, p in stats.items())
    cluster.events.wait(lambda s: len(cluster.events.of("release", "req-3")) == 4)


def test_killed_rank_counts_zero_within_deadline_then_recovers_after_restart(
    cluster: Cluster, client: tuple[LookupClient, Metrics]
) -> None:
    c, m = client
    keys = make_keys(10)
    before = m.value("lookup_timeouts_total", target="2")
    cluster.procs[2].terminate()
    cluster.procs[2].join(10)
    assert not cluster.procs[2].is_alive()

    # long enough for the live ranks of a loaded host to answer; the dead one never holds the
    # lookup past it
    timeout_ms = 1000
    t0 = time.perf_counter()
    res = c.lookup(keys, "dead-1", timeout_ms=timeout_ms)
    elapsed = time.perf_counter() - t0
    assert elapsed < timeout_ms / 1000 + 0.5, elapsed
    assert res.timed_out == (2,)
    assert res.per_rank == {**HELD, 2: 0}
    assert (res.hit_chunks, res.limiting_rank) == (0, 2)
    assert m.value("lookup_timeouts_total", target="2") == before + 1
    assert m.value("lookup_timeouts_total", target="1") == 0
    c.release(["dead-1"])  # never raises for the dead rank

    cluster.start(2)  # same endpoint, new process
    c.wait_ready(30.0)
    res = c.lookup(keys, "alive-again")
    assert res.per_rank == HELD
    assert (res.hit_chunks, res.limiting_rank, res.timed_out) == (3, 1, ())
    cluster.events.wait(lambda s: 2 in cluster.events.of("lease", "alive-again"))
    c.release(["alive-again"])


# -- in-process servers ---------------------------------------------------------------------


def _servers(
    run_dir: Path, backends: dict[int, FakeBackend], **kw: Any
) -> tuple[dict[int, LookupServer], dict[int, str]]:
    eps = {r: endpoint_for(r, run_dir=run_dir) for r in backends}
    servers = {r: LookupServer(r, b, eps[r], Metrics(r), **kw).start() for r, b in backends.items()}
    return servers, eps


def test_slow_rank_late_reply_is_never_used_for_a_later_lookup(run_dir: Path) -> None:
    keys = make_keys(8)
    gate = threading.Event()
    slow = FakeBackend(1, keys[:6], gate=gate)
    servers, eps = _servers(run_dir, {0: FakeBackend(0, keys), 1: slow})
    m = Metrics(0)
    c = LookupClient(eps, m, chunk_size=CHUNK, world=2, timeout_ms=300, tier_order=TIER_ORDER)
    try:
        c.wait_ready(10.0)
        gate.clear()
        first = c.lookup(keys, "seq-7")
        assert first.timed_out == (1,)
        assert first.per_rank == {0: 8, 1: 0}
        assert m.value("lookup_timeouts_total", target="1") == 1

        # Rank 1 evicts; its late answer to the first lookup (6) is now wrong. The next lookup
        # reuses the lookup id, so only the request number tells the two answers apart.
        slow.held = set(keys[:2])
        gate.set()
        second = c.lookup(keys, "seq-7")
        assert second.per_rank == {0: 8, 1: 2}
        assert (second.hit_chunks, second.limiting_rank, second.timed_out) == (2, 1, ())
        assert c.stale_replies == 1
        assert m.value("lookup_timeouts_total", target="1") == 1
    finally:
        gate.set()
        c.close()
        for s in servers.values():
            s.close()


def test_a_rank_slower_than_the_first_probe_is_found_ready(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank whose every frame takes 0.2 s (a starved host) answers each 50 ms probe too late,
    and each unanswered probe queues one more frame ahead of the next: the probes must widen,
    or a live rank is refused at startup as silent."""
    handle = LookupServer._handle

    def slow(self: LookupServer, *args: Any) -> None:
        time.sleep(0.2)  # the rank's own slowness, not a wait for another thread
        handle(self, *args)

    monkeypatch.setattr(LookupServer, "_handle", slow)
    servers, eps = _servers(run_dir, {0: FakeBackend(0, make_keys(2))})
    c = LookupClient(eps, Metrics(0), chunk_size=CHUNK, world=1, tier_order=TIER_ORDER)
    try:
        t0 = time.perf_counter()
        c.wait_ready(10.0)
        assert time.perf_counter() - t0 < 5.0
    finally:
        c.close()
        servers[0].close()


def test_a_lookup_in_flight_never_blocks_its_caller_past_the_wait(run_dir: Path) -> None:
    """`begin` + `poll(wait_ms)`: the scheduler is blocked for at most the wait, the answer is
    collected by a later poll, and two lookups in flight each get their own replies."""
    keys = make_keys(8)
    gate = threading.Event()
    slow = FakeBackend(1, keys[:6], gate=gate)
    servers, eps = _servers(run_dir, {0: FakeBackend(0, keys), 1: slow})
    m = Metrics(0)
    c = LookupClient(eps, m, chunk_size=CHUNK, world=2, timeout_ms=5000, tier_order=TIER_ORDER)
    try:
        c.wait_ready(10.0)
        gate.clear()
        a = c.begin(keys, "a")
        b = c.begin(keys[:3], "b")
        t0 = time.perf_counter()
        assert c.poll(a, wait_ms=20) is None
        assert time.perf_counter() - t0 < 1.0  # the wait, not the 5 s deadline
        gate.set()
        got_b = c.poll(b, wait_ms=5000)
        got_a = c.poll(a, wait_ms=5000)
        assert got_a is not None and got_b is not None
        assert got_a.per_rank == {0: 8, 1: 6} and got_a.timed_out == ()
        assert got_b.per_rank == {0: 3, 1: 3}
        assert c.poll(a) is got_a  # settled once
        assert m.value("lookup_timeouts_total", target="1") == 0
        assert slow.leases == {"a": 6, "b": 3}
    finally:
        gate.set()
        c.close()
        for s in servers.values():
            s.close()


def _raw_reply(sock: zmq.Socket, key: bytes) -> LookupReply | Pong:
    msg = Codec().decode(recv_signed(sock, key))
    assert isinstance(msg, LookupReply | Pong)
    return msg


def test_malformed_frames_are_rejected_counted_and_the_server_keeps_serving(
    run_dir: Path,
) -> None:
    keys = make_keys(4)
    servers, eps = _servers(run_dir, {0: FakeBackend(0, keys[:3])}, max_frame_bytes=4096)
    server = servers[0]
    sm = server._m
    key = engine_key(run_dir)
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(eps[0])
    enc = msgspec.msgpack.encode
    k = keys[0]
    ping = enc(Ping(PROTOCOL_VERSION, 1))
    # bodies under the engine's MAC that are no message this server takes: answered with an
    # error reply naming why (a client of the engine with a bug, or of another version)
    hostile: list[tuple[str, bytes]] = [
        ("garbage", b"\xc1" + os.urandom(64)),
        ("version", enc(["lookup", 2, "id", 1, [k], True])),
        ("version", enc(["lookup", 2, "id", 1, [k], True, "new-field"])),
        ("schema", enc(["lookup", 1, "id", 1, "not-a-list", True])),
        ("schema", enc(["lookup", 1, "id", 1, [b"short-key"], True])),
        # a hybrid model's end keys (LookupRequest.ends): 16-byte keys in a list, or nothing
        ("schema", enc(["lookup", 1, "id", 1, [k], True, [b"short-key"]])),
        ("schema", enc(["lookup", 1, "id", 1, [k], True, "not-a-list"])),
        ("schema", enc({"lookup_id": "id"})),
        ("unexpected", enc(Pong(PROTOCOL_VERSION, 1, 0, 0, 0, 0))),
    ]
    # messages refused before their body is read: counted, never answered
    refused: list[tuple[str, list[bytes]]] = [
        ("oversized", signed(key, b"\x00" * 4097)),
        ("frames", [*signed(key, ping), b"extra"]),
        ("frames", [b"a", b"b", b"c", b"d"]),
        # the framing before one frame: a multipart message, whatever it carries
        ("frames", [FrameMac(key, REQUESTS, 0).of(ping), ping]),
        ("auth", [ping]),
        ("auth", [b"short"]),
        ("auth", [os.urandom(32) + ping]),
    ]
    m = Metrics(0)
    c = LookupClient(eps, m, chunk_size=CHUNK, world=1, timeout_ms=2000, tier_order=TIER_ORDER)
    try:
        c.wait_ready(10.0)
        for reason, body in hostile:
            raw.send_multipart(signed(key, body))
            reply = _raw_reply(raw, key)
            assert isinstance(reply, LookupReply)
            assert reply.error is not None and reply.error.startswith(f"rejected: {reason}")
            assert (reply.rank, reply.hit_chunks) == (0, 0)
            # ... and a well-formed lookup right after is answered correctly.
            res = c.lookup(keys, f"after-{reason}")
            assert (res.hit_chunks, res.timed_out) == (3, ())
        for nonce, (reason, frames) in enumerate(refused, start=100):
            raw.send_multipart(frames)
            # one connection's messages are handled in order: the first answer this socket
            # gets is the one to its next ping, so the refused message got none
            raw.send_multipart(signed(key, enc(Ping(PROTOCOL_VERSION, nonce))))
            pong = _raw_reply(raw, key)
            assert isinstance(pong, Pong) and pong.nonce == nonce, (reason, pong)
        every = [r for r, _ in hostile] + [r for r, _ in refused]
        for reason in set(every):
            assert sm.value("rejected_frames_total", reason=reason) == every.count(reason), reason
        stats = c.server_stats(2000)[0]
        assert stats is not None
        assert (stats.rejected, stats.served) == (len(every), len(hostile))
    finally:
        raw.close()
        c.close()
        server.close()


def test_backend_error_is_an_error_reply_not_a_timeout(run_dir: Path) -> None:
    keys = make_keys(4)
    servers, eps = _servers(run_dir, {0: FakeBackend(0, keys), 1: FakeBackend(1, keys, fail=True)})
    m = Metrics(0)
    c = LookupClient(eps, m, chunk_size=CHUNK, world=2, timeout_ms=2000, tier_order=TIER_ORDER)
    try:
        c.wait_ready(10.0)
        res = c.lookup(keys, "boom")
        assert res.per_rank == {0: 4, 1: 0}
        assert res.timed_out == () and res.limiting_rank == 1
        assert "OSError: disk on fire" in res.errors[1]
        servers[1]._backend.fail = False  # type: ignore[attr-defined]
        assert c.lookup(keys, "fine").hit_chunks == 4
    finally:
        c.close()
        for s in servers.values():
            s.close()


class _TieredBackend(FakeBackend):
    """A rank whose chunks sit in named tiers: `lookup_run` says each run's tier."""

    def __init__(self, rank: int, keys: Sequence[bytes], tiers: str) -> None:
        super().__init__(rank, keys)
        self.tiers = tiers  # one letter per key: m(emory), d(isk), r(emote)

    def lookup_run(self, keys: Sequence[bytes], lease_id: str | None) -> Any:
        names = {"m": "memory", "d": "disk", "r": "remote"}
        n = self.lookup(keys, lease_id)
        runs: list[tuple[str, int]] = []
        for letter in self.tiers[:n]:
            if runs and runs[-1][0] == names[letter]:
                runs[-1] = (names[letter], runs[-1][1] + 1)
            else:
                runs.append((names[letter], 1))
        return LookupRun(n, runs[-1][0] if runs else "", tuple(runs))


def test_the_answer_carries_each_chunks_tier_the_slowest_rank_deciding(run_dir: Path) -> None:
    """Every rank reads its part of a chunk: the chunk comes at the deepest tier any rank
    serves it from, so a load-or-recompute choice reads the tail at the store's speed."""
    keys = make_keys(5)
    servers, eps = _servers(
        run_dir,
        {0: _TieredBackend(0, keys, "mmmmd"), 1: _TieredBackend(1, keys[:4], "mmrm")},
    )
    c = LookupClient(
        eps, Metrics(0), chunk_size=CHUNK, world=2, timeout_ms=2000, tier_order=TIER_ORDER
    )
    try:
        c.wait_ready(10.0)
        res = c.lookup(keys, "tiers")
        assert res.hit_chunks == 4
        assert res.runs == (("memory", 2), ("remote", 1), ("memory", 1))
        assert res.tier == "remote"
    finally:
        c.close()
        for s in servers.values():
            s.close()


def test_merged_runs_are_empty_when_a_rank_said_none() -> None:
    # an older rank: the deepest tier only
    assert merged_runs([(("memory", 3),), ()], 2, TIER_ORDER) == ()
    assert merged_runs([(("memory", 1), ("disk", 2))], 2, TIER_ORDER) == (
        ("memory", 1),
        ("disk", 1),
    )


def test_endpoint_served_by_another_rank_is_detected(run_dir: Path) -> None:
    keys = make_keys(4)
    servers, eps = _servers(run_dir, {0: FakeBackend(0, keys)})
    m = Metrics(0)
    # Both ranks point at rank 0's socket: the shared-socket failure across replicas.
    c = LookupClient(
        {0: eps[0], 1: eps[0]}, m, chunk_size=CHUNK, world=2, timeout_ms=1000, tier_order=TIER_ORDER
    )
    try:
        assert c.wait_connected(10.0) == []
        assert c.ping(2000) == {0: True, 1: False}
        res = c.lookup(keys, "shared")
        assert res.per_rank == {0: 4, 1: 0}
        # frames for rank 1 carry rank 1's MAC: rank 0 refuses them (counted, never answered)
        assert 1 in res.timed_out
        assert servers[0].rejected == 2  # rank 1's ping and lookup
    finally:
        c.close()
        servers[0].close()


def test_dead_rank_never_hangs_then_is_skipped_until_probed_and_recovers(run_dir: Path) -> None:
    eps = {0: endpoint_for(0, run_dir=run_dir)}
    keys = make_keys(2)
    m = Metrics(0)
    now = [0.0]
    c = LookupClient(
        eps,
        m,
        chunk_size=CHUNK,
        world=1,
        timeout_ms=100,
        miss_limit=2,
        probe_interval_s=10.0,
        clock=lambda: now[0],
        tier_order=TIER_ORDER,
    )
    try:
        for i in range(2):
            t0 = time.perf_counter()
            res = c.lookup(keys, f"nobody-{i}")
            assert time.perf_counter() - t0 < 0.1 + 0.5
            assert (res.hit_chunks, res.timed_out, res.limiting_rank) == (0, (0,), 0)
        # Two misses in a row: the rank is down and its socket was replaced.
        assert c.socket_resets[0] == 1
        c.release(["nobody-0", "nobody-1"])  # never raises
        assert c.dropped_releases[0] == 1
        with pytest.raises(StartupError, match=r"ranks \[0\] did not answer"):
            c.wait_ready(0.2)

        backend = FakeBackend(0, keys)
        with LookupServer(0, backend, eps[0], Metrics(0)):
            assert c.wait_connected(10.0) == []
            # Down and not yet due for a probe: skipped without being asked.
            res = c.lookup(keys, "skipped")
            assert (res.hit_chunks, res.timed_out) == (0, (0,))
            now[0] = 10.0  # probe due
            # the live server's answers get a loaded host's deadline, not the dead rank's 100 ms
            res = c.lookup(keys, "probe", timeout_ms=2000)
            assert (res.hit_chunks, res.timed_out) == (2, ())
            assert backend.lookups == 1  # only the probe reached the backend
            assert c.lookup(keys, "back", timeout_ms=2000).hit_chunks == 2
        assert m.value("lookup_timeouts_total", target="0") == 3
    finally:
        c.close()


def test_server_close_is_prompt_and_a_second_server_cannot_steal_a_live_endpoint(
    run_dir: Path,
) -> None:
    ep = endpoint_for(0, run_dir=run_dir)
    first = LookupServer(0, FakeBackend(0, []), ep, Metrics(0)).start()
    with pytest.raises(StartupError, match="already served by a live process"):
        LookupServer(0, FakeBackend(0, []), ep, Metrics(0)).start()
    t0 = time.perf_counter()
    first.close()
    assert time.perf_counter() - t0 < 0.5
    assert first._thread is not None and not first._thread.is_alive()
    # After close, the endpoint is free again.
    with LookupServer(0, FakeBackend(0, []), ep, Metrics(0)) as again:
        assert again.bound_endpoint == ep


def test_a_closed_server_has_let_go_of_its_ipc_endpoint_when_close_returns(
    run_dir: Path,
) -> None:
    # zmq closes a listener on its IO thread, after close() of the socket: a rank restarted at
    # once must find the endpoint free, never "already served by a live process"
    ep = endpoint_for(0, run_dir=run_dir)
    path = ep[len("ipc://") :]
    for _ in range(20):
        LookupServer(0, FakeBackend(0, []), ep, Metrics(0)).start().close()
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with pytest.raises((FileNotFoundError, ConnectionRefusedError)):
            probe.connect(path)
        probe.close()


# -- endpoints ------------------------------------------------------------------------------


def test_ipc_run_dir_is_private_0o700(run_dir: Path, tmp_path: Path) -> None:
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    assert run_dir.stat().st_uid == os.getuid()
    ep = endpoint_for(3, run_dir=run_dir)
    assert ep == f"ipc://{run_dir}/lookup-rank3.sock"
    with LookupServer(3, FakeBackend(3, []), ep, Metrics(3)):
        assert stat.S_ISSOCK(os.stat(run_dir / "lookup-rank3.sock").st_mode)

    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(ConfigError, match="mode 0o755"):
        endpoint_for(0, run_dir=shared)
    with pytest.raises(ConfigError, match="private directory"):
        LookupServer(0, FakeBackend(0, []), f"ipc://{shared}/x.sock", Metrics(0)).start()
    with pytest.raises(ConfigError, match="need run_dir"):
        endpoint_for(0)
    with pytest.raises(ConfigError, match="does not exist"):
        endpoint_for(0, run_dir=tmp_path / "missing")


def test_ipc_path_over_the_unix_socket_limit_is_a_clear_error(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 100)
    deep.mkdir(mode=0o700)
    with pytest.raises(ConfigError, match="107-byte limit"):
        endpoint_for(0, run_dir=deep)


def test_tcp_binds_loopback_only_unless_allowed(caplog: pytest.LogCaptureFixture) -> None:
    assert endpoint_for(2, transport="tcp", base_port=7000) == "tcp://127.0.0.1:7002"
    assert endpoint_for(0, transport="tcp", host="::1", base_port=7000) == "tcp://[::1]:7000"
    for host in ("0.0.0.0", "10.1.2.3", "example.org"):
        with pytest.raises(ConfigError, match="not a loopback address"):
            endpoint_for(0, transport="tcp", host=host, base_port=7000)
    with pytest.raises(ConfigError, match="not a loopback address"):
        LookupServer(0, FakeBackend(0, []), "tcp://0.0.0.0:7000", Metrics(0))
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        ep = endpoint_for(
            1, transport="tcp", host="0.0.0.0", base_port=7000, allow_remote_bind=True
        )
    assert ep == "tcp://0.0.0.0:7001"
    assert any(r.levelno == logging.WARNING and "0.0.0.0" in r.message for r in caplog.records)
    with pytest.raises(ConfigError, match="base_port"):
        endpoint_for(0, transport="tcp")
    with pytest.raises(ConfigError, match="transport='udp'"):
        endpoint_for(0, transport="udp")


def test_tcp_loopback_round_trip(run_dir: Path) -> None:
    keys = make_keys(3)
    key = engine_key(run_dir)
    ep = "tcp://127.0.0.1:*"
    server = LookupServer(0, FakeBackend(0, keys), ep, Metrics(0), key=key).start()
    c = LookupClient(
        {0: server.bound_endpoint},
        Metrics(0),
        chunk_size=CHUNK,
        world=1,
        key=key,
        tier_order=TIER_ORDER,
    )
    try:
        c.wait_ready(10.0)
        assert c.lookup(keys, "tcp").hit_tokens == 3 * CHUNK
    finally:
        c.close()
        server.close()


# -- client contract, wire ------------------------------------------------------------------


def test_startup_line_logged_once(caplog: pytest.LogCaptureFixture, run_dir: Path) -> None:
    assert format_client_line([3, 0, 2, 1], 4) == (
        "kvtier: lookup client on ranks [0, 1, 2, 3] (world=4)"
    )
    eps = {r: endpoint_for(r, run_dir=run_dir) for r in (1, 0)}
    with caplog.at_level(logging.INFO, logger="kvtier"):
        LookupClient(eps, Metrics(0), chunk_size=CHUNK, world=4, tier_order=TIER_ORDER).close()
    lines = [r.message for r in caplog.records if "lookup client on ranks" in r.message]
    assert lines == ["kvtier: lookup client on ranks [0, 1] (world=4)"]


def test_bad_client_input_raises_clear_errors(run_dir: Path) -> None:
    eps = {0: endpoint_for(0, run_dir=run_dir)}
    with pytest.raises(TopologyError, match=r"ranks \[4\] are outside \[0, world=4\)"):
        LookupClient({4: eps[0]}, Metrics(0), chunk_size=CHUNK, world=4, tier_order=TIER_ORDER)
    with pytest.raises(TopologyError, match="at least one rank"):
        LookupClient({}, Metrics(0), chunk_size=CHUNK, world=4, tier_order=TIER_ORDER)
    with pytest.raises(ConfigError, match="chunk_size=0"):
        LookupClient(eps, Metrics(0), chunk_size=0, world=1, tier_order=TIER_ORDER)
    with pytest.raises(ConfigError, match="not ipc://"):
        LookupClient(
            {0: "/tmp/x.sock"}, Metrics(0), chunk_size=CHUNK, world=1, tier_order=TIER_ORDER
        )
    c = LookupClient(
        eps, Metrics(0), chunk_size=CHUNK, world=1, max_frame_bytes=1024, tier_order=TIER_ORDER
    )
    try:
        with pytest.raises(ValueError, match="key 1 is bytes of length 15"):
            c.lookup([b"k" * 16, b"k" * 15], "x")
        with pytest.raises(ValueError, match="key 0 is str"):
            c.lookup(["k" * 16], "x")  # type: ignore[list-item]
        with pytest.raises(ValueError, match="non-empty str"):
            c.lookup(make_keys(1), "")
        with pytest.raises(ValueError, match="over max_frame_bytes=1024"):
            c.lookup(make_keys(100), "big")
    finally:
        c.close()
    with pytest.raises(RuntimeError, match="closed"):
        c.lookup(make_keys(1), "after-close")


def test_every_message_round_trips_through_one_decoder() -> None:
    codec = Codec()
    k = make_keys(2)
    msgs = [
        LookupRequest(PROTOCOL_VERSION, "id", 7, k, True),
        LookupReply(PROTOCOL_VERSION, "id", 7, 3, 2, None),
        LookupReply(PROTOCOL_VERSION, "id", 7, 3, 0, "backend: boom"),
        ReleaseRequest(PROTOCOL_VERSION, ["a", "b"]),
        Ping(PROTOCOL_VERSION, 9),
        Pong(PROTOCOL_VERSION, 9, 3, 1, 2, 0),
    ]
    for msg in msgs:
        frame = codec.encode(msg)
        assert b"pickle" not in frame
        assert codec.decode(frame) == msg
    assert len(codec.encode(LookupRequest(PROTOCOL_VERSION, "x", 1, make_keys(128), True))) < 2400
