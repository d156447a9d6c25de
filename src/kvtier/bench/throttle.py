"""A TCP proxy that makes a fast store slow: every answer (server to client) waits `latency_s`
and the answers of all connections share a link of `rate` bytes/s; requests pass as they are.
The rate can change while it runs (a store that slows down or recovers).

`kvtier bench load-cost` puts it between kvtier and a real Valkey/Redis, so the store's speed
crosses the prefill's break-even on demand.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from types import TracebackType

log = logging.getLogger("kvtier")

_PIECE = 1024 * 1024  # the most bytes forwarded per paced piece
_ACCEPT_POLL_S = 0.2  # how often the accept loop looks at its stop flag


class ThrottledProxy:
    """Listens on 127.0.0.1 (port 0: a free one) and forwards to `target`; see the module."""

    def __init__(self, target: tuple[str, int], rate: float, latency_s: float = 0.0) -> None:
        if rate <= 0:
            raise ValueError(f"proxy rate {rate!r} bytes/s must be > 0")
        if latency_s < 0:
            raise ValueError(f"proxy latency {latency_s!r} s must be >= 0")
        self.target = target
        self.latency_s = latency_s
        self._rate = float(rate)
        self._link = threading.Lock()
        self._free_at = 0.0  # when the shared link is free for the next piece
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(_ACCEPT_POLL_S)
        self.port = self._listener.getsockname()[1]
        self.bytes_down = 0
        self._thread = threading.Thread(target=self._accept, name="kvtier-throttle", daemon=True)
        self._thread.start()

    @property
    def rate(self) -> float:
        return self._rate

    def set_rate(self, rate: float) -> None:
        """The link's new speed in bytes/s, from the next piece on."""
        if rate <= 0:
            raise ValueError(f"proxy rate {rate!r} bytes/s must be > 0")
        self._rate = float(rate)

    def url(self, scheme: str = "redis") -> str:
        return f"{scheme}://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # the listener was closed
            try:
                server = socket.create_connection(self.target, timeout=5.0)
            except OSError as e:
                log.warning("kvtier: throttle proxy cannot reach %s:%d: %s", *self.target, e)
                client.close()
                continue
            server.settimeout(None)
            self._conns += [client, server]
            for src, dst, paced in ((client, server, False), (server, client, True)):
                threading.Thread(
                    target=self._pump, args=(src, dst, paced), name="kvtier-throttle-pump",
                    daemon=True,
                ).start()  # fmt: skip

    def _pump(self, src: socket.socket, dst: socket.socket, paced: bool) -> None:
        try:
            while True:
                data = src.recv(_PIECE)
                if not data:
                    break
                if paced:
                    self._pace(len(data), time.monotonic())
                    self.bytes_down += len(data)
                dst.sendall(data)
        except OSError:
            pass  # either side went away: the connection ends, as a real link's would
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # already closed by the other pump

    def _pace(self, n: int, arrived: float) -> None:
        """Hold a piece of `n` bytes that arrived at `arrived` until the latency has passed and
        the shared link has carried it at the current rate."""
        with self._link:
            start = max(arrived + self.latency_s, self._free_at)
            self._free_at = start + n / self._rate
            until = self._free_at
        delay = until - time.monotonic()
        if delay > 0:
            time.sleep(delay)  # the pacing itself, not a wait for another thread

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        for s in self._conns:
            s.close()
        self._thread.join(2 * _ACCEPT_POLL_S + 1.0)

    def __enter__(self) -> ThrottledProxy:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
