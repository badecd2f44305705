"""The direct NATS connection's frames (pure)."""

from __future__ import annotations

import pytest

from edge.nats_direct import header_block, hpub


def test_header_block_is_the_status_line_then_one_line_per_header() -> None:
    headers = {"Nats-Msg-Id": "s1:7", "Nats-Expected-Last-Subject-Sequence": "12", "X-Ünicode": "ä b"}
    expected = "NATS/1.0\r\nNats-Msg-Id: s1:7\r\nNats-Expected-Last-Subject-Sequence: 12\r\nX-Ünicode: ä b\r\n\r\n"
    assert header_block(headers) == expected.encode()
    assert header_block({}) == b"NATS/1.0\r\n\r\n"


@pytest.mark.parametrize("bad", ["a\r\nb", "a\nb", "a\rb", "\r\n"])
def test_a_line_break_in_a_header_is_refused(bad: str) -> None:
    assert header_block({"X": bad}) is None
    assert header_block({bad: "v"}) is None


def test_hpub_frames_the_header_block_and_payload() -> None:
    block = header_block({"A": "1"})
    assert block is not None
    frame = hpub("rb.s1.turn", "_INBOX.x.3", block, b"payload")
    assert frame == b"HPUB rb.s1.turn _INBOX.x.3 %d %d\r\n%spayload\r\n" % (len(block), len(block) + 7, block)
