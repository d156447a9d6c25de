"""The repository needs nothing outside it: the bundled trace is the published file, byte for
byte, a plain install reads it by name, and no source, test, script or doc names a path above
the repository root (a user's clone has no sibling directories)."""

from __future__ import annotations

import ast
import gzip
import hashlib
import re
import subprocess
from pathlib import Path

import pytest

from kvtier.cachemodel.trace import read_trace_rows
from kvtier.data import MOONCAKE_SYNTHETIC, bundled_trace, resolve_trace

ROOT = Path(__file__).resolve().parents[1]
# the published file (kvtier/data/NOTICE.md): size and sha256 of the uncompressed bytes
MOONCAKE_BYTES = 1_136_313
MOONCAKE_SHA256 = "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131"
# a place outside the repository that a file could name: the sibling "shared" tree of a
# development checkout, or an absolute path of this machine
_OUTSIDE = re.compile(r"\.\./+shared\b|(?<![\w.])shared/(?:data|reference|seeds|hooks)\b|/work/")
_MD_LINK = re.compile(r"\]\(([^)#\s]+)")
_TEXT = {".py", ".md", ".sh", ".toml", ".yaml", ".yml", ".json", ".txt", ".cfg", ".ini", ""}


def test_the_bundled_trace_is_the_published_file() -> None:
    raw = gzip.decompress(bundled_trace().read_bytes())
    assert len(raw) == MOONCAKE_BYTES
    assert hashlib.sha256(raw).hexdigest() == MOONCAKE_SHA256
    rows = read_trace_rows(MOONCAKE_SYNTHETIC, block_tokens=512)
    assert len(rows) == 3993
    assert sum(r.input_length for r in rows) == sum(
        r.input_length for r in read_trace_rows(bundled_trace())
    )


def test_a_trace_name_is_a_path_first(tmp_path: Path) -> None:
    # a file the user named "mooncake-synthetic" is theirs, not the bundled trace
    own = tmp_path / MOONCAKE_SYNTHETIC
    own.write_text('{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [7]}\n')
    assert resolve_trace(own) == own
    assert [r.hash_ids for r in read_trace_rows(own)] == [(7,)]
    assert resolve_trace(MOONCAKE_SYNTHETIC) == bundled_trace()
    with pytest.raises(KeyError, match="no bundled trace 'nope'"):
        bundled_trace("nope")


def _tracked() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    return [ROOT / p for p in out.split("\0") if p and (ROOT / p).is_file()]


def _escapes_root(path: Path, n: int) -> bool:
    """`Path(__file__).parents[n]` for the file at `path` lies above the repository root."""
    return n > len(path.relative_to(ROOT).parts) - 1


def outside_references(path: Path, text: str) -> list[str]:
    """What in `text` (the file at `path`) names a place outside the repository."""
    found = [f"{path.name}: {m.group(0)!r}" for m in _OUTSIDE.finditer(text)]
    if path.suffix == ".md":
        for m in _MD_LINK.finditer(text):
            target = m.group(1)
            if "://" in target or target.startswith("mailto:"):
                continue
            resolved = (path.parent / target).resolve()
            if not resolved.is_relative_to(ROOT):
                found.append(f"{path.name}: link {target!r}")
    if path.suffix == ".py":
        for node in ast.walk(ast.parse(text)):
            if (
                isinstance(node, ast.Subscript)
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "parents"
                and isinstance(node.slice, ast.Constant)
                and isinstance(node.slice.value, int)
                and _escapes_root(path, node.slice.value)
            ):
                found.append(f"{path.name}:{node.lineno}: .parents[{node.slice.value}]")
    return found


def test_no_file_names_a_path_outside_the_repository() -> None:
    this = Path(__file__).resolve()
    found = []
    for path in _tracked():
        if path.suffix not in _TEXT or path == this:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        found += outside_references(path, text)
    assert not found, "files that name a place outside the repository:\n" + "\n".join(found)


def test_the_outside_reference_check_catches_each_form(tmp_path: Path) -> None:
    deep = ROOT / "tests" / "x.py"
    assert outside_references(deep, 'P = "../shared/data/t.jsonl"\n')
    assert outside_references(deep, "P = Path(__file__).resolve().parents[2] / 'x'\n")
    assert not outside_references(deep, "P = Path(__file__).resolve().parents[1] / 'x'\n")
    assert outside_references(ROOT / "docs" / "a.md", "see [it](../../elsewhere/x.md)\n")
    assert not outside_references(ROOT / "docs" / "a.md", "see [it](../README.md)\n")
    assert not outside_references(deep, "# a shared/tier and shared prefixes\n")
