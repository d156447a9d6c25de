"""A thin wrapper over `tokenizers.Tokenizer` reading an HF model directory: tokenizer.json for
the vocabulary, tokenizer_config.json (or chat_template.jinja) for the chat template."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from kvtier.errors import ConfigError
from kvtier.native.chat_template import ChatTemplateError, Renderer, RenderLimits

__all__ = ["ChatTemplateError", "Tokenizer"]


def _eos_from(path: Path) -> list[int]:
    if not path.exists():
        return []
    value = json.loads(path.read_text()).get("eos_token_id")
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def _token_text(value: object) -> str:
    # tokenizer_config.json writes special tokens as strings or as AddedToken objects
    if isinstance(value, Mapping):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


def _template_from(d: Path, config: Mapping[str, Any]) -> str | None:
    jinja = d / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    value = config.get("chat_template")
    if isinstance(value, list):  # named templates: the "default" one serves chat
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        value = named.get("default")
    return value if isinstance(value, str) else None


class Tokenizer:
    """encode (special tokens per the post-processor, so BOS where the model wants it) / decode,
    and the model's chat template."""

    def __init__(self, model_dir: str | Path) -> None:
        d = Path(model_dir)
        path = d / "tokenizer.json"
        if not path.exists():
            raise ConfigError(f"{path} does not exist; the native engine needs a tokenizer.json")
        self._tok = _HFTokenizer.from_file(str(path))
        eos = _eos_from(d / "generation_config.json") or _eos_from(d / "config.json")
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        self.eos_token_id: int | None = eos[0] if eos else None
        bos = json.loads((d / "config.json").read_text()).get("bos_token_id")
        self.bos_token_id: int | None = bos if isinstance(bos, int) else None
        cfg_path = d / "tokenizer_config.json"
        config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.chat_template: str | None = _template_from(d, config)
        self.special_tokens = {
            name: _token_text(config.get(name)) for name in ("bos_token", "eos_token")
        }

    @property
    def vocab_size(self) -> int:
        """Number of tokens the tokenizer knows (special tokens included)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (the batch call releases the GIL: a long text cannot stall the
        server's event loop while a worker thread encodes it)."""
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token as logprobs report it (special tokens kept)."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    @cached_property
    def _renderer(self) -> Renderer:
        # jinja2 only for chat requests
        return Renderer()

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        documents: Sequence[Mapping[str, str]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        limits: RenderLimits | None = None,
    ) -> str:
        """The prompt text of a conversation, rendered with the model's (or the given) template
        under `limits` (time and size; defaults when None). `template_kwargs` sets variables
        the template reads (a request's chat_template_kwargs); raises ChatTemplateError."""
        template = chat_template or self.chat_template
        if template is None:
            raise ChatTemplateError(
                "the model directory has no chat template (tokenizer_config.json 'chat_template' "
                "or chat_template.jinja); add one, pass chat_template in the request, or use "
                "/v1/completions"
            )
        variables = {
            "messages": list(messages),
            "add_generation_prompt": add_generation_prompt,
            "documents": documents,
            **self.special_tokens,
        }
        return self._renderer.render(template, variables, template_kwargs, limits or RenderLimits())
