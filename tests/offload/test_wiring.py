"""The spec both connector halves are built from: every rank's lookup endpoint derived once,
the same for the scheduler and each worker, and a spec missing a rank refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.config import KVTierConfig
from kvtier.lookup import make_run_dir
from kvtier.offload.messages import OffloadMeta
from kvtier.offload.wiring import OffloadSpec, decode_step_meta, encode_step_meta
from kvtier.topology import resolve


def test_derive_gives_every_rank_its_ipc_socket(tmp_path: Path) -> None:
    run = make_run_dir(base=tmp_path)
    topo = resolve({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, rank=3)
    spec = OffloadSpec.derive(KVTierConfig(), "m", topo, run_dir=run, base_port=None)
    assert spec.endpoints == {r: f"ipc://{run.absolute()}/lookup-rank{r}.sock" for r in range(4)}


def test_derive_puts_rank_r_on_base_port_plus_r() -> None:
    cfg = KVTierConfig(lookup_transport="tcp", lookup_base_port=15500)
    topo = resolve({"tensor_parallel_size": 2}, rank=0)
    spec = OffloadSpec.derive(cfg, "m", topo, run_dir="/nonexistent", base_port=15504)
    assert spec.endpoints == {0: "tcp://127.0.0.1:15504", 1: "tcp://127.0.0.1:15505"}


def test_a_spec_without_every_ranks_endpoint_is_refused() -> None:
    topo = resolve({"tensor_parallel_size": 2}, rank=0)
    with pytest.raises(ValueError, match=r"no lookup endpoint for ranks \[1\]"):
        OffloadSpec(KVTierConfig(), "m", topo, {0: "tcp://127.0.0.1:15500"})


def test_an_empty_step_is_no_bytes_and_no_bytes_an_empty_step() -> None:
    assert encode_step_meta(OffloadMeta()) == b""
    assert decode_step_meta(b"").is_empty()
