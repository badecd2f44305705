"""The wire adapters, pure: Anthropic decoding into neutral messages, and both wires'
encodings of outcomes and of streamed turns."""

import json

import msgspec
import pytest

from edge.chat.conversation import Conversation, Message, SamplingOverrides, TurnOutcome
from edge.chat.deltas import ContentDelta, ReasoningDelta, StreamFinished, StreamStarted, ToolCallReady
from edge.chat.digest import prefix_digests, tools_digest
from edge.wires.anthropic import AnthropicWire
from edge.wires.openai import OpenAIWire
from schemas.errors import EngineUnavailable, MalformedRequest, SessionClosed
from schemas.events import ToolCall

ANTHROPIC = AnthropicWire()
OPENAI = OpenAIWire()
CALL = ToolCall(id="call_2_0", name="calc", arguments='{"x": 1}')


def decode(**body) -> Conversation:
    return ANTHROPIC.decode(json.dumps({"model": "m", "max_tokens": 8, **body}).encode())


def test_anthropic_messages_become_the_neutral_messages_openai_would_give():
    conversation = decode(
        system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief.", "cache_control": {"x": 1}}],
        messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "sig"}, {"type": "text", "text": "Sure."},
                {"type": "tool_use", "id": "toolu_1", "name": "calc", "input": {"x": 1}},
                {"type": "tool_use", "id": "toolu_2", "name": "calc", "input": {"x": 2}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "1"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                 "content": [{"type": "text", "text": "no"}, {"type": "text", "text": "pe"}]},
                {"type": "text", "text": ""}, {"type": "text", "text": "and now?"}]},
        ],
        tools=[{"name": "calc", "description": "d", "input_schema": {"type": "object"}}],
        tool_choice={"type": "auto"}, stop_sequences=["END"], temperature=0.5, top_k=5, stream=True,
    )
    assert conversation.messages == (
        Message(role="system", content="Be brief."),
        Message(role="user", content="hi"),
        Message(role="assistant", content="Sure.", reasoning="hmm", tool_calls=(
            ToolCall(id="toolu_1", name="calc", arguments='{"x": 1}'),
            ToolCall(id="toolu_2", name="calc", arguments='{"x": 2}'))),
        Message(role="tool", content="1", tool_call_id="toolu_1"),
        Message(role="tool", content="nope", tool_call_id="toolu_2"),
        Message(role="user", content="and now?"),
    )
    expected = OPENAI.decode(json.dumps({"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Sure.", "reasoning_content": "hmm", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "calc", "arguments": '{"x": 1}'}},
            {"id": "toolu_2", "type": "function", "function": {"name": "calc", "arguments": '{"x": 2}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "1"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "nope"}, {"role": "user", "content": "and now?"}],
        "tools": [{"type": "function", "function": {"name": "calc", "description": "d",
                                                    "parameters": {"type": "object"}}}]}).encode())
    assert conversation.messages == expected.messages and conversation.tools == expected.tools
    assert conversation.sampling == SamplingOverrides(temperature=0.5, top_k=5, max_tokens=8, stop=("END",))
    assert conversation.stream and conversation.tool_choice == "auto"


def test_a_user_message_of_empty_text_is_still_a_user_turn():
    assert decode(messages=[{"role": "user", "content": [{"type": "text", "text": ""}]}]).messages == (
        Message(role="user", content=""),)


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": [
        {"type": "redacted_thinking", "data": "x"}]}, {"role": "user", "content": "b"}]},
     "messages[1].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {}}]}]}]}, "messages[0].content[0].content[0].source.type"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}]},
     "messages[0].content[0].source.type"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": [
        {"type": "image", "source": {"type": "base64", "data": "AAAA"}}]}, {"role": "user", "content": "b"}]},
     "messages[1].content[0].type"),
    ({"messages": [{"role": "user", "content": "a"}], "tool_choice": {"type": "tool", "name": "calc"}},
     "tool_choice.name"),  # a tool the request does not define
    ({"messages": [{"role": "user", "content": "a"}], "tool_choice": {"type": "any"}}, "tool_choice"),  # no tools
    ({"messages": [{"role": "user", "content": "a"}], "tool_choice": {"type": "some"}}, "tool_choice.type"),
    ({"messages": [{"role": "user", "content": "a"}], "top_p": 0}, "top_p"),
])
def test_unsupported_anthropic_input_is_refused_naming_the_field(body, param):
    with pytest.raises(MalformedRequest) as caught:
        decode(**body)
    assert caught.value.param == param


def outcome(**fields) -> TurnOutcome:
    base = {"session_id": "ab" * 16, "request_no": 2, "content": "", "finish_reason": "stop", "prompt_tokens": 10,
            "completion_tokens": 4, "created": 1}
    return TurnOutcome(**{**base, **fields})


def test_anthropic_message_shape_and_stop_reasons():
    conversation = Conversation(messages=(), model="claude", sampling=SamplingOverrides(stop=("END",)))
    body = json.loads(ANTHROPIC.encode(outcome(content="hi", reasoning="r", tool_calls=(CALL,),
                                               finish_reason="tool_calls"), conversation, lambda ids: []))
    assert body == {"id": "msg_abababababab_2", "model": "claude", "type": "message", "role": "assistant",
                    "content": [{"type": "thinking", "thinking": "r", "signature": ""},
                                {"type": "text", "text": "hi"},
                                {"type": "tool_use", "id": "call_2_0", "name": "calc", "input": {"x": 1}}],
                    "stop_reason": "tool_use", "stop_sequence": None,
                    "usage": {"input_tokens": 10, "output_tokens": 4}}

    def stop(**fields):
        encoded = json.loads(ANTHROPIC.encode(outcome(**fields), conversation, lambda ids: []))
        return encoded["stop_reason"], encoded["stop_sequence"], encoded["content"]

    assert stop(content="x END") == ("stop_sequence", "END", [{"type": "text", "text": "x END"}])
    assert stop(content="x", finish_reason="length")[:2] == ("max_tokens", None)
    assert stop()[:3] == ("end_turn", None, [])


def test_error_shapes():
    assert json.loads(ANTHROPIC.encode_error(SessionClosed("closed"))) == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "closed"}}
    assert json.loads(ANTHROPIC.encode_error(EngineUnavailable("down")))["error"]["type"] == "overloaded_error"
    assert json.loads(ANTHROPIC.encode_error(MalformedRequest("bad", param="top_p")))["error"]["message"] == \
        "top_p: bad"


STREAM = [StreamStarted(session_id="ab" * 16, request_no=2, created=5, prompt_tokens=10),
          ReasoningDelta("th"), ReasoningDelta("ink"), ContentDelta("He"), ContentDelta("llo"),
          ToolCallReady(0, CALL), ToolCallReady(1, ToolCall(id="call_2_1", name="f", arguments="not json")),
          StreamFinished(outcome(content="Hello", finish_reason="tool_calls"))]


def _sse(data: bytes) -> list[tuple[str | None, str]]:
    events = []
    for block in data.decode().split("\n\n"):
        if block:
            lines = dict(line.split(": ", 1) for line in block.split("\n"))
            events.append((lines.get("event"), lines["data"]))
    return events


def test_anthropic_stream_blocks():
    encoder = ANTHROPIC.stream(Conversation(messages=()), lambda ids: [])
    events = _sse(b"".join(encoder.event(e) for e in STREAM))
    assert all(json.loads(data)["type"] == name for name, data in events)
    summary = [(name, json.loads(data).get("index")) for name, data in events]
    assert summary == [("message_start", None),
                       ("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0),
                       ("content_block_stop", 0), ("content_block_start", 1), ("content_block_delta", 1),
                       ("content_block_delta", 1), ("content_block_stop", 1),
                       ("content_block_start", 2), ("content_block_delta", 2), ("content_block_stop", 2),
                       ("content_block_start", 3), ("content_block_delta", 3), ("content_block_stop", 3),
                       ("message_delta", None), ("message_stop", None)]
    data = [json.loads(d) for _, d in events]
    assert data[0]["message"]["usage"] == {"input_tokens": 10, "output_tokens": 0}
    assert data[1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert data[10]["delta"] == {"type": "input_json_delta", "partial_json": '{"x":1}'}
    assert json.loads(data[13]["delta"]["partial_json"]) == {"arguments": "not json"}
    assert data[15] == {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                        "usage": {"output_tokens": 4}}
    assert _sse(encoder.error(EngineUnavailable("down")))[0][0] == "error"


def test_openai_stream_chunks():
    conversation = Conversation(messages=(), stream_usage=True, logprobs=True, model="m")
    encoder = OPENAI.stream(conversation, lambda ids: [f"t{i}" for i in ids])
    finished = StreamFinished(outcome(token_ids=(7, 8), logprobs=(-0.5, -0.25), completion_tokens=2))
    events = _sse(b"".join(encoder.event(e) for e in [*STREAM[:6], finished]))
    assert events[-1] == (None, "[DONE]")
    chunks = [json.loads(d) for _, d in events[:-1]]
    assert {c["id"] for c in chunks} == {"chatcmpl-abababababab-2"}
    deltas = [c["choices"][0]["delta"] for c in chunks[:-1]]
    assert deltas == [{"role": "assistant", "content": ""}, {"reasoning_content": "th"},
                      {"reasoning_content": "ink"}, {"content": "He"}, {"content": "llo"},
                      {"tool_calls": [{"index": 0, "id": "call_2_0", "type": "function",
                                       "function": {"name": "calc", "arguments": ""}}]},
                      {"tool_calls": [{"index": 0, "function": {"arguments": '{"x": 1}'}}]}, {}]
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-2]["choices"][0]["logprobs"]["content"][1] == {"token": "t8", "logprob": -0.25, "bytes": None,
                                                                  "top_logprobs": []}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2
    assert msgspec.json.decode(encoder.error(EngineUnavailable("down"))[len(b"data: "):])["error"]["code"] == \
        "engine_unavailable"


TOOL = {"type": "function", "function": {"name": "ls", "description": "List", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}}}}


def test_openai_tools_decode_once_per_json_and_bad_tools_name_the_field():
    def body(tools: object) -> bytes:
        return json.dumps({"messages": [{"role": "user", "content": "hi"}], "tools": tools}).encode()

    first = OPENAI.decode(body([TOOL]))
    assert [t.name for t in first.tools] == ["ls"] and first.tools[0].parameters == TOOL["function"]["parameters"]
    assert OPENAI.decode(body([TOOL])).tools is first.tools  # the same JSON: the same specs
    assert OPENAI.decode(body(None)).tools == () and OPENAI.decode(body([])).tools == ()
    for bad in ([{"type": "function", "function": {"name": 3}}], {"name": "ls"}, ["ls"]):
        with pytest.raises(MalformedRequest) as caught:
            OPENAI.decode(body(bad))
        assert caught.value.param == "tools"


def _openai(messages: list[dict], tools: list | None = None) -> Conversation:
    return OPENAI.decode(json.dumps({"model": "m", "messages": messages, "tools": tools}).encode())


def _digests(conversation: Conversation) -> tuple[str, ...]:
    return tuple(d.hex() for d in prefix_digests(tools_digest(conversation.tools), conversation.messages))


def test_openai_history_digests_are_those_of_its_decoded_messages():
    call = {"id": "call_a", "type": "function", "function": {"name": "ls", "arguments": '{"path": "."}'}}
    history = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "list it ✓"},
               {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_a", "content": "a.py"}]
    first = _openai(history, [TOOL])
    assert len(first.history_digests) == 4 and first.history_digests == _digests(first)
    # Resent with its call id and argument formatting rewritten, then extended: the same prefix.
    echoed = {**call, "id": "other", "function": {"name": "ls", "arguments": '{ "path":"." }'}}
    longer = _openai([*history[:2], {**history[2], "tool_calls": [echoed]}, history[3],
                      {"role": "assistant", "content": "done"}], [TOOL])
    assert longer.history_digests[:4] == first.history_digests and longer.history_digests == _digests(longer)
    # A different second message: a different history from there on.
    other = _openai([history[0], {"role": "user", "content": "list that"}, *history[2:]], [TOOL])
    assert other.history_digests[0] == first.history_digests[0]
    assert not set(other.history_digests[1:]) & set(first.history_digests)
    # Other tools: another root, so no digest in common.
    assert not set(_openai(history).history_digests) & set(first.history_digests)


def test_openai_resent_messages_are_decoded_once_per_history_they_follow():
    bare = {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "ls", "arguments": "{}"}}]}
    short = _openai([{"role": "user", "content": "u1"}, bare])
    again = _openai([{"role": "user", "content": "u1"}, bare, {"role": "tool", "content": "x"}])
    assert again.messages[1] is short.messages[1]  # found, not decoded again
    later = _openai([{"role": "user", "content": "u1"}, {"role": "user", "content": "u2"}, bare])
    # The same raw message after another history is decoded there: its default call id has its index.
    assert short.messages[1].tool_calls[0].id == "call_1_0" and later.messages[2].tool_calls[0].id == "call_2_0"
    with pytest.raises(MalformedRequest) as caught:
        _openai([{"role": "user", "content": "u1"}, {"role": "assistant", "content": 3}])
    assert caught.value.param == "messages[1]"
