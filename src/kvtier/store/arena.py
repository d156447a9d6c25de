"""The memory tier's host arena, sized exactly, and the host-RAM check made before it exists.

torch's pinned allocator rounds a request up to a power of two (100 GiB asked pins 128 GiB), so
the arena is plain host memory of the exact size, registered with CUDA for DMA where CUDA is
present (in parallel pieces, on the GPU's NUMA node, with its progress and time logged) and
unregistered when it closes. Before any rank allocates, the total over every rank
of every replica on this host is held against the host's RAM (or its cgroup limit).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kvtier.config import format_size
from kvtier.cpus import parse_cpu_list
from kvtier.errors import ConfigError

log = logging.getLogger("kvtier")

# vLLM refuses a CPU swap space over 70% of RAM and warns above 40%; the tier follows suit
REFUSE_FRACTION = 0.7
WARN_FRACTION = 0.4
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def host_ram_bytes() -> int:
    """Physical RAM of this host, or the cgroup memory limit when that is smaller."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in _CGROUP_LIMITS:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def check_host_memory(
    memory_bytes: int, ranks_on_host: int, tag: str, ram_bytes: int | None = None
) -> None:
    """Refuse `memory_bytes` per rank when all ranks on this host would take over 70% of RAM;
    warn above 40%."""
    ram = host_ram_bytes() if ram_bytes is None else ram_bytes
    total = memory_bytes * max(1, ranks_on_host)
    share = total / ram if ram > 0 else float("inf")
    what = (
        f"memory_bytes={format_size(memory_bytes)} per rank x {ranks_on_host} rank(s) on this "
        f"host = {format_size(total)}, {share:.0%} of the host's {format_size(ram)} RAM"
    )
    if share > REFUSE_FRACTION:
        fit = int(ram * REFUSE_FRACTION) // max(1, ranks_on_host)
        raise ConfigError(
            f"{what}, over the {REFUSE_FRACTION:.0%} limit: lower memory_bytes to at most "
            f"{format_size(fit)} per rank (or add a disk tier for the rest)"
        )
    if share > WARN_FRACTION:
        log.warning("%s: %s; the engine and the OS share the rest", tag, what)


# page-locking runs in pieces of about this size on parallel threads (the kernel's work per
# page dominates: one thread locks ~2-5 GB/s, so 200 GiB on one thread takes about a minute)
REGISTER_PIECE_BYTES = 1 << 30
REGISTER_THREADS = 8
_PROGRESS_EVERY_S = 5.0
# arenas a copy may still use when they closed: kept allocated and registered (see abandon)
_ABANDONED: list[torch.Tensor] = []


def _cuda_register(ptr: int, nbytes: int) -> int:
    return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))


def _cuda_unregister(ptr: int) -> int:
    return int(torch.cuda.cudart().cudaHostUnregister(ptr))


def gpu_numa_cpus() -> tuple[int | None, frozenset[int] | None]:
    """The NUMA node of the current CUDA device and that node's CPUs, from sysfs; (None, None)
    when either cannot be read (a single-node host, a container without /sys)."""
    if not torch.cuda.is_available():
        return None, None
    try:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        bus = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        node = int(Path(f"/sys/bus/pci/devices/{bus}/numa_node").read_text().strip())
        if node < 0:
            return None, None
        cpulist = Path(f"/sys/devices/system/node/node{node}/cpulist").read_text().strip()
        cpus = parse_cpu_list(cpulist, f"node{node}/cpulist") & frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError, ValueError, RuntimeError, ConfigError):
        return None, None
    return node, cpus or None


class HostArena:
    """One exact-size host buffer, resident from construction: page-locked for CUDA DMA when
    `pin` is set (in `align`-multiple pieces on parallel threads placed on the GPU's NUMA node,
    so a copy never straddles two registrations), else zeroed."""

    def __init__(self, nbytes: int, *, pin: bool, align: int = 1) -> None:
        try:
            self.tensor = torch.empty(nbytes, dtype=torch.uint8)
        except RuntimeError as e:
            raise ConfigError(
                f"memory_bytes: could not allocate a host arena of {format_size(nbytes)} "
                f"({e}); lower memory_bytes"
            ) from None
        self.nbytes = nbytes
        self.pinned = False
        self._pieces: list[int] = []  # data pointers registered
        if pin and nbytes:
            self._register(max(1, align))
        else:
            # write every page now: the tier's memory is resident from startup, so an
            # over-committed host fails here and not mid-run, and no save pays a first-touch
            # page fault inside its copy (0.30 vs 0.06 ms per MiB on a 2-core VM)
            self.tensor.zero_()

    def _register(self, align: int) -> None:
        """Page-lock the arena piece by piece on parallel threads; page-locking faults every
        page in, on the registering thread's NUMA node."""
        base = self.tensor.data_ptr()
        piece = max(align, REGISTER_PIECE_BYTES // align * align)
        spans = [(off, min(piece, self.nbytes - off)) for off in range(0, self.nbytes, piece)]
        node, cpus = gpu_numa_cpus()
        threads = max(1, min(REGISTER_THREADS, len(spans), len(cpus) if cpus else REGISTER_THREADS))
        where = f"NUMA node {node}" if node is not None else "no NUMA placement"
        log.info(
            "kvtier: page-locking the memory tier's %s in %d pieces on %d threads (%s)",
            format_size(self.nbytes),
            len(spans),
            threads,
            where,
        )
        t0 = time.monotonic()
        lock = threading.Lock()
        done = [0, t0]  # bytes locked, time of the last progress line
        errors: list[str] = []

        def one(span: tuple[int, int]) -> None:
            off, n = span
            if cpus:
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(0, cpus)  # this thread only: first touch on the node
            err = _cuda_register(base + off, n)
            with lock:
                if err != 0:
                    errors.append(f"bytes {off}..{off + n}: cudaHostRegister error {err}")
                    return
                self._pieces.append(base + off)
                done[0] += n
                now = time.monotonic()
                if now - done[1] >= _PROGRESS_EVERY_S:
                    done[1] = now
                    log.info(
                        "kvtier: page-locked %s of %s (%.0f%%, %.1f s)",
                        format_size(done[0]),
                        format_size(self.nbytes),
                        100.0 * done[0] / self.nbytes,
                        now - t0,
                    )

        with ThreadPoolExecutor(threads, thread_name_prefix="kvtier-pin") as pool:
            list(pool.map(one, spans))
        if errors:
            self._unregister()
            raise ConfigError(
                f"memory_bytes: CUDA could not page-lock a host arena of "
                f"{format_size(self.nbytes)} ({errors[0]}); lower memory_bytes or raise the "
                "locked-memory limit (ulimit -l)"
            )
        self.pinned = True
        seconds = time.monotonic() - t0
        log.info(
            "kvtier: page-locked the memory tier's %s in %.1f s (%.1f GB/s, %d threads, %s)",
            format_size(self.nbytes),
            seconds,
            self.nbytes / max(seconds, 1e-9) / 1e9,
            threads,
            where,
        )

    def _unregister(self) -> None:
        for ptr in self._pieces:
            err = _cuda_unregister(ptr)
            if err != 0:
                log.warning("kvtier: cudaHostUnregister of the arena failed (error %d)", err)
        self._pieces = []

    def abandon(self) -> None:
        """A copy may still read or write this memory: keep it allocated and page-locked for
        the rest of the process, so `close` neither frees nor unregisters it."""
        _ABANDONED.append(self.tensor)
        self._pieces = []
        self.pinned = False

    def close(self) -> None:
        """Unregister and drop the buffer."""
        if self.pinned:
            self._unregister()
            self.pinned = False
        self.tensor = torch.empty(0, dtype=torch.uint8)
