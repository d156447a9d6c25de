"""A thin wrapper over `tokenizers.Tokenizer` reading an HF model directory's tokenizer.json."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from kvtier.errors import ConfigError


def _eos_from(path: Path) -> list[int]:
    if not path.exists():
        return []
    value = json.loads(path.read_text()).get("eos_token_id")
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


class Tokenizer:
    """encode (special tokens per the post-processor, so BOS where the model wants it) / decode."""

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

    @property
    def vocab_size(self) -> int:
        """Number of tokens the tokenizer knows (special tokens included)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
