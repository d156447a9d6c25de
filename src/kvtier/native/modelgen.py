"""Write a tiny, deterministic, valid HF Llama model directory (config, tokenizer with a simple
chat template, safetensors).

The weights are random but scaled so that greedy output depends on the context (embedding std
1.0, linear std 1/sqrt(fan_in)); with HF's default std 0.02 every prompt decodes to one repeated
token, which cannot show whether restored KV is right. vLLM loads the same directory.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from kvtier.errors import ConfigError

SPECIAL_TOKENS = ("<s>", "</s>", "<unk>")
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
# plain-text role markers (the vocabulary has no chat tokens); vLLM renders the same template
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)
_SYLLABLES = (
    "ka ro mi ne su ta lo vi pe da zu fo ri ma ke no sa te li wa ge bu ho ya ni do ru se "
    "pa mo ti ga fe ko la vu re so di ba je nu ha to yo ze mu ki po"
).split()


def make_sentences(seed: int, n: int = 20000) -> list[str]:
    """`n` random sentences over a made-up word list; the same seed gives the same text."""
    rng = random.Random(seed)
    words = sorted(
        {"".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(1200)}
    )
    out = []
    for _ in range(n):
        body = " ".join(rng.choice(words) for _ in range(rng.randint(4, 14)))
        out.append(body.capitalize() + rng.choice(".!?,;"))
    return out


def _train_tokenizer(seed: int, vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(make_sentences(seed), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return tok


def _weights(
    seed: int, *, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int,
    head_dim: int, intermediate: int, dtype: torch.dtype, device: str = "cpu",
) -> dict[str, torch.Tensor]:  # fmt: skip
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        # drawn on `device` (a GPU makes an 8B model's weights in seconds), kept on the host
        return torch.randn(*shape, generator=gen, dtype=torch.float32, device=device)

    def linear(out_f: int, in_f: int) -> torch.Tensor:
        return (randn(out_f, in_f) / in_f**0.5).to(dtype).cpu()

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": randn(vocab, hidden).to(dtype).cpu()}
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = linear(heads * head_dim, hidden)
        w[p + "self_attn.k_proj.weight"] = linear(kv_heads * head_dim, hidden)
        w[p + "self_attn.v_proj.weight"] = linear(kv_heads * head_dim, hidden)
        w[p + "self_attn.o_proj.weight"] = linear(hidden, heads * head_dim)
        w[p + "mlp.gate_proj.weight"] = linear(intermediate, hidden)
        w[p + "mlp.up_proj.weight"] = linear(intermediate, hidden)
        w[p + "mlp.down_proj.weight"] = linear(hidden, intermediate)
        w[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=dtype)
        w[p + "post_attention_layernorm.weight"] = torch.ones(hidden, dtype=dtype)
    w["model.norm.weight"] = torch.ones(hidden, dtype=dtype)
    w["lm_head.weight"] = linear(vocab, hidden)
    return w


def init_model(
    directory: str | Path,
    *,
    seed: int = 0,
    vocab_size: int = 2048,
    hidden: int = 256,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    intermediate: int = 512,
    max_position: int = 4096,
    dtype: str = "bfloat16",
    device: str = "cpu",
) -> Path:
    """Write a tiny Llama model into `directory` (created if missing); returns its path.

    Deterministic: the same arguments give byte-identical `model.safetensors` (`device` draws
    the weights there, with that device's generator: a GPU makes full-size shapes quickly).
    """
    if dtype not in _DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not one of {sorted(_DTYPES)}; pick one of them")
    if heads % kv_heads:
        raise ConfigError(f"heads={heads} is not a multiple of kv_heads={kv_heads}")
    if vocab_size < 300:
        raise ConfigError(f"vocab_size={vocab_size} is below 300; byte-level BPE needs >= 300")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tok = _train_tokenizer(seed, vocab_size)
    tok.save(str(out / "tokenizer.json"))
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_position,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": dtype,
        "initializer_range": 0.02,
    }
    _write_json(out / "config.json", config)
    gen_config = {"bos_token_id": bos, "eos_token_id": eos, "do_sample": False}
    _write_json(out / "generation_config.json", gen_config)
    specials = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "</s>"}
    _write_json(out / "special_tokens_map.json", specials)
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **specials,
            "add_bos_token": True,
            "add_eos_token": False,
            "model_max_length": max_position,
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    weights = _weights(
        seed, vocab=vocab_size, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
        head_dim=head_dim, intermediate=intermediate, dtype=_DTYPES[dtype], device=device,
    )  # fmt: skip
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
