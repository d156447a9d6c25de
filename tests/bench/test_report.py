"""The report renders from a recorded run directory: PNGs with content, report.html embedding
them and the summary table, re-rendering with another window, and aiperf imports."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import typer
from matplotlib.image import imread
from typer.testing import CliRunner

from kvtier.bench.report import PNGS, bench_report_command
from tests.bench.recorded import T0, make_run
from tests.bench.test_aiperf import write_sample

app = typer.Typer()
app.command("report")(bench_report_command)
app.command("noop")(lambda: None)  # two commands: `report` stays a subcommand, as in kvtier


def invoke(*args: str) -> str:
    result = CliRunner().invoke(app, ["report", *args])
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    run_dir = make_run(tmp_path_factory.mktemp("bench") / "run")
    return run_dir, invoke(str(run_dir))


def test_pngs_exist_and_are_not_blank(rendered: tuple[Path, str]) -> None:
    run_dir, _ = rendered
    for name in PNGS:
        path = run_dir / name
        assert path.stat().st_size > 5 * 1024, name
        img = imread(path)
        assert img.ndim == 3 and img.shape[0] > 300 and img.shape[1] > 600
        colours = np.unique(img.reshape(-1, img.shape[-1]), axis=0)
        assert len(colours) > 1, f"{name} has one colour"
        # lines or bars in the arms' colours, not just black text on white
        assert len(colours) > 20, f"{name} has only {len(colours)} colours"


def test_html_embeds_the_pngs_and_the_summary_table(rendered: tuple[Path, str]) -> None:
    run_dir, out = rendered
    page = (run_dir / "report.html").read_text()
    for name in PNGS:
        assert f"<img src='{name}'" in page
    doc = json.loads((run_dir / "summary.json").read_text())
    for row in doc["table"]["rows"]:
        assert row["label"].replace("'", "&#x27;") in page
    assert "on: TTFT p50" in page and "off: cache-read rate (server)" in page
    assert "serve --hbm-blocks 6 --block-size 16 --offload" in page  # the arms' commands
    # the terminal got the same table
    assert "kvtier bench run: multi_turn x 12 requests" in out
    assert "on: TTFT p50" in out


def test_summary_numbers_come_from_the_records(rendered: tuple[Path, str]) -> None:
    run_dir, _ = rendered
    doc = json.loads((run_dir / "summary.json").read_text())
    rows = {r["id"]: r for r in doc["table"]["rows"]}
    # ON TTFT: rep 0 is 20 + turn ms (p50 21), rep 1 is 22 + turn ms (p50 23); OFF is the raw
    ttft = rows["full.on.ttft_p50_ms"]
    assert ttft["value"] == pytest.approx(22.0)
    assert ttft["raw"] == pytest.approx((46.0 + 50.5) / 2)
    assert ttft["detail"]["min"] == pytest.approx(21.0)
    assert ttft["detail"]["max"] == pytest.approx(23.0)
    assert rows["full.on.itl_p50_ms"]["value"] == pytest.approx(5.0)
    # each arm measures exactly its predicted ceiling (the recorded hits are the simulator's)
    on, off = rows["full.on.hit_rate"], rows["full.off.hit_rate"]
    assert on["value"] == pytest.approx(on["raw"]) and off["value"] == pytest.approx(off["raw"])
    assert on["value"] > off["value"] > 0
    assert on["detail"]["ceiling_infinite_pct"] == pytest.approx(on["value"])
    for check in ("identities_failing", "above_infinite", "pool_mismatches", "requests_failed"):
        assert rows[f"checks.{check}"]["value"] == 0 and rows[f"checks.{check}"]["pass"] is True
    # per repetition: ON 4 identities, OFF 2, each arm 2 client/server checks
    assert doc["checks"]["identities_checked"] == 2 * (4 + 2) + 2 * (2 + 2)
    on_rep = next(r for r in doc["runs"] if r["arm"] == "on")
    assert {i["name"] for i in on_rep["identities"]} == {
        "hbm_hits_le_queries",
        "hbm_misses_eq_external_queries",
        "retrieved_eq_external_hits",
        "external_hits_le_queries",
    }
    residency = on_rep["series"]["residency"]["memory"]
    assert residency[0] == [0.0, 0.0] and residency[-1][1] > residency[1][1] > 0


def test_rerender_with_a_start_cut_and_buckets(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "run")
    invoke(str(run_dir), "--from", "3s", "--bucket", "2s")
    doc = json.loads((run_dir / "summary.json").read_text())
    assert (doc["cut_s"], doc["bucket_s"]) == (3.0, 2.0)
    rep = doc["runs"][0]
    # requests are sent every 0.5 s: those at 3.0 s .. 5.5 s are in the window
    assert rep["windows"]["cut"]["completed"] == 6
    assert rep["windows"]["full"]["completed"] == 12
    assert [b["requests"] for b in rep["series"]["buckets"]] == [4, 4, 4]
    assert [b["t_s"] for b in rep["series"]["buckets"]] == [0.0, 2.0, 4.0]
    ids = {r["id"] for r in doc["table"]["rows"]}
    assert {"cut.on.ttft_p50_ms", "cut.on.hit_rate", "cut.off.hit_rate"} <= ids
    # the cut window's ceiling counts only late requests, with the cache warmed by the early
    cut_ceiling = rep["ceilings"]["cut"]["infinite"]
    assert cut_ceiling["requests"] == 6
    assert cut_ceiling["prompt_tokens"] == rep["windows"]["cut"]["total_input_tokens"]
    page = (run_dir / "report.html").read_text()
    assert "from 3s" in page


def test_aiperf_import_joins_the_report(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "run")
    export = write_sample(tmp_path / "art" / "profile_export_aiperf.json")
    out = invoke(str(run_dir), "--aiperf", f"aiperf-off={export}")
    assert (run_dir / "aiperf" / "aiperf-off.json").is_file()
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["aiperf"] == {"aiperf-off": "aiperf/aiperf-off.json"}
    doc = json.loads((run_dir / "summary.json").read_text())
    rows = {r["id"]: r for r in doc["table"]["rows"]}
    assert rows["aiperf.aiperf-off.ttft_p50_ms"]["value"] == 16.2
    assert rows["aiperf.aiperf-off.cache_read_pct"]["value"] == 8.889
    assert rows["aiperf.aiperf-off.request_throughput"]["value"] == 85.2
    assert "aiperf aiperf-off:" in out and "16.2 ms" in out
    page = (run_dir / "report.html").read_text()
    assert "aiperf imports" in page and "0.13.0" in page
    # a second render reads the copy in the run directory, not the original
    export.unlink()
    invoke(str(run_dir))
    assert "aiperf.aiperf-off.ttft_p50_ms" in (run_dir / "summary.json").read_text()


def test_an_interrupted_run_renders_what_completed(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "run")
    (run_dir / "scrapes" / "on-rep1.json").unlink()
    invoke(str(run_dir))
    doc = json.loads((run_dir / "summary.json").read_text())
    assert (doc["arms"]["on"]["reps"], doc["arms"]["off"]["reps"]) == (1, 2)


def test_bad_directories_and_files_are_refused(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 2 and "has no meta.json" in result.output
    run_dir = make_run(tmp_path / "run")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    result = CliRunner().invoke(app, ["report", str(run_dir), "--aiperf", f"x={bad}"])
    assert result.exit_code == 2 and "has none of the metrics" in result.output
    assert T0 > 0
