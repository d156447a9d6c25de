"""`VLLMRequestView` without vLLM: it reads the host request live and keeps the block table."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvtier.offload.protocols import RequestView
from kvtier.vllm.request_view import VLLMRequestView


def _request(**kw: object) -> SimpleNamespace:
    base = {"request_id": "r1", "prompt_token_ids": [5, 6, 7], "num_computed_tokens": 0}
    return SimpleNamespace(**{**base, **kw})


def test_view_reads_the_host_request_live() -> None:
    req = _request()
    view = VLLMRequestView(req, [3, 4])
    assert isinstance(view, RequestView)
    assert (view.request_id, list(view.prompt_token_ids), view.num_computed_tokens) == (
        "r1",
        [5, 6, 7],
        0,
    )
    req.num_computed_tokens = 128  # vLLM advances its request; the view sees it
    assert view.num_computed_tokens == 128
    assert view.request is req


def test_view_keeps_the_block_table_it_learned() -> None:
    view = VLLMRequestView(_request())
    assert list(view.block_ids) == []
    view.set_block_ids([7, 8])
    view.extend_block_ids([9])
    assert list(view.block_ids) == [7, 8, 9]
    view.set_block_ids(())
    assert list(view.block_ids) == []


def test_view_of_an_embeddings_prompt_has_no_tokens() -> None:
    assert tuple(VLLMRequestView(_request(prompt_token_ids=None)).prompt_token_ids) == ()


def test_view_is_slotted() -> None:
    view = VLLMRequestView(_request())
    assert not hasattr(view, "__dict__")
    with pytest.raises(AttributeError):
        view.request_id = "other"  # type: ignore[misc]


def test_view_keeps_every_kv_cache_groups_table() -> None:
    view = VLLMRequestView(_request())
    view.set_group_block_ids([[1, 2], [-1, 9]])
    view.extend_group_block_ids([[3], [10]])
    assert [list(t) for t in view.group_block_ids] == [[1, 2, 3], [-1, 9, 10]]
    # the first group's table is the block table of a one-group host
    assert list(view.block_ids) == [1, 2, 3]
    view.set_block_ids([7])
    assert [list(t) for t in view.group_block_ids] == [[7]]
