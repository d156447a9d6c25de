"""`KVTierConnector.reset_cache` (namespace epoch, True), `model_id_for` (the weights'
identity) and the kernel's page format in the namespace, checked under .venv-vllm by
`drivers/connector_units.py`."""

from __future__ import annotations

from collections.abc import Callable

from tests.vllm.conftest import DriverRun

CHECKS = (
    "check_reset_cache_starts_a_new_epoch_and_returns_true",
    "check_model_id_is_the_identity_of_the_weights",
    "check_kv_changing_vllm_settings_are_in_the_model_identity",
    "check_pages_of_other_kernel_isas_never_share_a_namespace",
)


def test_connector_units(run_driver: Callable[..., DriverRun], tmp_path) -> None:
    results = run_driver("connector_units", {"tmp": str(tmp_path)}).result["checks"]
    assert set(results) == set(CHECKS)
    failed = {name: err for name, err in results.items() if err != "ok"}
    assert not failed, "\n".join(f"{name}:\n{err}" for name, err in failed.items())
