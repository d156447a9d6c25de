"""KVTierConfig: coercion, validation, secrets, and YAML < env < dict precedence."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvtier.config import KVTierConfig, config_environ, format_size, parse_size
from kvtier.errors import ConfigError
from tests.record_key import RECORD_KEY

GiB = 1 << 30
SECRET = "hunter2-s3cr3t"


def error_of(**kwargs: object) -> str:
    """The ConfigError message from building a config out of `kwargs` as an extra-config dict."""
    with pytest.raises(ConfigError) as err:
        KVTierConfig.from_dict(kwargs)
    return str(err.value)


# ------------------------------------------------------------------------------------ defaults


def test_defaults_serve_one_machine_with_memory_tier_only() -> None:
    cfg = KVTierConfig()
    assert cfg.enabled and cfg.chunk_size == 256 and cfg.memory_bytes == 2 * GiB
    assert cfg.disk_bytes == 0 and cfg.disk_dir is None and cfg.remote_url is None
    assert cfg.lookup_scope is None and cfg.lookup_transport == "ipc"
    assert cfg.min_load(16) == 16  # unset: one host block
    assert dataclasses.replace(cfg, min_load_tokens=1024).min_load(16) == 1024


def test_config_is_frozen() -> None:
    cfg = KVTierConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.chunk_size = 512  # type: ignore[misc]


def test_replace_revalidates() -> None:
    with pytest.raises(ConfigError, match="chunk_size=100"):
        dataclasses.replace(KVTierConfig(), chunk_size=100)


# ---------------------------------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512MiB", 512 << 20),
        ("64GiB", 64 << 30),
        ("1.5GB", 1_500_000_000),
        ("4096", 4096),
        ("10KiB", 10240),
        ("2TiB", 2 << 40),
        ("500KB", 500_000),
        ("64gib", 64 << 30),
        ("1.5 kib", 1536),
        ("100B", 100),
        ("1e3", 1000),
        (4096, 4096),
        (2.0, 2),
        (0, 0),
    ],
)
def test_parse_size_units(text: object, expected: int) -> None:
    assert parse_size(text, "memory_bytes") == expected


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("-5GiB", "is negative"),
        (-1, "is negative"),
        ("lots", "is not a size"),
        ("12 parsecs", "unknown unit 'parsecs'"),
        ("1.1B", "not a whole number of bytes"),
        (1.5, "not a whole number of bytes"),
        (True, "is a boolean"),
        ([1], "not a size"),
        (float("inf"), "not a finite size"),
    ],
)
def test_parse_size_errors_name_key_and_value(value: object, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_size(value, "disk_bytes")
    msg = str(err.value)
    assert needle in msg
    assert f"disk_bytes={value!r}" in msg


def test_size_fields_accept_units_from_dict() -> None:
    cfg = KVTierConfig.from_dict({"memory_bytes": "64GiB", "disk_dir": "/d", "disk_bytes": "1TB"})
    assert (cfg.memory_bytes, cfg.disk_bytes) == (64 * GiB, 10**12)


def test_format_size() -> None:
    assert [format_size(n) for n in (100, 1536, 2 * GiB, 3 << 40)] == [
        "100B",
        "1.5KiB",
        "2GiB",
        "3TiB",
    ]


# ------------------------------------------------------------------------ the listed errors


def test_unknown_key_is_error_with_suggestion() -> None:
    msg = error_of(chunk_sise=256)
    assert "unknown key 'chunk_sise' in extra config" in msg
    assert "did you mean 'chunk_size'?" in msg


def test_unknown_key_without_close_match_lists_valid_keys() -> None:
    msg = error_of(zzzzzz=1)
    assert "unknown key 'zzzzzz'" in msg and "valid keys: enabled, chunk_size" in msg


def test_negative_size_is_error() -> None:
    msg = error_of(memory_bytes="-2GiB")
    assert "memory_bytes='-2GiB' is negative" in msg
    assert "from extra config" in msg


def test_unparsable_size_is_error() -> None:
    msg = error_of(memory_bytes="two gigs")
    assert "memory_bytes='two gigs' is not a size" in msg
    assert "64GiB" in msg  # the fix shows the accepted forms


def test_chunk_not_multiple_of_16_is_error() -> None:
    msg = error_of(chunk_size=100)
    assert msg.startswith(
        "chunk_size=100 is not a positive multiple of 16; "
        "use 256 (the default) or another multiple of 16"
    )
    assert "chunk_size=0 is not a positive" in error_of(chunk_size=0)
    assert "chunk_size=-16 is not a positive" in error_of(chunk_size=-16)


def test_disk_tier_without_directory_names_both_keys() -> None:
    msg = error_of(disk_bytes="64GiB")
    assert f"disk_bytes={64 * GiB}" in msg and "disk_dir is not set" in msg
    assert "set disk_dir" in msg


def test_disk_dir_without_bytes_is_error() -> None:
    msg = error_of(disk_dir="/mnt/kv")
    assert "disk_dir='/mnt/kv'" in msg and "disk_bytes=0" in msg


@pytest.mark.parametrize("url", ["http://cache:6379", "memcached://h", "cache:6379"])
def test_bad_remote_scheme_is_error(url: str) -> None:
    msg = error_of(remote_url=url)
    assert f"remote_url={url!r}" in msg
    assert "not one of redis, rediss, unix" in msg and "redis://host:6379/0" in msg


@pytest.mark.parametrize(
    "url", ["redis://cache:6379/0", "rediss://u@cache:6380", "unix:///run/redis.sock"]
)
def test_good_remote_urls_pass(url: str) -> None:
    assert KVTierConfig.from_dict({"remote_url": url, "record_key": RECORD_KEY}).remote_url == url


@pytest.mark.parametrize(
    ("url", "needle"),
    [("redis://", "names no host"), ("unix://", "names no socket path"), ("redis://h:x", "valid")],
)
def test_incomplete_remote_url_is_error(url: str, needle: str) -> None:
    assert needle in error_of(remote_url=url)


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "node7.cluster"])
def test_non_loopback_bind_without_option_is_error(host: str) -> None:
    msg = error_of(lookup_transport="tcp", lookup_bind_host=host)
    assert f"lookup_bind_host={host!r} is not a loopback address" in msg
    assert "allow_remote_bind=true" in msg
    cfg = KVTierConfig.from_dict(
        {"lookup_transport": "tcp", "lookup_bind_host": host, "allow_remote_bind": True}
    )
    assert cfg.lookup_bind_host == host


@pytest.mark.parametrize("host", ["127.0.0.1", "127.9.9.9", "::1", "localhost"])
def test_loopback_bind_is_fine(host: str) -> None:
    assert KVTierConfig.from_dict({"lookup_bind_host": host}).lookup_bind_host == host


def test_memory_zero_is_error_only_when_enabled() -> None:
    msg = error_of(memory_bytes=0)
    assert "memory_bytes=0" in msg and "enabled=false" in msg
    assert KVTierConfig.from_dict({"enabled": False, "memory_bytes": 0}).memory_bytes == 0


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("lookup_transport", "udp", "lookup_transport='udp' is not a transport"),
        ("lease_ttl_s", 0, "lease_ttl_s=0.0 must be > 0; use 30.0"),
        ("max_leases", -1, "max_leases=-1 must be > 0"),
        ("write_queue_depth", 0, "write_queue_depth=0 must be > 0"),
        ("write_wait_ms", -1, "write_wait_ms=-1.0 is negative"),
        ("write_wait_ms", "nan", "write_wait_ms='nan' is not a finite number"),
        # a wait this long overflowed the save lane's Condition.wait (OverflowError: every save
        # of the step failed as a hook error)
        ("write_wait_ms", 1e300, "write_wait_ms=1e+300 is over 60000"),
        ("lookup_timeout_ms", 0, "lookup_timeout_ms=0 must be > 0"),
        ("remote_timeout_ms", -5, "remote_timeout_ms=-5 must be > 0"),
        ("memory_read_gbps", 0, "memory_read_gbps=0.0 must be > 0"),
        ("breaker_failures", 0, "breaker_failures=0 must be > 0"),
        ("remote_ttl_s", -1, "remote_ttl_s=-1 is negative"),
        ("min_load_tokens", -1, "min_load_tokens=-1 is negative"),
        ("tenant", "a b", "tenant='a b' is not a valid tenant"),
        ("chunk_size", "abc", "chunk_size='abc' is not an integer"),
        ("chunk_size", 256.5, "chunk_size=256.5 is not an integer"),
        ("chunk_size", True, "chunk_size=True is a boolean"),
        ("enabled", "maybe", "enabled='maybe' is not a boolean"),
        ("lease_ttl_s", "soon", "lease_ttl_s='soon' is not a finite number"),
        ("lease_ttl_s", "nan", "lease_ttl_s='nan' is not a finite number"),
        ("lookup_scope", "0,x", "non-integer rank 'x'"),
        ("lookup_scope", [0, 0], "names ranks [0] more than once"),
        ("lookup_scope", [], "is empty"),
        ("lookup_scope", "0,-1", "negative rank -1"),
        ("lookup_scope", 3, "is not a list of ranks"),
        ("disk_dir", 5, "disk_dir=5 has type int"),
    ],
)
def test_other_value_errors_name_key_and_value(key: str, value: object, needle: str) -> None:
    assert needle in error_of(**{key: value})


# ---------------------------------------------------------------------------------- coercion


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1", True),
        ("yes", True),
        ("ON", True),
        ("true", True),
        ("0", False),
        ("no", False),
        ("Off", False),
        ("FALSE", False),
    ],
)
def test_bool_coercion(text: str, expected: bool) -> None:
    assert KVTierConfig.from_dict({"load_gate": text}).load_gate is expected


def test_string_coercion_of_numbers_and_scope() -> None:
    cfg = KVTierConfig.from_dict(
        {
            "chunk_size": "512",
            "lease_ttl_s": "2.5",
            "lookup_scope": "0, 1,2,3",
            "min_load_tokens": "1024",
            "disk_dir": "",
        }
    )
    assert (cfg.chunk_size, cfg.lease_ttl_s, cfg.lookup_scope) == (512, 2.5, (0, 1, 2, 3))
    assert (cfg.min_load_tokens, cfg.disk_dir) == (1024, None)
    assert KVTierConfig.from_dict({"lookup_scope": [2, 0]}).lookup_scope == (2, 0)
    assert KVTierConfig.from_dict({"lookup_scope": "all"}).lookup_scope is None
    assert KVTierConfig.from_dict({"min_load_tokens": ""}).min_load_tokens is None


def test_key_spellings_normalise_and_duplicates_are_errors() -> None:
    assert KVTierConfig.from_dict({"chunk-size": 512}).chunk_size == 512
    assert "chunk_size is given twice" in error_of(**{"chunk_size": 256, "chunk-size": 512})


def test_from_dict_rejects_non_mapping() -> None:
    with pytest.raises(ConfigError, match="not a mapping"):
        KVTierConfig.from_dict([("chunk_size", 256)])  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------- secrets


def secret_config() -> KVTierConfig:
    return KVTierConfig.from_dict(
        {
            "remote_url": f"redis://admin:{SECRET}@cache:6379/0",
            "record_key": RECORD_KEY,
            "remote_username": "admin",
            "remote_password": SECRET,
        }
    )


def test_password_never_in_repr_str_or_to_dict() -> None:
    cfg = secret_config()
    assert cfg.remote_password == SECRET  # still usable by the remote tier
    for text in (repr(cfg), str(cfg), str(cfg.to_dict()), cfg.describe()):
        assert SECRET not in text
    assert "remote_password='***'" in repr(cfg)
    d = cfg.to_dict()
    assert d["remote_password"] == "***"
    assert d["remote_url"] == "redis://admin:***@cache:6379/0"
    assert KVTierConfig().to_dict()["remote_password"] is None


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        (f"redis://:{SECRET}@cache:6379/0", "redis://:***@cache:6379/0"),
        (f"rediss://admin:{SECRET}@cache", "rediss://admin:***@cache"),
        (f"unix:///run/r.sock?db=0&password={SECRET}", "unix:///run/r.sock?db=0&password=***"),
        ("redis://cache:6379/0", "redis://cache:6379/0"),
    ],
)
def test_url_passwords_are_masked(url: str, masked: str) -> None:
    cfg = KVTierConfig.from_dict({"remote_url": url, "record_key": RECORD_KEY})
    assert cfg.to_dict()["remote_url"] == masked
    assert SECRET not in repr(cfg) and SECRET not in cfg.describe()


def test_password_never_in_error_messages() -> None:
    # a config error elsewhere, with the password and a URL password present
    msg = error_of(
        remote_url=f"http://admin:{SECRET}@cache:6379", remote_password=SECRET, chunk_size=256
    )
    assert SECRET not in msg and "http://admin:***@cache:6379" in msg
    # credentials without a URL: the error names the key, never the value
    msg = error_of(remote_password=SECRET)
    assert "remote_password is set but remote_url is not" in msg and SECRET not in msg
    # a password YAML turned into a number is refused without echoing it
    with pytest.raises(ConfigError) as err:
        KVTierConfig.from_dict({"remote_url": "redis://h", "remote_password": 987654321})
    assert "987654321" not in str(err.value) and "remote_password must be a string" in str(
        err.value
    )


def test_password_never_in_yaml_syntax_error(tmp_path: Path) -> None:
    path = tmp_path / "kv.yaml"
    path.write_text(f'remote_url: redis://h\nremote_password: "{SECRET}\n  broken: [\n')
    with pytest.raises(ConfigError) as err:
        KVTierConfig.from_yaml(path)
    assert "is not valid YAML at line" in str(err.value)
    assert SECRET not in str(err.value)
    assert err.value.__cause__ is None and err.value.__suppress_context__


# -------------------------------------------------------------------------------- env + yaml


def test_from_env_reads_kvtier_vars() -> None:
    cfg = KVTierConfig.from_env(
        {
            "KVTIER_CHUNK_SIZE": "128",
            "KVTIER_MEMORY_BYTES": "8GiB",
            "KVTIER_LOOKUP_SCOPE": "0,1",
            "KVTIER_LOAD_GATE": "off",
            "KVTIER_REMOTE_URL": "unix:///run/valkey.sock",
            "KVTIER_RECORD_KEY": RECORD_KEY,
            "PATH": "/usr/bin",  # not ours, ignored
        }
    )
    assert (cfg.chunk_size, cfg.memory_bytes, cfg.lookup_scope) == (128, 8 * GiB, (0, 1))
    assert cfg.load_gate is False and cfg.remote_url == "unix:///run/valkey.sock"


def test_unknown_env_var_is_error_with_suggestion() -> None:
    with pytest.raises(ConfigError) as err:
        KVTierConfig.from_env({"KVTIER_CHUNK_SIZ": "256"})
    msg = str(err.value)
    assert "unknown environment variable KVTIER_CHUNK_SIZ" in msg
    assert "did you mean KVTIER_CHUNK_SIZE?" in msg


def test_bench_token_and_test_device_are_not_config() -> None:
    # the bench's bearer token and the GPU check's device share the prefix: the loader must
    # pass them by, and a bench must not hand the token to the servers it starts
    env = {
        "KVTIER_BENCH_API_KEY": "sk-secret",
        "KVTIER_TEST_DEVICE": "cuda:0",
        "KVTIER_CHUNK_SIZE": "128",
    }
    assert KVTierConfig.from_env(env).chunk_size == 128
    assert config_environ(env) == {"KVTIER_CHUNK_SIZE": "128"}


def test_env_error_names_the_variable() -> None:
    with pytest.raises(ConfigError) as err:
        KVTierConfig.from_env({"KVTIER_CHUNK_SIZE": "100"})
    msg = str(err.value)
    assert "chunk_size=100 is not a positive multiple of 16" in msg
    assert "chunk_size from environment KVTIER_CHUNK_SIZE" in msg


def test_from_yaml(tmp_path: Path) -> None:
    path = tmp_path / "kv.yaml"
    path.write_text("chunk_size: 512\nmemory_bytes: 16GiB\nlookup_scope: [0, 1]\n")
    cfg = KVTierConfig.from_yaml(path)
    assert (cfg.chunk_size, cfg.memory_bytes, cfg.lookup_scope) == (512, 16 * GiB, (0, 1))
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert KVTierConfig.from_yaml(empty) == KVTierConfig()


def test_yaml_errors_name_file_and_key(tmp_path: Path) -> None:
    path = tmp_path / "kv.yaml"
    path.write_text("chunk_size: 100\n")
    with pytest.raises(ConfigError) as err:
        KVTierConfig.from_yaml(path)
    assert f"chunk_size from YAML file {str(path)!r}" in str(err.value)
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="is a list, not a mapping"):
        KVTierConfig.from_yaml(path)
    path.write_text("chunk_sizes: 256\n")
    with pytest.raises(ConfigError, match="did you mean 'chunk_size'"):
        KVTierConfig.from_yaml(path)


def test_missing_yaml_file_names_env_var(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as err:
        KVTierConfig.from_env({"KVTIER_CONFIG": str(missing)})
    assert f"KVTIER_CONFIG={str(missing)!r} cannot be read" in str(err.value)


def test_precedence_yaml_then_env_then_dict(tmp_path: Path) -> None:
    path = tmp_path / "kv.yaml"
    path.write_text("chunk_size: 512\nmemory_bytes: 4GiB\nlease_ttl_s: 9\ntenant: from-yaml\n")
    environ = {
        "KVTIER_CONFIG": str(path),
        "KVTIER_MEMORY_BYTES": "8GiB",
        "KVTIER_LEASE_TTL_S": "10",
    }
    cfg = KVTierConfig.load({"lease_ttl_s": 11.0}, environ)
    assert cfg.chunk_size == 512  # only in YAML
    assert cfg.tenant == "from-yaml"  # only in YAML
    assert cfg.memory_bytes == 8 * GiB  # env beats YAML
    assert cfg.lease_ttl_s == 11.0  # dict beats env and YAML
    # from_env is the same merge without a dict
    assert KVTierConfig.from_env(environ).lease_ttl_s == 10.0
    # a bad value in a lower layer that a higher layer overrides never reaches validation
    path.write_text("chunk_size: 100\n")
    assert KVTierConfig.load({"chunk_size": 256}, environ).chunk_size == 256


def test_load_defaults_to_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_WRITE_QUEUE_DEPTH", "17")
    assert KVTierConfig.load().write_queue_depth == 17
    monkeypatch.setenv("KVTIER_WRITE_QUEUE_DEPHT", "17")
    with pytest.raises(ConfigError, match="KVTIER_WRITE_QUEUE_DEPHT"):
        KVTierConfig.load()


# ---------------------------------------------------------------------------------- describe


def test_describe_is_one_line_summary() -> None:
    cfg = KVTierConfig.from_dict(
        {
            "memory_bytes": "64GiB",
            "disk_dir": "/mnt/kv",
            "disk_bytes": "1TiB",
            "lookup_scope": "0,1,2,3",
        }
    )
    line = cfg.describe()
    assert "\n" not in line
    assert line == (
        "kvtier: offload on; chunk=256 tokens; memory=64GiB/rank; disk=1TiB at /mnt/kv; "
        "remote=off; lookup=ipc over ranks [0, 1, 2, 3] within 200ms; min_load=1 block; "
        "load_policy=cost; sync_load_fraction=0.25; self_test=on"
    )
    assert KVTierConfig(enabled=False).describe() == "kvtier: offload off"


def test_to_dict_round_trips_without_secrets() -> None:
    cfg = KVTierConfig.from_dict({"lookup_scope": [0, 1], "memory_bytes": "1GiB"})
    assert KVTierConfig.from_dict(cfg.to_dict()) == cfg


def test_a_kv_layout_kvtier_cannot_move_whole_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"preferred_kv_layout='LHBNC' is not a layout.*BLHNC"):
        KVTierConfig(preferred_kv_layout="LHBNC")
    assert KVTierConfig(preferred_kv_layout="").preferred_kv_layout == ""


# ------------------------------------------------- configs that cannot start wrong (issue 10)


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        # a password holding '/' (unescaped): the mask must not stop at the first '/'
        (f"redis://admin:{SECRET}/x@cache:6379/0", "redis://admin:***@cache:6379/0"),
        # a bare token as userinfo is a secret too
        (f"redis://{SECRET}@cache:6379/0", "redis://***@cache:6379/0"),
    ],
)
def test_one_mask_url_hides_slashed_passwords_and_bare_tokens_everywhere(
    url: str, masked: str
) -> None:
    from kvtier.config import mask_url

    assert mask_url(url) == masked
    msg = error_of(remote_url=url.replace("redis://", "http://"))  # any error quoting it
    assert SECRET not in msg
    if "/x@" not in url:  # a slashed password is not a URL urlsplit can read: only errors show it
        cfg = KVTierConfig.from_dict({"remote_url": url, "record_key": RECORD_KEY})
        for text in (cfg.describe(), repr(cfg), str(cfg.to_dict())):
            assert SECRET not in text and masked in text


@pytest.mark.parametrize("url", ["redis://cache:6379/abc", "unix:///run/r.sock?db=x"])
def test_redis_db_that_is_not_a_number_is_refused(url: str) -> None:
    msg = error_of(remote_url=url)
    assert "is not a database number; use /0" in msg and "remote_url=" in msg


def test_yaml_key_given_twice_is_an_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "kvtier.yaml"
    path.write_text("chunk_size: 64\nmemory_bytes: 1GiB\nchunk_size: 128\n")
    with pytest.raises(ConfigError, match=r"line 3, column 1: key 'chunk_size' is given twice"):
        KVTierConfig.from_yaml(path)


def test_chunk_size_larger_than_max_model_len_names_both() -> None:
    cfg = KVTierConfig(chunk_size=512)
    with pytest.raises(ConfigError, match=r"chunk_size=512 .* max_model_len=300.* larger than 300"):
        cfg.check_max_model_len(300)
    cfg.check_max_model_len(512)
    KVTierConfig(chunk_size=512, enabled=False).check_max_model_len(300)


def test_lookup_base_port_is_a_key_both_hosts_use_and_tcp_needs() -> None:
    from kvtier.lookup import endpoint_for

    assert KVTierConfig(lookup_base_port="15500").lookup_base_port == 15500
    assert "outside 1..65535" in error_of(lookup_base_port=70000)
    with pytest.raises(ConfigError, match="set lookup_base_port"):
        endpoint_for(1, transport="tcp")
    assert endpoint_for(1, transport="tcp", base_port=15500) == "tcp://127.0.0.1:15501"


def test_model_revision_is_a_key() -> None:
    assert KVTierConfig(model_revision="v2").model_revision == "v2"
    assert KVTierConfig(model_revision="").model_revision is None


def test_a_shared_store_without_a_record_key_is_refused_naming_the_fix() -> None:
    msg = error_of(remote_url="redis://cache:6379/0")
    assert "no record key" in msg and "KVTIER_RECORD_KEY" in msg and "record_key_file" in msg


def test_record_key_rules_and_the_key_is_never_shown() -> None:
    short = "s3cr3t-but-short"
    msg = error_of(record_key=short)
    assert "has 16 characters" in msg and "at least 32" in msg and short not in msg
    both = error_of(record_key=RECORD_KEY, record_key_file="/etc/kvtier/key")
    assert "both set" in both and RECORD_KEY not in both
    cfg = KVTierConfig(record_key=RECORD_KEY)
    assert RECORD_KEY not in repr(cfg) and RECORD_KEY not in cfg.describe()
    assert cfg.to_dict()["record_key"] == "***"
    assert cfg.to_dict(secrets=True)["record_key"] == RECORD_KEY
    with pytest.raises(ConfigError) as e:
        KVTierConfig.from_dict({"record_key": 12345678901234567890123456789012345})
    assert "value not shown" in str(e.value) and "1234567890" not in str(e.value)


def test_disk_and_store_policy_keys_name_their_choices() -> None:
    assert "is negative" in error_of(disk_gc_days=-1)
    assert "refuse, own_dir" in error_of(disk_conflict="share")
    assert "refuse, warn" in error_of(remote_full="ignore")
    cfg = KVTierConfig()
    assert (cfg.disk_gc_days, cfg.disk_conflict, cfg.remote_full) == (30.0, "refuse", "refuse")
    assert cfg.encrypt_at_rest is False


def test_the_default_chunk_is_raised_to_a_block_that_does_not_divide_it() -> None:
    # vLLM raises a state hybrid's block until an attention page holds a state page
    cfg = KVTierConfig()
    assert cfg.fitted_to_block(640).chunk_size == 640
    assert cfg.fitted_to_block(96).chunk_size == 288
    assert cfg.fitted_to_block(128) is cfg and cfg.fitted_to_block(16) is cfg
    # a chunk size the user chose is theirs: the connector's startup check names the fix
    chosen = KVTierConfig(chunk_size=512)
    assert chosen.fitted_to_block(640) is chosen
    # a model with state layers: one block (vLLM keeps states at block boundaries, kvtier
    # stores one only at a chunk boundary)
    assert cfg.fitted_to_block(128, states=True).chunk_size == 128
    assert cfg.fitted_to_block(640, states=True).chunk_size == 640
    assert chosen.fitted_to_block(128, states=True) is chosen


def test_a_chunk_size_chosen_equal_to_the_default_is_still_the_users(tmp_path: Path) -> None:
    """`chunk_size: 256` set by the user could not be told from the default, so a 640-token
    block raised it silently to 640 while the startup line called 256 "the default" (a
    review found it). `given` says which keys the user set, wherever they came from."""
    yaml_file = tmp_path / "kv.yaml"
    yaml_file.write_text("chunk_size: 256\n", encoding="utf-8")
    env = {"KVTIER_CONFIG": str(yaml_file)}
    assert KVTierConfig.given({"chunk_size": 256}, {}) == {"chunk_size"}
    assert KVTierConfig.given({}, env) == {"chunk_size"}
    assert KVTierConfig.given({}, {"KVTIER_CHUNK_SIZE": "256"}) == {"chunk_size"}
    assert KVTierConfig.given({"memory_bytes": "1GiB"}, {}) == {"memory_bytes"}
    cfg = KVTierConfig.load({"chunk_size": 256}, {})
    assert cfg.fitted_to_block(640, chosen=True) is cfg
    assert cfg.fitted_to_block(640).chunk_size == 640  # the default, not chosen: fitted
