"""Incremental output text of one sequence, with stop strings (vLLM's detokenizer semantics).

Text is decoded over a sliding window: the tokens since the last emitted boundary are decoded
with and without the new ones and the difference is the new text; a trailing replacement
character (an incomplete UTF-8 sequence) waits for the next token, for at most
`MAX_PENDING_TOKENS` tokens (no UTF-8 character takes more bytes, so a replacement character
still there is an invalid byte for good and goes out as it is). The window so stays bounded and
the work is linear in the output: before, a text that kept ending in U+FFFD was decoded again
from its last boundary on every step. With stop strings, the last `max(len(stop)) - 1`
characters are held back until the sequence ends, so a stop string split over two tokens is
never streamed; a match truncates the text (keeping the stop string with
`include_stop_str_in_output`).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.native.tokenizer import Tokenizer

MAX_PENDING_TOKENS = 8  # a UTF-8 character is at most 4 bytes, a byte token at least one


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
        waiting = len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd")
        if waiting and not final and len(token_ids) - self._read < MAX_PENDING_TOKENS:
            return ""
        self._prefix, self._read = self._read, len(token_ids)
        return new_text[len(prefix_text) :]


class TextStream:
    """A sequence's text as the client sees it: decoded, stop strings applied, held back.

    Emitted text is kept as pieces and only the held-back text (plus the last
    `max(len(stop)) - 1` emitted characters a match may start in) is searched and copied per
    update, so an update costs what it adds, not the length of the text so far.
    """

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
        self._longest = max((len(s) for s in self.stop), default=0)
        self._hold = max(self._longest - 1, 0) if not include_stop else 0
        self._pieces: list[str] = []  # emitted text
        self._held = ""  # decoded, not emitted yet
        self._tail = ""  # the last `longest - 1` emitted characters
        self.stopped_by: str | None = None

    @property
    def text(self) -> str:
        """All text so far (emitted plus held back)."""
        return "".join(self._pieces) + self._held

    def update(self, token_ids: Sequence[int], final: bool) -> str:
        """Feed the output so far; returns the text to emit now.

        Sets `stopped_by` when a stop string matched (the caller then ends the sequence).
        """
        if self.stopped_by is not None:
            return ""
        delta = self._detok.update(token_ids, final)
        pending = self._held + delta
        if self.stop and delta:
            # a new match ends in the new text: it starts at most longest - 1 characters before
            search = self._tail + pending
            start = max(0, len(self._tail) + len(self._held) - self._longest + 1)
            hit = self._find_stop(search, start)
            if hit is not None:
                i, s = hit
                pending = search[len(self._tail) : i + len(s) if self.include_stop else i]
                self.stopped_by = s
                final = True
        cut = len(pending) if final else max(0, len(pending) - self._hold)
        out, self._held = pending[:cut], pending[cut:]
        if out:
            self._pieces.append(out)
            if self._longest > 1:
                self._tail = (self._tail + out)[-(self._longest - 1) :]
        return out

    def _find_stop(self, text: str, start: int) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best
