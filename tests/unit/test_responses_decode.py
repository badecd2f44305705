"""The Responses API adapter's decoding, pure: input items and tools into the neutral messages and
tool specs the chat wire gives for the same conversation, what it refuses, and reasoning references."""

import json
from typing import Any

import pytest

from edge.chat.conversation import (
    Continuation,
    Conversation,
    Message,
    NamedTool,
    OutputFormat,
    SamplingOverrides,
    ToolSpec,
)
from edge.chat.digest import prefix_digests, tools_digest
from edge.wires.openai import OpenAIWire
from edge.wires.reasoning_refs import ReasoningRefs, stack_key
from edge.wires.responses import ResponsesWire, parse_response_id
from schemas.errors import MalformedRequest, ResponseNotFound
from schemas.events import ToolCall

REFS = ReasoningRefs(stack_key("admin"))
WIRE = ResponsesWire(REFS)
SESSION = "ab" * 16
CALC = {"type": "function", "name": "calc", "description": "Add.", "strict": True,
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}


def decode(**body: Any) -> Conversation:
    return WIRE.decode(json.dumps({"model": "m", **body}).encode())


def chat(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> Conversation:
    return OpenAIWire().decode(json.dumps({"messages": messages, "tools": tools}).encode())


def call(call_id: str, name: str, arguments: str, **extra: Any) -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": arguments, **extra}


HISTORY: list[dict[str, Any]] = [
    {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
    {"role": "user", "content": "What is 1+2?"},
    {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Add them."}]},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me "},
                                                         {"type": "output_text", "text": "add."}]},
    call("call_1_0", "calc", '{"x": 1}'), call("call_1_1", "calc", '{"x": 2}'),
    {"type": "function_call_output", "call_id": "call_1_0", "output": "1"},
    {"type": "function_call_output", "call_id": "call_1_1", "output": [{"type": "input_text", "text": "2"}]},
    call("call_2_0", "calc", '{"x": 3}'),  # an assistant turn of calls alone
    {"type": "function_call_output", "call_id": "call_2_0", "output": "3"},
]
CHAT = [{"role": "system", "content": "Use tools."}, {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 1+2?"},
        {"role": "assistant", "content": "Let me add.", "reasoning_content": "Add them.", "tool_calls": [
            {"id": "call_1_0", "type": "function", "function": {"name": "calc", "arguments": '{"x": 1}'}},
            {"id": "call_1_1", "type": "function", "function": {"name": "calc", "arguments": '{"x": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1_0", "content": "1"},
        {"role": "tool", "tool_call_id": "call_1_1", "content": "2"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_2_0", "type": "function", "function": {"name": "calc", "arguments": '{"x": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_2_0", "content": "3"}]
CHAT_TOOLS = [{"type": "function", "function": {k: CALC[k] for k in ("name", "description", "parameters")}}]


def test_items_become_the_messages_and_digests_the_chat_wire_gives():
    conversation = decode(instructions="Use tools.", input=HISTORY, tools=[CALC], temperature=0.5, top_p=0.9,
                          max_output_tokens=64, stream=True, store=False, parallel_tool_calls=False,
                          reasoning={"effort": "high", "summary": "auto"}, metadata={"k": "v"}, user="u",
                          prompt_cache_key="p", client_metadata={"turn": "1"}, truncation="auto",
                          service_tier="auto", include=["reasoning.encrypted_content"],
                          text={"format": {"type": "text"}})
    expected = chat(CHAT, CHAT_TOOLS)
    assert conversation.messages == expected.messages and conversation.tools == expected.tools
    assert conversation.history_digests == expected.history_digests
    assert conversation.history_digests == tuple(d.hex() for d in prefix_digests(tools_digest(expected.tools),
                                                                                   expected.messages))
    assert conversation.sampling == SamplingOverrides(temperature=0.5, top_p=0.9, max_tokens=64)
    assert conversation.stream and not conversation.store and conversation.head == 1
    assert conversation.continues is None and conversation.refers_to is None
    options = conversation.options
    assert options.summary == "auto" and options.encrypted and not options.parallel_tool_calls
    assert options.metadata == {"k": "v"} and options.truncation == "auto"


def test_string_input_is_one_user_message_and_store_is_the_default():
    conversation = decode(input="hi")
    assert conversation.messages == (Message(role="user", content="hi"),) and conversation.store
    assert conversation.head == 0 and conversation.tool_choice == "auto"


def test_an_item_out_of_order_starts_the_next_assistant_message():
    items = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "one"},
             {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "r"}]},
             {"role": "assistant", "content": "two"}, call("c", "calc", "{}"), {"role": "assistant", "content": "3"}]
    assert decode(input=items).messages == (
        Message(role="user", content="a"), Message(role="assistant", content="one"),
        Message(role="assistant", content="two", reasoning="r", tool_calls=(ToolCall(id="c", name="calc",
                                                                                      arguments="{}"),)),
        Message(role="assistant", content="3"))


NAMESPACE = {"type": "namespace", "name": "crm", "description": "CRM tools.", "tools": [
    {"type": "function", "name": "find", "description": "Find a customer.", "parameters": {"type": "object"}},
    {"type": "function", "name": "bare"}, {"type": "custom", "name": "patch"}]}
HOSTED = [{"type": "web_search", "external_web_access": False}, {"type": "file_search", "vector_store_ids": ["v"]},
          {"type": "code_interpreter", "container": {"type": "auto"}}, {"type": "image_generation"},
          {"type": "computer_use_preview", "display_width": 1, "display_height": 1, "environment": "linux"},
          {"type": "mcp", "server_label": "s"}, {"type": "custom", "name": "apply_patch"}]


def test_namespaces_are_flattened_and_tools_rollbus_cannot_run_are_left_out():
    conversation = decode(input="hi", tools=[CALC, NAMESPACE, *HOSTED])
    assert conversation.tools == (
        ToolSpec(name="calc", description="Add.", parameters=CALC["parameters"]),
        ToolSpec(name="crm.find", description="CRM tools.\n\nFind a customer.", parameters={"type": "object"}),
        ToolSpec(name="crm.bare", description="CRM tools."))
    assert conversation.options.namespaced == {"crm.find": ("crm", "find"), "crm.bare": ("crm", "bare")}
    # A call of a namespaced function sent back is the qualified name the model wrote.
    items = [{"role": "user", "content": "a"}, call("c", "find", "{}", namespace="crm", id="fc_1"),
             {"type": "function_call_output", "call_id": "c", "output": "x", "namespace": "crm"}]
    assert decode(input=items).messages[1].tool_calls == (ToolCall(id="c", name="crm.find", arguments="{}"),)
    # Forcing auto or none is fine with hosted tools; forcing one of them is not.
    assert decode(input="hi", tools=HOSTED, tool_choice="none").tool_choice == "none"
    with pytest.raises(MalformedRequest, match="web_search") as caught:
        decode(input="hi", tools=HOSTED, tool_choice={"type": "web_search"})
    assert caught.value.param == "tool_choice"


@pytest.mark.parametrize(("body", "param"), [
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:"}]}]},
     "input[0].content[0].image_url"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]},
     "input[0].content[0].image_url"),
    ({"input": [{"role": "assistant", "content": [{"type": "input_image", "image_url": "data:"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "message", "content": "no role"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": "a"}, call("", "f", "{}")]}, "input[1].call_id"),
    ({"input": [{"role": "user", "content": "a"}, {"type": "function_call", "call_id": "c", "name": "f"}]},
     "input[1].arguments"),
    ({"input": [{"role": "user", "content": "a"}, call("c", "f", "[" * 100 + "]" * 100)]}, "input[1].arguments"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "reasoning", "summary": [{"type": "text", "text": "x"}]}]}, "input[0].summary[0].type"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "tools": [CALC], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice.name"),
    ({"input": "hi", "tools": [CALC], "tool_choice": {"type": "function"}}, "tool_choice.name"),
    ({"input": "hi", "tools": [CALC], "tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"input": "hi", "text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),
    ({"input": "hi", "prompt": {"id": "p"}}, "prompt"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "temperature": -1}, "temperature"),
    ({"input": "hi", "top_p": 0}, "top_p"),
    ({"input": "hi", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"input": "hi", "tools": [CALC, CALC]}, "tools"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f",
                                "parameters": {"a": json.loads("[" * 70 + "]" * 70)}}]}, "tools[0].parameters"),
])
def test_what_is_not_served_is_a_400_naming_the_field(body, param):
    with pytest.raises(MalformedRequest) as caught:
        decode(**body)
    assert caught.value.param == param


def test_forced_tool_choices_and_json_formats_are_decoded_for_the_constraint():
    named = decode(input="hi", tools=[CALC], tool_choice={"type": "function", "name": "calc"},
                   parallel_tool_calls=False)
    assert named.tool_choice == NamedTool(name="calc") and named.parallel_tool_calls is False
    assert decode(input="hi", tools=[CALC], tool_choice="required").tool_choice == "required"
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    shaped = decode(input="hi", text={"format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}})
    assert shaped.output_format == OutputFormat(type="json_schema", schema=schema, name="n", strict=True)
    json_object = decode(input="hi", text={"format": {"type": "json_object"}})
    assert json_object.output_format == OutputFormat(type="json_object")
    assert decode(input="hi", text={"format": {"type": "text"}}).output_format is None


def test_a_resent_history_is_decoded_from_what_follows_the_known_prefix():
    first = {"model": "m", "instructions": "Use tools.", "input": HISTORY[:2], "tools": [CALC]}
    known = WIRE.decode(json.dumps(first).encode()).known
    assert known is not None and known.count == 2
    later = json.dumps({**first, "input": HISTORY}).encode()
    incremental, full = WIRE.decode(later, known), WIRE.decode(later)
    assert incremental.messages == full.messages and incremental.history_digests == full.history_digests
    assert incremental.body_digest == full.body_digest and incremental.known.count == len(HISTORY)
    # Other instructions after the input: the known digests do not apply, decoded in full.
    moved = json.dumps({"model": "m", "input": HISTORY, "tools": [CALC], "instructions": "Other."}).encode()
    assert WIRE.decode(moved, known).messages[0] == Message(role="system", content="Other.")
    # A request that ends inside an assistant turn teaches nothing (its next items may join that turn).
    assert WIRE.decode(json.dumps({**first, "input": HISTORY[:5]}).encode()).known is None


def test_reasoning_references_round_trip_and_forgeries_are_refused():
    ref = REFS.issue(SESSION, 7)
    assert REFS.check(ref, "x") == (SESSION, 7)
    item = {"type": "reasoning", "summary": [], "encrypted_content": ref}
    conversation = decode(input=[{"role": "user", "content": "a"}, item, {"role": "assistant", "content": "b"},
                                 {"role": "user", "content": "c"}])
    assert conversation.messages[1] == Message(role="assistant", content="b", reasoning_ref=7)
    assert conversation.refers_to == SESSION
    prefix = ref.rsplit(".", 1)[0]
    forged = [f"{prefix}.{'A' * 24}", ref.replace(".7.", ".8."), ref.replace(SESSION, "cd" * 16),
              ReasoningRefs(stack_key("another stack")).issue(SESSION, 7), "gAAAAABencryptedbyopenai==", ref + "x"]
    for text in forged:
        with pytest.raises(MalformedRequest) as caught:
            decode(input=[{"role": "user", "content": "a"}, {**item, "encrypted_content": text}])
        assert caught.value.param == "input[1].encrypted_content", text
    other = ReasoningRefs(stack_key("admin")).issue("cd" * 16, 1)
    with pytest.raises(MalformedRequest, match="different sessions"):
        decode(input=[{**item}, {**item, "encrypted_content": other}])


def test_previous_response_id_names_a_session_and_a_request():
    conversation = decode(input="more", previous_response_id=f"resp_{SESSION}_3", instructions="I.")
    assert conversation.continues == Continuation(SESSION, 3) and conversation.history_digests == ()
    assert conversation.messages == (Message(role="system", content="I."), Message(role="user", content="more"))
    assert conversation.known is None
    for bad in ("resp_x", "resp_abc_1", f"resp_{SESSION}_0", f"resp_{SESSION}_1_2", "msg_1", "r" * 200):
        with pytest.raises(ResponseNotFound):
            parse_response_id(bad)
