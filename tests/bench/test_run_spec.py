"""`kvtier bench run`'s run spec: YAML and TOML read into one typed struct, flags and `--set`
over the file, wrong keys and values named with their place, the docs' examples valid, and
the command's flags few."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import typer

from kvtier.bench.run_cli import bench_run_command
from kvtier.bench.run_spec import RunSpec, parse_set, read_spec, to_run_config
from kvtier.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]

YAML = """\
workload:
  kind: trace
  trace: t.jsonl
  trace_block: 16
  trace_source_block: 512
  ignore_timestamps: true
  concurrency: 4
arms:
  url: http://127.0.0.1:8000
  vocab: 32000
  hbm_blocks: 320
  chunk_size: 64
  tier_tokens: 1048576
load:
  repeat: 3
  reset: true
report:
  start_cut: 60s
  html: false
"""

TOML = """\
[workload]
kind = "trace"
trace = "t.jsonl"
trace_block = 16
trace_source_block = 512
ignore_timestamps = true
concurrency = 4

[arms]
url = "http://127.0.0.1:8000"
vocab = 32000
hbm_blocks = 320
chunk_size = 64
tier_tokens = 1048576

[load]
repeat = 3
reset = true

[report]
start_cut = "60s"
html = false
"""


def test_yaml_and_toml_read_into_the_same_spec(tmp_path: Path) -> None:
    (tmp_path / "run.yaml").write_text(YAML)
    (tmp_path / "run.toml").write_text(TOML)
    a, b = read_spec(tmp_path / "run.yaml"), read_spec(tmp_path / "run.toml")
    assert a == b
    assert (a.workload.kind, a.workload.trace_block, a.arms.tier_tokens) == ("trace", 16, 1 << 20)
    # what is not in the file keeps its default
    assert (a.workload.osl, a.load.warmup, a.report.bucket) == (16, 0, "10s")
    assert read_spec(None) == RunSpec()


def test_flags_and_set_lay_over_the_file(tmp_path: Path) -> None:
    (tmp_path / "run.yaml").write_text(YAML)
    spec = read_spec(
        tmp_path / "run.yaml",
        [parse_set("load.repeat=1"), parse_set("arms.model=tiny"), parse_set("workload.rate=2.5"),
         parse_set("arms.hbm_blocks=null"), ("workload.concurrency", 8)],
    )  # fmt: skip
    assert (spec.load.repeat, spec.arms.model, spec.workload.rate) == (1, "tiny", 2.5)
    assert spec.arms.hbm_blocks is None and spec.workload.concurrency == 8
    assert spec.workload.trace == "t.jsonl"  # untouched keys stay the file's
    cfg = to_run_config(spec)
    assert cfg.repeat == 1 and cfg.reset_path is not None and cfg.cut_s == 60.0
    assert cfg.workload.trace_block == 16 and cfg.ceiling.tier_chunks == (1 << 20) // 64
    # a rate makes the loop open: no concurrency cap
    assert cfg.load.model == "tiny" and cfg.load.open_loop and cfg.load.concurrency is None
    # the A/A pair belongs to the ON/OFF arms: with a URL it is refused, naming the fix
    with pytest.raises(ConfigError, match=r"arms\.aa \(--aa\) adds an OFF arm"):
        to_run_config(read_spec(tmp_path / "run.yaml", [("arms.aa", True)]))


@pytest.mark.parametrize(
    ("doc", "sets", "said"),
    [
        ("workload:\n  prefixs: 4\n", [], "unknown field `prefixs` - at `$.workload`"),
        ("workload:\n  requests: many\n", [], "Expected `int | null`, got `str` - at "
                                              "`$.workload.requests`"),
        ("", ["load.warmupp=2"], "unknown field `warmupp` - at `$.load`"),
        ("", ["loads.repeat=2"], "no section 'loads'; use one of workload, arms, load, report"),
        ("", ["repeat=2"], "must look like section.key=value"),
        ("- a\n- b\n", [], "must be a mapping of sections"),
        ("workload: [\n", [], "does not parse"),
    ],
)  # fmt: skip
def test_a_wrong_key_or_value_is_named_with_its_place(
    tmp_path: Path, doc: str, sets: list[str], said: str
) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(doc)
    with pytest.raises(ConfigError) as e:
        read_spec(path, [parse_set(s) for s in sets])
    assert said in str(e.value)


def test_a_missing_spec_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.yaml is not a file"):
        read_spec(tmp_path / "nope.yaml")


def test_every_example_in_the_docs_is_a_valid_spec(tmp_path: Path) -> None:
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, flags=re.S)
    specs = [b for b in blocks if re.match(r"(workload|arms|load|report):", b)]
    assert len(specs) >= 3, "docs/benchmarks.md shows the run spec in examples"
    for i, block in enumerate(specs):
        path = tmp_path / f"example{i}.yaml"
        path.write_text(block)
        read_spec(path)


def test_the_command_has_at_most_fifteen_options() -> None:
    params = inspect.signature(bench_run_command).parameters.values()
    options = [p for p in params if isinstance(p.default, typer.models.OptionInfo)]
    assert len(options) <= 15, [p.name for p in options]
