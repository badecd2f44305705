"""End to end: the official OpenAI SDK drives a tool-using session; the Parquet record is
checked token by token against what the scripted engine produced."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from openai import OpenAI

from edge.chat.conversation import template_message, template_tools
from edge.wires.openai import decode_request
from materializer.dataset import session_rows
from rollbus.testing.scripted import ScriptedReply, default_logprobs

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate arithmetic.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
IM_END = 151645


def reply(tokenizer, text: str) -> ScriptedReply:
    ids = [*tokenizer.encode(text), IM_END]
    return ScriptedReply(token_ids=ids, logprobs=default_logprobs(len(ids)))


def call_text(expression: str) -> str:
    args = json.dumps({"expression": expression})
    return f'<tool_call>\n{{"name": "calculator", "arguments": {args}}}\n</tool_call>'


def open_session(stack, **body) -> dict:
    response = httpx.post(f"{stack.url}/sessions", json=body, headers=stack.admin)
    assert response.status_code == 201, response.text
    return response.json()


def wait_for_parquet(directory: Path, session_id: str, timeout: float = 30.0) -> list[dict]:
    """The session's rows, once the materializer committed them to the dataset."""
    deadline = time.monotonic() + timeout
    while not (rows := session_rows(directory, [session_id])):
        assert time.monotonic() < deadline, f"no records for {session_id}"
        time.sleep(0.05)
    return rows


def full_render(tokenizer, messages: list[dict]) -> str:
    conversation = decode_request(json.dumps({"messages": messages, "tools": TOOLS}).encode())
    return tokenizer.chat_template.render([template_message(m) for m in conversation.messages],
                                          tools=template_tools(conversation.tools), add_generation_prompt=False)


def run_agent(client: OpenAI, engine, tokenizer) -> tuple[list[dict], list[ScriptedReply]]:
    """Three turns: two tool calls, then an answer."""
    replies = [reply(tokenizer, "Let me compute.\n" + call_text("6*7")),
               reply(tokenizer, call_text("42+0")),
               reply(tokenizer, "The answer is 42.")]
    engine.push(*replies)
    messages: list[dict] = [{"role": "system", "content": "Use the calculator."},
                            {"role": "user", "content": "What is 6*7? ünïcödé ✓"}]
    for expected in ("6*7", "42+0"):
        completion = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert json.loads(call.function.arguments) == {"expression": expected}
        messages.append(choice.message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "42"})
    final = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    assert final.choices[0].finish_reason == "stop"
    assert final.choices[0].message.content == "The answer is 42."
    messages.append(final.choices[0].message.model_dump(exclude_none=True))
    return messages, replies


def test_openai_sdk_session_becomes_an_exact_record(stack, engine, tokenizer):
    session = open_session(stack, uid="prompt42", session_index=1, metadata={"agent_name": "calc"})
    client = OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    messages, scripted = run_agent(client, engine, tokenizer)

    reward = httpx.post(session["reward_url"], json={"reward_info": {"reward": 0.75, "acc": 1.0}},
                        headers={"Authorization": f"Bearer {session['api_key']}"})
    assert reward.json() == {"status": "ok"}
    final = httpx.post(f"{stack.url}/sessions/{session['session_id']}/finalize", headers=stack.admin).json()
    assert final == {"session_id": session["session_id"], "status": "finalized", "trajectories": 1}

    (row,) = wait_for_parquet(stack.trajectories, session["session_id"])
    replies = [r.token_ids for r in scripted]
    inputs = [r["input_ids"] for r in engine.requests]
    assert row["key"] == "prompt42_1_0" and row["agent_name"] == "calc" and row["num_turns"] == 5
    assert row["prompts"] == inputs[0]
    assert row["input_ids"] == row["prompts"] + row["responses"]
    # The engine saw exactly the stored tokens before each turn.
    for turn in range(1, 3):
        assert inputs[turn] == (row["prompts"] + row["responses"])[: len(inputs[turn])]
    expected_mask, expected_lp = _expected_mask(inputs, replies)
    assert row["response_mask"] == expected_mask
    assert row["loss_mask"] == expected_mask
    np.testing.assert_allclose(row["rollout_log_probs"], expected_lp, rtol=1e-6)
    assert row["rm_scores"] == [0.0] * (len(row["responses"]) - 1) + [0.75]
    assert row["attention_mask"] == [1] * row["seq_len"] and row["position_ids"] == list(range(row["seq_len"]))
    # Stored tokens decode to the chat template's render of the final conversation
    # (which ends with the turn separator "\n" the model never emits).
    decoded = tokenizer.decode(row["prompts"] + row["responses"])
    assert decoded + "\n" == full_render(tokenizer, messages)


def _expected_mask(inputs: list[list[int]], replies: list[list[int]]) -> tuple[list[int], list[float]]:
    mask: list[int] = []
    logprobs: list[float] = []
    stored = len(inputs[0])
    for turn, tokens in enumerate(replies):
        if turn:
            context = len(inputs[turn]) - stored
            mask += [0] * context
            logprobs += [0.0] * context
            stored += context
        mask += [1] * len(tokens)
        logprobs += default_logprobs(len(tokens))
        stored += len(tokens)
    return mask, logprobs


def test_bad_input_gets_openai_errors_and_leaves_the_session_usable(stack, engine, tokenizer):
    session = open_session(stack)
    url = f"{session['base_url']}/chat/completions"
    auth = {"Authorization": f"Bearer {session['api_key']}"}
    good = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

    cases = [
        (httpx.post(url, content=b"{not json", headers=auth), 400, "invalid_request_error"),
        (httpx.post(url, json={"model": "m", "messages": []}, headers=auth), 400, "invalid_request_error"),
        (httpx.post(url, json={"messages": "nope"}, headers=auth), 400, "invalid_request_error"),
        (httpx.post(url, json={**good, "n": 2}, headers=auth), 400, "invalid_request_error"),
        (httpx.post(url, json=good, headers={"Authorization": "Bearer wrong"}), 401, "authentication_error"),
        (httpx.post(url, json=good), 401, "authentication_error"),
        # another session's key on an unknown session: the same 401 (nothing said about which sessions exist)
        (httpx.post(url.replace(session["session_id"], "f" * 32), json=good, headers=auth), 401,
         "authentication_error"),
        (httpx.post(url.replace(session["session_id"], "../etc"), json=good, headers=auth), 404, None),
        (httpx.post(f"{stack.url}/sessions", json={"uid": "a_b"}, headers=stack.admin), 400, "invalid_request_error"),
        (httpx.post(f"{stack.url}/sessions", json={}), 401, "authentication_error"),
    ]
    for response, status, kind in cases:
        assert response.status_code == status, response.text
        if kind is not None:
            error = response.json()["error"]
            assert error["type"] == kind and error["message"]
            assert set(error) == {"message", "type", "param", "code"}
    assert engine.requests == []  # nothing reached the engine

    engine.push(reply(tokenizer, "hello"))
    client = OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    completion = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert completion.choices[0].message.content == "hello"

    httpx.post(f"{stack.url}/sessions/{session['session_id']}/finalize", headers=stack.admin)
    closed = httpx.post(url, json=good, headers=auth)
    assert closed.status_code == 409 and closed.json()["error"]["code"] == "session_closed"
    summary = httpx.get(f"{stack.url}/sessions/{session['session_id']}", headers=stack.admin).json()
    assert summary["status"] == "finalized" and summary["turns"] == 1 and summary["trajectories"] == 1
    (row,) = wait_for_parquet(stack.trajectories, session["session_id"])
    assert row["response_mask"] == [1] * len(row["responses"])


def test_finalize_is_idempotent_and_abort_after_finalize_conflicts(stack):
    session = open_session(stack)
    finalize = f"{stack.url}/sessions/{session['session_id']}/finalize"
    first = httpx.post(finalize, headers=stack.admin).json()
    assert first == httpx.post(finalize, headers=stack.admin).json()
    assert first["trajectories"] == 0
    abort = httpx.post(f"{stack.url}/sessions/{session['session_id']}/abort", json={"reason": "x"},
                       headers=stack.admin)
    assert abort.status_code == 409


@pytest.mark.parametrize("reward", ["high", True, None])
def test_reward_validation(stack, reward):
    session = open_session(stack)
    response = httpx.post(session["reward_url"], json={"reward_info": {"reward": reward}},
                          headers={"x-api-key": session["api_key"]})
    if reward is None:
        assert response.status_code == 200
    else:
        assert response.status_code == 400 and response.json()["error"]["param"] == "reward_info.reward"


def test_engine_failure_is_a_clear_error_recorded_for_audit_and_retryable(stack, engine, tokenizer):



    session = open_session(stack)
    client = OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    engine.push(reply(tokenizer, "first"))
    first = client.chat.completions.create(model="m", messages=messages)
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "user", "content": "again"})

    engine.push(ScriptedReply(token_ids=[1], fault="http_500"))
    response = httpx.post(f"{session['base_url']}/chat/completions", json={"model": "m", "messages": messages},
                          headers={"Authorization": f"Bearer {session['api_key']}"})
    assert response.status_code == 502 and response.json()["error"]["code"] == "engine_error"

    engine.push(reply(tokenizer, "second"))
    retried = client.chat.completions.create(model="m", messages=messages)
    assert retried.choices[0].message.content == "second"
    assert engine.requests[2]["input_ids"] == engine.requests[1]["input_ids"]  # the retry saw the same context

    kinds = [type(e).__name__ for e in stack.events(session["session_id"])]
    assert "EngineFailed" in kinds
    summary = httpx.get(f"{stack.url}/sessions/{session['session_id']}", headers=stack.admin).json()
    assert summary["turns"] == 2 and len(summary["chains"]) == 1


def test_a_client_that_leaves_mid_generation_aborts_its_turn(make_stack, engine, tokenizer):
    """The route hears the client leave through ASGI's ``http.disconnect`` (from the edge's server)."""
    stack = make_stack(disconnect_grace_s=0.2)  # aborts a plain turn 0.2 s after its client left
    session = open_session(stack)
    url = f"{session['base_url']}/chat/completions"
    auth = {"Authorization": f"Bearer {session['api_key']}"}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    slow = reply(tokenizer, "too late")
    engine.push(ScriptedReply(token_ids=slow.token_ids, logprobs=slow.logprobs, delay_s=5.0))
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json=body, headers=auth, timeout=0.5)
    deadline = time.monotonic() + 10
    while not engine.aborted and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.aborted == [engine.requests[0]["rid"]]  # the engine request was aborted

    def kinds() -> list[str]:
        return [type(e).__name__ for e in stack.events(session["session_id"])]

    deadline = time.monotonic() + 10
    while "TurnAbandoned" not in (found := kinds()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert found[-2:] == ["RequestReceived", "TurnAbandoned"]
    engine.push(reply(tokenizer, "on time"))
    again = httpx.post(url, json=body, headers=auth).json()
    assert again["choices"][0]["message"]["content"] == "on time"
    summary = httpx.get(f"{stack.url}/sessions/{session['session_id']}", headers=stack.admin).json()
    assert summary["turns"] == 1 and len(summary["chains"]) == 1
