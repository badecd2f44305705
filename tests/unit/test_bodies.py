"""Request bodies stored as parts (schemas/bodies.py): what an earlier request of the session already
has is a byte-range reference, the rest is data, and rebuilding gives back every body byte for byte."""

from __future__ import annotations

import hashlib
import json
import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import envelope
from schemas.bodies import (
    _BLOCK,
    MIN_SHARED,
    Bodies,
    common_prefix,
    common_suffix,
    literal,
    parts_against,
    rebuild,
    received,
)
from schemas.errors import FoldError
from schemas.events import SCHEMA_VERSION, BodyPart, RequestReceived, TurnCompleted, body_digest

SESSION = "s-bodies"


def request(request_no: int, parts: tuple[BodyPart, ...], body: bytes, *, size: int | None = None,
            digest: str | None = None) -> RequestReceived:
    return RequestReceived(session_id=SESSION, seq=request_no, time=float(request_no), request_no=request_no,
                           wire="openai", parts=parts, body_size=len(body) if size is None else size,
                           body_digest=body_digest(body) if digest is None else digest)


def part_size(part: BodyPart) -> int:
    return part.length if part.request_no else len(part.data)


def stored_data(parts: tuple[BodyPart, ...]) -> int:
    return sum(len(p.data) for p in parts if not p.request_no)


def naive_prefix(a: bytes, b: bytes) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def naive_suffix(a: bytes, b: bytes, limit: int) -> int:
    return min(limit, naive_prefix(a[::-1], b[::-1]))


# --- bodies the way agents send them ---------------------------------------------------------

HEAD = b'{"model": "m", "stream": false, "messages": ['
TAIL = (b'], "tools": [{"type": "function", "function": {"name": "read", "description": "Read a file.", '
        b'"parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}], '
        b'"temperature": 0.7, "max_tokens": 512}')


def agent_body(messages: list[dict[str, str]]) -> bytes:
    return HEAD + b", ".join(json.dumps(m, ensure_ascii=False).encode() for m in messages) + TAIL


_words = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=120)
_turn = st.tuples(st.sampled_from(["append", "append", "append", "rewrite", "compact", "resend"]),
                  st.lists(_words, min_size=1, max_size=3), st.integers(0, 10**6))


@st.composite
def agent_bodies(draw: st.DrawFn) -> list[bytes]:
    """Bodies of a session: the history grows by a few messages a turn, the tail stays; some turns
    rewrite (or drop) messages in the middle, some resend the same body."""
    messages = [{"role": "system", "content": "You are a coder." * draw(st.integers(1, 8))},
                {"role": "user", "content": draw(_words)}]
    out = [agent_body(messages)]
    for kind, texts, at in draw(st.lists(_turn, max_size=10)):
        if kind == "append":
            messages += [{"role": ("assistant", "user")[i % 2], "content": t} for i, t in enumerate(texts)]
        elif kind == "rewrite":
            messages[at % len(messages)] = {"role": "user", "content": texts[0]}
        elif kind == "compact" and len(messages) > 2:
            del messages[1 + at % (len(messages) - 1)]
        out.append(agent_body(messages))
    return out


@st.composite
def edited_bodies(draw: st.DrawFn) -> list[bytes]:
    """Random bytes, each body an edit (insert, delete, replace, extend at either end) of an earlier one,
    or new random bytes."""
    out = [draw(st.binary(max_size=400))]
    for _ in range(draw(st.integers(0, 8))):
        base = out[draw(st.integers(0, len(out) - 1))]
        kind = draw(st.sampled_from(["insert", "delete", "replace", "append", "prepend", "fresh", "same"]))
        i = draw(st.integers(0, len(base)))
        j = draw(st.integers(i, len(base)))
        new = draw(st.binary(max_size=200))
        body = {"insert": base[:i] + new + base[i:], "delete": base[:i] + base[j:],
                "replace": base[:i] + new + base[j:], "append": base + new, "prepend": new + base,
                "fresh": new, "same": base}[kind]
        out.append(body)
    return out


@settings(max_examples=150, deadline=None)
@given(st.one_of(agent_bodies(), edited_bodies()), st.data())
def test_bodies_rebuild_byte_exact_from_parts_against_any_earlier_body(bodies, data):
    stored = Bodies()
    events = []
    for index, body in enumerate(bodies):
        request_no = index + 1
        if index == 0:
            parts = literal(body)
        else:
            base_no = data.draw(st.integers(1, index), label="base request")
            base = bodies[base_no - 1]
            parts = parts_against(body, base_no, base)
            for part in parts:
                if part.request_no:  # references are into the base, long enough to pay off
                    assert part.request_no == base_no
                    assert part.length >= MIN_SHARED and 0 <= part.start <= part.start + part.length <= len(base)
        assert sum(part_size(p) for p in parts) == len(body)
        event = request(request_no, parts, body)
        stored.add(event)
        events.append(event)
        assert stored.body(request_no) == body
    assert len(stored) == len(bodies) and list(stored.request_numbers()) == list(range(1, len(bodies) + 1))
    again = rebuild(envelope.decode(envelope.encode(events)))  # the parts survive the log
    for request_no, body in enumerate(bodies, 1):
        assert stored.body(request_no) == again.body(request_no) == body
        assert stored.verify(request_no) and again.verify(request_no)
        assert events[request_no - 1].body_size == len(body)


def test_a_body_shares_its_history_and_its_tail_as_references():
    first = agent_body([{"role": "user", "content": "hello there " * 10}])
    second = agent_body([{"role": "user", "content": "hello there " * 10}, {"role": "assistant", "content": "hi"}])
    parts = parts_against(second, 1, first)
    assert [bool(p.request_no) for p in parts] == [True, False, True]
    assert parts[1].data == b', {"role": "assistant", "content": "hi"}'
    assert parts[2] == BodyPart(request_no=1, start=len(first) - len(TAIL), length=len(TAIL))


def test_short_shared_runs_are_data_and_nothing_shared_is_literal():
    base = b"x" * (MIN_SHARED - 1) + b"A" + b"y" * (MIN_SHARED - 1)
    body = b"x" * (MIN_SHARED - 1) + b"B" + b"y" * (MIN_SHARED - 1)
    assert parts_against(body, 1, base) == literal(body)
    assert parts_against(b"", 1, base) == literal(b"")
    long = b"z" * MIN_SHARED
    assert parts_against(long + b"B", 1, long + b"A") == (BodyPart(request_no=1, start=0, length=MIN_SHARED),
                                                          BodyPart(data=b"B"))
    assert parts_against(long, 1, long) == (BodyPart(request_no=1, start=0, length=MIN_SHARED),)


def test_prefix_and_suffix_never_overlap():
    base = b"ab" * 200
    body = b"ab" * 300  # every byte of the base is both a common prefix and suffix byte
    parts = parts_against(body, 1, base)
    stored = Bodies()
    stored.add(request(1, literal(base), base))
    stored.add(request(2, parts, body))
    assert stored.body(2) == body
    assert sum(p.length for p in parts if p.request_no) <= len(base)


# --- common prefix / suffix -------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.binary(max_size=300), st.binary(max_size=300), st.integers(0, 700))
def test_common_prefix_and_suffix_equal_the_naive_ones_on_small_inputs(shared, a, b, limit):
    for x, y in ((shared + a, shared + b), (a + shared, b + shared), (a, b), (shared, shared + a)):
        assert common_prefix(x, y) == naive_prefix(x, y) == common_prefix(y, x)
        assert common_suffix(x, y, limit) == naive_suffix(x, y, limit) == common_suffix(y, x, limit)
        whole = min(len(x), len(y))
        assert common_suffix(x, y, whole) == naive_suffix(x, y, whole)


def _big_pair(seed: int, size: int, extra: int, where: int) -> tuple[bytes, bytes, int]:
    rng = random.Random(seed)
    a = rng.randbytes(size)
    b = bytearray(a + rng.randbytes(extra))
    where = where % (size + 1)
    if where < size:
        b[where] ^= 1 + rng.randrange(255)
    return a, bytes(b), where


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32), st.integers(60 * 1024, 200 * 1024), st.integers(0, 3000), st.integers(0, 10**7))
def test_common_prefix_equals_the_naive_one_past_the_block_size(seed, size, extra, where):
    a, b, _ = _big_pair(seed, size, extra, where)
    assert common_prefix(a, b) == naive_prefix(a, b) == common_prefix(b, a)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32), st.integers(60 * 1024, 200 * 1024), st.integers(0, 3000), st.integers(0, 10**7),
       st.integers(0, 250 * 1024))
def test_common_suffix_equals_the_naive_one_past_the_block_size(seed, size, extra, where, limit):
    a, b, _ = _big_pair(seed, size, 0, where)
    head = random.Random(seed + 1).randbytes(extra)
    b = head + b  # the suffixes line up, the lengths differ
    for lim in (limit, min(len(a), len(b)), len(a) + len(b)):
        assert common_suffix(a, b, lim) == naive_suffix(a, b, lim) == common_suffix(b, a, lim)


@pytest.mark.parametrize("where", [0, 1, _BLOCK - 1, _BLOCK, _BLOCK + 1, 2 * _BLOCK - 1, 2 * _BLOCK,
                                   3 * _BLOCK - 7, 3 * _BLOCK])
def test_a_difference_at_a_block_boundary(where):
    size = 3 * _BLOCK
    a, b, _ = _big_pair(7, size, 0, where)
    assert common_prefix(a, b) == naive_prefix(a, b) == min(where, size)
    mirrored = size - 1 - where if where < size else size
    assert common_suffix(a[::-1], b[::-1], size) == min(where, size)
    assert common_suffix(a, b, size) == naive_suffix(a, b, size) == mirrored
    for limit in (0, 1, where, _BLOCK, _BLOCK + 3, size):
        assert common_suffix(a, b, limit) == min(limit, mirrored)


# --- what the log stores ----------------------------------------------------------------------


def test_an_agent_session_stores_what_each_turn_adds_not_its_square():
    rng = random.Random(3)
    messages = [{"role": "system", "content": "You are a careful coding agent. " * 40},
                {"role": "user", "content": "Fix the failing test."}]
    bodies = [agent_body(messages)]
    for turn in range(49):
        messages.append({"role": "assistant", "content": f"step {turn}: " + "thinking " * rng.randrange(5, 60)})
        messages.append({"role": "tool", "content": "output line\n" * rng.randrange(1, 200)})
        bodies.append(agent_body(messages))
    stored = Bodies()
    data = added = 0
    for request_no, body in enumerate(bodies, 1):
        if request_no == 1:
            parts, grew = literal(body), len(body)
        else:
            previous = bodies[request_no - 2]
            parts, grew = parts_against(body, request_no - 1, previous), len(body) - len(previous)
        assert stored_data(parts) <= grew + 2 * MIN_SHARED
        data += stored_data(parts)
        added += grew
        stored.add(request(request_no, parts, body))
        assert stored.body(request_no) == body and stored.verify(request_no)
    assert len(bodies) == 50
    assert data <= added + 2 * MIN_SHARED * len(bodies)
    assert data * 10 < sum(map(len, bodies))  # what the whole bodies would have cost


def test_an_appending_session_stores_exactly_what_is_new():
    messages = [{"role": "user", "content": "go " * 100}]
    bodies = [agent_body(messages)]
    for turn in range(50):
        messages.append({"role": "assistant", "content": f"turn {turn}"})
        bodies.append(agent_body(messages))
    for i in range(1, len(bodies)):
        assert stored_data(parts_against(bodies[i], i, bodies[i - 1])) == len(bodies[i]) - len(bodies[i - 1])


# --- what does not fit ------------------------------------------------------------------------


def _one_added(body: bytes = b"0123456789") -> Bodies:
    stored = Bodies()
    stored.add(request(1, literal(body), body))
    return stored


def test_a_reference_to_a_request_not_added_yet_is_a_fold_error():
    stored = _one_added()
    with pytest.raises(FoldError, match="refers to request 2"):
        stored.add(request(2, (BodyPart(request_no=2, start=0, length=3),), b"012"))
    with pytest.raises(FoldError, match="refers to request 5"):
        stored.add(request(2, (BodyPart(request_no=5, start=0, length=3),), b"012"))
    with pytest.raises(FoldError):
        Bodies().add(request(1, (BodyPart(request_no=1, start=0, length=0),), b""))
    assert 2 not in stored and len(stored) == 1


@pytest.mark.parametrize(("start", "length"), [(5, 10), (0, 11), (10, 1), (11, 0), (-1, 2), (2, -1)])
def test_a_reference_beyond_the_referenced_body_is_a_fold_error(start, length):
    stored = _one_added()
    with pytest.raises(FoldError, match="refers to bytes"):
        stored.add(request(2, (BodyPart(request_no=1, start=start, length=length),), b"x", size=max(length, 0)))
    assert 2 not in stored


def test_a_reference_to_the_end_of_a_body_is_fine():
    stored = _one_added()
    stored.add(request(2, (BodyPart(request_no=1, start=10, length=0), BodyPart(request_no=1, start=7, length=3)),
                       b"789"))
    assert stored.body(2) == b"789" and stored.verify(2)


@pytest.mark.parametrize("size", [0, 9, 11, 100])
def test_a_body_size_that_does_not_match_is_a_fold_error(size):
    stored = _one_added()
    with pytest.raises(FoldError, match="parts make 10 bytes, its body had"):
        stored.add(request(2, (BodyPart(request_no=1, start=0, length=10),), b"0123456789", size=size))
    with pytest.raises(FoldError):
        Bodies().add(request(1, literal(b"0123456789"), b"0123456789", size=size))


def test_a_wrong_digest_does_not_verify_and_an_unknown_request_is_a_key_error():
    stored = Bodies()
    stored.add(request(1, literal(b"abc"), b"abc", digest=body_digest(b"abd")))
    assert stored.body(1) == b"abc" and not stored.verify(1)
    with pytest.raises(KeyError):
        stored.body(2)


def test_rebuild_reads_only_requests():
    body = b'{"messages": []}'
    events = [received(session_id=SESSION, seq=1, time=0.0, request_no=1, wire="openai", body=body),
              TurnCompleted(session_id=SESSION, seq=2, time=0.0, chain=0, request_no=1, finish_reason="stop",
                            text="hi", tip_digest="t", n_messages=1)]
    bodies = rebuild(events)
    assert list(bodies.request_numbers()) == [1] and bodies.body(1) == body and bodies.verify(1)
    assert events[0].body_size == len(body) and events[0].parts == literal(body)


# --- schema v1 --------------------------------------------------------------------------------


def _v1(request_no: int, body: bytes, *, digest: bool) -> dict[str, object]:
    raw: dict[str, object] = {"type": "request_received", "session_id": SESSION, "seq": request_no,
                              "time": 1.5, "v": 1, "request_no": request_no, "wire": "anthropic",
                              "body": body, "idempotency_key": None}
    if digest:
        raw["body_digest"] = body_digest(body)
    return raw


def test_v1_requests_are_upgraded_to_one_part_of_their_own():
    assert ("request_received", 1) in envelope.UPGRADERS
    bodies = [b'{"model": "m", "messages": [{"role": "user", "content": "\xc3\xa9"}]}', b"", bytes(range(256)) * 40]
    raw = [_v1(i, body, digest=i % 2 == 0) for i, body in enumerate(bodies, 1)]
    events = envelope.decode(msgspec.msgpack.encode(raw), 1)
    assert all(type(e) is RequestReceived for e in events)
    rebuilt = rebuild(events)
    for event, body in zip(events, bodies, strict=True):
        assert event.v == SCHEMA_VERSION and event.wire == "anthropic" and event.idempotency_key is None
        assert event.body_size == len(body)
        assert event.body_digest == body_digest(body)
        assert rebuilt.body(event.request_no) == body and rebuilt.verify(event.request_no)


def test_a_v1_request_without_a_digest_gets_the_sha256_of_its_body():
    body = b'{"messages": [{"role": "user", "content": "hi"}]}'
    (event,) = envelope.decode(msgspec.msgpack.encode([_v1(1, body, digest=False)]), 1)
    assert event.body_digest == hashlib.sha256(body).hexdigest()
    assert event.parts == (BodyPart(data=body),)
    assert rebuild([event]).body(1) == body


def test_a_known_run_in_a_new_part_becomes_a_reference_and_the_body_rebuilds_byte_for_byte() -> None:
    from schemas.bodies import MIN_RUN, referencing

    image = bytes(range(65, 91)) * 100  # (as base64 text would be: ASCII, longer than MIN_RUN)
    first = b'{"messages": [{"image": "' + image + b'"}]}'
    second = b'{"messages": [{"image": "' + image + b'"}, {"again": "' + image + b'", "and": "' + image + b'"}]}'
    runs = {image: (1, first.index(image))}
    parts = referencing(parts_against(second, 1, first), runs)
    assert sum(len(p.data) for p in parts) < 200 and len(second) > 3 * len(image)
    assert [p.request_no for p in parts if not p.data] == [1, 1, 1]  # the shared prefix, then the image twice
    assert referencing(parts, {}) == parts and referencing(literal(b"x" * MIN_RUN), runs) == literal(b"x" * MIN_RUN)
    events = [RequestReceived(session_id="s", seq=1, time=0.0, request_no=1, wire="openai", parts=literal(first),
                              body_size=len(first), body_digest=body_digest(first)),
              RequestReceived(session_id="s", seq=2, time=0.0, request_no=2, wire="openai", parts=parts,
                              body_size=len(second), body_digest=body_digest(second))]
    bodies = rebuild(events)
    assert bodies.body(2) == second and bodies.verify(2)
