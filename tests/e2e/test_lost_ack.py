"""End to end: a turn answered 503 because JetStream's acknowledgement of its append was lost
(the message was stored all the same) is answered from the log when the agent retries it: with
the official SDK's automatic retry (``x-stainless-retry-count``) or the same ``Idempotency-Key``.
The engine is not called again and the turn is in the log once."""

from __future__ import annotations

from collections.abc import Sequence

import httpx
import openai
import pytest

from eventlog.publisher import Appended, JetStreamLog
from schemas.errors import LogUnavailable
from schemas.events import Event, RequestReceived, TurnCompleted
from tests.e2e.test_openai_session import open_session, reply


@pytest.fixture
def lose_ack(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """The first append of a turn fails with 503 after JetStream stored it (``stored[0]`` False:
    before it did); returns the switch."""
    original = JetStreamLog.append
    stored = [True]
    left = [1]

    async def append(self: JetStreamLog, session_id: str, events: Sequence[Event], expected_last: int) -> Appended:
        if left[0] and any(isinstance(event, TurnCompleted) for event in events):
            left[0] -= 1
            if stored[0]:
                await original(self, session_id, events, expected_last)
            raise LogUnavailable("JetStream did not acknowledge the append")
        return await original(self, session_id, events, expected_last)

    monkeypatch.setattr(JetStreamLog, "append", append)
    return stored


def recorded(stack, session_id: str) -> tuple[int, int]:
    events = stack.events(session_id)
    return (sum(isinstance(e, RequestReceived) for e in events), sum(isinstance(e, TurnCompleted) for e in events))


def test_the_sdks_retry_gets_the_stored_turn(stack, engine, tokenizer, lose_ack) -> None:
    session = open_session(stack)
    client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=1)
    messages = [{"role": "user", "content": "hi"}]
    engine.push(reply(tokenizer, "first"))  # a retry sampled again would find nothing queued: 500
    answered = client.chat.completions.create(model="m", messages=messages)
    assert answered.choices[0].message.content == "first"
    assert engine.served == 1
    assert recorded(stack, session["session_id"]) == (1, 1)

    messages += [answered.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
    engine.push(reply(tokenizer, "second"))
    assert client.chat.completions.create(model="m", messages=messages).choices[0].message.content == "second"


def test_a_retry_with_the_same_idempotency_key_gets_the_stored_turn(stack, engine, tokenizer, lose_ack) -> None:
    session = open_session(stack)
    url = f"{session['base_url']}/chat/completions"
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    headers = {"Authorization": f"Bearer {session['api_key']}", "Idempotency-Key": "turn-1"}
    engine.push(reply(tokenizer, "first"), reply(tokenizer, "sampled again"))
    failed = httpx.post(url, json=body, headers=headers)
    assert failed.status_code == 503 and failed.json()["error"]["code"] == "log_unavailable"

    retried = httpx.post(url, json=body, headers=headers)
    assert retried.status_code == 200, retried.text
    assert retried.json()["choices"][0]["message"]["content"] == "first"
    assert engine.served == 1
    assert recorded(stack, session["session_id"]) == (1, 1)


def test_a_turn_that_was_not_stored_runs_again(stack, engine, tokenizer, lose_ack) -> None:
    lose_ack[0] = False
    session = open_session(stack)
    client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=1)
    engine.push(reply(tokenizer, "lost"), reply(tokenizer, "again"))
    answered = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert answered.choices[0].message.content == "again"
    assert engine.served == 2
    assert recorded(stack, session["session_id"]) == (1, 1)
