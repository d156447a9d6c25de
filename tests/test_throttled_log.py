"""ThrottledLog: an outsider's flood of one kind of event costs one log line a minute."""

from __future__ import annotations

import logging

import pytest

from kvtier.throttled_log import ThrottledLog


def test_a_flood_is_one_line_then_one_per_interval_counting_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    lines = ThrottledLog(logging.getLogger("kvtier.test"), every_s=60.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        for i in range(500):
            lines.warning("key_mismatch", "record %d bad", i)
        lines.warning("checksum", "record %s bad", "x")  # another kind: its own first line
        now[0] = 61.0
        lines.warning("key_mismatch", "record %d bad", 500)
    got = [r.getMessage() for r in caplog.records]
    assert got == [
        "record 0 bad",
        "record x bad",
        "record 500 bad (499 more since the last line)",
    ]
