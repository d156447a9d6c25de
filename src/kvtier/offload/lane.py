"""A worker lane: one daemon thread that runs a rank's transfer jobs in order, bound to the
rank's KV device (and, on CUDA, to a side stream of its own), optionally pinned to CPUs."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from prometheus_client import Counter

from kvtier.cpus import describe, host_cpus
from kvtier.errors import ConfigError
from kvtier.offload.device import DeviceOps, Lane

log = logging.getLogger("kvtier")

T = TypeVar("T")
Job = Callable[[Lane], object]
# retires what a job left in flight on the lane (a path's persistent transfer ring)
Settle = Callable[[Lane], None]


class WorkLane:
    """Jobs run one at a time on a daemon thread, so a stuck job never blocks process exit."""

    def __init__(
        self,
        name: str,
        ops: DeviceOps,
        cpus: frozenset[int] | None = None,
        cpu: Counter | None = None,
    ) -> None:
        """`cpus`: the CPUs the thread runs on (None: those of the thread that starts it);
        `cpu`: counts the thread's CPU seconds inside jobs (kvtier_lane_cpu_seconds)."""
        self.name = name
        self.cpus = cpus
        self._cpu = cpu
        self._ops = ops
        self._jobs: queue.Queue[tuple[Job, Settle | None] | None] = queue.Queue()
        self._ready = threading.Event()
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self, timeout_s: float = 30.0) -> None:
        """Start the thread; raise what binding it to the device raised."""
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"lane {self.name} did not start within {timeout_s} s")
        if self._failed is not None:
            raise self._failed

    def submit(self, job: Job, settle: Settle | None = None) -> None:
        """Queue `job(lane)`; it must report its own outcome (the lane only logs a crash).
        `settle(lane)` retires what the job may leave in flight: the lane runs it before it
        waits for more work, before any job that brings another `settle` (or none), and
        before it stops, so a job of the same path queued behind it keeps the link busy."""
        self._jobs.put((job, settle))

    def call(self, fn: Callable[[Lane], T], timeout_s: float) -> T:
        """Run `fn(lane)` on the lane and return its result (or raise what it raised)."""
        fut: Future[T] = Future()

        def job(lane: Lane) -> None:
            try:
                fut.set_result(fn(lane))
            except BaseException as e:  # noqa: BLE001 - handed to the caller, never swallowed
                fut.set_exception(e)

        self.submit(job)
        return fut.result(timeout=timeout_s)

    def close(self, timeout_s: float = 10.0) -> bool:
        """Stop after the queued jobs; False if the thread is still busy after `timeout_s`."""
        if not self._thread.is_alive():
            return True
        self._jobs.put(None)
        self._thread.join(timeout=timeout_s)
        return not self._thread.is_alive()

    def _pin(self, cpus: frozenset[int]) -> None:
        try:
            # pid 0 is the calling thread: the owner and the other lanes keep their CPUs
            os.sched_setaffinity(0, cpus)
        except OSError as e:
            raise ConfigError(
                f"lane {self.name} cannot run on CPUs {describe(cpus)} ({e.strerror}); this "
                f"host offers {describe(host_cpus())}: set "
                "lane_cpus to CPUs among those, or to 'inherit'"
            ) from e

    def _run(self) -> None:
        try:
            if self.cpus is not None:
                self._pin(self.cpus)
            self._ops.bind_thread()
            lane = self._ops.lane()
        except BaseException as e:  # noqa: BLE001 - re-raised by start() in the owner's thread
            self._failed = e
            self._ready.set()
            return
        self._ready.set()
        left: Settle | None = None  # what the last job left in flight, to settle
        while True:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                # out of work: nothing may stay on the link unreported while the lane sleeps
                left = self._timed(lane, left, "settle")
                item = self._jobs.get()
            if item is None:
                self._timed(lane, left, "settle")
                return
            job, settle = item
            if left is not None and settle != left:
                left = self._timed(lane, left, "settle")
            self._timed(lane, job, "job")
            left = settle

    def _timed(self, lane: Lane, fn: Callable[[Lane], object] | None, what: str) -> None:
        """Run `fn(lane)` (a job or a settle) counting its CPU time; None is a no-op. A job
        reports its outcome itself: one that raised anyway is a bug, and the lane lives on
        for the jobs behind it."""
        if fn is None:
            return
        c0 = time.thread_time()
        try:
            fn(lane)
        except Exception:
            log.exception("kvtier: %s %s raised", self.name, what)
        if self._cpu is not None:
            self._cpu.inc(time.thread_time() - c0)
