"""A body that starts with its session's last request's messages is parsed only past them
(edge/wires/prefix.py), on both wires, and decodes to exactly what a decode from scratch gives:
the same messages, history digests, options and errors, and the sha256 of the whole body."""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator
from types import ModuleType, SimpleNamespace
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge.chat.conversation import Conversation
from edge.wires import anthropic as anthropic_wire
from edge.wires import openai as openai_wire
from edge.wires.prefix import KnownPrefix, skip_known
from schemas.errors import MalformedRequest

STYLES: dict[str, dict[str, Any]] = {
    "default": {},  # ", " and ": ", as Python's json and many SDKs write
    "compact": {"separators": (",", ":")},  # as JS's JSON.stringify writes
    "unicode": {"separators": (",", ":"), "ensure_ascii": False},
    "indent": {"indent": 2},
}

OA_TOOLS = [{"type": "function", "function": {"name": "read", "description": "Read a file.",
                                              "parameters": {"type": "object",
                                                             "properties": {"path": {"type": "string"}}}}},
            {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
AN_TOOLS = [{"name": "read", "description": "Read a file.",
             "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}},
            {"name": "calc", "input_schema": {"type": "object"}}]


def dumps(value: Any, style: str) -> bytes:
    return json.dumps(value, **STYLES[style]).encode()


def oa_body(messages: list[Any], style: str = "default", *, messages_last: bool = False,
            tools: Any = OA_TOOLS, **fields: Any) -> bytes:
    head: dict[str, Any] = {"model": "gpt-x"}
    tail: dict[str, Any] = {"tools": tools, "temperature": 0.5, "max_tokens": 64, **fields}
    if tools is None:
        del tail["tools"]
    request = {**head, **tail, "messages": messages} if messages_last else {**head, "messages": messages, **tail}
    return dumps(request, style)


def an_body(messages: list[Any], style: str = "default", *, messages_last: bool = False,
            system: Any = "You are a coder.", system_first: bool = True, tools: Any = AN_TOOLS,
            **fields: Any) -> bytes:
    request: dict[str, Any] = {"model": "claude-x", "max_tokens": 64}
    if system is not None and system_first:
        request["system"] = system
    if not messages_last:
        request["messages"] = messages
    if tools is not None:
        request["tools"] = tools
    request.update(fields)
    if system is not None and not system_first:
        request["system"] = system
    if messages_last:
        request["messages"] = messages
    return dumps(request, style)


def without_known(conversation: Conversation) -> Conversation:
    return msgspec.structs.replace(conversation, known=None)


def known_state(known: KnownPrefix | None) -> tuple[Any, ...] | None:
    if known is None:
        return None
    return (known.body, known.start, known.end, known.root, known.messages, known.digests, known.sha.hexdigest(),
            known.count, known.tip, known.extra)


@contextlib.contextmanager
def spy(wire: ModuleType) -> Iterator[SimpleNamespace]:
    """Records, for each decode, whether :func:`skip_known` cut the known messages out (``cut``) and,
    for each body learnt from, whether it was decoded against the known prefix, how many wire
    messages were parsed, and how long the parsed document was (``learnt``)."""
    calls = SimpleNamespace(cut=[], learnt=[])
    real_skip, real_learn = wire.skip_known, wire.learn

    def skip(body: bytes, known: KnownPrefix | None) -> tuple[bytes, KnownPrefix | None, int]:
        out = real_skip(body, known)
        calls.cut.append(out[1] is not None)
        return out

    def learn(body: bytes, document: bytes, shift: int, known: KnownPrefix | None, new_raws: list[Any],
              **kwargs: Any) -> tuple[KnownPrefix | None, str]:
        calls.learnt.append((known is not None, len(new_raws), len(document)))
        return real_learn(body, document, shift, known, new_raws, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(wire, "skip_known", skip)
        patch.setattr(wire, "learn", learn)
        yield calls


def decode_both(wire: ModuleType, body: bytes, known: KnownPrefix | None) -> tuple[Conversation, SimpleNamespace]:
    """The body decoded against ``known`` equals the body decoded from scratch; both come back."""
    with spy(wire) as calls:
        got = wire.decode_request(body, known)
    scratch = wire.decode_request(body)
    assert without_known(got) == without_known(scratch)
    assert got.body_digest == scratch.body_digest == hashlib.sha256(body).hexdigest()
    assert len(got.history_digests) == len(got.messages)
    assert known_state(got.known) == known_state(scratch.known)  # the next request is decoded the same either way
    return got, calls


def decode_session(wire: ModuleType, bodies: list[bytes], new: list[int]) -> list[Conversation]:
    """Each body against the previous one's known prefix; ``new[i]``: wire messages body ``i`` adds."""
    out = []
    known = None
    for i, (body, added) in enumerate(zip(bodies, new, strict=True)):
        got, calls = decode_both(wire, body, known)
        if i and not added:  # a resend with no new message is decoded in full (edge.wires.prefix.skip_known)
            assert calls.cut == [False]
        elif i:  # the known path, to the end: only the new messages were parsed
            assert calls.cut == [True]
            assert calls.learnt == [(True, added, calls.learnt[0][2])]
            assert calls.learnt[0][2] <= len(body) - (known.end - known.start)
        else:
            assert calls.learnt[0][:2] == (False, added)
        known = got.known
        assert known is not None and known.count == sum(new[: i + 1])
        out.append(got)
    return out


def grow(make: Any, turns: list[list[Any]], **kwargs: Any) -> tuple[list[bytes], list[int]]:
    """The bodies of a session whose history grows by ``turns[i]`` at request ``i``."""
    history: list[Any] = []
    bodies, new = [], []
    for added in turns:
        history = [*history, *added]
        bodies.append(make(history, **kwargs))
        new.append(len(added))
    return bodies, new


# --- OpenAI -----------------------------------------------------------------------------------


def oa_turns() -> list[list[dict[str, Any]]]:
    call = {"id": "call_1", "type": "function", "function": {"name": "read", "arguments": '{"path": "a.py"}'}}
    anonymous = {"type": "function", "function": {"name": "calc", "arguments": '{"x": [1, 2]}'}}  # id from index
    return [
        [{"role": "system", "content": "You are a coder. Don't say \"]\", or \\ or é."},
         {"role": "user", "content": "Fix the bug in a.py, please ✓"}],
        [{"role": "assistant", "content": None, "tool_calls": [call, anonymous]},
         {"role": "tool", "tool_call_id": "call_1", "content": "def f():\n    return [1, 2]\n"},
         {"role": "tool", "tool_call_id": "call_x", "content": "3"}],
        [{"role": "assistant", "content": "Done.", "reasoning_content": "It was simple."},
         {"role": "user", "content": [{"type": "text", "text": "And "}, {"type": "text", "text": "b.py?"}]}],
        [{"role": "assistant", "content": "", "tool_calls": [anonymous]},
         {"role": "tool", "tool_call_id": "call_6_0", "content": "ok"},
         {"role": "developer", "content": "Be brief.", "name": "ops"}],
        [],  # a retry: the same body again
        [{"role": "assistant", "content": "Both fixed."}, {"role": "user", "content": "Thanks"}],
    ]


@pytest.mark.parametrize("style", list(STYLES))
@pytest.mark.parametrize("messages_last", [False, True])
def test_an_openai_session_decodes_past_its_known_messages(style, messages_last):
    bodies, new = grow(oa_body, oa_turns(), style=style, messages_last=messages_last)
    conversations = decode_session(openai_wire, bodies, new)
    last = conversations[-1]
    assert [m.role for m in last.messages] == ["system", "user", "assistant", "tool", "tool", "assistant", "user",
                                               "assistant", "tool", "system", "assistant", "user"]
    assert last.messages[2].tool_calls[1].id == "call_2_1" and last.messages[8].tool_calls == ()
    assert last.messages[7].tool_calls[0].id == "call_7_0"
    assert last.messages[6].content == "And b.py?" and last.messages[5].reasoning == "It was simple."
    assert conversations[4].messages == conversations[3].messages and last.sampling.temperature == 0.5


def test_odd_whitespace_around_the_cut():
    first = oa_body([{"role": "user", "content": "hi"}], "compact")
    known = openai_wire.decode_request(first).known
    new = b'{"role":"assistant","content":"yo"}, {"role":"user","content":"again"}'
    for space in (b"", b" ", b"\n\t ", b"\r\n  "):
        for after in (b"", b" ", b"\n"):
            body = first[:known.end] + space + b"," + after + new + first[known.end:]
            got, calls = decode_both(openai_wire, body, known)
            assert calls.cut == [True] and calls.learnt[0][:2] == (True, 2)
            assert [m.content for m in got.messages] == ["hi", "yo", "again"]
        body = first[:known.end] + space + first[known.end:]  # nothing new: decoded in full
        got, calls = decode_both(openai_wire, body, known)
        assert calls.cut == [False] and calls.learnt[0][:2] == (False, 1)


# --- Anthropic --------------------------------------------------------------------------------


def an_turns() -> list[list[dict[str, Any]]]:
    def assistant(i: int, *, tool_id: str | None, thinking: bool = True) -> dict[str, Any]:
        use: dict[str, Any] = {"type": "tool_use", "name": "read", "input": {"path": f"f{i}.py", "s": "é\"]"}}
        if tool_id is not None:
            use["id"] = tool_id
        blocks = [{"type": "thinking", "thinking": f"think {i}", "signature": "sig"}] if thinking else []
        return {"role": "assistant", "content": [*blocks, {"type": "text", "text": f"say {i}"}, use]}

    def results(i: int, tool_id: str) -> dict[str, Any]:
        return {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": tool_id, "content": f"result {i}"},
            {"type": "tool_result", "tool_use_id": tool_id, "is_error": True,
             "content": [{"type": "text", "text": "no"}, {"type": "text", "text": f"pe {i}"}]},
            {"type": "text", "text": ""}, {"type": "text", "text": f"and {i}?", "cache_control": {"type": "x"}}]}

    return [
        [{"role": "user", "content": "Fix the bug, please ✓"}],
        [assistant(1, tool_id="toolu_1"), results(1, "toolu_1")],
        [assistant(3, tool_id="toolu_3_2"), results(3, "toolu_3_2")],
        [],  # a retry
        [{"role": "assistant", "content": "Plain text."},
         {"role": "user", "content": [{"type": "text", "text": "ok"}]}],
        [assistant(7, tool_id="toolu_7", thinking=False), results(7, "toolu_7")],
    ]


SYSTEMS = {"string": "You are a coder.", "blocks": [{"type": "text", "text": "You are "},
                                                      {"type": "text", "text": "a coder.", "cache_control": {"t": 1}}],
           "none": None, "empty": ""}


@pytest.mark.parametrize("style", list(STYLES))
@pytest.mark.parametrize("system", list(SYSTEMS))
@pytest.mark.parametrize(("messages_last", "system_first"), [(False, True), (False, False), (True, True)])
def test_an_anthropic_session_decodes_past_its_known_messages(style, system, messages_last, system_first):
    bodies, new = grow(an_body, an_turns(), style=style, system=SYSTEMS[system], messages_last=messages_last,
                       system_first=system_first)
    conversations = decode_session(anthropic_wire, bodies, new)
    last = conversations[-1]
    lead = ["system"] if system in ("string", "blocks") else []
    assert [m.role for m in last.messages] == [*lead, "user", "assistant", "tool", "tool", "user", "assistant",
                                               "tool", "tool", "user", "assistant", "user", "assistant", "tool",
                                               "tool", "user"]
    if lead:
        assert last.messages[0].content == "You are a coder."
    body = last.messages[len(lead):]
    assert body[1].reasoning == "think 1" and body[1].tool_calls[0].id == "toolu_1"
    assert body[5].tool_calls[0].id == "toolu_3_2" and body[10].reasoning is None
    assert json.loads(body[1].tool_calls[0].arguments) == {"path": "f1.py", "s": "é\"]"}


# --- random histories -------------------------------------------------------------------------

_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)
_arguments = st.dictionaries(st.text(max_size=5), st.one_of(st.integers(), _text, st.lists(st.integers(), max_size=3)),
                             max_size=3)


@st.composite
def oa_message(draw: st.DrawFn) -> dict[str, Any]:
    role = draw(st.sampled_from(["system", "developer", "user", "assistant", "tool"]))
    message: dict[str, Any] = {"role": role}
    if draw(st.booleans()) and role != "tool":
        message["content"] = [{"type": "text", "text": t} for t in draw(st.lists(_text, max_size=3))]
    else:
        message["content"] = draw(st.one_of(st.none(), _text))
    if role == "assistant" and draw(st.booleans()):
        calls = []
        for _ in range(draw(st.integers(1, 2))):
            call: dict[str, Any] = {"type": "function", "function": {"name": draw(st.sampled_from(["read", "calc"])),
                                                                      "arguments": json.dumps(draw(_arguments))}}
            if draw(st.booleans()):
                call["id"] = draw(_text)
            calls.append(call)
        message["tool_calls"] = calls
        if draw(st.booleans()):
            message["reasoning_content"] = draw(_text)
    if role == "tool":
        message["tool_call_id"] = draw(_text)
    if draw(st.integers(0, 5)) == 0:
        message["name"] = draw(_text)
    return message


_block_text = st.builds(lambda t: {"type": "text", "text": t}, _text)


@st.composite
def an_exchange(draw: st.DrawFn) -> list[dict[str, Any]]:
    """An assistant message and the user message after it (a request never ends with an assistant's)."""
    blocks: list[dict[str, Any]] = []
    for kind in draw(st.lists(st.sampled_from(["text", "thinking", "tool_use"]), max_size=4)):
        if kind == "text":
            blocks.append(draw(_block_text))
        elif kind == "thinking":
            blocks.append({"type": "thinking", "thinking": draw(_text), "signature": "s"})
        else:
            blocks.append({"type": "tool_use", "id": "toolu_" + draw(_text), "name": "calc",
                           "input": draw(_arguments)})
    assistant = {"role": "assistant", "content": blocks if blocks and draw(st.booleans()) else draw(_text)}
    user_blocks: list[dict[str, Any]] = []
    for kind in draw(st.lists(st.sampled_from(["text", "tool_result"]), max_size=4)):
        if kind == "text":
            user_blocks.append(draw(_block_text))
        else:
            content = draw(st.one_of(_text, st.lists(_block_text, max_size=2)))
            user_blocks.append({"type": "tool_result", "tool_use_id": "toolu_" + draw(_text), "content": content,
                                "is_error": draw(st.booleans())})
    user = {"role": "user", "content": user_blocks if draw(st.booleans()) else draw(_text)}
    return [assistant, user]


_settings = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_settings
@given(st.lists(st.lists(oa_message(), max_size=3), min_size=1, max_size=5).filter(lambda t: len(t[0]) > 0),
       st.sampled_from(list(STYLES)), st.booleans())
def test_random_openai_histories(turns, style, messages_last):
    bodies, new = grow(oa_body, turns, style=style, messages_last=messages_last)
    decode_session(openai_wire, bodies, new)


@_settings
@given(st.lists(st.lists(an_exchange(), max_size=2).map(lambda t: [m for pair in t for m in pair]), max_size=4),
       st.sampled_from(list(STYLES)), st.sampled_from(list(SYSTEMS)), st.booleans(), _text)
def test_random_anthropic_histories(turns, style, system, system_first, first):
    turns = [[{"role": "user", "content": first}], *turns]
    bodies, new = grow(an_body, turns, style=style, system=SYSTEMS[system], system_first=system_first)
    decode_session(anthropic_wire, bodies, new)


# --- what is decoded in full ------------------------------------------------------------------


def _previous(wire: ModuleType, body: bytes) -> KnownPrefix:
    known = wire.decode_request(body).known
    assert known is not None
    return known


def full(wire: ModuleType, body: bytes, known: KnownPrefix, *, cut: bool) -> Conversation:
    """Decoded in full, with the same result as from scratch; ``cut``: skip_known did cut (and the
    decoder then found the known prefix does not apply)."""
    got, calls = decode_both(wire, body, known)
    assert calls.cut[0] is cut
    assert [learnt[0] for learnt in calls.learnt] == [False]
    return got


@pytest.mark.parametrize("style", ["default", "compact"])
def test_a_rewritten_history_is_decoded_in_full(style):
    turns = oa_turns()
    history = turns[0] + turns[1]
    known = _previous(openai_wire, oa_body(history, style))
    rewritten = [*history[:3], {"role": "tool", "tool_call_id": "call_1", "content": "(elided)"}, *history[4:]]
    got = full(openai_wire, oa_body([*rewritten, *turns[2]], style), known, cut=False)
    assert got.messages[3].content == "(elided)"
    full(openai_wire, oa_body(history[:2], style), known, cut=False)  # compacted: shorter than the known prefix
    full(openai_wire, oa_body(history[1:], style), known, cut=False)  # the system prompt dropped

    an_history = an_turns()[0] + an_turns()[1]
    an_known = _previous(anthropic_wire, an_body(an_history, style))
    got = full(anthropic_wire, an_body([{"role": "user", "content": "Other"}, *an_history[1:]], style), an_known,
               cut=False)
    assert got.messages[1].content == "Other"


@pytest.mark.parametrize("messages_last", [False, True])
def test_changed_tools_are_decoded_in_full(messages_last):
    history = oa_turns()[0]
    known = _previous(openai_wire, oa_body(history, messages_last=messages_last))
    more = [*history, {"role": "assistant", "content": "ok"}]
    for tools in (OA_TOOLS[:1], None, [*OA_TOOLS, {"type": "function", "function": {"name": "x"}}]):
        got = full(openai_wire, oa_body(more, messages_last=messages_last, tools=tools), known,
                   cut=not messages_last)  # tools after the messages: the cut is made, then the root differs
        assert len(got.tools) == len(tools or ())

    an_history = an_turns()[0]
    an_known = _previous(anthropic_wire, an_body(an_history, messages_last=messages_last))
    an_more = [*an_history, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}]
    for tools in (AN_TOOLS[:1], None):
        got = full(anthropic_wire, an_body(an_more, messages_last=messages_last, tools=tools), an_known,
                   cut=not messages_last)
        assert len(got.tools) == len(tools or ())


def test_a_changed_anthropic_system_is_decoded_in_full():
    history = an_turns()[0] + an_turns()[1]
    more = [*history, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}]
    for before, after in (("string", "blocks"), ("blocks", "string"), ("string", "none"), ("none", "string"),
                          ("string", "empty")):
        for system_first in (True, False):
            known = _previous(anthropic_wire, an_body(history, system=SYSTEMS[before], system_first=system_first))
            body = an_body(more, system=SYSTEMS[after], system_first=system_first)
            if SYSTEMS[before] is None and not system_first:  # the key order only differs after the messages
                continue
            got = full(anthropic_wire, body, known, cut=not system_first)
            assert len(got.messages) == len(more) + 4 - 2 + (after in ("string", "blocks"))
    # the same system prompt, written as blocks that say the same: the bytes differ, the history's root too
    known = _previous(anthropic_wire, an_body(history, system=SYSTEMS["string"], system_first=False))
    full(anthropic_wire, an_body(more, system=[{"type": "text", "text": "You are a coder."}], system_first=False),
         known, cut=True)


def test_bytes_that_differ_inside_the_known_messages_are_decoded_in_full():
    history = oa_turns()[0] + oa_turns()[1]
    more = [*history, {"role": "assistant", "content": "ok"}]
    known = _previous(openai_wire, oa_body(history, "unicode"))
    got = full(openai_wire, oa_body(more, "compact"), known, cut=False)  # "é" written as \u00e9 now
    assert got.messages[0].content.endswith("é.")
    known = _previous(openai_wire, oa_body(history, "default"))
    full(openai_wire, oa_body(more, "compact"), known, cut=False)  # other separators
    body = oa_body(more)
    changed = body.replace(b'"role": "tool", "tool_call_id": "call_1"', b'"role": "tool", "tool_call_id":  "call_1"')
    assert changed != body
    full(openai_wire, changed, known, cut=False)  # one space more, inside a known message
    full(openai_wire, oa_body(more, n=1, messages_last=True), known, cut=False)  # a field before the messages
    assert known.end < len(oa_body(history))
    unrelated = oa_body([{"role": "user", "content": "another session"}])
    full(openai_wire, unrelated, known, cut=False)

    an_history = an_turns()[0] + an_turns()[1]
    an_known = _previous(anthropic_wire, an_body(an_history, "unicode"))
    full(anthropic_wire, an_body([*an_history, {"role": "assistant", "content": "ok"},
                                  {"role": "user", "content": "go"}], "compact"), an_known, cut=False)


def test_a_known_prefix_not_followed_by_a_comma_or_the_end_of_the_array_is_not_cut():
    first = oa_body([{"role": "user", "content": "hi"}], "compact")
    known = _previous(openai_wire, first)
    assert first[known.end:known.end + 1] == b"]"
    for rest in (b"", b"  ", b"}", b'{"role":"user","content":"x"}]}'):
        body = first[:known.end] + rest
        assert skip_known(body, known) == (body, None, 0)


# --- errors -----------------------------------------------------------------------------------


def error_of(wire: ModuleType, body: bytes, known: KnownPrefix | None) -> MalformedRequest:
    with pytest.raises(MalformedRequest) as caught:
        wire.decode_request(body, known)
    return caught.value


def same_error(wire: ModuleType, body: bytes, known: KnownPrefix) -> MalformedRequest:
    got, scratch = error_of(wire, body, known), error_of(wire, body, None)
    assert (type(got), got.message, got.param) == (type(scratch), scratch.message, scratch.param)
    return got


OA_BAD = [
    ({"role": "function", "content": "x"}, "messages[7].role"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]},
     "messages[7].content[0].image_url.url"),
    ({"role": "user", "content": [{"type": "file", "file": {}}]}, "messages[7].content"),
    ({"role": "user", "content": 5}, "messages[7]"),
    ({"role": "robot", "content": "x"}, "messages[7]"),
    ({"role": "tool", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}, "messages[7].tool_calls"),
    (7, "messages[7]"),
    ([], "messages[7]"),
]


@pytest.mark.parametrize("style", ["default", "compact"])
@pytest.mark.parametrize(("bad", "param"), OA_BAD)
def test_a_malformed_new_openai_message_is_refused_as_from_scratch(style, bad, param):
    turns = oa_turns()
    history = turns[0] + turns[1] + turns[2]
    assert len(history) == 7
    known = _previous(openai_wire, oa_body(history, style))
    error = same_error(openai_wire, oa_body([*history, bad], style), known)
    assert error.param == param
    error = same_error(openai_wire, oa_body([*history, {"role": "user", "content": "ok"}, bad], style), known)
    assert error.param == param.replace("[7]", "[8]")


def test_other_malformed_openai_fields_are_refused_as_from_scratch():
    history = oa_turns()[0]
    known = _previous(openai_wire, oa_body(history))
    more = [*history, {"role": "assistant", "content": "ok"}]
    for fields, param in (({"temperature": -1}, "temperature"), ({"n": 2}, "n"), ({"tool_choice": "some"},
                                                                                   "tool_choice"),
                          ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
                          ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
                          ({"stream": "yes"}, None)):
        assert same_error(openai_wire, oa_body(more, **fields), known).param == param
    assert same_error(openai_wire, oa_body(more, tools=[{"function": {}}]), known).param == "tools"
    body = oa_body(more)
    for broken in (body[:-1], body.replace(b'"ok"}]', b'"ok"},]'), body.replace(b'"ok"}]', b'"ok"}, ]'),
                   body.replace(b'"ok"}]', b'"ok"},,]'), body.replace(b'"ok"}]', b'"ok"} {}]')):
        assert broken != body
        same_error(openai_wire, broken, known)


def test_a_trailing_comma_after_the_known_messages_is_refused():
    """``[known..., ]`` is not JSON; cutting the known messages out of it once made it ``[ ]``."""
    for wire, body in ((openai_wire, oa_body([{"role": "user", "content": "hi"}])),
                       (anthropic_wire, an_body([{"role": "user", "content": "hi"}]))):
        known = _previous(wire, body)
        for comma in (b",", b", ", b" ,\n"):
            broken = body[:known.end] + comma + body[known.end:]
            assert skip_known(broken, known) == (broken, None, 0)
            assert "not valid JSON" in same_error(wire, broken, known).message


AN_BAD = [
    ({"role": "user", "content": [{"type": "image", "source": {}}]}, "messages[6].content[0].source.type"),
    ({"role": "user", "content": [{"type": "text", "text": "a"},
                                  {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}]},
     "messages[6].content[1].content[0].source"),
    ({"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "not base64!"}}]},
     "messages[6].content[0].source.data"),
    ({"role": "user", "content": [{"type": "document"}]}, "messages[6].content[0].type"),
    ({"role": "robot", "content": "x"}, None),
    ({"role": "user"}, None),
    ({"role": "user", "content": 5}, None),
]


@pytest.mark.parametrize("style", ["default", "compact"])
@pytest.mark.parametrize(("bad", "param"), AN_BAD)
def test_a_malformed_new_anthropic_message_is_refused_as_from_scratch(style, bad, param):
    turns = an_turns()
    history = turns[0] + turns[1] + turns[2] + [{"role": "assistant", "content": "so"}]
    assert len(history) == 6
    known = _previous(anthropic_wire, an_body([*history[:-1]], style))
    error = same_error(anthropic_wire, an_body([*history, bad], style), known)
    assert error.param == param


def test_other_malformed_anthropic_requests_are_refused_as_from_scratch():
    history = an_turns()[0]
    known = _previous(anthropic_wire, an_body(history))
    ending = [*history, {"role": "user", "content": "go"}, {"role": "assistant", "content": "prefill"}]
    assert same_error(anthropic_wire, an_body(ending), known).param == "messages"
    redacted = [*history, {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]},
                {"role": "user", "content": "go"}]
    assert same_error(anthropic_wire, an_body(redacted), known).param == "messages[1].content[0].type"
    more = [*history, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}]
    for fields, param in (({"temperature": -1}, "temperature"), ({"tool_choice": {"type": "x"}}, "tool_choice.type"),
                          ({"top_p": 0}, "top_p")):
        assert same_error(anthropic_wire, an_body(more, **fields), known).param == param
    assert same_error(anthropic_wire, an_body(more, tools=[{"name": "b", "type": "bash_20250124"}]),
                      known).param == "tools[0].type"
    assert same_error(anthropic_wire, an_body(more, system=[{"type": "image"}], system_first=False),
                      known).param == "system[0].type"


# --- known limitation -------------------------------------------------------------------------


@pytest.mark.parametrize("wire", [openai_wire, anthropic_wire])
def test_a_duplicate_messages_key_is_decoded_as_from_scratch(wire):
    make = oa_body if wire is openai_wire else an_body
    first = make([{"role": "user", "content": "A"}], "compact", messages_last=True)
    known = _previous(wire, first)
    body = first[:known.end] + b',{"role":"user","content":"B"}],"messages":[{"role":"user","content":"C"}]}'
    assert [m.content for m in wire.decode_request(body).messages][-1:] == ["C"]
    decode_both(wire, body, known)
