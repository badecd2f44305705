"""End to end on the Responses wire: the official ``openai`` SDK's ``responses.create`` and
``responses.stream`` drive a multi-turn tool session with reasoning through a real stack, three
ways (the whole history resent, ``previous_response_id``, and ``store: false`` with encrypted
reasoning, as Codex does), and each record equals, token for token, the same conversation's
through chat completions."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from tests.e2e import scenario
from tests.e2e.test_hostile_input import openai_error
from tests.e2e.test_openai_session import TOOLS, open_session

RESPONSES_TOOLS = [{"type": "function", **tool["function"], "strict": False} for tool in TOOLS]
MODES = ["history", "previous", "unstored"]


def finalize(stack, session) -> None:
    answer = httpx.post(f"{stack.url}/sessions/{session['session_id']}/finalize", headers=stack.admin)
    assert answer.json()["trajectories"] == 1, answer.text


def _ask(client: OpenAI, stream: bool, **request: Any) -> Any:
    if not stream:
        return client.responses.create(**request)
    with client.responses.stream(**request) as events:
        kinds = [event.type for event in events]
        response = events.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds or "response.function_call_arguments.delta" in kinds
    return response


def _check_turn(response: Any, turn: int, *, encrypted: bool) -> list[dict[str, Any]]:
    """The turn's output as the items an agent sends back (the SDK's own dumps)."""
    kinds = [item.type for item in response.output]
    reasoning = response.output[0]
    assert reasoning.type == "reasoning" and reasoning.content[0].text == scenario.THOUGHT
    assert (reasoning.encrypted_content or "").startswith("rbr1.") == encrypted
    assert response.usage.output_tokens_details.reasoning_tokens > 0
    if turn < len(scenario.EXPRESSIONS):
        assert response.status == "completed" and kinds[-1] == "function_call"
        assert json.loads(response.output[-1].arguments) == {"expression": scenario.EXPRESSIONS[turn]}
    else:
        assert kinds == ["reasoning", "message"] and response.output_text == scenario.ANSWER
    items = [item.model_dump(exclude_none=True, exclude={"parsed_arguments"}) for item in response.output]
    if encrypted:  # what Codex sends back: the reference, no reasoning text
        items[0] = {key: value for key, value in items[0].items() if key not in ("content", "summary")}
    return items


def run_responses(client: OpenAI, mode: str, stream: bool) -> list[dict[str, Any]]:
    """Three turns; returns the history as items, each turn's output included."""
    items: list[dict[str, Any]] = [{"role": "user", "content": scenario.QUESTION}]
    new, previous = list(items), None
    for turn in range(3):
        request: dict[str, Any] = {"model": "m", "instructions": scenario.SYSTEM, "tools": RESPONSES_TOOLS,
                                   "input": new if mode == "previous" else items}
        if mode == "previous" and previous is not None:
            request["previous_response_id"] = previous
        if mode == "unstored":
            request.update(store=False, include=["reasoning.encrypted_content"], reasoning={"summary": "auto"},
                           parallel_tool_calls=True, prompt_cache_key="k",
                           extra_body={"client_metadata": {"turn": str(turn)}})  # Codex sends it
        response = _ask(client, stream, **request)
        output = _check_turn(response, turn, encrypted=mode == "unstored")
        new = [{"type": "function_call_output", "call_id": item["call_id"], "output": "42"}
               for item in output if item["type"] == "function_call"]
        items += output + new
        previous = response.id
    return items


def chat_reference(stack, engine, tokenizer) -> dict[str, Any]:
    """The same conversation through chat completions: its record."""
    engine.push(*scenario.scripted(tokenizer, reasoning=True))
    session = open_session(stack, uid="chat")
    scenario.run_openai(OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0),
                        stream=False)
    finalize(stack, session)
    return scenario.read_row(stack, session["session_id"])


@pytest.mark.parametrize("mode", MODES)
def test_a_responses_session_leaves_the_record_chat_completions_leaves(stack, engine, tokenizer, mode):
    reference = chat_reference(stack, engine, tokenizer)
    chat_inputs = [r["input_ids"] for r in engine.requests]
    for stream in (False, True):
        replies = scenario.scripted(tokenizer, reasoning=True)
        engine.push(*replies)
        session = open_session(stack, uid=f"{mode}{int(stream)}")
        client = OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
        run_responses(client, mode, stream)
        finalize(stack, session)
        row = scenario.read_row(stack, session["session_id"])
        requests = engine.requests[-3:]
        scenario.check_row(row, requests, replies, tokenizer, None)
        assert [r["input_ids"] for r in requests] == chat_inputs[:3]
        for field in scenario.TRAINING_FIELDS:
            assert row[field] == reference[field], (mode, stream, field)


def test_a_stored_response_is_retrieved_and_ids_of_another_session_are_refused(stack, engine, tokenizer):
    engine.push(*scenario.scripted(tokenizer, reasoning=True)[:2])
    first, second = open_session(stack), open_session(stack)
    client = OpenAI(base_url=first["base_url"], api_key=first["api_key"], max_retries=0)
    other = OpenAI(base_url=second["base_url"], api_key=second["api_key"], max_retries=0)
    stored = client.responses.create(model="m", input="hi", tools=RESPONSES_TOOLS)
    assert client.responses.retrieve(stored.id).model_dump() == stored.model_dump()
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(stored.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model="m", input="more", previous_response_id=stored.id)
    unstored = other.responses.create(model="m", input="hi", tools=RESPONSES_TOOLS, store=False,
                                      include=["reasoning.encrypted_content"])
    reasoning = unstored.output[0].model_dump(exclude_none=True)
    history = [{"role": "user", "content": "hi"}, reasoning, {"role": "user", "content": "go on"}]
    with pytest.raises(openai.BadRequestError, match="another session"):
        client.responses.create(model="m", input=history)
    forged = {**reasoning, "encrypted_content": reasoning["encrypted_content"].replace(".1.", ".2.")}
    with pytest.raises(openai.BadRequestError, match="not issued by this rollbus stack"):
        other.responses.create(model="m", input=[{"role": "user", "content": "hi"}, forged])
    assert len(engine.requests) == 2  # nothing refused reached the engine


def test_hostile_input_on_the_responses_routes_gets_openai_shaped_4xx(stack, engine, tokenizer):
    session = open_session(stack)
    url, auth = f"{session['base_url']}/responses", {"Authorization": f"Bearer {session['api_key']}"}
    deep = b"[" * 1000 + b"]" * 1000
    cases = [
        (httpx.post(url, content=b'{"model": "m", "input": ' + deep + b"}", headers=auth), 400, None),
        (httpx.post(url, content=b'{"model": "m", "input": [' + deep + b"]}", headers=auth), 400, None),
        (httpx.post(url, content=b'{"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"a": '
                    + b"[" * 70 + b"]" * 70 + b"}}]}", headers=auth), 400, "tools[0].parameters"),
        (httpx.post(url, json={"model": "m", "input": "hi", "max_output_tokens": 2**64}, headers=auth), 400, None),
        (httpx.post(url, json={"model": "m", "input": [{"role": "user", "content": "hi"}, {
            "type": "function_call", "call_id": "c", "name": "f", "arguments": "[" * 500 + "]" * 500}]}, headers=auth),
         400, "input[1].arguments"),
        (httpx.post(url, json={"model": "m", "input": "hi"}), 401, None),
        (httpx.get(url, headers=auth), 405, None),
        (httpx.get(f"{url}/resp_nope", headers=auth), 404, "response_id"),
        (httpx.get(f"{url}/resp_{session['session_id']}_1", headers=auth), 404, "response_id"),
        (httpx.get(f"{url}/resp_{session['session_id']}_1"), 401, None),
        (httpx.delete(f"{url}/resp_{session['session_id']}_1", headers=auth), 405, None),
    ]
    for response, status, param in cases:
        error = openai_error(response, status, param)
        assert error["message"], response.text
    assert engine.requests == []
