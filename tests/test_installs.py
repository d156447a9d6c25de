"""Every install the README names works as written (scripts/check-installs.sh): a fresh venv,
kvtier's wheel, then what the plain install, `[native]` and `[bench]` each promise. A module the
code imports but no install declares fails here, not on a user's machine."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(600)
def test_each_install_the_readme_names_runs_what_it_promises(tmp_path: Path) -> None:
    proc = subprocess.run(
        [str(ROOT / "scripts" / "check-installs.sh"), str(tmp_path / "work")],
        capture_output=True,
        text=True,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "plain install: every module of the tier, tools and connector imports" in out
    venv = tmp_path / "work" / "venv"
    # the plain install runs without the packages only the extras bring
    plan = json.loads((tmp_path / "work" / "plan.json").read_text())
    assert plan["model"] == "llama-3.1-8b" and plan["bytes_per_token_per_rank"] == 131072
    # the bench install read the trace that ships in the wheel, not one beside the source
    rows = json.loads((tmp_path / "work" / "bench-cache.json").read_text())["rows"]
    assert any(r["id"].startswith("mooncake_trace.") for r in rows)
    site = next(venv.glob("lib/python*/site-packages"))
    assert (site / "kvtier" / "data" / "mooncake-synthetic-trace.jsonl.gz").is_file()
    assert not (site / "kvtier" / "__editable__").exists()
