"""kvtier lowers the GIL switch interval of the processes it runs in (never raises it), so its
lookup server and copy lanes wait at most `gil_switch_ms` for the GIL."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.offload.gil import apply_switch_interval


@pytest.fixture(autouse=True)
def interpreter_default() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(before)


def test_the_default_lowers_the_interval_and_logs_it(caplog):
    caplog.set_level("INFO", logger="kvtier")
    assert apply_switch_interval(KVTierConfig(), "rank 0") == pytest.approx(0.005)
    assert sys.getswitchinterval() == pytest.approx(0.0005)
    assert "rank 0: GIL switch interval 5.00 -> 0.50 ms (gil_switch_ms)" in caplog.text


def test_zero_leaves_the_interpreter_alone():
    assert apply_switch_interval(KVTierConfig(gil_switch_ms=0), "scheduler") is None
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_a_host_that_set_a_shorter_interval_keeps_it():
    sys.setswitchinterval(0.0001)
    assert apply_switch_interval(KVTierConfig(gil_switch_ms=1.0), "scheduler") is None
    assert sys.getswitchinterval() == pytest.approx(0.0001)


def test_a_negative_interval_is_refused_naming_the_fix():
    with pytest.raises(ConfigError, match=r"gil_switch_ms.*negative; use 0 to keep"):
        KVTierConfig(gil_switch_ms=-1)


@pytest.mark.parametrize("backend", ["cpu", "sim"])
def test_a_worker_sets_the_interval_on_every_backend(backend: str, caplog) -> None:  # type: ignore[no-untyped-def]
    """On a device whose copies are asynchronous the lanes still need the GIL to issue each
    chunk and to wake from its event: at the interpreter's 5 ms, a forward thread running Python
    kept a burst of saves 2.6x longer on the simulated device (`datapath.sim.gil`)."""
    from kvtier.offload.device import CpuOps
    from kvtier.offload.pages import KVCacheDescription
    from kvtier.offload.simdevice import SimOps
    from tests.offload.test_worker import BS, NB, config, rank0
    from tests.offload.vllm_views import build, gqa

    caplog.set_level("INFO", logger="kvtier")
    ops = CpuOps() if backend == "cpu" else SimOps()
    _, views = build(gqa(block_size=BS), NB, "LBNHC")
    worker = rank0(config(), ops)  # type: ignore[arg-type]
    try:
        worker.register_kv_caches(KVCacheDescription(views, NB, BS, "LBNHC"))
    finally:
        worker.close()
        if isinstance(ops, SimOps):
            ops.close()
    assert sys.getswitchinterval() == pytest.approx(0.0005)
    assert "kvtier[rank 0/1]: GIL switch interval 5.00 -> 0.50 ms" in caplog.text
