"""The startup self-test: a synthetic chunk stored on every rank, looked up from the scheduler,
read back on every rank. Any failure stops startup with the cause."""

from __future__ import annotations

from collections.abc import Sequence

import blake3
import torch

from kvtier.errors import StartupError
from kvtier.offload.protocols import LookupPort

SELF_TEST_KEY = blake3.blake3(b"kvtier self-test chunk v1").digest(16)


def self_test_payload(nbytes: int) -> torch.Tensor:
    """Deterministic non-trivial bytes, so a rank that returns zeros or stale bytes fails."""
    g = torch.Generator().manual_seed(0x6B7674)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def check_lookup(client: LookupPort, ranks: Sequence[int]) -> None:
    """Look the self-test chunk up on every rank in scope; raise naming any rank that missed."""
    result = client.lookup([SELF_TEST_KEY], "kvtier-self-test", lease=False)
    per_rank = getattr(result, "per_rank", {})
    missing = [r for r in ranks if per_rank.get(r, 0) < 1]
    if result.hit_chunks < 1 or missing:
        raise StartupError(
            f"kvtier self-test: ranks {missing or list(ranks)} did not report the self-test chunk "
            f"(timed out: {list(result.timed_out)}); every rank in the lookup scope must run an "
            "OffloadWorker with a lookup server reachable from the scheduler"
        )
