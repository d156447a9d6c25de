"""What the issue-10 rows of the fault suite set up outside the engine: a small tmpfs
that a filler file fills for real, a second weight set under the same config and directory
name, and completion requests with sampling edge values."""

from __future__ import annotations

import errno
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx

from kvtier.errors import StartupError

TMPFS_BYTES = 8 << 20
# what a greedy reference must still produce: temperatures vLLM treats as greedy (< 1e-5), and
# a top_p so small that only the most likely token is left
EDGE_SAMPLING: tuple[dict[str, float], ...] = (
    {"temperature": 1e-39},
    {"temperature": 1e-45},
    {"temperature": 1e-300},
    {"temperature": 1.0, "top_p": 1e-300},
)


class Tmpfs:
    """A tmpfs of `size` bytes mounted at `path` (root and CAP_SYS_ADMIN needed), unmounted on
    `close`; `fill()` writes a filler file until the filesystem reports ENOSPC."""

    def __init__(self, path: Path, size: int = TMPFS_BYTES) -> None:
        self.path = path
        self.size = size
        path.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise StartupError(
                f"the disk_tmpfs fault mounts an {size >> 20} MiB tmpfs at {path} and could not "
                f"({proc.stderr.strip() or f'exit code {proc.returncode}'}); run the tests as "
                "root with CAP_SYS_ADMIN, or leave that fault out"
            )
        self._filler = path / "filler"

    def fill(self) -> int:
        """Fill every free byte; returns how many the filler took."""
        block = b"\0" * (64 << 10)
        written = 0
        with self._filler.open("ab", buffering=0) as f:
            while True:
                try:
                    written += f.write(block)
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    return written

    def unfill(self) -> None:
        """Remove the filler: the space is back."""
        self._filler.unlink(missing_ok=True)

    def close(self) -> None:
        """Unmount (whatever was on it is gone)."""
        proc = subprocess.run(["umount", str(self.path)], capture_output=True, check=False)
        if proc.returncode != 0:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True, check=False)


def other_weights(model: Path, parent: Path) -> Path:
    """A copy of `model` under `parent` with the same directory name and config.json and
    perturbed weights: another checkpoint that only its weights tell apart."""
    import torch
    from safetensors.torch import load_file, save_file

    out = parent / model.name
    shutil.copytree(model, out)
    g = torch.Generator().manual_seed(20261)
    for path in sorted(out.glob("*.safetensors")):
        weights = load_file(str(path))
        save_file(
            {k: v + 0.5 * v.std() * torch.randn(v.shape, generator=g) for k, v in weights.items()},
            str(path),
        )
    return out


async def edge_completion(
    client: httpx.AsyncClient, prompt: list[int], max_tokens: int, sampling: dict[str, float],
    model: str,
) -> tuple[list[int] | None, str]:  # fmt: skip
    """One non-streamed completion with `sampling`: (output token ids, "") or (None, why)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "return_token_ids": True,
        **sampling,
    }
    r = await client.post("/v1/completions", json=body)
    if r.status_code != 200:
        shown = "a traceback" if "Traceback" in r.text else repr(r.text[:160])
        return None, f"{sampling}: HTTP {r.status_code} with {shown}"
    ids = r.json()["choices"][0].get("token_ids")
    if not isinstance(ids, list):
        return None, f"{sampling}: no token_ids in the response"
    return [int(t) for t in ids], ""
