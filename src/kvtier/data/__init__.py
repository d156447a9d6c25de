"""Data that ships inside the package, so a plain `pip install kvtier` has what its defaults
name (`NOTICE.md` beside this file says where each file comes from and under what license)."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

# the name `--trace` accepts for the bundled trace, and the file it stands for
MOONCAKE_SYNTHETIC = "mooncake-synthetic"
_BUNDLED = {MOONCAKE_SYNTHETIC: "mooncake-synthetic-trace.jsonl.gz"}


def bundled_trace(name: str = MOONCAKE_SYNTHETIC) -> Path:
    """The path of a trace shipped with kvtier (gzip JSONL; `read_trace_rows` reads it as is)."""
    try:
        file = _BUNDLED[name]
    except KeyError:
        raise KeyError(f"no bundled trace {name!r}; bundled: {sorted(_BUNDLED)}") from None
    return Path(str(files(__name__).joinpath(file)))


def resolve_trace(value: str | Path) -> Path:
    """`value` as a trace path: a bundled trace's name (when no such file exists) or a path."""
    p = Path(value)
    if not p.exists() and str(value) in _BUNDLED:
        return bundled_trace(str(value))
    return p
