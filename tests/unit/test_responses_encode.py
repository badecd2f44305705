"""The Responses API adapter's answers, pure: the response object, and the streamed events, fed to
the official SDK's own stream accumulator (what ``client.responses.stream()`` runs)."""

import json
from typing import Any

import pytest
from openai._models import construct_type
from openai._types import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from edge.chat.conversation import Conversation, TurnOutcome
from edge.chat.deltas import ContentDelta, ReasoningDelta, StreamFinished, StreamStarted, ToolCallReady
from edge.wires.reasoning_refs import ReasoningRefs, stack_key
from edge.wires.responses import ResponsesWire
from schemas.errors import EngineUnavailable, MalformedRequest
from schemas.events import ToolCall

REFS = ReasoningRefs(stack_key("admin"))
WIRE = ResponsesWire(REFS)
SESSION = "ab" * 16
TOOLS = [{"type": "function", "name": "calc", "parameters": {"type": "object"}},
         {"type": "namespace", "name": "crm", "description": "CRM.", "tools": [{"type": "function", "name": "find"}]},
         {"type": "web_search"}]
CALLS = (ToolCall(id="call_2_0", name="calc", arguments='{"x": 1}'), ToolCall(id="call_2_1", name="crm.find",
                                                                                arguments="{}"))
THINK = ["<think>", "\nhm", "m\n", "</think>", "\n\nHe", "llo"]  # each token's text


def conversation(**body: Any) -> Conversation:
    return WIRE.decode(json.dumps({"model": "m", "input": "hi", "tools": TOOLS, **body}).encode())


def outcome(**fields: Any) -> TurnOutcome:
    base = {"session_id": SESSION, "request_no": 2, "content": "Hello", "reasoning": "hmm", "tool_calls": CALLS,
            "finish_reason": "tool_calls", "prompt_tokens": 10, "completion_tokens": 6, "created": 5,
            "token_ids": tuple(range(6)), "logprobs": (-0.5,) * 6}
    return TurnOutcome(**{**base, **fields})


def token_text(ids: Any) -> list[str]:
    return [THINK[i] for i in ids]


def encode(result: TurnOutcome, **body: Any) -> dict[str, Any]:
    return json.loads(WIRE.encode(result, conversation(**body), token_text))


def test_the_response_object_holds_reasoning_message_and_calls_with_derived_ids():
    body = encode(outcome(), include=["reasoning.encrypted_content"], reasoning={"summary": "auto"},
                  instructions="Be brief.", temperature=0.5, metadata={"a": "b"})
    assert body["id"] == f"resp_{SESSION}_2" and body["object"] == "response" and body["status"] == "completed"
    assert body["incomplete_details"] is None and body["created_at"] == 5 and body["model"] == "m"
    assert body["instructions"] == "Be brief." and body["temperature"] == 0.5 and body["metadata"] == {"a": "b"}
    assert body["tools"] == TOOLS and body["tool_choice"] == "auto" and body["store"] is True
    reasoning, message, calc, find = body["output"]
    assert reasoning == {"type": "reasoning", "id": "rs_abababababab_2", "summary": [
        {"type": "summary_text", "text": "hmm"}], "content": [{"type": "reasoning_text", "text": "hmm"}],
        "encrypted_content": REFS.issue(SESSION, 2), "status": "completed"}
    assert message == {"type": "message", "id": "msg_abababababab_2", "status": "completed", "role": "assistant",
                       "content": [{"type": "output_text", "text": "Hello", "annotations": [], "logprobs": []}]}
    assert calc == {"type": "function_call", "id": "fc_abababababab_2_0", "call_id": "call_2_0", "name": "calc",
                    "arguments": '{"x": 1}', "status": "completed"}
    assert find["name"] == "find" and find["namespace"] == "crm" and find["call_id"] == "call_2_1"
    assert body["usage"] == {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 6,
                             "output_tokens_details": {"reasoning_tokens": 4}, "total_tokens": 16}


def test_without_asking_there_is_no_reference_nor_summary_and_a_cut_reply_is_incomplete():
    body = encode(outcome(tool_calls=(), finish_reason="length"))
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    reasoning, message = body["output"]
    assert reasoning["encrypted_content"] is None and reasoning["summary"] == []
    assert message["status"] == "incomplete"
    # A reply with neither text nor calls still has its (empty) message: the agent sends it back.
    empty = encode(outcome(content="", reasoning=None, tool_calls=()))["output"]
    assert [(item["type"], item["content"][0]["text"]) for item in empty] == [("message", "")]
    assert encode(outcome(content="", reasoning=None))["output"][0]["type"] == "function_call"


def test_logprobs_when_included():
    body = encode(outcome(reasoning=None, tool_calls=()), include=["message.output_text.logprobs"])
    logprobs = body["output"][0]["content"][0]["logprobs"]
    assert [(p["token"], p["logprob"]) for p in logprobs] == [(t, -0.5) for t in THINK]


def test_errors_are_openai_shaped():
    assert json.loads(WIRE.encode_error(MalformedRequest("bad", param="input"))) == {"error": {
        "message": "bad", "type": "invalid_request_error", "param": "input", "code": "invalid_request_error"}}


STARTED = StreamStarted(session_id=SESSION, request_no=2, created=5, prompt_tokens=10)
STREAM = [STARTED, ReasoningDelta("h"), ReasoningDelta("mm"), ContentDelta("He"), ContentDelta("llo"),
          ToolCallReady(0, CALLS[0]), ToolCallReady(1, CALLS[1]), StreamFinished(outcome())]


def _events(data: bytes) -> list[dict[str, Any]]:
    events = []
    for block in data.decode().split("\n\n"):
        if block:
            name, payload = block.split("\n")
            event = json.loads(payload.removeprefix("data: "))
            assert name == f"event: {event['type']}"
            events.append(event)
    return events


def _accumulated(events: list[dict[str, Any]]) -> Any:
    """What the SDK's ``responses.stream()`` helper makes of the events (it raises on any it cannot take)."""
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=omit, text_format=omit)
    for event in events:
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=event))  # type: ignore[arg-type]
    return state._completed_response


@pytest.mark.parametrize("summary", [None, "auto"])
def test_a_streamed_turn_is_the_full_event_sequence_the_sdk_accumulates(summary):
    options = {"reasoning": {"summary": summary}} if summary else {}
    encoder = WIRE.stream(conversation(stream=True, **options), token_text)
    events = _events(b"".join(encoder.event(e) for e in STREAM))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    reasoning = (["response.reasoning_summary_part.added", "response.reasoning_summary_text.delta",
                  "response.reasoning_summary_text.delta", "response.reasoning_summary_text.done",
                  "response.reasoning_summary_part.done"] if summary else
                 ["response.reasoning_text.delta", "response.reasoning_text.delta", "response.reasoning_text.done"])
    call = ["response.output_item.added", "response.function_call_arguments.delta",
            "response.function_call_arguments.done", "response.output_item.done"]
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", *reasoning,
        "response.output_item.done", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", *call, *call, "response.completed"]
    assert [e.get("output_index") for e in events if e["type"] == "response.output_item.added"] == [0, 1, 2, 3]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    plain = encode(outcome(), **options)
    assert events[-1]["response"] == plain
    assert [e["item"] for e in events if e["type"] == "response.output_item.done"] == plain["output"]
    final = _accumulated(events)
    assert final.id == plain["id"] and final.output_text == "Hello"
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call", "function_call"]


def test_a_stream_without_text_still_sends_the_message_and_a_cut_one_ends_incomplete():
    encoder = WIRE.stream(conversation(stream=True), token_text)
    cut = outcome(content="", reasoning=None, tool_calls=(), finish_reason="length")
    events = _events(encoder.event(STARTED) + encoder.event(StreamFinished(cut)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete"]
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [e["item"]["status"] for e in events if e["type"] == "response.output_item.done"] == ["incomplete"]
    assert _accumulated(events) is None  # taken; the SDK's helper keeps a final response on completed only


def test_a_failure_mid_stream_is_response_failed():
    encoder = WIRE.stream(conversation(stream=True), token_text)
    sent = encoder.event(STARTED) + encoder.event(ContentDelta("x")) + encoder.error(EngineUnavailable("down"))
    events = _events(sent)
    failed = events[-1]
    assert failed["type"] == "response.failed" and failed["sequence_number"] == len(events) - 1
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "engine_unavailable", "message": "down"}
