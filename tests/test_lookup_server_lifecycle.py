"""The lookup server's serving thread and its close(), found by a review hunting for ways the
engine's process can hang or die. The server woke its thread with a blocking PAIR send, and a
PAIR with no peer blocks forever: once the serving thread had ended, `close()` (and the engine's
shutdown) never returned. A backend raising SystemExit ended that thread silently, and so did
another library ending the process-wide zmq context. Each case runs in a subprocess, so a hang
costs the test its timeout, never the pytest process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

_PRELUDE = textwrap.dedent(
    """
    import os, threading, time
    from kvtier.lookup import LookupClient
    from kvtier.lookup.server import LookupServer
    from kvtier.metrics import Metrics

    KEY = b"k" * 32

    class Dying:
        # a backend whose lookup raises past `except Exception` (a library calling sys.exit;
        # anything else that ends the serving thread)
        def lookup(self, keys, lease_id):
            raise {exc}("backend bailed out")
        def release(self, lease_id):
            pass

    server = LookupServer(0, Dying(), "tcp://127.0.0.1:*", Metrics(0), key=KEY).start()
    client = LookupClient({0: server.bound_endpoint}, Metrics("scheduler"), chunk_size=16,
                          world=1, key=KEY, tier_order=["memory"], timeout_ms=300)
    client.wait_ready(5)
    client.lookup([b"x" * 16], "a")  # the serving thread ends inside this lookup
    server._thread.join(5)
    print("serving thread alive:", server._thread.is_alive(), flush=True)
    """
)


def _run(body: str, exc: str, timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _PRELUDE.replace("{exc}", exc) + textwrap.dedent(body)],
        capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip


def test_close_returns_after_the_serving_thread_ended() -> None:
    done = _run(
        """
        closer = threading.Thread(target=server.close, daemon=True)
        closer.start()
        closer.join(8)
        print("close returned:", not closer.is_alive(), flush=True)
        os._exit(0 if not closer.is_alive() else 7)
        """,
        "KeyboardInterrupt",  # past every handler of the thread: it ends, and says so
    )
    assert "serving thread alive: False" in done.stdout, done.stdout + done.stderr
    assert "lookup server rank 0 stopped serving" in done.stderr, done.stderr[-2000:]
    assert done.returncode == 0, (
        "LookupServer.close() blocked forever once its serving thread had ended "
        f"(PAIR send without a peer):\n{done.stdout}{done.stderr[-2000:]}"
    )


def test_a_backend_exception_past_except_exception_does_not_end_the_rank() -> None:
    done = _run(
        """
        client.lookup([b"x" * 16], "b")
        os._exit(0)
        """,
        "SystemExit",
    )
    assert "serving thread alive: True" in done.stdout, (
        "one lookup whose backend raised a BaseException ended the rank's serving thread: "
        "every later lookup of this rank times out, silently (no counter, one traceback)\n"
        + done.stdout + done.stderr[-2000:]
    )


def test_another_library_ending_the_global_zmq_context_does_not_end_the_rank() -> None:
    """Server and client take `zmq.Context.instance()`, the process-wide context any other
    library in the engine process may also take and `term()`/`destroy()` at its own shutdown
    (destroy closes kvtier's sockets from that thread while the serving thread polls them,
    which libzmq calls undefined)."""
    body = textwrap.dedent(
        """
        import os, threading, zmq
        from kvtier.lookup.server import LookupServer
        from kvtier.metrics import Metrics

        class Backend:
            def lookup(self, keys, lease_id): return 0
            def release(self, lease_id): pass

        server = LookupServer(0, Backend(), "tcp://127.0.0.1:*", Metrics(0), key=b"k" * 32)
        server.start()
        # another library's shutdown of "its" context: term blocks until that context's
        # sockets close, so it returns at once only if none of them is kvtier's
        term = threading.Thread(target=zmq.Context.instance().term, daemon=True)
        term.start()
        term.join(10.0)
        print("term returned:", not term.is_alive(), flush=True)
        print("serving thread alive:", server._thread.is_alive(), flush=True)
        os._exit(0)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", body], capture_output=True, text=True, timeout=30
    )
    said = done.stdout + done.stderr[-2000:]
    assert "term returned: True" in done.stdout, said
    assert "serving thread alive: True" in done.stdout, said
