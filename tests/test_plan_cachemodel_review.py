"""Review of `kvtier plan` and the cache model: malformed trace files give errors naming the line
and the value (never a traceback or the whole file in memory), edge values of the numeric
options, predictions held to the documented formulas, and degenerate traces."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner, Result

from kvtier.cachemodel import trace as trace_mod
from kvtier.cachemodel.predict import key_of, predict
from kvtier.cachemodel.stream import Request, hbm_floors, working_set
from kvtier.cachemodel.trace import parse_trace_rows, read_trace_rows
from kvtier.errors import ConfigError
from kvtier.plan import (
    ABOVE_TIER,
    INSIDE,
    NO_REUSE,
    GiB,
    SyntheticWorkload,
    parse_trace,
    plan,
    plan_command,
    read_trace,
    trace_curve,
)
from kvtier.plan.presets import preset
from kvtier.plan.window import MAX_SIM_BLOCKS
from tests.test_plan import GPT_OSS_LIKE

app = typer.Typer()
app.command()(plan_command)

LLAMA_BPT = 131_072
PER_LAYER = 2 * 2 * 64 * 2  # K and V, 2 heads, 64 dims, bf16


def invoke(*args: str) -> Result:
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "250"})


def plan_cli(trace: Path, tmp_path: Path, *extra: str) -> Result:
    return invoke(
        "--model", "llama-3.1-8b", "--hbm-tokens", "32", "--tier-bytes", "1GiB",
        "--trace", str(trace), "--trace-block", "16", "--png", str(tmp_path / "c.png"), *extra,
    )  # fmt: skip


def row(ids: list[int], ts: float | None = None, n_in: int | None = None) -> str:
    doc: dict[str, object] = {"input_length": n_in or 16 * len(ids), "hash_ids": ids}
    if ts is not None:
        doc["timestamp"] = ts
    return json.dumps(doc)


GOOD = [row([1, 2, 3], 0), row([1, 2, 4], 1), row([1, 2, 3], 2)]


# ------------------------------------------------------------------ malformed trace files


def test_binary_trace_file_is_an_error_naming_the_line_not_a_traceback(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_bytes((GOOD[0] + "\n").encode() + bytes([0xF4, 0x90, 0x00, 0xFF]) + b"\n")
    with pytest.raises(ConfigError, match=r"trace\.jsonl:2: not UTF-8 text"):
        read_trace_rows(path)
    result = plan_cli(path, tmp_path)
    assert result.exit_code == 2, result.exception
    assert "error: trace.jsonl:2: not UTF-8 text" in result.stderr


def test_corrupt_or_truncated_gzip_is_an_error_naming_the_file(tmp_path: Path) -> None:
    body = ("\n".join(GOOD * 200) + "\n").encode()
    truncated = tmp_path / "cut.jsonl.gz"
    truncated.write_bytes(gzip.compress(body)[:-40])
    corrupt = tmp_path / "bad.jsonl.gz"
    corrupt.write_bytes(b"\x1f\x8b" + bytes(range(256)) * 4)
    for path in (truncated, corrupt):
        with pytest.raises(ConfigError, match=rf"{path.name}: cannot read it as a gzip Mooncake"):
            read_trace_rows(path)
        result = plan_cli(path, tmp_path)
        assert result.exit_code == 2, result.exception
        assert f"error: {path.name}: cannot read it" in result.stderr


def test_gzip_is_recognised_by_its_bytes_not_its_name(tmp_path: Path) -> None:
    body = "\n".join(GOOD) + "\n"
    zipped = tmp_path / "zipped.jsonl"  # gzip data, plain name
    zipped.write_bytes(gzip.compress(body.encode()))
    plain = tmp_path / "plain.jsonl.gz"  # plain text, gzip name
    plain.write_text(body, encoding="utf-8")
    want = [(1, 2, 3), (1, 2, 4), (1, 2, 3)]
    assert [r.hash_ids for r in read_trace_rows(zipped)] == want
    assert [r.hash_ids for r in read_trace_rows(plain)] == want


def test_a_utf8_bom_before_the_first_row_is_read(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + ("\n".join(GOOD) + "\n").encode())
    rows = read_trace_rows(path, block_tokens=16)
    assert [r.hash_ids[-1] for r in rows] == [3, 4, 3]


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        # an integer timestamp no float can hold: OverflowError before
        ('{"timestamp": 1' + "0" * 400 + ', "input_length": 10, "hash_ids": [1]}',
         r"t\.jsonl:2: 'timestamp' must be a finite number of ms >= 0 \(got 1000"),
        # a number past Python's 4300-digit limit: ValueError before
        ('{"timestamp": 1' + "0" * 5000 + ', "input_length": 10, "hash_ids": [1]}',
         r"t\.jsonl:2: not JSON \(Exceeds the limit \(4300 digits\)"),
        # nested far past the recursion limit: RecursionError before
        ("[" * 100_000, r"t\.jsonl:2: not JSON \(maximum recursion depth"),
    ],
    ids=["timestamp_past_float", "digits_past_limit", "nested_arrays"],
)  # fmt: skip
def test_numbers_and_nesting_json_cannot_hold_are_errors_naming_the_line(
    line: str, needle: str
) -> None:
    with pytest.raises(ConfigError, match=needle) as info:
        parse_trace_rows([GOOD[0], line], source="t.jsonl")
    assert len(str(info.value)) < 400  # the value cut, not printed whole


def test_an_error_in_a_gigantic_hash_id_list_names_the_id_not_the_list() -> None:
    ids = list(range(200_000)) + [-7]
    with pytest.raises(ConfigError) as info:
        parse_trace_rows([json.dumps({"input_length": 10, "hash_ids": ids})], source="t.jsonl")
    msg = str(info.value)
    assert "t.jsonl:1: 'hash_ids' must be a non-empty list of integers >= 0" in msg
    assert "hash_ids[200000] = -7 in a list of 200,001" in msg
    assert len(msg) < 400, len(msg)
    with pytest.raises(ConfigError, match=r"got 'xxxxx.*\(100,002 characters\)") as info:
        parse_trace_rows([json.dumps({"input_length": "x" * 100_000, "hash_ids": [1]})])
    assert len(str(info.value)) < 400


def test_a_line_longer_than_the_cap_is_refused_by_its_number(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trace_mod, "MAX_LINE_BYTES", 1000)
    path = tmp_path / "long.jsonl"
    path.write_text(GOOD[0] + "\n" + row(list(range(1000))) + "\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"long\.jsonl:2: a line longer than 1,000 bytes"):
        read_trace_rows(path)


def test_a_trace_past_the_block_cap_stops_reading_at_the_line_that_passes_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "big.jsonl"
    path.write_text("\n".join(row([i, i + 1]) for i in range(50)) + "\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"big\.jsonl:6: the trace passes 10 hash ids .* first 5"):
        read_trace(path, 16, max_blocks=10)
    assert len(read_trace(path, 16, max_blocks=100).requests) == 50

    def lines() -> object:  # a 10 GB file, as far as the reader can tell
        for i in range(10**9):
            if i > 6:
                raise AssertionError(f"read line {i + 1} past the cap")
            yield row([i, i + 1])

    with pytest.raises(ConfigError, match=r"t:6: the trace passes 10"):
        parse_trace_rows(lines(), source="t", max_blocks=10)  # type: ignore[arg-type]
    # `kvtier plan` reads a trace file only as far as it can replay
    assert read_trace.__kwdefaults__ == {"max_blocks": MAX_SIM_BLOCKS}


def test_integer_timestamps_float_would_merge_still_sort_by_value() -> None:
    big = 2**60
    rows = parse_trace_rows([row([1], big + 1), row([2], big)])
    assert [r.hash_ids for r in rows] == [(2,), (1,)]


def test_non_monotonic_timestamps_replay_sorted_and_row_order_does_not_change_the_plan(
    tmp_path: Path,
) -> None:
    rng = random.Random(7)
    rows = [row([i % 5, 100 + i % 3, 1000 + i], ts=10 * i) for i in range(60)]
    docs = []
    for k in range(3):
        rng.shuffle(rows)
        path = tmp_path / f"t{k}.jsonl"
        path.write_text("\n".join(rows) + "\n", encoding="utf-8")
        r = plan(preset("llama-3.1-8b"), hbm_tokens=64, tier_bytes=64 * 16 * LLAMA_BPT,
                 workload=read_trace(path, 16))  # fmt: skip
        assert [t.timestamp_ms for t in r.workload.requests] == [10.0 * i for i in range(60)]
        doc = r.to_json()
        doc["workload"].pop("source")
        docs.append(doc)
    assert docs[0] == docs[1] == docs[2]
    assert docs[0]["verdict"]["kind"] == INSIDE


# ------------------------------------------------------------------ gigantic values, big tiers


def test_hash_ids_past_128_bits_replay_like_small_ones() -> None:
    big = 1 << 200
    lines = [row([big + 1, big + 2, big + 3]), row([big + 1, big + 2, big + 4]),
             row([big + 1, big + 2, big + 3])]  # fmt: skip
    small = [row([1, 2, 3]), row([1, 2, 4]), row([1, 2, 3])]
    a = plan(preset("llama-3.1-8b"), hbm_tokens=16, tier_bytes=GiB, workload=parse_trace(lines, 16))
    b = plan(preset("llama-3.1-8b"), hbm_tokens=16, tier_bytes=GiB, workload=parse_trace(small, 16))
    assert a.ceilings is not None and b.ceilings is not None
    assert a.ceilings.to_json() == b.ceilings.to_json()
    # rows 2 and 3: chunk 2 past the 1-block HBM (chunk 3 holds the last token)
    assert a.ceilings.kvtier.served == 2
    assert len({key_of(big + i) for i in range(100)}) == 100
    assert all(len(key_of(big + i)) == 16 for i in range(3))


def test_a_tier_far_past_the_working_set_is_replayed_without_allocating_it() -> None:
    work = parse_trace(GOOD, 1 << 4)
    # 2^70 B of tier at 131,072 B a token: 2^53 blocks (an arena of 2^57 B before)
    r = plan(preset("llama-3.1-8b"), hbm_tokens=16, tier_bytes=1 << 70, workload=work)
    assert r.ceilings is not None
    assert r.ceilings.tier_blocks == 1 << 49
    c = r.ceilings
    assert (c.kvtier.usable, c.kvtier.hbm) == (c.infinite.usable, c.infinite.hbm) == (6, 2)
    assert c.kvtier.served == c.optimum.served == c.infinite.served == 2


def test_the_real_tier_at_the_working_set_hits_as_one_many_times_larger() -> None:
    rng = random.Random(3)
    prefixes = [[rng.randrange(10**6) for _ in range(rng.randint(1, 6))] for _ in range(30)]
    reqs = []
    for i in range(300):
        p = prefixes[rng.randrange(30)]
        reqs.append(Request((*p, 10**7 + i), len(p) + 1))
    ws = working_set(reqs)
    floors = hbm_floors(reqs, 8)
    assert predict(reqs, ws, floors) == predict(reqs, 7 * ws, floors)


# ------------------------------------------------------------------ formulas and numeric options


def test_a_hybrids_needed_tier_bytes_are_the_bytes_the_tier_stores() -> None:
    work = SyntheticWorkload(4, 1000)  # reuse distance 4 x 1000 + 1000 in flight
    r = plan(GPT_OSS_LIKE, hbm_tokens=16, tier_bytes=1000 * 3 * PER_LAYER, workload=work)
    assert r.tier_token_bytes == 3 * PER_LAYER
    assert r.bytes_per_token == 4 * PER_LAYER
    assert r.verdict.kind == ABOVE_TIER
    assert r.verdict.needed_tier_bytes == 5000 * 3 * PER_LAYER
    # a tier of the bytes the verdict asks for serves the reuse
    fit = plan(GPT_OSS_LIKE, hbm_tokens=16, tier_bytes=r.verdict.needed_tier_bytes, workload=work)
    assert fit.tier_tokens == 5000
    assert fit.verdict.kind == INSIDE


def test_a_hybrids_break_even_reads_the_bytes_the_tier_stores_per_token() -> None:
    work = SyntheticWorkload(1, 100)
    r = plan(GPT_OSS_LIKE, hbm_tokens=16, tier_bytes=GiB, workload=work, prefill_tokens_per_s=1e4)
    assert r.break_even_gbps == pytest.approx(3 * PER_LAYER * 1e4 / 1e9)
    assert r.to_json()["break_even_gbps"] == pytest.approx(0.0153600)
    dense = plan(preset("llama-3.1-8b"), hbm_tokens=16, tier_bytes=GiB, workload=work,
                 prefill_tokens_per_s=1e4)  # fmt: skip
    assert dense.break_even_gbps == pytest.approx(LLAMA_BPT * 1e4 / 1e9)


@pytest.mark.parametrize("chunk", [0, -256])
def test_a_chunk_size_below_one_token_is_refused(chunk: int) -> None:
    with pytest.raises(ConfigError, match=rf"--chunk-size {chunk} must be an integer >= 1"):
        plan(preset("qwen3-next-80b"), hbm_tokens=100_000, tier_bytes=64 * GiB,
             workload=SyntheticWorkload(4, 8192), block_size=256, chunk_size=chunk)  # fmt: skip
    result = invoke(
        "--model", "llama-3.1-8b", "--hbm-tokens", "10", "--tier-bytes", "1GiB",
        "--prefixes", "2", "--prefix-len", "100", "--chunk-size", str(chunk),
    )  # fmt: skip
    assert result.exit_code == 2
    assert f"error: --chunk-size {chunk} must be an integer >= 1" in result.stderr


@pytest.mark.parametrize(
    ("flag", "value", "needle"),
    [
        ("--store-gbps", "nan", "--store-gbps nan must be a number of GB/s > 0"),
        ("--store-gbps", "inf", "--store-gbps inf must be"),
        ("--store-gbps", "-5", "--store-gbps -5.0 must be"),
        ("--prefill-tokens-per-s", "nan", "--prefill-tokens-per-s nan must be a rate > 0"),
        ("--prefill-tokens-per-s", "0", "--prefill-tokens-per-s 0.0 must be"),
        ("--tp", "0", "--tp 0 must be an integer >= 1"),
        ("--tp", "-2", "--tp -2 must be an integer >= 1"),
        ("--block-size", "0", "--block-size 0 must be an integer >= 1"),
        ("--hbm-tokens", "0", "--hbm-tokens 0 must be an integer >= 1"),
        ("--tier-bytes", "0", "--tier-bytes 0 must be an integer >= 1"),
        ("--concurrency", "-1", "--concurrency -1 must be an integer >= 0"),
        ("--tail-len", "-1", "--tail-len -1 must be an integer >= 0"),
    ],
)
def test_numeric_options_at_their_edges_exit_2_naming_the_value(
    flag: str, value: str, needle: str
) -> None:
    args = {"--model": "llama-3.1-8b", "--hbm-tokens": "10", "--tier-bytes": "1GiB",
            "--prefixes": "2", "--prefix-len": "100", flag: value}  # fmt: skip
    result = invoke(*[x for kv in args.items() for x in kv])
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert f"error: {needle}" in result.stderr


def test_trace_block_zero_is_refused_before_the_file_is_read(tmp_path: Path) -> None:
    result = plan_cli(tmp_path / "absent.jsonl", tmp_path, "--trace-block", "0")
    assert result.exit_code == 2
    # plan_cli passes --trace-block 16 first; the later one wins
    assert "error: --trace-block 0 must be an integer >= 1" in result.stderr


# ------------------------------------------------------------------ the hit curve's PNG


def test_the_hit_curve_png_is_written_at_the_path_the_report_names(tmp_path: Path) -> None:
    work = parse_trace(GOOD, 16, source="t.jsonl")
    _, drawn = trace_curve(work, 16, 1024, tmp_path / "curve")  # no extension
    assert drawn == tmp_path / "curve"
    assert drawn.is_file()
    assert drawn.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "curve.png").exists()


def test_a_png_path_that_cannot_be_written_is_an_error_naming_it(tmp_path: Path) -> None:
    work = parse_trace(GOOD, 16, source="t.jsonl")
    with pytest.raises(ConfigError, match=r"PNG path '.*' is a directory; give a file path"):
        trace_curve(work, 16, 1024, tmp_path)
    assert not tmp_path.with_suffix(".png").exists()
    blocker = tmp_path / "afile"
    blocker.write_text("x", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"cannot write the hit curve's PNG at '.*afile/c\.png'"):
        trace_curve(work, 16, 1024, blocker / "c.png")
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(GOOD) + "\n", encoding="utf-8")
    result = invoke(
        "--model", "llama-3.1-8b", "--hbm-tokens", "16", "--tier-bytes", "1GiB",
        "--trace", str(path), "--trace-block", "16", "--png", str(blocker / "c.png"),
    )  # fmt: skip
    assert result.exit_code == 2, result.exception
    assert "error: cannot write the hit curve's PNG" in result.stderr


# ------------------------------------------------------------------ degenerate traces


def test_one_request_has_no_reuse_and_zero_rates(tmp_path: Path) -> None:
    path = tmp_path / "one.jsonl"
    path.write_text(row([1, 2, 3], 5) + "\n", encoding="utf-8")
    result = plan_cli(path, tmp_path, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["verdict"]["kind"] == NO_REUSE
    assert doc["reuse_distance_tokens"] is None and doc["reuse_p90_tokens"] is None
    assert doc["reusable_tokens"] == 0 and doc["tier_over_reusable"] is None
    c = doc["ceilings"]
    assert (c["usable_blocks"], c["hbm_hit_blocks"], c["hbm_rate"]) == (2, 0, 0.0)
    assert c["kvtier"]["rate"] == c["optimum"]["rate"] == c["infinite"]["rate"] == 0.0
    assert all(p["infinite"]["served_chunks"] == 0 for p in doc["hit_curve"])


def test_prompts_shorter_than_a_block_replay_with_nothing_usable(tmp_path: Path) -> None:
    # every prompt inside its first 512-token block: no full chunk, nothing a hit could cover
    path = tmp_path / "short.jsonl"
    path.write_text("\n".join(row([1], i, n_in=1) for i in range(4)) + "\n", encoding="utf-8")
    result = invoke(
        "--model", "llama-3.1-8b", "--hbm-tokens", "16", "--tier-bytes", "1GiB",
        "--trace", str(path), "--png", str(tmp_path / "c.png"), "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["ceilings"]["usable_blocks"] == 0
    assert doc["ceilings"]["kvtier"]["rate"] == 0.0
    # the reuse profile still sees block 1 reused at distance 1 block (512 tokens > 16)
    assert doc["reuse_distance_tokens"] == 512
    assert doc["verdict"]["kind"] == INSIDE


def test_all_unique_prefixes_miss_everywhere(tmp_path: Path) -> None:
    lines = [row([3 * i, 3 * i + 1, 3 * i + 2], i) for i in range(20)]
    r = plan(preset("llama-3.1-8b"), hbm_tokens=16, tier_bytes=GiB, workload=parse_trace(lines, 16))
    assert r.verdict.kind == NO_REUSE
    assert r.ceilings is not None
    assert r.ceilings.usable_blocks == 40
    assert (r.ceilings.kvtier.served, r.ceilings.infinite.served, r.ceilings.hbm_hit_blocks) == (
        0, 0, 0,
    )  # fmt: skip
    assert r.ceilings.infinite.rate == 0.0


def test_an_empty_or_blank_trace_file_names_the_file_and_an_example(tmp_path: Path) -> None:
    for text in ("", "\n\n   \n"):
        path = tmp_path / "empty.jsonl"
        path.write_text(text, encoding="utf-8")
        result = plan_cli(path, tmp_path)
        assert result.exit_code == 2
        assert "error: empty.jsonl has no requests" in result.stderr
        assert '"hash_ids": [0, 1]' in result.stderr
