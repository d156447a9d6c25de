"""Incremental output text of one sequence, with stop strings (vLLM's detokenizer semantics).

Text is decoded over a sliding window: the tokens since the last emitted boundary are decoded
with and without the new ones and the difference is the new text; a trailing replacement
character (an incomplete UTF-8 sequence) waits for the next token. With stop strings, the last
`max(len(stop)) - 1` characters are held back until the sequence ends, so a stop string split
over two tokens is never streamed; a match truncates the text (keeping the stop string with
`include_stop_str_in_output`).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.native.tokenizer import Tokenizer


class Detokenizer:
    """The text `token_ids` (all output so far) adds, token by token."""

    def __init__(self, tokenizer: Tokenizer | None, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens whose text was emitted

    def update(self, token_ids: Sequence[int], final: bool) -> str:
        """The text the tokens after the last call add to what was emitted."""
        if self.tokenizer is None:
            return ""
        tok = self.tokenizer
        # a window start a little before the emitted boundary keeps word-joining decoders right
        prefix_text = tok.decode(token_ids[self._prefix : self._read], self.skip)
        new_text = tok.decode(token_ids[self._prefix :], self.skip)
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(token_ids)
        return new_text[len(prefix_text) :]


class TextStream:
    """A sequence's text as the client sees it: decoded, stop strings applied, held back."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        stop: Sequence[str] = (),
        *,
        include_stop: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self._detok = Detokenizer(tokenizer, skip_special_tokens)
        self.stop = tuple(stop)
        self.include_stop = include_stop
        self._hold = max((len(s) for s in self.stop), default=1) - 1 if not include_stop else 0
        self.text = ""  # all text so far (emitted plus held back)
        self._emitted = 0
        self.stopped_by: str | None = None

    def update(self, token_ids: Sequence[int], final: bool) -> str:
        """Feed the output so far; returns the text to emit now.

        Sets `stopped_by` when a stop string matched (the caller then ends the sequence).
        """
        if self.stopped_by is not None:
            return ""
        delta = self._detok.update(token_ids, final)
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0) + 1)
        self.text += delta
        if self.stop and delta:
            hit = self._find_stop(start)
            if hit is not None:
                final = True
        end = len(self.text) if final else max(self._emitted, len(self.text) - self._hold)
        self._emitted = min(self._emitted, end)
        out = self.text[self._emitted : end]
        self._emitted = end
        return out

    def _find_stop(self, start: int) -> str | None:
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
        self.stopped_by = s
        return s
