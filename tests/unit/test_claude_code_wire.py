"""What Claude Code 2.1 sends on the Anthropic wire, decoded: ``system`` messages inside ``messages``
(where they stand), the fields accepted without effect on the tokens, and ``count_tokens`` bodies
(a Messages request without ``max_tokens``)."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from edge.chat.conversation import Conversation, Message
from edge.wires import anthropic as a
from edge.wires.openai import decode_request as decode_openai
from schemas.errors import MalformedRequest
from schemas.events import ToolCall

AGENTS = "Available agent types for the Agent tool:\n- general-purpose: ..."
SKILLS = "The following skills are available for use with the Skill tool: ..."
TOOL = {"name": "Bash", "description": "Run a command.",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}


def history() -> list[dict[str, Any]]:
    """As a sub-agent's second request: user, system, assistant tool_use, tool_result, system."""
    return [
        {"role": "user", "content": [{"type": "text", "text": "<system-reminder>date</system-reminder>\n\n"},
                                     {"type": "text", "text": "Add 2+2.", "cache_control": {"type": "ephemeral"}}]},
        {"role": "system", "content": SKILLS},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "call_2_0", "name": "Bash",
                                           "input": {"command": "echo 4"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_2_0", "content": "4",
                                      "is_error": False, "cache_control": {"type": "ephemeral"}}]},
        {"role": "system", "content": [{"type": "text", "text": AGENTS, "cache_control": {"type": "ephemeral"}}]},
    ]


def body(messages: list[dict[str, Any]], **fields: Any) -> bytes:
    return json.dumps({"model": "claude-opus-4-8", "max_tokens": 64000, "messages": messages, **fields}).encode()


def both(raw: bytes) -> Conversation:
    """The incremental decoding, checked against the by-value one."""
    incremental = msgspec.structs.replace(a.decode_request(raw), body_digest="", known=None, history_digests=())
    assert incremental == a._decode_by_value(raw)
    return incremental


def test_system_messages_in_messages_are_system_messages_where_they_stand() -> None:
    conversation = both(body(history(), system=[{"type": "text", "text": "You are an agent."}], tools=[TOOL]))
    assert conversation.messages == (
        Message(role="system", content="You are an agent."),
        Message(role="user", content="<system-reminder>date</system-reminder>\n\nAdd 2+2."),
        Message(role="system", content=SKILLS),
        Message(role="assistant", tool_calls=(ToolCall(id="call_2_0", name="Bash",
                                                       arguments='{"command": "echo 4"}'),)),
        Message(role="tool", content="4", tool_call_id="call_2_0"),
        Message(role="system", content=AGENTS),
    )
    openai = decode_openai(json.dumps({"messages": [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "<system-reminder>date</system-reminder>\n\nAdd 2+2."},
        {"role": "system", "content": SKILLS},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_2_0", "type": "function", "function": {
            "name": "Bash", "arguments": '{"command": "echo 4"}'}}]},
        {"role": "tool", "tool_call_id": "call_2_0", "content": "4"},
        {"role": "system", "content": AGENTS}]}).encode())
    assert conversation.messages == openai.messages


def test_without_a_system_prompt_a_first_system_message_is_the_system_prompt() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert both(body(messages)).messages == (Message(role="system", content="Be brief."),
                                             Message(role="user", content="hi"))


def test_a_system_message_may_be_empty_or_last() -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "system", "content": []}]
    assert both(body(messages)).messages[-1] == Message(role="system", content="")


@pytest.mark.parametrize(("block", "param"), [
    ({"type": "image", "source": {}}, "messages[1].content[0].type"),
    ({"type": "tool_result", "tool_use_id": "t", "content": "x"}, "messages[1].content[0].type"),
    ({"type": "text"}, "messages[1].content[0].type"),
])
def test_a_system_message_holds_text_only(block: dict[str, Any], param: str) -> None:
    raw = body([{"role": "user", "content": "hi"}, {"role": "system", "content": [block]}])
    for decode in (a.decode_request, a._decode_by_value):
        with pytest.raises(MalformedRequest) as caught:
            decode(raw)
        assert caught.value.param == param


CLAUDE_CODE_FIELDS: list[dict[str, Any]] = [
    {"thinking": {"type": "adaptive"}, "context_management": {"edits": [{"type": "clear_thinking_20251015",
                                                                         "keep": "all"}]},
     "output_config": {"effort": "high"}, "stream": True,
     "metadata": {"user_id": '{"device_id":"9b7b","account_uuid":"","session_id":"2187"}'}},
    {"thinking": {"type": "enabled", "budget_tokens": 1024}},
    {"thinking": {"type": "disabled"}, "output_config": {"effort": "low", "format": {"type": "json_schema"}}},
]


@pytest.mark.parametrize("fields", CLAUDE_CODE_FIELDS)
def test_the_fields_claude_code_sends_change_nothing_in_the_prompt(fields: dict[str, Any]) -> None:
    tools = [{**TOOL, "cache_control": {"type": "ephemeral"}, "defer_loading": False,
              "eager_input_streaming": True}]
    plain = both(body(history(), tools=[TOOL]))
    sent = both(body(history(), tools=tools, **fields))
    assert (sent.messages, sent.tools, sent.sampling) == (plain.messages, plain.tools, plain.sampling)


@pytest.mark.parametrize("fields", [{"metadata": "x"}, {"context_management": []}, {"output_config": 1},
                                    {"thinking": "adaptive"}])
def test_those_fields_must_still_be_objects(fields: dict[str, Any]) -> None:
    for decode in (a.decode_request, a._decode_by_value):
        with pytest.raises(MalformedRequest, match=r"Expected `object \| null`, got `\w+` - at `\$\.\w+`"):
            decode(body(history(), **fields))


def test_a_count_tokens_body_is_the_messages_conversation_without_max_tokens() -> None:
    fields = {"system": "You are an agent.", "tools": [TOOL], "thinking": {"type": "enabled", "budget_tokens": 9}}
    counted = a.decode_count_request(json.dumps({"model": "m", "messages": history(), **fields}).encode())
    sent = both(body(history(), **fields))
    assert (counted.messages, counted.tools) == (sent.messages, sent.tools)


@pytest.mark.parametrize(("messages", "param"), [
    ([], "messages"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "messages"),
    ([{"role": "user", "content": [{"type": "document", "source": {}}]}], "messages[0].content[0].type"),
])
def test_a_count_tokens_body_is_refused_as_a_messages_one(messages: list[dict[str, Any]], param: str) -> None:
    with pytest.raises(MalformedRequest) as caught:
        a.decode_count_request(json.dumps({"model": "m", "messages": messages}).encode())
    assert caught.value.param == param
    with pytest.raises(MalformedRequest) as by_value:
        a._decode_by_value(body(messages))
    assert (by_value.value.param, by_value.value.message) == (param, caught.value.message)
