"""The host-adapter conformance suite against `VLLMRequestView` over vLLM's real `Request`."""

from __future__ import annotations

from collections.abc import Callable

from tests.offload.conformance import CHECKS, HYBRID_CHECKS
from tests.vllm.conftest import DriverRun


def test_vllm_request_view_conformance(run_driver: Callable[..., DriverRun]) -> None:
    results = run_driver("conformance", {}).result["checks"]
    assert set(results) == {c.__name__ for c in (*CHECKS, *HYBRID_CHECKS)}
    failed = {name: err for name, err in results.items() if err != "ok"}
    assert not failed, "\n".join(f"{name}:\n{err}" for name, err in failed.items())
