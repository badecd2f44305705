"""End to end on the Anthropic wire: the official ``anthropic`` SDK (sync, async, streaming)
drives tool-using sessions checked token by token; the same conversation through the
OpenAI SDK leaves the identical record; errors come in Anthropic's shape."""

from __future__ import annotations

import anthropic
import httpx
import pytest
from openai import OpenAI

from rollbus.testing.scripted import ScriptedReply
from tests.e2e import scenario
from tests.e2e.test_openai_session import open_session, reply


def finalize(stack, session) -> dict:
    return httpx.post(f"{stack.url}/sessions/{session['session_id']}/finalize", headers=stack.admin).json()


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_anthropic_sdk_session_becomes_an_exact_record(stack, engine, tokenizer, stream):
    replies = scenario.scripted(tokenizer)
    engine.push(*replies)
    session = open_session(stack, uid="claude", metadata={"agent_name": "calc"})
    client = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=session["api_key"], max_retries=0)
    messages = scenario.run_anthropic(client, stream=stream)
    assert finalize(stack, session)["trajectories"] == 1
    row = scenario.read_row(stack, session["session_id"])
    assert row["num_turns"] == 5 and row["key"] == "claude_0_0"
    scenario.check_row(row, engine.requests, replies, tokenizer, scenario.anthropic_render(tokenizer, messages))


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_async_anthropic_sdk_session_becomes_an_exact_record(stack, engine, tokenizer, stream):
    replies = scenario.scripted(tokenizer)
    engine.push(*replies)
    session = open_session(stack)
    client = anthropic.AsyncAnthropic(base_url=session["anthropic_base_url"], auth_token=session["api_key"],
                                      max_retries=0)  # the key as a bearer token this time
    messages = await scenario.run_anthropic_async(client, stream=stream)
    await client.close()
    assert finalize(stack, session)["trajectories"] == 1
    scenario.check_row(scenario.read_row(stack, session["session_id"]), engine.requests, replies, tokenizer,
                       scenario.anthropic_render(tokenizer, messages))


def test_the_same_conversation_on_both_wires_leaves_the_identical_record(stack, engine, tokenizer):
    rows, renders = [], []
    for wire in ("openai", "anthropic"):
        engine.push(*scenario.scripted(tokenizer))
        session = open_session(stack, uid=wire)
        if wire == "openai":
            client = OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
            renders.append(scenario.openai_render(tokenizer, scenario.run_openai(client, stream=False)))
        else:
            client = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=session["api_key"],
                                         max_retries=0)
            renders.append(scenario.anthropic_render(tokenizer, scenario.run_anthropic(client, stream=True)))
        finalize(stack, session)
        rows.append(scenario.read_row(stack, session["session_id"]))
    assert renders[0] == renders[1]
    for field in scenario.TRAINING_FIELDS:
        assert rows[0][field] == rows[1][field], field
    assert [r["input_ids"] for r in engine.requests[:3]] == [r["input_ids"] for r in engine.requests[3:]]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_reasoning_is_a_thinking_block_and_its_tokens_stay_in_the_record(stack, engine, tokenizer, stream):
    replies = scenario.scripted(tokenizer, reasoning=True)
    engine.push(*replies)
    session = open_session(stack)
    client = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=session["api_key"], max_retries=0)
    messages = scenario.run_anthropic(client, stream=stream)
    for message in messages[1::2]:  # the assistant turns
        assert message["role"] == "assistant"
        assert message["content"][0] == {"type": "thinking", "thinking": scenario.THOUGHT, "signature": ""}
    finalize(stack, session)
    # The think tokens are in the record as sampled (the Qwen2.5 template does not render reasoning).
    scenario.check_row(scenario.read_row(stack, session["session_id"]), engine.requests, replies, tokenizer, None)


def test_stop_sequences_and_max_tokens_map_to_stop_reasons(stack, engine, tokenizer):
    session = open_session(stack)
    client = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=session["api_key"], max_retries=0)
    engine.push(reply(tokenizer, "one two three"))
    cut = client.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "count"}])
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2
    assert engine.requests[-1]["sampling_params"]["max_new_tokens"] == 2
    engine.push(reply(tokenizer, "alpha STOP"))
    stopped = client.messages.create(model="m", max_tokens=50, stop_sequences=["STOP"],
                                     messages=[{"role": "user", "content": "go"}])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "STOP")
    assert engine.requests[-1]["sampling_params"]["stop"] == ["STOP"]


def _post(session, body, **headers) -> httpx.Response:
    url = f"{session['anthropic_base_url']}/v1/messages"
    return httpx.post(url, headers={"x-api-key": session["api_key"], **headers}, timeout=30,
                      **({"content": body} if isinstance(body, bytes) else {"json": body}))


GOOD = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}


BAD = [
    (b"{not json", "JSON"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({**GOOD, "messages": []}, "messages"),
    ({**GOOD, "max_tokens": 0}, "max_tokens"),
    ({**GOOD, "temperature": -1}, "temperature"),
    ({**GOOD, "messages": [{"role": "user", "content": [IMAGE]}]},
     "messages[0].content[0].source.data: this edge has no image processor"),  # (a stack without --processor)
    ({**GOOD, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "messages[0].content[0].type"),
    ({**GOOD, "tool_choice": {"type": "any"}}, "tool_choice: tool_choice forces a tool call"),  # no tools
    ({**GOOD, "tool_choice": {"type": "some"}}, "tool_choice.type"),
    ({**GOOD, "tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0].type"),
    ({**GOOD, "messages": [*GOOD["messages"], {"role": "assistant", "content": "Sure"}]}, "prefill"),
]


def test_bad_requests_are_anthropic_400s_naming_the_field(stack, engine):
    session = open_session(stack)
    for body, named in BAD:
        response = _post(session, body)
        assert response.status_code == 400, response.text
        payload = response.json()
        assert payload["type"] == "error" and set(payload["error"]) == {"type", "message"}
        assert payload["error"]["type"] == "invalid_request_error" and named in payload["error"]["message"]
    assert engine.requests == []  # nothing reached the engine


def test_errors_come_in_anthropic_shape_through_the_sdk(stack, engine, tokenizer):
    session = open_session(stack)
    base = session["anthropic_base_url"]

    def client(key: str, url: str = base) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)

    cases = [
        (lambda: client("wrong").messages.create(**GOOD), anthropic.AuthenticationError, "authentication_error"),
        (lambda: client(session["api_key"], base.replace(session["session_id"], "f" * 32)).messages.create(**GOOD),
         anthropic.AuthenticationError, "authentication_error"),  # unknown: as a wrong key (no existence oracle)
    ]
    for call, kind, error_type in cases:
        with pytest.raises(kind) as caught:
            call()
        assert caught.value.body == {"type": "error", "error": {"type": error_type, "message": caught.value.body[
            "error"]["message"]}}
    assert _post(session, GOOD, **{"x-api-key": ""}).json()["error"]["type"] == "authentication_error"
    too_large = _post(session, b"x" * (16 * 1024 * 1024 + 1))
    assert too_large.status_code == 413 and too_large.json()["error"]["type"] == "request_too_large"

    engine.push(reply(tokenizer, "hello"))
    assert client(session["api_key"]).messages.create(**GOOD).content[0].text == "hello"
    finalize(stack, session)
    with pytest.raises(anthropic.ConflictError) as closed:
        client(session["api_key"]).messages.create(**GOOD)
    assert closed.value.status_code == 409 and closed.value.body["error"]["type"] == "invalid_request_error"
    assert "finalized" in closed.value.body["error"]["message"]


def test_an_engine_failure_mid_stream_is_an_error_event(stack, engine, tokenizer):
    session = open_session(stack)
    client = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=session["api_key"], max_retries=0)
    engine.push(ScriptedReply(token_ids=tokenizer.encode("a b c d e f g h"), fault="engine_error"))
    seen = []
    with pytest.raises(anthropic.APIStatusError, match="scripted engine error") as caught, \
            client.messages.stream(**GOOD) as events:
        seen.extend(event.type for event in events)
    assert caught.value.body["error"]["type"] == "api_error"
    assert seen[:2] == ["message_start", "content_block_start"] and "message_stop" not in seen
    engine.push(reply(tokenizer, "ok"))
    with client.messages.stream(**GOOD) as events:
        assert events.get_final_message().content[0].text == "ok"
    summary = httpx.get(f"{stack.url}/sessions/{session['session_id']}", headers=stack.admin).json()
    assert summary["turns"] == 1
