"""One masking path for every shape a store URL can take: no secret from `remote_url` reaches a
log line, an error message, a shard name or `to_dict()`, whatever characters it holds (the
password shapes people write: '/', '?', '#', '@', ':', '&', '%', spaces, unicode), on every URL
form (redis://, rediss://, redis+cluster://, unix:// with the password in the userinfo or in
the query)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import remote_endpoint
from kvtier.config import KVTierConfig, mask_url
from kvtier.errors import ConfigError
from kvtier.store.remote_socket import SocketTransport
from kvtier.store.remote_transport import Timeouts
from tests.record_key import RECORD_KEY

# a marker no URL template holds, around characters that break naive URL splitting
PASSWORDS = st.builds(
    lambda mid: f"Pw{mid}Zq",
    st.text(alphabet=st.sampled_from(list("/?#@:&%=+ ;,[]~!$'()*xyz019é")), min_size=1,
            max_size=24),
)  # fmt: skip
SHAPES = [
    "redis://user:{pw}@cache.internal:6379/0",
    "redis://{pw}@cache.internal:6379/0",
    "rediss://admin:{pw}@cache.internal:6380/1",
    "redis+cluster://user:{pw}@n1.internal:7000,n2.internal:7001",
    "rediss+cluster://{pw}@n1.internal:7000",
    "unix://user:{pw}@/run/valkey/valkey.sock?db=2",
    "unix:///run/valkey/valkey.sock?db=1&password={pw}",
    "unix:///run/valkey/valkey.sock?password={pw}&db=1",
    # broken shapes must not leak either: a bad port, a query on TCP, two hosts on redis://
    "redis://user:{pw}@cache.internal:99999/0",
    "redis://user:{pw}@cache.internal:6379/0?ssl_cert_reqs=none",
    "redis://user:{pw}@h1:1,h2:2/0",
]


@settings(max_examples=120, deadline=None, derandomize=True)
@given(pw=PASSWORDS, shape=st.sampled_from(SHAPES))
def test_no_password_shape_leaks_through_any_url_form(pw: str, shape: str) -> None:
    url = shape.format(pw=pw)
    assert pw not in mask_url(url)
    try:
        remote_endpoint.parse(url)
    except ValueError as e:
        assert pw not in str(e)
    try:
        cfg = KVTierConfig(remote_url=url, record_key=RECORD_KEY)
    except ConfigError as e:
        assert pw not in str(e)
    else:
        for shown in (repr(cfg), str(cfg.to_dict()), cfg.describe()):
            assert pw not in shown


@settings(max_examples=40, deadline=None, derandomize=True)
@given(pw=PASSWORDS)
def test_a_unix_socket_shard_is_named_by_its_path_never_its_credentials(pw: str) -> None:
    url = f"unix://user:{pw}@/run/valkey/valkey.sock?db=0"
    transport = SocketTransport(
        remote_endpoint.parse(url), Timeouts(0.1, 0.1, 0.1), username=None, password=None
    )
    try:
        assert pw not in transport.shard_of(b"k") and pw not in str(transport.shards())
        assert "/run/valkey/valkey.sock" in transport.shard_of(b"k")
    finally:
        transport.close()


def test_a_password_with_a_slash_is_parsed_as_a_password() -> None:
    """The parser cut the authority at the first '/', so `default:abc/def@host` read as a host
    `default:abc` with port `abc`, and the error printed the password."""
    ep = remote_endpoint.parse("redis://default:abc/def@cache:6379/0")
    assert (ep.username, ep.password, ep.seeds) == ("default", "abc/def", (("cache", 6379),))
    ep = remote_endpoint.parse("redis://u:p?a#s@cache:6379/3")
    assert (ep.password, ep.seeds, ep.db) == ("p?a#s", (("cache", 6379),), 3)


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("redis://u:se/cret@h:1/0", "redis://u:***@h:1/0"),
        ("redis://u:se?cr#et@h:1/0", "redis://u:***@h:1/0"),
        ("unix:///s.sock?password=a&b#c&db=1", "unix:///s.sock?password=***"),
    ],
)
def test_mask_url_shapes(url: str, masked: str) -> None:
    assert mask_url(url) == masked


@pytest.mark.parametrize(
    "url",
    [
        "admin:hunter2-s3cr3t@127.0.0.1:6379",
        "redis:/admin:hunter2-s3cr3t@h:1",
        "hunter2-s3cr3t@h",
        "admin:hunter2-s3cr3t@h:1/x://y",
    ],
)
def test_a_url_without_its_scheme_separator_is_refused_without_quoting_it(url: str) -> None:
    """The parser quoted everything before '://', the whole URL when it was missing, and
    `kvtier bench tier --remote-url` printed it (a review found the password on screen)."""
    with pytest.raises(ValueError) as e:
        remote_endpoint.parse(url)
    assert "hunter2" not in str(e.value) and "'://' is missing" in str(e.value)
