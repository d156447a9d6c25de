"""The lookup endpoint belongs to its engine: a frame that does not carry the engine's key is
never answered, never leases and never releases, and is counted as `auth`."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
import zmq

from kvtier.bench.ports import free_port
from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.lookup import (
    KEY_FILE,
    MAC_BYTES,
    PROTOCOL_VERSION,
    Codec,
    LookupClient,
    LookupReply,
    LookupRequest,
    LookupServer,
    ReleaseRequest,
    endpoint_for,
    engine_key,
    make_run_dir,
)
from kvtier.lookup.keyfile import endpoint_key
from kvtier.metrics import Metrics
from kvtier.offload.wiring import OffloadSpec
from kvtier.store.memory import MemoryTier
from kvtier.store.registry import order
from kvtier.store.stack import TierStack
from kvtier.topology import resolve
from tests.lookup_helpers import FakeBackend, engine_side, make_keys, signed

KEYS = make_keys(4, salt="auth")
HELD = 3
NS = bytes(range(16))
DEADLINE_S = 10.0
# how long a reply to a foreign frame would take at most once the server has answered a later
# ping: the server handles frames in order on one thread, so a reply it sent is already queued
NO_REPLY_MS = 300

TIER_ORDER = order()  # the registry's tier names, accelerator outwards


def _wait(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not cond():
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} not within {DEADLINE_S}s")
        time.sleep(0.01)


@dataclass
class Rank:
    """One rank's server over a real memory tier, the engine's own client and a foreign one."""

    stack: TierStack
    metrics: Metrics
    server: LookupServer
    client: LookupClient
    foreign: zmq.Socket
    key: bytes  # the engine's (a frame under it for another rank is still foreign here)
    base: int = 0

    def settled(self, frames: int) -> None:
        """Wait until the server handled `frames` more frames than the engine's client sent
        (answered, released or rejected), then until it answered a ping of that client."""
        s = self.server
        _wait(lambda: s.served + s.released + s.rejected >= self.base + frames, f"{frames} frames")
        assert self.client.ping(2000) == {0: True}

    def leased(self) -> bool:
        return any(self.stack.memory.is_leased(k) for k in KEYS[:HELD])


@pytest.fixture(params=["tcp", "ipc"])
def rank(request: pytest.FixtureRequest) -> Iterator[Rank]:
    run_dir = make_run_dir(base="/tmp")
    metrics = Metrics(0)
    memory = MemoryTier(64, 64 * 8, NS, metrics)
    for key in KEYS[:HELD]:
        assert memory.put(key, bytes(64))
    stack = TierStack(memory, (), metrics)
    ep = endpoint_for(0, transport=request.param, run_dir=run_dir, base_port=free_port())
    server = LookupServer(0, stack, ep, metrics).start()
    client = LookupClient(
        {0: ep},
        Metrics("scheduler"),
        chunk_size=16,
        world=1,
        timeout_ms=2000,
        tier_order=TIER_ORDER,
    )
    foreign = zmq.Context.instance().socket(zmq.DEALER)
    foreign.setsockopt(zmq.LINGER, 0)
    if request.param == "tcp":
        # past the handshake (test_lookup_untrusted: no one without the key gets there), so
        # what is judged here is the MAC layer behind it
        engine_side(foreign, endpoint_key(ep))
    foreign.connect(ep)
    try:
        client.wait_ready(DEADLINE_S)
        yield Rank(stack, metrics, server, client, foreign, endpoint_key(ep))
    finally:
        foreign.close()
        client.close()
        server.close()
        stack.close()
        shutil.rmtree(run_dir, ignore_errors=True)


def _lookup_frame(lookup_id: str) -> bytes:
    return msgspec.msgpack.encode(LookupRequest(PROTOCOL_VERSION, lookup_id, 1, KEYS, True))


def _release_frame(lookup_id: str) -> bytes:
    return msgspec.msgpack.encode(ReleaseRequest(PROTOCOL_VERSION, [lookup_id]))


def test_a_foreign_lookup_is_not_answered_leases_nothing_and_is_counted(rank: Rank) -> None:
    body = _lookup_frame("lk0")
    forged = [
        [body],  # a well-formed request without the engine's key
        [os.urandom(32) + body],  # with a made-up MAC
        signed(os.urandom(32), body),  # MAC'd under another key (another engine's)
        # the engine's own frame for rank 1, replayed here by whoever held rank 1's TCP port
        signed(rank.key, body, rank=1),
    ]
    for frames in forged:
        rank.foreign.send_multipart(frames)
    rank.settled(len(forged))
    assert not rank.leased(), "a foreign lookup took a lease"
    assert rank.foreign.poll(NO_REPLY_MS) == 0, "the server answered a foreign client"
    assert rank.metrics.value("rejected_frames_total", reason="auth") == len(forged)
    assert rank.metrics.value("lookups_total") == 0
    # the engine's own client is served as before
    res = rank.client.lookup(KEYS, "lk1")
    assert (res.hit_chunks, res.timed_out, res.errors) == (HELD, (), {})
    assert rank.leased()
    rank.client.release(["lk1"])
    _wait(lambda: not rank.leased(), "the engine's own release")


def test_a_lease_cannot_be_released_without_the_key(rank: Rank) -> None:
    # the scheduler's lookup ids are a counter (lk0, lk1, ...): easy to guess
    assert rank.client.lookup(KEYS, "lk7").hit_chunks == HELD
    assert rank.leased()
    rank.base = rank.server.served
    body = _release_frame("lk7")
    forged = [[body], [os.urandom(32) + body], signed(os.urandom(32), body),
              signed(rank.key, body, rank=1)]  # fmt: skip
    for frames in forged:
        rank.foreign.send_multipart(frames)
    rank.settled(len(forged))
    assert rank.leased(), "a foreign release dropped the engine's lease"
    assert rank.server.released == 0
    assert rank.metrics.value("rejected_frames_total", reason="auth") == len(forged)
    rank.client.release(["lk7"])
    _wait(lambda: not rank.leased(), "the engine's own release")


# -- the engine's key -----------------------------------------------------------------------


def test_the_first_asker_creates_a_private_key_every_other_process_reads_it(tmp_path: Path) -> None:
    def ask(run: Path, start: threading.Barrier, got: list[bytes]) -> None:
        start.wait(DEADLINE_S)
        got.append(engine_key(run))

    for attempt in range(10):
        run = make_run_dir(base=tmp_path)
        start = threading.Barrier(8)
        got: list[bytes] = []
        threads = [threading.Thread(target=ask, args=(run, start, got)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(DEADLINE_S)
        assert len(got) == 8 and len(set(got)) == 1, attempt  # one key, whoever linked first
        st = os.lstat(run / KEY_FILE)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_uid == os.getuid() and st.st_size == 32
        assert sorted(p.name for p in run.iterdir()) == [KEY_FILE]  # no temporary left
        assert engine_key(run) == got[0]
    assert engine_key(make_run_dir(base=tmp_path)) != got[0]  # another engine, another key


def test_a_key_or_run_dir_others_could_reach_is_refused(tmp_path: Path) -> None:
    run = make_run_dir(base=tmp_path)
    engine_key(run)
    key = run / KEY_FILE
    key.chmod(0o644)
    with pytest.raises(ConfigError, match="mode 0o644.*remove it"):
        engine_key(run)
    key.chmod(0o600)
    key.write_bytes(b"short")
    with pytest.raises(ConfigError, match="5 bytes, not 32"):
        engine_key(run)
    key.unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(bytes(32))
    elsewhere.chmod(0o600)
    key.symlink_to(elsewhere)
    with pytest.raises(ConfigError, match="is a symlink"):
        engine_key(run)
    key.unlink()
    run.chmod(0o755)
    with pytest.raises(ConfigError, match="mode 0o755"):
        engine_key(run)
    linked = tmp_path / "linked"
    run.chmod(0o700)
    linked.symlink_to(run)
    with pytest.raises(ConfigError, match="is a symlink"):
        engine_key(linked)


def test_tcp_needs_the_engines_run_dir_or_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="names no run dir holding its engine's key"):
        LookupServer(0, FakeBackend(0, []), "tcp://127.0.0.1:*", Metrics(0))
    with pytest.raises(ConfigError, match="names no run dir"):
        LookupClient(
            {0: "tcp://127.0.0.1:15500"}, Metrics(0), chunk_size=16, world=1, tier_order=TIER_ORDER
        )
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    ep = endpoint_for(0, transport="tcp", run_dir=shared, base_port=15500)
    with pytest.raises(ConfigError, match="mode 0o755"):
        LookupServer(0, FakeBackend(0, []), ep, Metrics(0))
    with pytest.raises(ConfigError, match="32-byte key"):
        LookupServer(0, FakeBackend(0, []), "tcp://127.0.0.1:*", Metrics(0), key=b"k" * 16)
    a, b = make_run_dir(base="/tmp"), make_run_dir(base="/tmp")
    try:
        eps = {0: endpoint_for(0, run_dir=a), 1: endpoint_for(1, run_dir=b)}
        with pytest.raises(ConfigError, match=r"ranks \[\[0\], \[1\]\] belong to engines"):
            LookupClient(eps, Metrics(0), chunk_size=16, world=2, tier_order=TIER_ORDER)
    finally:
        shutil.rmtree(a)
        shutil.rmtree(b)


def test_both_halves_of_a_tcp_engine_share_the_run_dirs_key(tmp_path: Path) -> None:
    """As the hosts wire it: each half derives the spec; the worker builds its server from its
    endpoint alone (OffloadWorker), the scheduler its client from every endpoint."""
    run = make_run_dir(base=tmp_path)
    port = free_port(count=2)
    cfg = KVTierConfig(lookup_transport="tcp", lookup_base_port=port)
    halves = [
        OffloadSpec.derive(
            cfg, "m", resolve({"tensor_parallel_size": 2}, rank=r), run_dir=run, base_port=port
        )
        for r in (0, 1)
    ]
    assert not (run / KEY_FILE).exists()  # deriving reads nothing: the first server writes it
    keys = make_keys(3)
    servers = [
        LookupServer(r, FakeBackend(r, keys), halves[r].endpoints[r], Metrics(r)).start()
        for r in (0, 1)
    ]
    client = LookupClient(
        halves[0].endpoints, Metrics("scheduler"), chunk_size=16, world=2, tier_order=TIER_ORDER
    )
    try:
        assert halves[0].endpoints[1] == f"tcp://127.0.0.1:{port + 1}"
        client.wait_ready(DEADLINE_S)
        res = client.lookup(keys, "lk0")
        assert (res.hit_chunks, res.timed_out, res.errors) == (3, (), {})
        assert stat.S_IMODE((run / KEY_FILE).stat().st_mode) == 0o600
    finally:
        client.close()
        for s in servers:
            s.close()


def test_a_reply_without_the_engines_mac_is_dropped_and_counted(run_dir: Path) -> None:
    """Whoever took a rank's port (the rank died, another process bound it) cannot answer for
    it: its replies, however well-formed, count as a timeout, never as hits."""
    ep = endpoint_for(0, transport="tcp", run_dir=run_dir, base_port=free_port())
    squatter = zmq.Context.instance().socket(zmq.ROUTER)
    squatter.setsockopt(zmq.LINGER, 0)
    # a squatter that passes the handshake (it holds the engine's CURVE keys, not its MAC key)
    engine_side(squatter, endpoint_key(ep), server=True)
    squatter.bind(ep)
    m = Metrics("scheduler")
    client = LookupClient(
        {0: ep}, m, chunk_size=16, world=1, timeout_ms=1000, tier_order=TIER_ORDER
    )
    codec = Codec()
    try:
        assert client.wait_connected(DEADLINE_S) == []
        pending = client.begin(KEYS, "lk0")
        assert squatter.poll(int(DEADLINE_S * 1000))
        peer, frame = squatter.recv_multipart()
        req = codec.decode(frame[MAC_BYTES:])
        assert isinstance(req, LookupRequest)
        claim = codec.encode(LookupReply(PROTOCOL_VERSION, "lk0", req.req, 0, len(KEYS)))
        squatter.send_multipart([peer, os.urandom(32), claim])  # two frames (no protocol's)
        squatter.send_multipart([peer, os.urandom(32) + claim])  # a made-up MAC
        squatter.send_multipart([peer, *signed(os.urandom(32), claim)])  # another key's
        res = client.poll(pending, wait_ms=DEADLINE_S * 1000)
        assert res is not None
        assert (res.hit_chunks, res.timed_out) == (0, (0,))
        assert m.value("rejected_frames_total", reason="auth") == 2
        assert m.value("rejected_frames_total", reason="frames") == 1
    finally:
        client.close()
        squatter.close()


@pytest.fixture
def run_dir() -> Iterator[Path]:
    d = make_run_dir(base="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_a_flood_of_foreign_frames_is_counted_whole_and_logged_once(
    rank: Rank, caplog: pytest.LogCaptureFixture
) -> None:
    n = 500
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        for i in range(n):
            rank.foreign.send(_lookup_frame(f"lk{i}"))
        rank.settled(n)
    assert rank.metrics.value("rejected_frames_total", reason="auth") == n
    assert not rank.leased()
    lines = [r.message for r in caplog.records if "refused a frame" in r.message]
    assert lines == [
        "kvtier: lookup server rank 0 refused a frame: auth: its MAC was not made with the "
        "engine's key for rank 0 (another engine, or a rank of this one sent to the wrong socket)"
    ]
