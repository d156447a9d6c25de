"""Read an HF Llama/Qwen2 checkpoint directory: `config.json` and safetensors (single file or
sharded with `model.safetensors.index.json`), each rank reading only its slice of each tensor."""

from __future__ import annotations

import json
import re
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kvtier.errors import ConfigError
from kvtier.native.model import AllReduce, LlamaForCausalLM, ModelConfig, Rotary

SUPPORTED_TYPES = ("llama", "qwen2")
# buffers some older checkpoints carry; they are recomputed, never loaded
_IGNORED = re.compile(r"\.rotary_emb\.inv_freq$")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist; pass an HF model directory") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None


def _eos_ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)  # type: ignore[union-attr]


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Parse `config.json` (+ `generation_config.json` for eos ids) into a ModelConfig."""
    d = Path(model_dir)
    raw = _read_json(d / "config.json")
    mtype = raw.get("model_type")
    if mtype not in SUPPORTED_TYPES:
        raise ConfigError(
            f"{d}/config.json has model_type={mtype!r}; the native engine runs {SUPPORTED_TYPES}"
        )
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{d}/config.json has hidden_act={act!r}; only 'silu' is supported")
    if raw.get("use_sliding_window"):
        raise ConfigError(f"{d}/config.json enables a sliding window; it is not supported")
    heads = int(raw["num_attention_heads"])
    eos = _eos_ids(raw.get("eos_token_id"))
    gen_path = d / "generation_config.json"
    if gen_path.exists():
        eos = _eos_ids(_read_json(gen_path).get("eos_token_id")) or eos
    bias = bool(raw.get("attention_bias", False))
    return ModelConfig(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
        max_position=int(raw.get("max_position_embeddings", 4096)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        rope_scaling=raw.get("rope_scaling"),
        # Qwen2 always has q/k/v biases and no o_proj bias; Llama's attention_bias covers all four
        qkv_bias=bias or mtype == "qwen2",
        o_bias=bias and mtype == "llama",
        mlp_bias=bool(raw.get("mlp_bias", False)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        model_type=mtype,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos,
    )


def checkpoint_files(model_dir: str | Path) -> dict[str, Path]:
    """Tensor name -> safetensors file holding it."""
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConfigError(f"{index} has no 'weight_map'; it is not a safetensors index")
        return {name: d / fname for name, fname in weight_map.items()}
    single = d / "model.safetensors"
    if not single.exists():
        raise ConfigError(
            f"{d} holds neither model.safetensors nor model.safetensors.index.json; "
            "the native engine loads safetensors checkpoints only"
        )
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def _shard_rule(name: str) -> tuple[int | None, str]:
    """(dim to split, or None to replicate; kind) for one parameter name."""
    if re.search(r"self_attn\.[qkv]_proj\.(weight|bias)$", name):
        return 0, "heads"
    if re.search(r"mlp\.(gate|up)_proj\.(weight|bias)$", name):
        return 0, "cols"
    if re.search(r"(self_attn\.o_proj|mlp\.down_proj)\.weight$", name):
        return 1, "rows"
    return None, "replicated"


def load_weights(
    model: LlamaForCausalLM, model_dir: str | Path, tp_rank: int = 0, tp_size: int = 1
) -> None:
    """Copy every parameter of `model` from the checkpoint, reading only this rank's slice.

    Missing tensors and unexpected ones (other than rotary buffers) are errors.
    """
    files = checkpoint_files(model_dir)
    params = dict(model.named_parameters())
    if model.config.tie_word_embeddings:
        files.pop("lm_head.weight", None)  # some tied checkpoints still store a copy
    missing = sorted(set(params) - set(files))
    if missing:
        raise ConfigError(
            f"checkpoint in {model_dir} lacks {len(missing)} tensors, e.g. {missing[:4]}; "
            "is config.json (biases, tie_word_embeddings) right for these weights?"
        )
    unexpected = sorted(n for n in set(files) - set(params) if not _IGNORED.search(n))
    if unexpected:
        raise ConfigError(
            f"checkpoint in {model_dir} has {len(unexpected)} tensors the model does not use, "
            f"e.g. {unexpected[:4]}; is config.json right for these weights?"
        )
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def handle(path: Path) -> Any:
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(str(path), framework="pt"))
            return handles[path]

        for name, param in params.items():
            _copy(name, param, handle(files[name]), tp_rank, tp_size)


def _copy(name: str, param: torch.nn.Parameter, f: Any, rank: int, size: int) -> None:
    dim, _ = _shard_rule(name)
    sl = f.get_slice(name)
    full = list(sl.get_shape())
    want = list(param.shape)
    if dim is None or size == 1:
        tensor = sl[:]
    else:
        step = full[dim] // size
        lo, hi = rank * step, (rank + 1) * step
        tensor = sl[lo:hi] if dim == 0 else sl[:, lo:hi]
    if list(tensor.shape) != want:
        raise ConfigError(
            f"tensor {name} has shape {full} (rank slice {list(tensor.shape)}), the model "
            f"expects {want}; config.json does not match the weights"
        )
    with torch.no_grad():
        param.copy_(tensor.to(param.dtype))


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    all_reduce: AllReduce | None = None,
    config: ModelConfig | None = None,
) -> LlamaForCausalLM:
    """Build the model for one rank, load its weights and move it to `dtype` on `device`."""
    cfg = config or load_model_config(model_dir)
    with torch.device("meta"):  # no throwaway random init: every parameter is loaded
        model = LlamaForCausalLM(cfg, tp_size, all_reduce)
    model = model.to_empty(device="cpu")
    load_weights(model, model_dir, tp_rank, tp_size)
    model = model.to(device=device, dtype=dtype).eval()
    # rotary tables stay float32 whatever the compute dtype
    model.rotary = Rotary(cfg.head_dim, cfg.max_position, cfg.rope_theta, cfg.rope_scaling)
    return model.to(device=device)
