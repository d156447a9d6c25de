"""The record key the tests' shared stores use (records there must be authenticated: the
config refuses a remote_url without one)."""

RECORD_KEY = "test-record-key-" + "5a" * 16
