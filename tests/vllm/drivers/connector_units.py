"""Unit checks of `KVTierConnector` pieces that need vLLM importable (runs under .venv-vllm):
`reset_cache` starts a namespace epoch and answers True; `model_id_for` is kvtier's identity of
the weights. Prints `{"checks": {name: "ok" | "<traceback>"}}`. Args (JSON): `{"tmp": dir}`.
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

from kvtier.config import KVTierConfig
from kvtier.metrics import Metrics
from kvtier.offload.scheduler import OffloadScheduler
from tests.offload.fakes import FakeLookup
from tests.vllm.drivers.common import args, emit

TMP = Path(args()["tmp"])


def check_reset_cache_starts_a_new_epoch_and_returns_true() -> None:
    from kvtier.vllm.connector import KVTierConnector

    core = OffloadScheduler(
        KVTierConfig(chunk_size=32, load_gate=False), FakeLookup(), model_id="m",
        block_size=16, world=1, metrics=Metrics(rank="scheduler"),
    )  # fmt: skip
    scheduler_role = object.__new__(KVTierConnector)
    # the scheduler half's reset: a new epoch in the core (and, with KV events, a clear)
    scheduler_role._scheduler = SimpleNamespace(core=core, reset=core.reset)  # type: ignore[assignment]
    assert scheduler_role.reset_cache() is True and core.epoch == 1
    assert scheduler_role.reset_cache() is True and core.epoch == 2
    worker_role = object.__new__(KVTierConnector)
    worker_role._scheduler = None
    assert worker_role.reset_cache() is True


def check_model_id_is_the_identity_of_the_weights() -> None:
    import torch
    from safetensors.torch import save_file

    from kvtier.errors import ConfigError
    from kvtier.identity import model_identity
    from kvtier.vllm.connector import model_id_for, runtime_settings

    model = TMP / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    save_file({"w": torch.arange(64.0)}, str(model / "model.safetensors"))

    def vc(name: str) -> SimpleNamespace:
        return SimpleNamespace(model_config=SimpleNamespace(model=name, revision=None))

    runtime = runtime_settings(vc(str(model)))
    assert model_id_for(vc(str(model)), KVTierConfig()) == model_identity(model, None, runtime)
    revised = model_id_for(vc(str(model)), KVTierConfig(model_revision="r2"))
    assert revised == model_identity(model, "r2", runtime) != model_identity(model, None, runtime)
    try:
        model_id_for(vc("no-such-org/no-such-model"), KVTierConfig())
    except ConfigError as e:
        assert "neither a local directory nor in the Hugging Face cache" in str(e), e
    else:
        raise AssertionError("an unresolvable hub id must be a startup error")


def check_kv_changing_vllm_settings_are_in_the_model_identity() -> None:
    """Settings outside the weight files that change the KV (rope scaling through
    --hf-overrides, an fp8 KV cache, its skipped layers) give another identity; vLLM's real
    config classes carry every field read."""
    import dataclasses

    import torch
    from safetensors.torch import save_file
    from vllm.config import CacheConfig, ModelConfig

    from kvtier.vllm.connector import _KV_CACHE_SETTINGS, _KV_MODEL_SETTINGS, model_id_for

    model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    cache_fields = {f.name for f in dataclasses.fields(CacheConfig)}
    assert set(_KV_MODEL_SETTINGS) <= model_fields, set(_KV_MODEL_SETTINGS) - model_fields
    assert set(_KV_CACHE_SETTINGS) <= cache_fields, set(_KV_CACHE_SETTINGS) - cache_fields

    model = TMP / "model-runtime"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    save_file({"w": torch.arange(64.0)}, str(model / "model.safetensors"))

    def vc(**kw: object) -> SimpleNamespace:
        mc = {"model": str(model), "revision": None, "hf_overrides": None, "quantization": None,
              "model_class_overrides": None}  # fmt: skip
        cc = {"cache_dtype": "auto", "kv_cache_dtype_skip_layers": None}
        mc.update({k: v for k, v in kw.items() if k in mc})
        cc.update({k: v for k, v in kw.items() if k in cc})
        return SimpleNamespace(model_config=SimpleNamespace(**mc),
                               cache_config=SimpleNamespace(**cc))  # fmt: skip

    base = model_id_for(vc(), KVTierConfig())
    assert model_id_for(vc(), KVTierConfig()) == base
    rope = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    others = [
        model_id_for(vc(hf_overrides=rope), KVTierConfig()),
        model_id_for(vc(cache_dtype="fp8_e4m3"), KVTierConfig()),
        model_id_for(vc(cache_dtype="fp8_e4m3", kv_cache_dtype_skip_layers=["0"]), KVTierConfig()),
    ]
    assert len({base, *others}) == 4, others


def check_pages_of_other_kernel_isas_never_share_a_namespace() -> None:
    """vLLM's CPU attention writes `amx` pages on AMX CPUs and `vec` pages elsewhere: the same
    shape in another order. A record one wrote must not be read by the other."""
    import torch
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from kvtier.offload.pages import KVPages, describe_pages
    from kvtier.vllm.worker_side import kv_description

    kv = {"model.layers.0.self_attn.attn": torch.zeros(8, 2, 16, 128, dtype=torch.bfloat16)}

    def pages(isa: str | None) -> KVPages:
        layer = SimpleNamespace(attn_backend=CPUAttentionBackend, isa=isa)
        vc = SimpleNamespace(
            compilation_config=SimpleNamespace(static_forward_context=dict.fromkeys(kv, layer)),
            cache_config=SimpleNamespace(kv_cache_layout=None),
            parallel_config=SimpleNamespace(tensor_parallel_size=1),
        )
        return describe_pages(kv_description(kv, vc, None, 16))

    amx, vec, unknown = pages("amx"), pages("vec"), pages(None)
    assert (amx.page_format, vec.page_format) == ("CPU_ATTN:amx", "CPU_ATTN:vec"), (amx, vec)
    assert unknown.page_format == "CPU_ATTN"
    assert len({amx.fingerprint, vec.fingerprint, unknown.fingerprint}) == 3
    assert "page format CPU_ATTN:amx" in amx.describe()


CHECKS: tuple[Callable[[], None], ...] = (
    check_reset_cache_starts_a_new_epoch_and_returns_true,
    check_model_id_is_the_identity_of_the_weights,
    check_kv_changing_vllm_settings_are_in_the_model_identity,
    check_pages_of_other_kernel_isas_never_share_a_namespace,
)


def main() -> None:
    results: dict[str, str] = {}
    for check in CHECKS:
        try:
            check()
        except Exception:  # noqa: BLE001 - every check's failure is reported, not just the first
            results[check.__name__] = traceback.format_exc()
        else:
            results[check.__name__] = "ok"
    emit({"checks": results})


if __name__ == "__main__":
    main()
