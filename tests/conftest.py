"""Fixtures shared across test directories: one `vllm serve` with KVTierConnector per session
(two passes, so the tier served a hit before /metrics was read), for the tests that hold
kvtier or the native server against vLLM."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.cpu_isa import vector_isa
from tests.vllm.conftest import DRIVERS, TIER, VLLM_CACHE, _run
from tests.vllm.conftest import tiny_vllm_model as tiny_vllm_model  # fixtures, visible everywhere
from tests.vllm.conftest import vllm_env as vllm_env
from tests.vllm.conftest import vllm_python as vllm_python
from tests.vllm.drivers.common import RESULT_PREFIX

SERVE_ARGS: dict[str, Any] = {"extra": TIER, "hostile_ids": True, "retention": True}


# optional: the GPU check runs tests/offload on a machine with pytest and no pytest-xdist
@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under `pytest -n N` (as `make test` runs): a test file per worker at a time, files that
    share an expensive session fixture together, the slowest first (tests/xdist_files.py)."""
    from tests.xdist_files import FileScheduling

    return FileScheduling(config, log)


def pytest_configure(config: pytest.Config) -> None:
    """Every vLLM server a test starts through kvtier's bench (which passes VLLM_CACHE_ROOT
    on) shares the drivers' cache: a developer's own cache stays out of the tests."""
    os.environ["VLLM_CACHE_ROOT"] = str(VLLM_CACHE)


def pytest_sessionstart(session: pytest.Session) -> None:
    """The CPU's vector ISA at the top of every run, `-q` included: bf16 outputs depend on the
    kernels it selects (AVX2, AVX-512, AMX), so a failure report says which ones ran."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and not hasattr(session.config, "workerinput"):
        reporter.write_line(
            f"cpu vector ISA: {vector_isa()} (tests/README.md: comparing generated tokens)"
        )


@pytest.fixture(scope="session")
def vllm_served(
    vllm_python: Path,
    vllm_env: dict[str, str],
    tiny_vllm_model: Path,
) -> dict:
    """The result of tests/vllm/drivers/serve.py on the tiny bf16 model: both passes (texts,
    token ids, cached tokens), the cache counters and the whole /metrics page."""
    args = json.dumps({"model": str(tiny_vllm_model), **SERVE_ARGS})
    code, out, err = _run([str(vllm_python), str(DRIVERS / "serve.py"), args], vllm_env, 280)
    lines = [x for x in out.splitlines() if x.startswith(RESULT_PREFIX)]
    if code != 0 or len(lines) != 1:
        raise AssertionError(f"serve driver exited {code}\n{err[-6000:]}")
    return json.loads(lines[0][len(RESULT_PREFIX) :])
