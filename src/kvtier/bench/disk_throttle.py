"""A slow disk made from real parts, for `kvtier bench load-cost --disk`: this process moved into
a block-I/O cgroup that caps reads from the device holding a directory, and the page cache of
that directory's files dropped before each read, so the disk tier reads the device at the cap.

Needs root and a cgroup with I/O throttling (v1 `blkio.throttle.read_bps_device` or v2
`io.max`); anything else is refused by name before a number is measured.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType

from kvtier.errors import ConfigError

_V1 = Path("/sys/fs/cgroup/blkio")
_V2 = Path("/sys/fs/cgroup")
_FIX = (
    "run the bench as root on a host whose cgroups throttle block I/O (cgroup v1 blkio or v2 "
    "io), on a directory of a real block device, or leave --disk out"
)


def device_of(directory: Path) -> str:
    """`major:minor` of the block device holding `directory`."""
    dev = os.stat(directory).st_dev
    major, minor = os.major(dev), os.minor(dev)
    if major == 0:
        raise ConfigError(
            f"{str(directory)!r} is on a virtual filesystem (device 0:{minor}: tmpfs, overlay, "
            f"NFS), whose reads no block-I/O cgroup can throttle; {_FIX}"
        )
    return f"{major}:{minor}"


def _current(controller: str) -> str:
    """This process's group under `controller` ("" : the v2 hierarchy), relative to its root."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        if controller in names.split(",") or (not controller and not names):
            return path.lstrip("/")
    raise ConfigError(f"this process is in no {controller or 'v2'} cgroup; {_FIX}")


def _v2_controllers() -> list[str]:
    """The controllers cgroup v2 offers at its root (none without a v2 hierarchy)."""
    path = _V2 / "cgroup.controllers"
    return path.read_text().split() if path.exists() else []


class ThrottledDisk:
    """While entered, this process reads the device of `directory` at `rate` bytes/s at most."""

    def __init__(self, directory: Path, rate: float) -> None:
        if rate <= 0:
            raise ValueError(f"disk read rate {rate!r} bytes/s must be > 0")
        self.directory = directory
        self.device = device_of(directory)
        self.rate = int(rate)
        self._group: Path | None = None
        self._home: Path | None = None

    def __enter__(self) -> ThrottledDisk:
        name = f"kvtier-bench-{os.getpid()}"
        if (_V1 / "blkio.throttle.read_bps_device").exists():
            home = _V1 / _current("blkio")
            group, limit = home / name, "blkio.throttle.read_bps_device"
            line = f"{self.device} {self.rate}"
        elif "io" in _v2_controllers():
            home = _V2 / _current("")
            group, limit, line = home / name, "io.max", f"{self.device} rbps={self.rate}"
        else:
            raise ConfigError(f"this host has no block-I/O cgroup controller; {_FIX}")
        self._home = home
        try:
            group.mkdir(exist_ok=True)
            self._group = group
            (group / limit).write_text(line)
            (group / "cgroup.procs").write_text(str(os.getpid()))
        except OSError as e:
            self._leave()
            raise ConfigError(f"could not throttle reads of {self.device} ({e}); {_FIX}") from e
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._leave()

    def _leave(self) -> None:
        """Back into the parent group, and the throttled one removed."""
        if self._group is None or self._home is None:
            return
        try:
            (self._home / "cgroup.procs").write_text(str(os.getpid()))
            self._group.rmdir()
        except OSError as e:
            raise ConfigError(
                f"could not leave the throttling cgroup {self._group} ({e}); remove it by hand"
            ) from e
        finally:
            self._group = None

    def drop_cache(self) -> int:
        """Write back and drop the page cache of every file under the directory (the next read
        goes to the device); the bytes dropped."""
        dropped = 0
        for path in self.directory.rglob("*"):
            if not path.is_file():
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                dropped += os.fstat(fd).st_size
            finally:
                os.close(fd)
        return dropped
