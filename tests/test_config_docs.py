"""docs/configuration.md's key table is generated from `KVTierConfig` and cannot go stale."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvtier import config_docs
from kvtier.config import KVTierConfig

PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_configuration_md_is_current() -> None:
    assert config_docs.main(["--check", str(PAGE)]) == 0, (
        "docs/configuration.md is stale: run `python -m kvtier.config_docs`"
    )


def test_every_field_has_a_row_with_its_default_and_meaning() -> None:
    text = PAGE.read_text()
    for f in dataclasses.fields(KVTierConfig):
        row = next((line for line in text.splitlines() if line.startswith(f"| `{f.name}` |")), "")
        assert f.metadata["doc"] in row and f.metadata["kind"] in row, f.name
    assert "| `memory_bytes` | size | `2GiB` |" in text
    assert "| `lookup_scope` | scope | unset |" in text


def test_a_stale_page_fails_the_check_and_is_rewritten(tmp_path: Path) -> None:
    page = tmp_path / "configuration.md"
    fresh = PAGE.read_text()
    page.write_text(
        fresh.replace("| `chunk_size` | int | `256` |", "| `chunk_size` | int | `512` |")
    )
    assert config_docs.main(["--check", str(page)]) == 1
    assert config_docs.main([str(page)]) == 0
    assert page.read_text() == fresh
    assert config_docs.main(["--check", str(page)]) == 0


def test_a_page_without_markers_is_a_clear_error(tmp_path: Path) -> None:
    page = tmp_path / "configuration.md"
    page.write_text("# Configuration\n")
    with pytest.raises(ValueError, match="no generated part"):
        config_docs.main([str(page)])
