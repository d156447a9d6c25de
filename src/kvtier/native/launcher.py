"""`kvtier serve`'s process: bind, build the engine (with kvtier when asked), serve until
SIGINT/SIGTERM or an engine failure, then close everything.

An engine failure (a step raised, a TP rank died) is fatal, as in vLLM: the loop fails what is
in flight, uvicorn is told to stop, and `serve` returns exit code 1 after one log line naming
the cause, instead of a server that answers 503 forever.
"""

from __future__ import annotations

import logging
import shutil
import signal
import threading
from pathlib import Path

from kvtier.config import KVTierConfig
from kvtier.native.config import EngineConfig
from kvtier.native.engine import Engine
from kvtier.native.engine_loop import DEFAULT_STALL_TIMEOUT_S
from kvtier.native.server import EngineServer, ServerLimits, bind_socket

__all__ = ["EXIT_ENGINE_FAILED", "bind_socket", "serve"]

log = logging.getLogger("kvtier.server")
EXIT_ENGINE_FAILED = 1


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


class _FatalExit:
    """Set from the engine loop thread when the engine failed; stops uvicorn if it runs."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.uvicorn: object | None = None
        self._lock = threading.Lock()

    def __call__(self, reason: str) -> None:
        with self._lock:
            self.reason = reason
            if self.uvicorn is not None:
                self.uvicorn.should_exit = True  # type: ignore[attr-defined]

    def attach(self, server: object) -> None:
        with self._lock:
            self.uvicorn = server
            if self.reason is not None:
                server.should_exit = True  # type: ignore[attr-defined]


def serve(
    model_dir: str | Path,
    engine_config: EngineConfig,
    *,
    offload: KVTierConfig | None,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    log_level: str = "info",
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
    limits: ServerLimits | None = None,
) -> int:
    """Serve `model_dir` over HTTP until SIGINT/SIGTERM (returns 0) or an engine failure
    (returns `EXIT_ENGINE_FAILED`), then close the engine and its ranks.

    `offload=None` runs without kvtier; `limits` bounds what one client may make the server
    do (body size, list sizes, queued sequences, chat templates). Startup errors (bad config,
    port in use, a rank that fails to start) raise before anything is served.
    """
    import uvicorn

    from kvtier.lookup import make_run_dir
    from kvtier.native.offload import connector_spec

    main = threading.current_thread() is threading.main_thread()
    # SIGTERM during startup or serving unwinds like Ctrl-C, so every finally below runs
    previous = signal.signal(signal.SIGTERM, _interrupt) if main else None
    sock = bind_socket(host, port)
    run_dir: Path | None = None
    server: EngineServer | None = None
    fatal = _FatalExit()
    try:
        spec = None
        if offload is not None:
            run_dir = make_run_dir(base=offload.lookup_dir)
            spec = connector_spec(offload, model_dir, run_dir)
        engine = Engine(model_dir, engine_config, spec)
        try:
            server = EngineServer(
                engine, model_name=served_model_name or str(model_dir),
                stall_timeout_s=stall_timeout_s, on_fatal=fatal, limits=limits,
            ).start()  # fmt: skip
        except BaseException:
            engine.close()
            raise
        sock.listen(2048)  # from here connections queue until uvicorn accepts them
        bound_host, bound_port = sock.getsockname()[:2]
        log.info(
            "kvtier serve: listening on http://%s:%d (model %s, TP=%d, hbm blocks=%d x %d tokens, "
            "max_model_len=%d, offload %s, stall timeout %g s)",
            bound_host, bound_port, server.model_name, engine_config.tensor_parallel_size,
            engine_config.num_blocks, engine_config.block_size, engine.max_model_len,
            "on" if offload is not None else "off", stall_timeout_s,
        )  # fmt: skip
        config = uvicorn.Config(
            server.app,
            log_level=log_level,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=5,
        )
        uv = uvicorn.Server(config)
        fatal.attach(uv)
        uv.run(sockets=[sock])
    except KeyboardInterrupt:
        log.info("kvtier serve: interrupted")
    finally:
        try:
            if server is not None:
                server.close()
        finally:
            sock.close()
            if run_dir is not None:
                shutil.rmtree(run_dir, ignore_errors=True)
            if main:
                signal.signal(signal.SIGTERM, previous)
    if fatal.reason is not None:
        log.error("kvtier serve: exiting with code %d: %s", EXIT_ENGINE_FAILED, fatal.reason)
        return EXIT_ENGINE_FAILED
    log.info("kvtier serve: shut down cleanly")
    return 0
