"""Events too large for one message (schemas/blobs.py): their largest bytes and str values move out,
referenced by sha256, until the event fits; a reader resolves the references and gets the event back."""

from __future__ import annotations

import hashlib
import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import envelope
from schemas.blobs import BYTES, MIN_BLOB, TEXT, decode_with, externalize, object_name, references
from schemas.bodies import received
from schemas.errors import FoldError
from schemas.events import SCHEMA_VERSION, BodyPart, ChainStarted, RequestReceived, ToolCall, TurnCompleted

LIMIT = 1024 * 1024
SESSION = "s-blobs"


def chain_started(prompt_ids: bytes) -> ChainStarted:
    return ChainStarted(session_id=SESSION, seq=3, time=2.0, chain=1, request_no=1, prompt_ids=prompt_ids,
                        prefix_digest="p", n_messages=4, chat_turns=2)


def turn(text: str, *, reasoning: str | None = None, arguments: str = "{}") -> TurnCompleted:
    return TurnCompleted(session_id=SESSION, seq=9, time=3.0, chain=1, request_no=1, finish_reason="stop",
                         text=text, reasoning=reasoning, tool_calls=(ToolCall(id="c1", name="f", arguments="{}"),
                                                                     ToolCall(id="c2", name="g", arguments=arguments)),
                         tip_digest="t", n_messages=5)


def digests(blobs: dict[str, bytes]) -> dict[bytes, bytes]:
    """What a reader fetched: digest -> stored bytes (the object names end with the digest's hex)."""
    out = {}
    for name, value in blobs.items():
        session, hexdigest = name.split("/")
        assert session == SESSION and hashlib.sha256(value).hexdigest() == hexdigest
        out[bytes.fromhex(hexdigest)] = value
    return out


def round_trip(events: list, limit: int = LIMIT) -> tuple[bytes, dict[str, bytes]]:
    """The envelope the writer publishes (every event externalized) and the objects it stores."""
    moved, blobs = [], {}
    for event in events:
        small, stored = externalize(event, limit)
        assert len(envelope.encode([small])) <= limit
        moved.append(small)
        blobs.update(stored)
    payload = envelope.encode(moved)
    assert sorted(references(payload)) == sorted(
        d for e in moved for d in _exts(e))  # every reference, as often as it occurs
    assert decode_with(payload, digests(blobs)) == events
    return payload, blobs


def _exts(value: object) -> list[bytes]:
    if isinstance(value, msgspec.msgpack.Ext):
        return [value.data]
    if isinstance(value, msgspec.Struct):
        return [d for name in value.__struct_fields__ for d in _exts(getattr(value, name))]
    if isinstance(value, (tuple, list)):
        return [d for item in value for d in _exts(item)]
    return []


def test_a_request_with_a_3_mb_literal_part():
    body = random.Random(1).randbytes(3 * 1024 * 1024)
    event = received(session_id=SESSION, seq=2, time=1.0, request_no=1, wire="openai", body=body)
    assert len(envelope.encode([event])) > LIMIT
    payload, blobs = round_trip([event])
    digest = hashlib.sha256(body).digest()
    assert blobs == {object_name(SESSION, digest): body}
    assert references(payload) == [digest]
    assert len(payload) < 1024  # only the reference is left in the message
    (small,) = msgspec.msgpack.decode(payload, type=list[dict])  # the part's data is an extension of code 1
    assert small["parts"] == [[msgspec.msgpack.Ext(BYTES, digest), 0, 0, 0]]


def test_a_request_whose_data_part_sits_between_references():
    data = b"\x00\xff" * (800 * 1024)
    parts = (BodyPart(request_no=1, start=0, length=10), BodyPart(data=data), BodyPart(data=b"tail" * 10),
             BodyPart(request_no=1, start=10, length=5))
    event = RequestReceived(session_id=SESSION, seq=5, time=1.0, request_no=2, wire="anthropic", parts=parts,
                            body_size=15 + len(data) + 40, body_digest="d")
    _, blobs = round_trip([event])
    assert list(blobs.values()) == [data]


def test_a_chain_with_large_prompt_ids():
    prompt_ids = random.Random(2).randbytes(4 * 400_000)  # 400k uint32 token ids
    _, blobs = round_trip([chain_started(prompt_ids)])
    assert list(blobs.values()) == [prompt_ids]


@pytest.mark.parametrize("unit", ["a", "é", "日本語のテキスト", "emoji 🎉🧪 ", "mixed \u00e9\u4e2d\U0001f600\n\"\\"])
def test_a_turn_with_a_large_text(unit):
    text = unit * (2 * LIMIT // len(unit.encode()))
    _, blobs = round_trip([turn(text)])
    (stored,) = blobs.values()
    assert stored == text.encode("utf-8")


def test_a_text_is_referenced_as_text_and_decoded_as_str():
    text = "ü" * LIMIT
    small, _ = externalize(turn(text), LIMIT)
    assert small.text == msgspec.msgpack.Ext(TEXT, hashlib.sha256(text.encode()).digest())
    (event,) = decode_with(envelope.encode([small]), {hashlib.sha256(text.encode()).digest(): text.encode()})
    assert type(event.text) is str and event.text == text


def test_the_largest_values_move_first_and_only_until_the_event_fits():
    text, reasoning, arguments = "t" * 800_000, "r" * 600_000, '{"x": "' + "a" * 400_000 + '"}'
    event = turn(text, reasoning=reasoning, arguments=arguments)
    small, blobs = externalize(event, LIMIT)
    assert list(blobs.values()) == [text.encode()]
    assert small.reasoning == reasoning and small.tool_calls == event.tool_calls
    round_trip([event])
    small, blobs = externalize(event, 500_000)  # two must go now, the text and the reasoning
    assert sorted(map(len, blobs.values())) == [600_000, 800_000]
    assert small.tool_calls[1].arguments == arguments
    small, blobs = externalize(event, 1000)  # all three, the one nested in a tool call too
    assert sorted(map(len, blobs.values())) == [len(arguments), 600_000, 800_000]
    assert isinstance(small.tool_calls[1].arguments, msgspec.msgpack.Ext) and small.tool_calls[0] == event.tool_calls[0]
    round_trip([event], limit=1000)


def test_the_same_value_twice_is_stored_once():
    text = "same " * 300_000
    event = turn(text, reasoning=text)
    small, blobs = externalize(event, 1000)
    assert len(blobs) == 1 and small.text == small.reasoning
    payload = envelope.encode([small])
    assert len(references(payload)) == 2
    assert decode_with(payload, digests(blobs)) == [event]


def test_an_event_under_the_limit_is_unchanged():
    for event in (turn("x" * (MIN_BLOB * 4)), chain_started(b"\x01" * 1000),
                  received(session_id=SESSION, seq=1, time=0.0, request_no=1, wire="openai", body=b"{}")):
        small, blobs = externalize(event, LIMIT)
        assert small == event and blobs == {}
        payload = envelope.encode([small])
        assert references(payload) == []
        assert decode_with(payload, {}) == [event] == envelope.decode(payload)


def test_values_under_min_blob_never_move():
    event = turn("x" * (MIN_BLOB - 1), reasoning="y" * (MIN_BLOB - 1))
    small, blobs = externalize(event, 100)  # cannot be helped: the caller sees it is still too large
    assert small == event and blobs == {}


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 300_000), min_size=1, max_size=6), st.integers(2_000, 1_500_000),
       st.integers(0, 2**32))
def test_externalized_events_fit_whenever_they_can(sizes, limit, seed):
    rng = random.Random(seed)
    parts = tuple(BodyPart(data=rng.randbytes(size)) for size in sizes)
    event = RequestReceived(session_id=SESSION, seq=1, time=0.0, request_no=1, wire="openai", parts=parts,
                            body_size=sum(sizes), body_digest="d")
    small, blobs = externalize(event, limit)
    moved = {len(v) for v in blobs.values()}
    left = [len(p.data) for p in small.parts if isinstance(p.data, bytes)]
    assert len(envelope.encode([small])) <= limit or all(size < MIN_BLOB for size in left)
    assert not moved or not left or max(left) <= min(moved)  # the largest went first
    payload = envelope.encode([small])
    assert decode_with(payload, digests(blobs)) == [event]


def test_the_envelope_fits_at_every_limit_around_the_size_after_one_move():
    """The size is estimated while values move out; near the limit the estimate must not be short."""
    event = turn("a" * 200_000, reasoning="b" * 100_000)
    one, _ = externalize(event, 250_000)
    after_one = len(envelope.encode([one]))
    assert isinstance(one.text, msgspec.msgpack.Ext) and one.reasoning == event.reasoning
    for limit in range(after_one - 64, after_one + 64):
        small, blobs = externalize(event, limit)
        assert len(envelope.encode([small])) <= limit
        assert decode_with(envelope.encode([small]), digests(blobs)) == [event]


def test_a_missing_value_is_a_fold_error():
    body = b"b" * (2 * LIMIT)
    small, _ = externalize(received(session_id=SESSION, seq=1, time=0.0, request_no=1, wire="openai",
                                    body=body), LIMIT)
    payload = envelope.encode([small])
    with pytest.raises(FoldError, match="is not in the object store"):
        decode_with(payload, {})
    with pytest.raises(FoldError, match="is not in the object store"):
        decode_with(payload, {hashlib.sha256(b"other").digest(): b"other"})


def test_a_tampered_value_is_a_fold_error():
    text = "t" * (2 * LIMIT)
    small, _ = externalize(turn(text), LIMIT)
    payload = envelope.encode([small])
    (digest,) = references(payload)
    for tampered in (text.encode()[:-1] + b"u", text.encode()[:-1], b""):
        with pytest.raises(FoldError, match="does not match its digest"):
            decode_with(payload, {digest: tampered})


def test_a_v1_request_with_its_body_moved_out_is_upgraded():
    body = b"v1 body " * 300_000
    digest = hashlib.sha256(body).digest()
    raw = {"type": "request_received", "session_id": SESSION, "seq": 1, "time": 0.0, "v": 1, "request_no": 1,
           "wire": "openai", "body": msgspec.msgpack.Ext(BYTES, digest)}
    payload = msgspec.msgpack.encode([raw])
    assert references(payload) == [digest]
    (event,) = decode_with(payload, {digest: body}, 1)
    assert type(event) is RequestReceived and event.v == SCHEMA_VERSION
    assert event.parts == (BodyPart(data=body),) and event.body_size == len(body)
    assert event.body_digest == hashlib.sha256(body).hexdigest()
