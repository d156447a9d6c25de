"""A test's own HTTP endpoint: a socketserver answering in a thread, reachable by its URL."""

from __future__ import annotations

import socketserver
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def serving(server: socketserver.TCPServer) -> Iterator[str]:
    """Serve `server` (bound to a local port) in a thread; yields its URL, then shuts it down."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
