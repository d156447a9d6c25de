"""`VLLMRequestView`: vLLM's `Request` as the offload core's read-only `RequestView`.

vLLM's scheduler-side `Request` carries no block table (the KV cache manager owns it), so the
view keeps the block ids the connector learned from allocations and scheduler outputs: one
table per KV cache group (a hybrid model has several; `block_ids` is the first).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from kvtier.offload.retention import RetentionHint, hint_from_params

__all__ = ["VLLMRequestView"]

log = logging.getLogger("kvtier")


class VLLMRequestView:
    """Read-only view over a vLLM `Request` plus the block table the connector learned."""

    __slots__ = ("_groups", "_request", "state_blocks")

    def __init__(self, request: Any, block_ids: Iterable[int] = ()) -> None:
        self._request = request
        self._groups: list[list[int]] = [list(block_ids)]
        # a hybrid model's boundary states vLLM handed over this step: boundary tokens -> the
        # block of each state group holding the state after them (valid for this step only)
        self.state_blocks: dict[int, list[int]] = {}

    @property
    def request(self) -> Any:
        """The wrapped vLLM request (the host owns it; the core never sees it)."""
        return self._request

    @property
    def request_id(self) -> str:
        """vLLM's request id, stable for the request's whole lifecycle."""
        return self._request.request_id

    @property
    def prompt_token_ids(self) -> Sequence[int]:
        """The prompt's token ids (empty for a prompt given as embeddings)."""
        ids = self._request.prompt_token_ids
        return () if ids is None else ids

    @property
    def num_computed_tokens(self) -> int:
        """Tokens vLLM counts as computed now (read live from the request)."""
        return self._request.num_computed_tokens

    @property
    def block_ids(self) -> Sequence[int]:
        """The request's KV block table as last learned (one id per block; the first group's)."""
        return self._groups[0]

    @property
    def group_block_ids(self) -> Sequence[Sequence[int]]:
        """Every KV cache group's block table as last learned, in vLLM's group order."""
        return self._groups

    @property
    def retention(self) -> RetentionHint | None:
        """The client's retention hint from the request's `kv_transfer_params` (the only
        per-request channel vLLM gives a connector); a bad one is logged and ignored."""
        params = getattr(self._request, "kv_transfer_params", None)
        if not isinstance(params, dict):
            return None
        try:
            return hint_from_params(params)
        except ValueError as e:
            # the message quotes the client's value: bounded, whatever its size
            log.warning("kvtier: request %.64s: retention hint ignored: %.200s",
                        self.request_id, str(e))  # fmt: skip
            return None

    def set_block_ids(self, block_ids: Iterable[int]) -> None:
        """Replace the learned block table (allocation, new or resumed request)."""
        self._groups = [list(block_ids)]

    def extend_block_ids(self, block_ids: Iterable[int]) -> None:
        """Append blocks vLLM allocated for a running request this step."""
        self._groups[0].extend(block_ids)

    def set_group_block_ids(self, groups: Iterable[Iterable[int]]) -> None:
        """Replace every group's learned block table."""
        self._groups = [list(g) for g in groups] or [[]]

    def extend_group_block_ids(self, groups: Iterable[Iterable[int]]) -> None:
        """Append each group's blocks vLLM allocated for a running request this step."""
        new = [list(g) for g in groups]
        while len(self._groups) < len(new):
            self._groups.append([])
        for table, more in zip(self._groups, new, strict=False):
            table.extend(more)

    def __repr__(self) -> str:
        return (
            f"VLLMRequestView({self.request_id!r}, prompt={len(self.prompt_token_ids)} tokens, "
            f"computed={self.num_computed_tokens}, blocks={len(self._groups[0])})"
        )
