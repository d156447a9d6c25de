"""The memory tier's host arena is exactly the size asked (torch's pinned allocator would round
it up to a power of two), is page-locked by registering it, and is refused by name when the
ranks of a host would take more of its RAM than is safe."""

from __future__ import annotations

import logging
import mmap
import resource

import pytest
import torch

from kvtier.errors import ConfigError
from kvtier.store import arena
from kvtier.store.arena import HostArena, check_host_memory

GiB = 1 << 30


class FakeCudart:
    def __init__(self) -> None:
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.registered.append((ptr, size))
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        return 0


def test_the_arena_is_exactly_the_size_asked_and_registered_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    n = 3 * (1 << 20) + 4097  # far from a power of two
    a = HostArena(n, pin=True)
    ptr = a.tensor.data_ptr()
    assert a.tensor.numel() == n and a.tensor.untyped_storage().nbytes() == n
    assert cudart.registered == [(ptr, n)]
    a.close()
    assert cudart.unregistered == [ptr] and a.tensor.numel() == 0


def test_a_failed_registration_names_memory_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    cudart = FakeCudart()
    cudart.cudaHostRegister = lambda ptr, size, flags: 2  # type: ignore[method-assign]
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    with pytest.raises(ConfigError, match=r"memory_bytes: CUDA could not page-lock.*ulimit -l"):
        HostArena(1 << 20, pin=True)


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_the_arena_is_resident_before_the_first_save_writes_it() -> None:
    # torch.empty maps pages lazily: without writing them at construction, every first save
    # into a slot page-faults inside its copy, and an over-committed host dies mid-run
    n = 64 << 20
    pages = n // mmap.PAGESIZE
    a = HostArena(n, pin=False)
    try:
        chunk = torch.full((1 << 20,), 7, dtype=torch.uint8)
        before = _minor_faults()
        for at in range(0, n, chunk.numel()):
            a.tensor[at : at + chunk.numel()].copy_(chunk)
        faults = _minor_faults() - before
        assert faults < pages // 20, f"{faults} page faults writing {pages} pages"
        assert int(a.tensor[-1]) == 7
    finally:
        a.close()


def test_an_arena_the_host_cannot_allocate_names_memory_bytes() -> None:
    with pytest.raises(ConfigError, match=r"memory_bytes: could not allocate a host arena"):
        HostArena(1 << 62, pin=False)


def test_ranks_over_70_percent_of_ram_are_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"memory_bytes=24GiB per rank x 4 rank\(s\)") as e:
        check_host_memory(24 * GiB, 4, "kvtier[rank 0/4]", ram_bytes=128 * GiB)
    assert "75% of the host's 128GiB RAM" in str(e.value)
    assert "lower memory_bytes to at most 22.4GiB per rank" in str(e.value)


def test_over_40_percent_warns_and_below_is_silent(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        check_host_memory(16 * GiB, 4, "kvtier[rank 2/4]", ram_bytes=128 * GiB)
        assert "kvtier[rank 2/4]: memory_bytes=16GiB per rank x 4" in caplog.text
        caplog.clear()
        check_host_memory(8 * GiB, 4, "kvtier[rank 2/4]", ram_bytes=128 * GiB)
        assert caplog.text == ""


def test_the_cgroup_limit_counts_as_the_hosts_ram(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    limit = tmp_path / "memory.max"
    limit.write_text(f"{4 * GiB}\n")
    monkeypatch.setattr(arena, "_CGROUP_LIMITS", (str(limit),))
    assert arena.host_ram_bytes() <= 4 * GiB
    with pytest.raises(ConfigError, match="of the host's 4GiB RAM"):
        check_host_memory(3 * GiB, 1, "kvtier[rank 0/1]")


def test_registration_runs_in_slot_aligned_pieces_on_parallel_threads_and_logs_its_time(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Page-locking 64-200 GiB on one thread takes minutes: pieces go to a pool of threads,
    each a whole number of slots (a slot's copy never straddles two registrations), and
    every piece is unregistered at close."""
    import threading

    cudart = FakeCudart()
    threads: set[str] = set()
    register = cudart.cudaHostRegister

    def watched(ptr: int, size: int, flags: int) -> int:
        threads.add(threading.current_thread().name)
        return register(ptr, size, flags)

    cudart.cudaHostRegister = watched  # type: ignore[method-assign]
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(arena, "REGISTER_PIECE_BYTES", 1 << 20)
    slot = 300_000
    caplog.set_level("INFO", logger="kvtier")
    a = HostArena(37 * slot, pin=True, align=slot)
    base = a.tensor.data_ptr()
    spans = sorted(cudart.registered)
    # contiguous, covering the arena exactly, each piece a whole number of slots
    assert spans[0][0] == base and sum(n for _, n in spans) == 37 * slot
    assert all(p + n == q for (p, n), (q, _) in zip(spans, spans[1:], strict=False))
    assert all(n % slot == 0 for _, n in spans) and len(spans) == 13
    assert all(name.startswith("kvtier-pin") for name in threads)
    assert "page-locking the memory tier's" in caplog.text and "in 13 pieces" in caplog.text
    assert "kvtier: page-locked the memory tier's" in caplog.text
    a.close()
    assert sorted(cudart.unregistered) == [p for p, _ in spans]


def test_a_failed_piece_unregisters_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    cudart = FakeCudart()
    register = cudart.cudaHostRegister
    calls = iter(range(1000))

    def third_fails(ptr: int, size: int, flags: int) -> int:
        return 2 if next(calls) == 2 else register(ptr, size, flags)

    cudart.cudaHostRegister = third_fails  # type: ignore[method-assign]
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(arena, "REGISTER_PIECE_BYTES", 1 << 20)
    with pytest.raises(ConfigError, match=r"cudaHostRegister error 2.*ulimit -l"):
        HostArena(8 << 20, pin=True)
    assert sorted(cudart.unregistered) == sorted(p for p, _ in cudart.registered)


def test_an_abandoned_arena_stays_registered_and_allocated(monkeypatch: pytest.MonkeyPatch) -> None:
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    a = HostArena(1 << 20, pin=True)
    t = a.tensor
    a.abandon()
    a.close()
    assert cudart.unregistered == [] and any(x is t for x in arena._ABANDONED)
