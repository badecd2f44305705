"""End to end: an engine refusing the input (SGLang's 400, e.g. a prompt longer than the
model's context) reaches the official SDKs as a 400 with the engine's message, which they do
not retry; the session stays usable."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from rollbus.testing.scripted import ScriptedReply
from schemas.events import EngineFailed
from tests.e2e.test_openai_session import open_session, reply

TOO_LONG = "The input (40000 tokens) is longer than the model's context length (32768 tokens)."


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_openai_gets_a_bad_request_with_the_engines_message(stack, engine, tokenizer, stream: bool) -> None:
    session = open_session(stack)
    client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    engine.push(ScriptedReply(token_ids=[1], fault="refused", error_message=TOO_LONG))
    with pytest.raises(openai.BadRequestError) as caught:
        created = client.chat.completions.create(model="m", messages=messages, stream=stream)  # type: ignore[call-overload]
        if stream:
            list(created)
    refused = caught.value
    assert refused.status_code == 400 and TOO_LONG in refused.message
    assert isinstance(refused.body, dict) and refused.body["type"] == "invalid_request_error"
    assert engine.served == 1
    failed = [e for e in stack.events(session["session_id"]) if isinstance(e, EngineFailed)]
    assert [e.error for e in failed] == ["EngineRefused"]

    engine.push(reply(tokenizer, "fine"))
    answered = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    assert answered.chat.completions.create(model="m", messages=messages).choices[0].message.content == "fine"


def test_anthropic_gets_a_bad_request_and_other_failures_stay_5xx(stack, engine) -> None:
    session = open_session(stack)
    client = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=session["api_key"], max_retries=0)
    request = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}
    engine.push(ScriptedReply(token_ids=[1], fault="refused", error_message=TOO_LONG))
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(**request)  # type: ignore[arg-type]
    assert TOO_LONG in caught.value.message
    assert isinstance(caught.value.body, dict) and caught.value.body["error"]["type"] == "invalid_request_error"

    engine.push(ScriptedReply(token_ids=[1], fault="http_500"))
    response = httpx.post(f"{session['anthropic_base_url']}/v1/messages", json=request,
                          headers={"x-api-key": session["api_key"], "anthropic-version": "2023-06-01"})
    assert response.status_code == 502
