"""Runs the host-adapter conformance suite for every host kvtier ships."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from kvtier.native.sampling import SamplingParams
from kvtier.native.sequence import Sequence as NativeSequence
from tests.offload.conformance import CHECKS, HostAdapter
from tests.offload.fakes import SlotView


def _native_make(req_id: str, prompt: Sequence[int], computed: int, blocks: Sequence[int]) -> Any:
    seq = NativeSequence(req_id, list(prompt), SamplingParams(), seed=0, arrival=0)
    seq.num_computed_tokens = computed
    seq.block_ids = list(blocks)
    return seq


def _native_advance(seq: Any, computed: int, blocks: Sequence[int]) -> None:
    seq.num_computed_tokens = computed
    seq.block_ids = list(blocks)


ADAPTERS = [
    HostAdapter("native", _native_make, _native_advance),
    HostAdapter("slots", SlotView, lambda v, c, b: v.advance(c, b)),
]


@pytest.mark.parametrize("adapter", ADAPTERS, ids=lambda a: a.name)
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_host_adapter_conformance(adapter: HostAdapter, check) -> None:
    check(adapter)
