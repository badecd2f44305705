"""The one splitting rule every log writer follows (:func:`schemas.log.fit_envelopes`): pure, no log."""

from __future__ import annotations

import hashlib

import pytest

from schemas import blobs, envelope
from schemas.bodies import literal
from schemas.errors import PayloadTooLarge
from schemas.events import RequestReceived, body_digest
from schemas.log import Envelope, fit_envelopes
from tests.helpers import SessionScript

LIMIT = 32 * 1024
SID = "0123456789abcdef0123456789abcdef"


def big_request(seq: int, size: int) -> RequestReceived:
    body = bytes(range(256)) * (size // 256)
    return RequestReceived(session_id=SID, seq=seq, time=1.0, request_no=1, wire="openai",
                           parts=literal(body), body_size=len(body), body_digest=body_digest(body))


def test_an_append_under_the_limit_is_one_envelope_of_its_own_encoding() -> None:
    script = SessionScript(session_id=SID)
    script.reward(1.0, acc=1.0)
    script.finalize()
    payload = envelope.encode(script.events)
    assert fit_envelopes(script.events, LIMIT) == [Envelope(script.events, payload)]
    assert fit_envelopes(script.events, LIMIT, payload)[0].payload is payload  # an encoding in hand is reused


def test_an_append_over_the_limit_is_halved_into_envelopes_that_fit_in_order() -> None:
    script = SessionScript(session_id=SID)
    for n in range(7):
        script.reward(float(n), note="x" * 10_000)
    fitted = fit_envelopes(script.events, LIMIT)
    assert len(fitted) > 1
    assert all(len(fit.payload) <= LIMIT and not fit.pieces for fit in fitted)
    assert all(fit.payload == envelope.encode(fit.events) for fit in fitted)
    assert [event for fit in fitted for event in fit.events] == script.events


def test_a_single_event_over_the_limit_keeps_its_large_values_aside() -> None:
    script = SessionScript(session_id=SID)
    request = big_request(len(script.events) + 1, 4 * LIMIT)
    [*before, fit] = fit_envelopes([*script.events, request], LIMIT)
    assert [event for f in before for event in f.events] == script.events
    body = request.parts[0].data
    assert len(fit.payload) <= LIMIT and fit.pieces == {blobs.object_name(SID, hashlib.sha256(body).digest()): body}
    values = {hashlib.sha256(data).digest(): data for data in fit.pieces.values()}
    assert blobs.decode_with(fit.payload, values) == [request]


def test_an_event_that_cannot_fit_is_refused_even_after_others_that_did() -> None:
    fits = big_request(1, 4 * LIMIT)  # fits once its body is kept aside
    many = SessionScript(session_id=SID, metadata={f"key{i}": "v" * 100 for i in range(2 * LIMIT // 100)})
    with pytest.raises(PayloadTooLarge, match=f"limit {LIMIT}"):
        fit_envelopes([fits, *many.events], LIMIT)


def test_an_images_base64_text_in_a_part_of_its_own_goes_to_the_object_store_whatever_its_size() -> None:
    from schemas.bodies import isolating

    image = b"iVBORw0KGgo" + b"A" * 300  # a small PNG's base64 text
    body = b'{"messages": [{"content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,' + image + \
        b'"}}]}]}'
    parts = isolating(literal(body), [image])
    assert [part.data for part in parts] == [body[:body.index(image)], image, body[body.index(image) + len(image):]]
    event = RequestReceived(session_id=SID, seq=1, time=1.0, request_no=1, wire="openai", parts=parts,
                            body_size=len(body), body_digest=body_digest(body))
    (fit,) = fit_envelopes([event], LIMIT)
    assert image not in fit.payload and fit.pieces == {blobs.object_name(SID, hashlib.sha256(image).digest()): image}
    (decoded,) = blobs.decode_with(fit.payload, {hashlib.sha256(image).digest(): image})
    assert decoded == event  # read back whole
    plain = RequestReceived(session_id=SID, seq=1, time=1.0, request_no=1, wire="openai", parts=literal(body),
                            body_size=len(body), body_digest=body_digest(body))
    assert fit_envelopes([plain], LIMIT)[0].pieces == {}  # text not set apart (a client's own) stays in the message
