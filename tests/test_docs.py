"""The docs stand alone and stay true to the code: README.md and docs/ link only to files in
the repository, every invariant the code cites is defined in docs/invariants.md, and every test
that page names exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
INVARIANTS = ROOT / "docs" / "invariants.md"

_LINK = re.compile(r"\]\(([^)\s]+)\)")
_CITATION = re.compile(r"\binvariants? (\d+)", re.IGNORECASE)
_HEADING = re.compile(r"^## (\d+)\. ", re.MULTILINE)
_TEST_REF = re.compile(r"`(tests/[\w/]+\.py)(?:::(\w+))?`")


def _defined_tests(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_pages_link_only_to_files_in_the_repository() -> None:
    bad = []
    for page in PAGES:
        text = page.read_text()
        for target in _LINK.findall(text):
            if re.match(r"^[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.is_relative_to(ROOT) or not path.exists():
                bad.append(f"{page.relative_to(ROOT)} -> {target}")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                bad.append(f"{page.relative_to(ROOT)} -> {target} (no such heading)")
    assert not bad, f"links outside the repository or to nothing: {bad}"


def test_every_cited_invariant_is_defined() -> None:
    defined = {int(n) for n in _HEADING.findall(INVARIANTS.read_text())}
    assert defined == set(range(1, len(defined) + 1)), f"invariants not numbered 1..N: {defined}"
    cited: dict[int, list[str]] = {}
    for path in [*sorted((ROOT / "src").rglob("*.py")), *sorted((ROOT / "tests").rglob("*.py"))]:
        for n in _CITATION.findall(path.read_text()):
            cited.setdefault(int(n), []).append(str(path.relative_to(ROOT)))
    assert cited, "no citation found: the pattern no longer matches how the code cites"
    missing = {n: where for n, where in cited.items() if n not in defined}
    assert not missing, f"cited but not in docs/invariants.md: {missing}"


def test_every_test_the_invariants_page_names_exists() -> None:
    refs = _TEST_REF.findall(INVARIANTS.read_text())
    assert len(refs) > 50
    missing = []
    for rel, name in refs:
        path = ROOT / rel
        if not path.is_file() or (name and name not in _defined_tests(path)):
            missing.append(f"{rel}::{name}" if name else rel)
    assert not missing, f"docs/invariants.md names tests that do not exist: {missing}"
