"""A real `kvtier serve` subprocess for tests: start it on a free port, read its log as it
comes, scrape its counters, stop it."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

LISTENING = "kvtier serve: listening on http://127.0.0.1:"


class Output:
    """Collects a subprocess's merged output on a thread; waits for a line with a deadline."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self._new: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.append(line)
            self._new.put(line)
        self._new.put(None)

    def wait_for(self, needle: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{needle!r} not seen in {timeout_s} s:\n{self.text}")
            try:
                line = self._new.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"process ended before {needle!r}:\n{self.text}")
            if needle in line:
                return line

    @property
    def text(self) -> str:
        return "".join(self.lines)


@dataclass
class Served:
    """A running `kvtier serve`."""

    base: str
    proc: subprocess.Popen[str]
    out: Output
    tp: int
    model_dir: Path

    def counters(self) -> dict[str, float]:
        """Every sample of /metrics summed over its label sets, by sample name."""
        text = httpx.get(f"{self.base}/metrics", timeout=30).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([0-9.eE+-]+)$", line)
            if m:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
        return out


def clean_env() -> dict[str, str]:
    """The environment without a developer's kvtier settings."""
    return {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}


@contextlib.contextmanager
def kvtier_serve(
    model_dir: Path, workdir: Path, *, tp: int, config: str, extra: tuple[str, ...] = ()
) -> Iterator[Served]:
    """`kvtier serve MODEL --tp N` with a kvtier YAML config; stopped with SIGTERM at exit."""
    cfg = workdir / f"kvtier-tp{tp}.yaml"
    cfg.write_text(config)
    cmd = [
        sys.executable, "-m", "kvtier.cli", "serve", str(model_dir), "--port", "0",
        "--tp", str(tp), "--hbm-blocks", "256", "--config", str(cfg),
        "--served-model-name", "tiny", *extra,
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=clean_env(),
        cwd=workdir,
    )  # fmt: skip
    out = Output(proc)
    try:
        line = out.wait_for(LISTENING, 90.0)
        base = line.split("listening on ")[1].split()[0]
        yield Served(base, proc, out, tp, model_dir)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
