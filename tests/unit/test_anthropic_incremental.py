"""The Anthropic wire decodes a resent history incrementally: each raw message is decoded, converted
and hashed once per (previous history digest, index, raw JSON), and what comes out is exactly what
decoding the whole request by value gives (the same messages, digests, errors and params)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge.chat import digest
from edge.chat.cache import BoundedCache
from edge.chat.conversation import Conversation, Message
from edge.chat.digest import prefix_digests, tools_digest
from edge.wires import anthropic as a
from schemas import wire_anthropic as w
from schemas.errors import MalformedRequest

TOOLS = [{"name": "calc", "description": "d", "input_schema": {"type": "object"}},
         {"name": "read", "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]
SYSTEM = [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief.", "cache_control": {"type": "x"}}]


def body(messages: list[dict[str, Any]], **fields: Any) -> bytes:
    return json.dumps({"model": "m", "max_tokens": 8, "messages": messages, **fields}).encode()


def assistant(i: int, *, tool_id: str | None = "") -> dict[str, Any]:
    """An assistant turn with a tool call (``tool_id`` None: without its id, which is refused)."""
    use: dict[str, Any] = {"type": "tool_use", "name": "calc", "input": {"x": i, "s": "é"}}
    if tool_id is not None:
        use["id"] = tool_id or f"toolu_{i}"
    return {"role": "assistant", "content": [
        {"type": "thinking", "thinking": f"think {i}", "signature": "sig"}, {"type": "text", "text": f"say {i}"}, use]}


def tool_result(i: int, tool_id: str = "t") -> dict[str, Any]:
    return {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": tool_id, "content": f"result {i}"},
        {"type": "tool_result", "tool_use_id": tool_id, "is_error": True,
         "content": [{"type": "text", "text": "no"}, {"type": "text", "text": f"pe {i}"}]},
        {"type": "text", "text": ""}, {"type": "text", "text": f"and {i}?"}]}


def session(turns: int) -> list[dict[str, Any]]:
    """user, (assistant, tool results)..., ending with a user message."""
    out: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    for i in range(1, turns):
        out += [assistant(i), tool_result(i, f"toolu_{i}")]
    return out


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """Empties every cache the decoding goes through (called once now; call it again to start over)."""
    def clear() -> None:
        monkeypatch.setattr(digest, "_BY_INDEXED_RAW", BoundedCache())
        monkeypatch.setattr(digest, "_EXTENDED", BoundedCache())
        monkeypatch.setattr(a, "_TOOLS", BoundedCache(max_items=1024))
    clear()
    return clear


@pytest.fixture
def decoded(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The index of every history entry the adapter decodes (the system prompt is -1)."""
    calls: list[int] = []
    inner = a._decoded

    def counting(index: int, raw: bytes) -> tuple[Message, ...]:
        calls.append(index)
        return inner(index, raw)
    monkeypatch.setattr(a, "_decoded", counting)
    return calls


def by_value(raw: bytes) -> Conversation:
    """The reference: the whole request decoded by value, its digests computed as turns.py would."""
    conversation = a._decode_by_value(raw)
    digests = tuple(map(bytes.hex, prefix_digests(tools_digest(conversation.tools), conversation.messages)))
    return msgspec.structs.replace(conversation, history_digests=digests)


def plain(conversation: Conversation) -> Conversation:
    """Without what only the session's next request is decoded with (tests/unit/test_known_prefix.py)."""
    return msgspec.structs.replace(conversation, body_digest="", known=None)


def outcome(decode: Callable[[bytes], Conversation], raw: bytes) -> Conversation | tuple[str, str, str | None]:
    try:
        return plain(decode(raw))
    except MalformedRequest as exc:
        return type(exc).__name__, exc.message, exc.param


def test_a_resent_history_is_looked_up_not_decoded(fresh: Callable[[], None], decoded: list[int]) -> None:
    history = session(6)
    first = a.decode_request(body(history, system=SYSTEM, tools=TOOLS))
    assert decoded == [-1, *range(len(history))]
    decoded.clear()

    history += [assistant(6), {"role": "user", "content": "next"}]
    second = a.decode_request(body(history, system=SYSTEM, tools=TOOLS))
    assert decoded == [len(history) - 2, len(history) - 1]  # only the new messages
    n = len(first.messages)
    assert all(x is y for x, y in zip(first.messages, second.messages[:n], strict=True))
    assert second.history_digests[:n] == first.history_digests
    assert second.tools is first.tools  # decoded once per distinct tools JSON
    assert plain(second) == by_value(body(history, system=SYSTEM, tools=TOOLS))

    decoded.clear()
    again = a.decode_request(body(history, system=SYSTEM, tools=TOOLS))
    assert decoded == [] and all(x is y for x, y in zip(again.messages, second.messages, strict=True))
    # The same objects, so the digests' lookup by object finds them too.
    assert tuple(map(bytes.hex, prefix_digests(tools_digest(again.tools), again.messages))) == again.history_digests


def test_the_message_decoder_is_not_called_for_seen_messages(fresh: Callable[[], None],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[bytes] = []

    class Counting:
        def decode(self, raw: bytes) -> w.MessageParam:
            calls.append(raw)
            return msgspec.json.decode(raw, type=w.MessageParam)
    monkeypatch.setattr(a, "_message_decoder", Counting())
    history = session(10)
    a.decode_request(body(history))
    assert len(calls) == len(history)
    calls.clear()
    a.decode_request(body([*history, assistant(10), {"role": "user", "content": "more"}]))
    assert [json.loads(c) for c in calls] == [assistant(10), {"role": "user", "content": "more"}]


HISTORIES: list[tuple[list[dict[str, Any]], dict[str, Any]]] = [
    (session(5), {"system": SYSTEM, "tools": TOOLS}),
    (session(4), {"system": "plain system"}),
    (session(3), {"system": ""}),  # an empty system prompt is no message
    (session(3), {"system": None, "tools": None}),
    (session(3), {"system": [], "tools": []}),
    ([{"role": "user", "content": [{"type": "text", "text": ""}]}], {}),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": [
        {"type": "text", "text": "x"}, {"type": "tool_result", "tool_use_id": "t", "content": None},
        {"type": "text", "text": "y"}, {"type": "text", "text": "z"}]}], {"tool_choice": {"type": "none"}}),
    # System messages inside messages (Claude Code's), first, between turns and last.
    # (each request of these is a prefix of odd length: the even indices are never assistant messages)
    ([{"role": "user", "content": "hi"}, assistant(1), {"role": "system", "content": SYSTEM}, assistant(2),
      tool_result(2, "toolu_2"), {"role": "assistant", "content": "ok"}, {"role": "system", "content": ""}],
     {"system": SYSTEM, "tools": TOOLS}),
    ([{"role": "system", "content": "agents: a"}, {"role": "assistant", "content": "ok"},
      {"role": "system", "content": [{"type": "text", "text": "late", "cache_control": {"type": "x"}}]}], {}),
]


@pytest.mark.parametrize(("history", "fields"), HISTORIES)
def test_every_prefix_decodes_as_from_scratch_and_by_value(fresh: Callable[[], None], history: list[dict[str, Any]],
                                                           fields: dict[str, Any]) -> None:
    warm = []
    for end in range(1, len(history) + 1, 2):  # each request of the session, in turn, on warm caches
        warm.append(outcome(a.decode_request, body(history[:end], **fields)))
    for end, got in zip(range(1, len(history) + 1, 2), warm, strict=True):
        fresh()
        raw = body(history[:end], **fields)
        assert got == outcome(a.decode_request, raw) == outcome(by_value, raw)
        assert isinstance(got, Conversation) and len(got.history_digests) == len(got.messages)


def test_a_refusal_names_the_index_even_where_the_previous_digest_is_the_same(fresh: Callable[[], None]) -> None:
    # The digests ignore tool-call ids, so these two histories share their digest before the
    # assistant message; its id-less tool_use (block 2) is messages[1] in one and messages[2] in the other.
    one = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                        {"type": "tool_result", "tool_use_id": "p", "content": "r"}]}]
    two = [{"role": "user", "content": "a"},
           {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "q", "content": "r"}]}]
    assert a.decode_request(body(one)).history_digests == a.decode_request(body(two)).history_digests
    tail = [assistant(1, tool_id=None), {"role": "user", "content": "ok"}]
    for history, index in ((one, 1), (two, 2), (one, 1)):
        raw = body(history + tail)
        expected = ("MalformedRequest", "a tool_use block needs an id", f"messages[{index}].content[2].id")
        assert outcome(a.decode_request, raw) == outcome(by_value, raw) == expected


NESTED: Any = 1
for _ in range(100):  # past the bound on a free-form value's nesting
    NESTED = [NESTED]

BAD: list[tuple[str | None, list[dict[str, Any]], dict[str, Any]]] = [
    ("messages[7].content[0].source.type",
     [*session(4), {"role": "user", "content": [{"type": "image", "source": {}}]}], {}),
    ("messages[7].content[0].content[0].source.type", [*session(4), {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {}}]}]}], {}),
    ("messages[7].content[0].type", [*session(4), {"role": "user", "content": [{"type": "document"}]}], {}),
    ("messages[1].content[0].type", [{"role": "user", "content": "a"}, {"role": "assistant", "content": [
        {"type": "redacted_thinking", "data": "x"}]}, {"role": "user", "content": "b"}], {}),
    ("messages", [*session(4), assistant(9)], {}),  # prefill
    ("messages", [], {"system": SYSTEM}),
    ("system[0].type", session(3), {"system": [{"type": "image", "source": {}}]}),
    ("messages[1].content[0].type", [{"role": "user", "content": "a"}, {"role": "system", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "r"}]}], {}),
    ("tools[1].type", session(3), {"tools": [TOOLS[0], {"name": "bash", "type": "bash_20250124"}]}),
    ("tool_choice.type", session(3), {"tool_choice": {"type": "every"}}),
    ("tool_choice.name", session(3), {"tool_choice": {"type": "tool", "name": "not_a_tool"}}),
    ("top_p", session(3), {"top_p": 0}),
    ("max_tokens", session(3), {"max_tokens": 0}),
    ("max_tokens", session(3), {"max_tokens": 2**31}),
    ("top_k", session(3), {"top_k": 0}),
    ("temperature", session(3), {"temperature": 101}),
    ("stop_sequences[1]", session(3), {"stop_sequences": ["a", ""]}),
    # Tool blocks without their ids, as on Anthropic's API.
    ("messages[5].content[2].id", [*session(3), assistant(9, tool_id=None), tool_result(9)], {}),
    ("messages[4].content[2].id", [*session(2), {"role": "user", "content": "b"}, assistant(9, tool_id=None),
                                   tool_result(9)], {}),
    ("messages[1].content[0].name", [{"role": "user", "content": "a"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "input": {}}]}, tool_result(1)], {}),
    ("messages[5].content[0].tool_use_id", [*session(3), {"role": "user", "content": [
        {"type": "tool_result", "content": "r"}]}], {}),
    ("messages[5].content[1].tool_use_id", [*session(3), {"role": "user", "content": [
        {"type": "text", "text": "x"}, {"type": "tool_result", "tool_use_id": "", "content": "r"}]}], {}),
    ("messages[1].content[2].input", [{"role": "user", "content": "a"}, {"role": "assistant", "content": [
        {"type": "text", "text": "x"}, {"type": "text", "text": "y"},
        {"type": "tool_use", "id": "t", "name": "calc", "input": {"x": NESTED}}]}, tool_result(1)], {}),
    ("tools[1].input_schema", session(3), {"tools": [TOOLS[0], {"name": "deep", "input_schema": {"x": NESTED}}]}),
    # Which refusal comes first is as by value: the messages before tools, tool_choice, sampling.
    ("messages[7].content[0].source", [*session(4), {"role": "user", "content": [{"type": "image"}]}],
     {"tools": [{"name": "bash", "type": "bash_20250124"}], "tool_choice": {"type": "any"}, "top_p": 0}),
    ("messages", [*session(4), assistant(9)], {"system": [{"type": "image"}], "top_p": 0}),
    ("system[0].type", [*session(3), {"role": "user", "content": [{"type": "image"}]}],
     {"system": [{"type": "image"}]}),
    # Wrong types anywhere: the whole request's validation error (no param), before any other refusal.
    (None, [*session(4), {"role": "user", "content": 5}], {"system": [{"type": "image"}]}),
    (None, [*session(4), {"role": "tool", "content": "x"}], {}),
    (None, [*session(4), {"role": "user", "content": [{"type": "text", "text": 1}]}], {}),
    (None, [*session(3), {"role": "user", "content": [{"type": "image"}]}], {"tools": {"name": "x"}}),
    (None, session(3), {"system": 3}),
    (None, session(3), {"max_tokens": "8"}),
    (None, [*session(3), assistant(9)], {"tool_choice": {"name": "x"}}),
]


@pytest.mark.parametrize(("param", "history", "fields"), BAD)
def test_errors_are_the_by_value_decodings(fresh: Callable[[], None], param: str | None,
                                           history: list[dict[str, Any]], fields: dict[str, Any]) -> None:
    raw = body(history, **fields)
    expected = outcome(by_value, raw)
    assert expected[2] == param  # type: ignore[index]
    assert outcome(a.decode_request, raw) == expected  # cold
    for end in range(len(history) + 1):  # the session's earlier requests, whatever they got
        for warm in (fields, {}):
            outcome(a.decode_request, body([*history[:end], {"role": "user", "content": "fine"}], **warm))
    assert outcome(a.decode_request, raw) == expected  # the history before it seen


@pytest.mark.parametrize("raw", [
    b"", b"[]", b'{"max_tokens": 8}', b'{"messages": [{"role": "user", "content": "a"}]}',
    b'{"max_tokens": 8, "messages": [{"role": "user", "content": "a"}', b'{"max_tokens": 8, "messages": {}}',
    b'{"max_tokens": 8, "messages": [{"role": "user", "content": "\xff"}]}',
    b'{"max_tokens": 8, "system": "\xff", "messages": [{"role": "user", "content": "a"}]}',
])
def test_malformed_bodies_are_refused_as_by_value(fresh: Callable[[], None], raw: bytes) -> None:
    expected = outcome(by_value, raw)
    assert isinstance(expected, tuple)
    assert outcome(a.decode_request, raw) == expected


def test_the_lazy_request_has_the_requests_fields() -> None:
    lazy = {f.name: f.default for f in msgspec.structs.fields(w.LazyMessagesRequest)}
    full = {f.name: f.default for f in msgspec.structs.fields(w.MessagesRequest)}
    assert lazy.keys() == full.keys()
    assert {k: v for k, v in lazy.items() if k not in ("system", "tools")} == \
        {k: v for k, v in full.items() if k not in ("system", "tools")}


# --- property: a session's requests, each as by value -----------------------------------------------------

_text = st.text(alphabet="ab é{}\"\\", max_size=6)
_plain = st.builds(lambda t: {"type": "text", "text": t}, _text)
_odd = st.sampled_from([{"type": "image", "source": {}}, {"type": "text"}, {"type": "text", "text": 3},
                        {"type": "tool_result"}, {"type": "tool_result", "tool_use_id": ""},
                        {"type": "tool_use", "name": "calc", "input": {}}, {"type": "redacted_thinking", "data": "x"}])
_result = st.builds(lambda i, c: {"type": "tool_result", "tool_use_id": f"t{i}", "content": c},
                    st.integers(0, 3), st.one_of(st.none(), _text, st.lists(_plain, max_size=2)))
_thinking = st.builds(lambda t: {"type": "thinking", "thinking": t, "signature": "s"}, _text)
_use = st.builds(lambda i, n: {"type": "tool_use", "id": f"toolu_{i}", "name": n, "input": {"x": i}},
                 st.integers(0, 2), st.sampled_from(["calc", "read"]))


def _blocks(*kinds: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[str | list[dict[str, Any]]]:
    return st.one_of(_text, st.lists(st.one_of(*kinds), max_size=4), st.lists(st.one_of(*kinds, _odd), max_size=3))


_user = st.builds(lambda c: {"role": "user", "content": c}, _blocks(_plain, _result))
_assistant = st.builds(lambda c: {"role": "assistant", "content": c}, _blocks(_plain, _thinking, _use))
_system = st.builds(lambda c: {"role": "system", "content": c}, _blocks(_plain))


def _sessions() -> st.SearchStrategy[tuple[list[dict[str, Any]], dict[str, Any]]]:
    pair = st.tuples(_assistant, st.one_of(_user, _system))
    fields = st.fixed_dictionaries({}, optional={
        "system": st.one_of(st.none(), _text, st.lists(_plain, max_size=2)), "tools": st.just(TOOLS)})
    return st.tuples(st.builds(lambda first, rest: [first, *(m for p in rest for m in p)],
                               st.one_of(_user, _system), st.lists(pair, max_size=5)), fields)


def _requests(history: list[dict[str, Any]], fields: dict[str, Any]) -> Iterator[bytes]:
    for end in range(1, len(history) + 1, 2):
        yield body(history[:end], **fields)
    yield body([*history, {"role": "assistant", "content": "prefill"}], **fields)


@settings(max_examples=150, deadline=None)
@given(_sessions())
def test_a_sessions_requests_decode_as_by_value(case: tuple[list[dict[str, Any]], dict[str, Any]]) -> None:
    history, fields = case
    for raw in _requests(history, fields):
        assert outcome(a.decode_request, raw) == outcome(by_value, raw)
