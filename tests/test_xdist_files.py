"""The scheduling units of `make test`'s workers stay true to the suite: every file that uses
an expensive shared session fixture is in that fixture's unit, and every slow unit named to go
first exists (tests/xdist_files.py)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.xdist_files import SHARED_UNITS, SLOW_FIRST, unit_of

ROOT = Path(__file__).resolve().parents[1]


def _takes(path: Path, fixture: str) -> bool:
    tree = ast.parse(path.read_text(), filename=str(path))
    return any(
        isinstance(node, ast.FunctionDef) and fixture in {a.arg for a in node.args.args}
        for node in ast.walk(tree)
    )


def test_files_sharing_vllm_served_are_one_unit() -> None:
    users = {
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "tests").rglob("test_*.py"))
        if _takes(path, "vllm_served")
    }
    assert users == {f for f, unit in SHARED_UNITS.items() if unit == "vllm_served"}


def test_every_unit_named_slow_exists_and_a_test_is_in_its_files_unit() -> None:
    units = set(SHARED_UNITS.values())
    for name in SLOW_FIRST:
        assert name in units or (ROOT / name).is_file(), name
    assert unit_of("tests/vllm/test_serve_vllm.py::test_x[a::b]") == "vllm_served"
    assert unit_of("tests/test_keys.py::test_y") == "tests/test_keys.py"
