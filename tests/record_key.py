"""The record key the tests' shared stores use (records there must be authenticated: the
config refuses a remote_url without one)."""

RECORD_KEY = "test-record-key-" + "5a" * 16


def codec_for_tests(namespace: bytes, tenant: str = "", encrypt: bool = False):
    """A RecordCodec of `namespace` under the tests' record key."""
    from kvtier.store.record import RecordCodec, RecordKeys

    return RecordCodec(namespace, RecordKeys.derive(RECORD_KEY.encode(), tenant), encrypt=encrypt)
