"""Review of the CLI and the configuration: bad input refused at once with a ConfigError naming
the key, the value and the fix (huge numbers, sizes past 64 bits, a URL without its '://'
holding a password), `kvtier` subcommands that exit 2 with one `error:` line instead of a
traceback, messages that name the right default, and the documented defaults read back equal
to the code's."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvtier import config_docs
from kvtier.cli import app
from kvtier.config import KVTierConfig, format_size, mask_url, parse_size
from kvtier.errors import ConfigError
from tests.record_key import RECORD_KEY

SECRET = "hunter2-s3cr3t"
PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def error_of(**kwargs: object) -> str:
    with pytest.raises(ConfigError) as err:
        KVTierConfig.from_dict(kwargs)
    return str(err.value)


def invoke(*args: str, **kwargs: Any) -> Any:
    return CliRunner().invoke(app, list(args), **kwargs)


def assert_clean_failure(result: Any, *needles: str) -> None:
    """Exit 2 with an `error:` line holding every needle, and no traceback."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    # a clean exit is typer's SystemExit; an escaped exception would be the exception itself
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    assert "error: " in result.output, result.output
    for needle in needles:
        assert needle in result.output, (needle, result.output)


# ------------------------------------------------------------------------------ huge numbers


@pytest.mark.parametrize("key", ["lease_ttl_s", "lookup_wait_ms", "retention_budget"])
def test_a_float_key_given_an_integer_past_floats_range_is_a_config_error(key: str) -> None:
    """json.loads('1' + '0' * 400) is an int; float() of it raised OverflowError, not a
    ConfigError naming the key."""
    msg = error_of(**{key: 10**400})
    assert f"{key}=" in msg and "is not a finite number" in msg
    assert "from extra config" in msg and len(msg) < 400


@pytest.mark.parametrize(
    "value",
    [
        "1e400",  # was accepted: 10**400 bytes
        pytest.param("1e100000000", id="huge-exponent"),  # a 1e8-digit int: minutes of CPU
        pytest.param("1" + "0" * 5000, id="5001-digit-string"),  # int-digits ValueError
        10**30,
        2**63,
        1e300,
        "16000000TiB",  # past 8 EiB
    ],
)
def test_a_size_past_64_bits_is_refused_at_once_naming_the_key(value: object) -> None:
    with pytest.raises(ConfigError) as err:
        parse_size(value, "memory_bytes")
    msg = str(err.value)
    assert msg.startswith("memory_bytes=") and "is out of range" in msg and "8 EiB" in msg
    assert len(msg) < 400  # the value is shown cut short, never as thousands of digits


def test_the_largest_size_and_the_unit_forms_still_parse() -> None:
    assert parse_size((1 << 63) - 1, "disk_bytes") == (1 << 63) - 1
    assert parse_size("8388607TiB", "disk_bytes") == 8388607 << 40
    assert parse_size("1e18", "disk_bytes") == 10**18
    assert parse_size("1.5e3KiB", "disk_bytes") == 1536000
    assert parse_size("-0", "disk_bytes") == 0  # -0 is zero, not negative


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("chunk_size", 16 * 10**30),  # a multiple of 16: was accepted, then repr() of it broke
        pytest.param("chunk_size", 16 * 10**5000, id="chunk_size-5001-digits"),
        ("lookup_timeout_ms", 10**20),
        # was "is not an integer" (int() refuses 4300+ digits)
        pytest.param("max_leases", "9" * 5000, id="max_leases-5000-digit-string"),
        ("breaker_failures", 2**64),
        ("lookup_scope", [0, 2**64]),
    ],
)
def test_an_integer_past_64_bits_is_refused_naming_the_key(key: str, value: object) -> None:
    msg = error_of(**{key: value})
    assert msg.startswith(f"{key}=") and "out of range" in msg
    assert len(msg) < 400


def test_every_config_that_builds_can_be_shown() -> None:
    """The largest values a config accepts still render in repr(), describe() and to_dict()."""
    cfg = KVTierConfig.from_dict(
        {"chunk_size": (1 << 62), "memory_bytes": (1 << 63) - 1, "max_leases": (1 << 63) - 1}
    )
    assert "chunk=4611686018427387904 tokens" in cfg.describe()
    assert "memory=8.39e+06TiB/rank" in cfg.describe()
    assert "max_leases=9223372036854775807" in repr(cfg)


# ---------------------------------------------------------------------------------- secrets


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        (f"admin:{SECRET}@cache:6379", "admin:***@cache:6379"),
        (f"redis:/admin:{SECRET}@cache:6379/0", "redis:***@cache:6379/0"),
        (f"redis//admin:{SECRET}@cache:6379", "redis//admin:***@cache:6379"),
        (f"{SECRET}@cache:6379", "***@cache:6379"),
        ("cache:6379", "cache:6379"),
        ("redis://cache:6379/0", "redis://cache:6379/0"),
    ],
)
def test_a_url_missing_its_scheme_separator_still_has_its_password_masked(
    url: str, masked: str
) -> None:
    assert mask_url(url) == masked
    if SECRET in url:
        msg = error_of(remote_url=url, record_key=RECORD_KEY)
        assert SECRET not in msg, msg
        assert f"remote_url={masked!r}" in msg
        assert "not one of redis, rediss, unix" in msg and "redis://host:6379/0" in msg


def test_a_bad_scheme_is_named_from_the_masked_url() -> None:
    msg = error_of(remote_url=f"HTTP://u:{SECRET}@cache:6379", record_key=RECORD_KEY)
    assert "has scheme 'http', not one of" in msg and SECRET not in msg
    msg = error_of(remote_url=f"u:{SECRET}@cache:6379", record_key=RECORD_KEY)
    assert "has no scheme ('://' is missing)" in msg and SECRET not in msg


def test_a_secret_given_a_huge_number_is_refused_without_showing_it() -> None:
    msg = error_of(remote_password=10**5000, remote_url="redis://c:1", record_key=RECORD_KEY)
    assert "remote_password must be a string (value not shown)" in msg


# ---------------------------------------------------------------- messages name the right fix


def test_tenant_share_out_of_range_names_its_own_default() -> None:
    """The message said '0.5 is the default' for retention_tenant_share, whose default is 1."""
    msg = error_of(retention_tenant_share=2)
    assert "retention_tenant_share=2 must lie in [0, 1]; 1 is the default" in msg
    assert "retention_budget=1.5 must lie in [0, 1]; 0.5 is the default" in error_of(
        retention_budget=1.5
    )


def test_a_max_ttl_below_the_default_ttl_names_the_key_the_user_set_and_the_fix() -> None:
    """retention_max_ttl_s=60 alone was refused as 'retention_ttl_s=300.0 must be ...', with
    no source for the key that was given and no fix."""
    msg = error_of(retention_max_ttl_s=60)
    assert "retention_ttl_s=300" in msg and "retention_max_ttl_s=60" in msg
    assert "lower retention_ttl_s or raise retention_max_ttl_s" in msg
    assert "retention_max_ttl_s from extra config" in msg
    assert "retention_ttl_s=0 must be > 0" in error_of(retention_ttl_s=0)


def test_negative_min_load_tokens_names_what_unset_means() -> None:
    """Unset is one host block (the docs, `min_load`), not one chunk as the message said."""
    msg = error_of(min_load_tokens=-1)
    assert "leave it unset for one host block" in msg
    assert KVTierConfig().min_load(16) == 16


# ---------------------------------------------------------------- documented defaults = code


def _doc_rows() -> dict[str, tuple[str, str]]:
    rows = {}
    for line in PAGE.read_text().splitlines():
        m = re.match(r"^\| `([a-z_]+)` \| (\w+) \| (.*?) \| ", line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3))
    return rows


def test_every_documented_default_reads_back_as_the_codes_default() -> None:
    """The docs table shows each default as text (`2GiB`, `0.1`, unset): read back through the
    key's own coercion it must equal the code's default, so a rounded size or float fails."""
    rows = _doc_rows()
    fields = dataclasses.fields(KVTierConfig)
    assert set(rows) == {f.name for f in fields}
    for f in fields:
        kind, shown = rows[f.name]
        assert kind == f.metadata["kind"], f.name
        if shown == "unset":
            assert f.default is None, f.name
            continue
        text = shown.strip("`")
        text = "" if text == "''" else text
        value = KVTierConfig.from_dict({f.name: text})
        assert getattr(value, f.name) == getattr(KVTierConfig(), f.name), (f.name, shown)


def test_format_size_of_a_default_is_exact_or_the_table_would_lie() -> None:
    # format_size keeps 3 significant digits: the docs' size defaults must survive it
    for f in dataclasses.fields(KVTierConfig):
        if f.metadata["kind"] == "size" and f.default:
            assert parse_size(format_size(f.default), f.name) == f.default, f.name


def test_config_docs_check_of_a_missing_page_exits_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`python -m kvtier.config_docs --check missing.md` raised FileNotFoundError."""
    missing = tmp_path / "nope.md"
    assert config_docs.main(["--check", str(missing)]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "cannot read" in err
    assert config_docs.main(["a.md", "b.md"]) == 2
    assert "usage: python -m kvtier.config_docs" in capsys.readouterr().err


# ------------------------------------------------------------------------- sources and keys


def test_env_yaml_and_mapping_each_name_their_source(tmp_path: Path) -> None:
    yaml_file = tmp_path / "kv.yaml"
    yaml_file.write_text("lease_ttl_s: 0\n")
    with pytest.raises(ConfigError) as err:
        KVTierConfig.load(environ={"KVTIER_CONFIG": str(yaml_file)})
    assert f"lease_ttl_s from YAML file {str(yaml_file)!r}" in str(err.value)
    with pytest.raises(ConfigError) as err:
        KVTierConfig.load(environ={"KVTIER_WRITE_QUEUE_DEPTH": "-3"})
    assert "write_queue_depth=-3 must be > 0" in str(err.value)
    assert "environment KVTIER_WRITE_QUEUE_DEPTH" in str(err.value)


def test_a_config_file_given_on_the_command_line_is_named_by_its_flag(tmp_path: Path) -> None:
    missing = tmp_path / "absent.yaml"
    with pytest.raises(ConfigError) as err:
        KVTierConfig.load(environ={}, config_file=missing)
    assert f"--config={str(missing)!r} cannot be read" in str(err.value)
    # the file replaces KVTIER_CONFIG's, and the KVTIER_* variables still override it
    given = tmp_path / "given.yaml"
    given.write_text("chunk_size: 64\nmemory_bytes: 64MiB\n")
    cfg = KVTierConfig.load(
        environ={"KVTIER_CONFIG": str(missing), "KVTIER_MEMORY_BYTES": "32MiB"},
        config_file=given,
    )
    assert (cfg.chunk_size, cfg.memory_bytes) == (64, 32 << 20)


def test_mapping_keys_are_trimmed_and_an_empty_env_value_unsets_an_optional_key() -> None:
    assert KVTierConfig.from_dict({" Chunk-Size ": 512}).chunk_size == 512
    cfg = KVTierConfig.load(environ={"KVTIER_DISK_DIR": "", "KVTIER_MIN_LOAD_TOKENS": "none"})
    assert cfg.disk_dir is None and cfg.min_load_tokens is None


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("enabled", 2, "enabled=2 is not a boolean"),
        ("enabled", 1.0, "enabled=1.0 is not a boolean"),
        ("max_leases", True, "max_leases=True is a boolean; max_leases takes an integer"),
        ("lease_ttl_s", False, "lease_ttl_s=False is a boolean"),
        ("memory_bytes", False, "memory_bytes=False is a boolean, not a size"),
        ("lookup_scope", [True], "non-integer rank True"),
        ("admission", "ALL", "admission='ALL' is not one of adaptive, all"),
        ("load_policy", " cost", "load_policy=' cost' is not one of cost, always"),
        ("retention_full", "Clip", "retention_full='Clip' is not one of clip, soonest"),
        ("lease_ttl_s", float("inf"), "lease_ttl_s=inf is not a finite number"),
        ("load_margin", float("nan"), "load_margin=nan is not a finite number"),
    ],
)
def test_wrong_types_and_enum_spellings_are_refused_by_name(
    key: str, value: object, needle: str
) -> None:
    assert needle in error_of(**{key: value})


# --------------------------------------------------------------------------------- the CLI


def test_serve_refuses_a_port_outside_the_tcp_range(tmp_path: Path) -> None:
    """--port 70000 reached socket.bind and escaped as OverflowError (a traceback, exit 1)."""
    for port in ("70000", "-1"):
        result = invoke("serve", str(tmp_path / "model"), "--no-offload", "--port", port)
        assert_clean_failure(result, f"--port {port} is outside 0..65535")


def test_serve_names_its_config_flag_when_the_file_is_missing(tmp_path: Path) -> None:
    """The message named KVTIER_CONFIG, a variable the user never set."""
    missing = tmp_path / "absent.yaml"
    result = invoke("serve", str(tmp_path / "model"), "--config", str(missing), env={})
    assert_clean_failure(result, f"--config={str(missing)!r} cannot be read")
    assert "KVTIER_CONFIG" not in result.output


def test_serve_refuses_an_out_of_range_body_size(tmp_path: Path) -> None:
    result = invoke(
        "serve", str(tmp_path / "model"), "--no-offload", "--max-request-body-size", "1e400"
    )
    assert_clean_failure(result, "--max-request-body-size='1e400' is out of range")


def test_serve_config_error_from_the_environment_hides_the_url_password(tmp_path: Path) -> None:
    result = invoke(
        "serve",
        str(tmp_path / "model"),
        env={
            "KVTIER_REMOTE_URL": f"admin:{SECRET}@cache:6379",
            "KVTIER_RECORD_KEY": RECORD_KEY,
        },
    )
    assert_clean_failure(result, "remote_url='admin:***@cache:6379'", "KVTIER_REMOTE_URL")
    assert SECRET not in result.output


@pytest.mark.parametrize(
    "args",
    [[], ["--remote-url", "redis://127.0.0.1:1", "--disk", "/tmp"]],
)
def test_bench_load_cost_without_exactly_one_tier_exits_2(args: list[str]) -> None:
    """The ConfigError escaped as a traceback with exit 1."""
    result = invoke("bench", "load-cost", *args)
    assert_clean_failure(result, "bench load-cost needs exactly one slow tier")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--host", "foo"], "--host 'foo' is unknown"),
        (["--load", "foo"], "--load 'foo' is unknown"),
        (["--tp", "0"], "--tp 0 must be >= 1"),
    ],
)
def test_bench_e2e_bad_flags_exit_2_naming_the_flag(args: list[str], needle: str) -> None:
    result = invoke("bench", "e2e", *args)
    assert_clean_failure(result, needle)


def test_bench_e2e_refuses_repeat_0_before_building_anything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--repeat 0 got as far as the arms (after the model build) and raised ValueError there."""

    def run(**kw: Any) -> None:
        raise AssertionError(f"e2e.run was called with repeat={kw['repeat']}")

    monkeypatch.setattr("kvtier.bench.e2e.run", run)
    result = invoke("bench", "e2e", "--repeat", "0")
    assert_clean_failure(result, "--repeat 0 must be >= 1")


def test_bench_tier_json_that_is_a_directory_exits_2(tmp_path: Path) -> None:
    """tier.run's ValueError for a directory escaped as a traceback."""
    result = invoke("bench", "tier", "--quick", "--json", str(tmp_path))
    assert_clean_failure(result, f"--json {str(tmp_path)!r} is a directory")


def test_demo_refuses_tp_0_before_running(monkeypatch: pytest.MonkeyPatch) -> None:
    """--tp 0 went on to build the demo model and start servers that could not start."""
    calls: list[int] = []
    monkeypatch.setattr("kvtier.bench.demo.run", lambda tp: calls.append(tp) or 0)
    result = invoke("demo", "--tp", "0")
    assert_clean_failure(result, "--tp 0 must be >= 1")
    assert calls == []
    assert invoke("demo", "--tp", "3").exit_code == 0 and calls == [3]


def test_a_failing_demo_exits_with_its_code(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvtier.bench.demo.run", lambda tp: 1)
    assert invoke("demo").exit_code == 1


def test_serve_engine_config_errors_exit_2_naming_the_value(tmp_path: Path) -> None:
    result = invoke("serve", str(tmp_path / "model"), "--no-offload", "--dtype", "float64")
    assert_clean_failure(result, "dtype='float64'")
    result = invoke("serve", str(tmp_path / "model"), "--no-offload", "--tp", "0")
    assert_clean_failure(result, "tensor_parallel_size=0")


def test_serve_stall_timeout_nan_is_refused(tmp_path: Path) -> None:
    result = invoke("serve", str(tmp_path / "model"), "--no-offload", "--stall-timeout", "nan")
    assert_clean_failure(result, "--stall-timeout nan must be > 0 seconds")


def test_admission_history_past_its_documented_cap_is_refused_naming_it() -> None:
    """The docs say at most 1048576, but only the automatic size was capped: an explicit
    value was used as given (each key ~100 bytes on the scheduler; a review found it)."""
    assert KVTierConfig.from_dict({"admission_history": 1 << 20}).admission_history == 1 << 20
    with pytest.raises(ConfigError) as e:
        KVTierConfig.from_dict({"admission_history": (1 << 20) + 1})
    assert "admission_history=1048577 is outside 0..1048576" in str(e.value)
