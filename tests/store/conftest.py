"""Shared fixtures for tier tests: a fresh Metrics per test, namespaces, keys and payloads."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import pytest

from kvtier.metrics import Metrics


class FakeClock:
    """A clock tests advance by hand instead of sleeping."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def metrics() -> Metrics:
    """Metrics of rank 0 in a private registry, so counters start at zero."""
    return Metrics(rank=0)


@pytest.fixture
def namespace() -> bytes:
    return bytes(range(16))


@pytest.fixture
def other_namespace() -> bytes:
    return bytes(range(16, 32))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def key_of(i: int) -> bytes:
    """A deterministic 16-byte chunk key for index `i`."""
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def payload_of(i: int, size: int) -> bytes:
    """Deterministic, index-dependent payload bytes of length `size`."""
    block = hashlib.sha256(i.to_bytes(8, "little")).digest()
    return (block * (size // len(block) + 1))[:size]


@pytest.fixture
def make_key() -> Callable[[int], bytes]:
    return key_of


@pytest.fixture
def make_payload() -> Callable[[int, int], bytes]:
    return payload_of
