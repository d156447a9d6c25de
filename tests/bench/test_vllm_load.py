"""`--load vllm-bench`'s driver under a deadline: a driver that never answers is stopped and the
load raises, naming the deadline; the deadline covers every round of timed-out requests."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest

from kvtier.bench.vllm_load import VLLMBenchLoad, job_deadline_s
from kvtier.bench.workload import RequestSpec


def _spec(i: int, arrival: float | None = None) -> RequestSpec:
    return RequestSpec(i, "t", (5, 6, 7), 2, arrival=arrival)


def test_the_job_deadline_is_the_last_arrival_then_every_round_timing_out():
    closed = [_spec(i) for i in range(5)]
    assert job_deadline_s(closed, 2, 10.0) == 10.0 * (3 + 1)  # rounds of 2, 2, 1
    timed = [_spec(i, arrival=float(i)) for i in range(4)]
    assert job_deadline_s(timed, None, 10.0) == 3.0 + 10.0 * (1 + 1)  # one round, uncapped


def _fake_driver(tmp_path: Path, after_ready: str) -> Path:
    """A stand-in for the vLLM venv's python: says it is ready, then runs `after_ready`."""
    fake = tmp_path / "python"
    fake.write_text(
        f"#!{sys.executable}\nimport os, sys\n"
        f"open({str(tmp_path / 'driver.pid')!r}, 'w').write(str(os.getpid()))\n"
        "print('kvtier-vllm-load ready', flush=True)\n" + after_ready + "\n"
    )
    fake.chmod(0o755)
    return fake


def _gone(tmp_path: Path) -> bool:
    """The fake driver was killed and reaped, not left behind."""
    try:
        os.kill(int((tmp_path / "driver.pid").read_text()), 0)
    except ProcessLookupError:
        return True
    return False


def test_a_driver_that_never_answers_is_stopped_and_the_load_raises(tmp_path: Path):
    fake = _fake_driver(tmp_path, "sys.stdin.read()")  # reads its jobs, answers none
    load = VLLMBenchLoad(fake, tmp_path / "work", timeout_s=0.5)
    t0 = time.perf_counter()
    try:
        with pytest.raises(RuntimeError, match=r"did not finish 1 requests within 1s .* stopped"):
            asyncio.run(load("http://127.0.0.1:9", [_spec(0)], concurrency=1))
    finally:
        load.close()
    assert time.perf_counter() - t0 >= 1.0  # it waited out the deadline, no less
    assert _gone(tmp_path)


def test_a_driver_whose_output_ends_is_stopped_and_the_load_raises(tmp_path: Path):
    fake = _fake_driver(tmp_path, "os.close(1); sys.stdin.read()")
    load = VLLMBenchLoad(fake, tmp_path / "work", timeout_s=60)
    try:
        with pytest.raises(RuntimeError, match=r"driver failed \(its output ended, exit code -9\)"):
            asyncio.run(load("http://127.0.0.1:9", [_spec(0)], concurrency=1))
    finally:
        load.close()
    assert _gone(tmp_path)


def test_a_timeout_that_is_not_a_positive_number_is_refused(tmp_path: Path):
    with pytest.raises(ValueError, match=r"timeout_s=0 must be a positive number"):
        VLLMBenchLoad(tmp_path / "python", tmp_path, timeout_s=0)
