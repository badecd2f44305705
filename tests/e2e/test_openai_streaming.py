"""End to end on the OpenAI wire: streaming (sync and async SDKs), reasoning, log probs,
failures mid-stream, and a client that leaves mid-stream, checked token by token."""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from rollbus.testing.scripted import ScriptedReply, default_logprobs
from schemas.events import EngineFailed, TurnAbandoned
from tests.e2e import scenario
from tests.e2e.test_openai_session import open_session, reply


def client_for(session) -> OpenAI:
    return OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)


def finalize(stack, session) -> None:
    httpx.post(f"{stack.url}/sessions/{session['session_id']}/finalize", headers=stack.admin)


def test_streamed_session_becomes_an_exact_record(stack, engine, tokenizer):
    replies = scenario.scripted(tokenizer)
    engine.push(*replies)
    session = open_session(stack)
    messages = scenario.run_openai(client_for(session), stream=True)
    finalize(stack, session)
    scenario.check_row(scenario.read_row(stack, session["session_id"]), engine.requests, replies, tokenizer,
                       scenario.openai_render(tokenizer, messages))
    assert all(r["stream"] for r in engine.requests)  # the engine streamed too


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_async_openai_sdk_session_becomes_an_exact_record(stack, engine, tokenizer, stream):
    replies = scenario.scripted(tokenizer)
    engine.push(*replies)
    session = open_session(stack)
    client = AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    messages = await scenario.run_openai_async(client, stream=stream)
    await client.close()
    finalize(stack, session)
    scenario.check_row(scenario.read_row(stack, session["session_id"]), engine.requests, replies, tokenizer,
                       scenario.openai_render(tokenizer, messages))


def test_deltas_arrive_as_the_engine_samples_and_never_show_tool_markup(stack, engine, tokenizer):
    replies = scenario.scripted(tokenizer)
    engine.push(*replies)
    client = client_for(open_session(stack))
    messages = scenario.openai_start()
    for turn, scripted in enumerate(replies):
        chunks = list(client.chat.completions.create(model="m", messages=messages, tools=scenario.TOOLS,
                                                     stream=True))
        message, finish, deltas = scenario.openai_accumulate(chunks)
        assert not any("<tool" in d or "</tool" in d for d in deltas)
        if turn == 2:  # the answer came in pieces, about one per engine chunk of 4 tokens
            assert len(deltas) >= len(scripted.token_ids) // 4 - 1 and "".join(deltas) == scenario.ANSWER
        else:
            (call,) = message["tool_calls"]
            assert call["id"] == f"call_{turn + 1}_0" and call["function"]["name"] == "calculator"
        scenario._openai_step(messages, message, finish, turn)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_reasoning_is_reasoning_content_and_its_tokens_stay_in_the_record(stack, engine, tokenizer, stream):
    replies = scenario.scripted(tokenizer, reasoning=True)
    engine.push(*replies)
    session = open_session(stack)
    messages = scenario.run_openai(client_for(session), stream=stream)
    assistant = [m for m in messages if m["role"] == "assistant"]
    assert [m["reasoning_content"] for m in assistant] == [scenario.THOUGHT] * 3
    assert assistant[0]["content"] == "Let me compute." and assistant[2]["content"] == scenario.ANSWER
    finalize(stack, session)
    scenario.check_row(scenario.read_row(stack, session["session_id"]), engine.requests, replies, tokenizer, None)


def test_streamed_log_probs_and_usage(stack, engine, tokenizer):
    engine.push(reply(tokenizer, "hello there"))
    chunks = list(client_for(open_session(stack)).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True, logprobs=True,
        stream_options={"include_usage": True}))
    finish = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
    tokens = finish.choices[0].logprobs.content
    expected = [*tokenizer.encode("hello there"), tokenizer.eos_token_id]
    assert [t.token for t in tokens] == [tokenizer.decode([i]) for i in expected]
    assert [t.logprob for t in tokens] == pytest.approx(default_logprobs(len(expected)))
    assert chunks[-1].usage.completion_tokens == len(expected)
    assert chunks[-1].usage.prompt_tokens == len(engine.requests[0]["input_ids"])


def test_engine_failures_before_and_during_a_stream(stack, engine, tokenizer):
    session = open_session(stack)
    client = client_for(session)
    messages = [{"role": "user", "content": "hi"}]
    engine.push(ScriptedReply(token_ids=[1], fault="http_503"))
    with pytest.raises(openai.InternalServerError) as down:  # before the stream: an HTTP error
        client.chat.completions.create(model="m", messages=messages, stream=True)
    assert down.value.status_code == 503 and down.value.body["code"] == "engine_unavailable"

    engine.push(ScriptedReply(token_ids=tokenizer.encode("a b c d e f g h i j"), fault="engine_error"))
    with pytest.raises(openai.APIError, match="scripted engine error"):  # during it: an error event
        list(client.chat.completions.create(model="m", messages=messages, stream=True))

    engine.push(reply(tokenizer, "fine"))
    chunks = list(client.chat.completions.create(model="m", messages=messages, stream=True))
    assert scenario.openai_accumulate(chunks)[0]["content"] == "fine"
    failed = [e for e in stack.events(session["session_id"]) if isinstance(e, EngineFailed)]
    assert [e.error for e in failed] == ["EngineUnavailable", "EngineError"]
    summary = httpx.get(f"{stack.url}/sessions/{session['session_id']}", headers=stack.admin).json()
    assert summary["turns"] == 1 and len(summary["chains"]) == 1


def _wait_for_abandoned(stack, session_id: str, timeout: float = 15.0) -> TurnAbandoned:
    deadline = time.monotonic() + timeout
    while True:
        found = [e for e in stack.events(session_id) if isinstance(e, TurnAbandoned)]
        if found:
            return found[0]
        assert time.monotonic() < deadline, "no turn_abandoned event"
        time.sleep(0.05)


def test_a_client_that_leaves_mid_stream_discards_its_turn_and_its_retry_continues_the_chain(
        stack, engine, tokenizer):
    session = open_session(stack)
    client = client_for(session)
    first, story, ending = reply(tokenizer, "Hi!"), reply(tokenizer, "Once upon a time, " * 20), reply(
        tokenizer, "The end.")
    engine.push(first)
    messages = [{"role": "user", "content": "hi"}]
    messages.append(client.chat.completions.create(model="m", messages=messages).choices[0].message.model_dump(
        exclude_none=True))
    messages.append({"role": "user", "content": "Tell me a story."})

    engine.push(ScriptedReply(token_ids=story.token_ids, chunk_delay_s=0.1))
    body = {"model": "m", "messages": messages, "stream": True}
    with httpx.stream("POST", f"{session['base_url']}/chat/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {session['api_key']}"}) as response:
        assert response.status_code == 200
        seen = [line for line in _take(response.iter_lines(), 3) if line]
    assert json.loads(seen[-1].removeprefix("data: "))["choices"][0]["delta"]["content"]  # saw text, then left

    abandoned = _wait_for_abandoned(stack, session["session_id"])
    assert abandoned.reason == "client_disconnected" and abandoned.chain == 0 and abandoned.request_no == 2
    assert 0 < abandoned.tokens_sampled < len(story.token_ids)
    assert engine.cancelled == [engine.requests[1]["rid"]]  # the engine request was aborted

    engine.push(ending)
    chunks = list(client.chat.completions.create(model="m", messages=messages, stream=True))
    final, finish, _ = scenario.openai_accumulate(chunks)
    assert finish == "stop" and final["content"] == "The end."
    assert engine.requests[2]["input_ids"] == engine.requests[1]["input_ids"]  # the same chain, same context
    messages.append(final)
    finalize(stack, session)
    row = scenario.read_row(stack, session["session_id"])
    scenario.check_row(row, [engine.requests[0], engine.requests[2]], [first, ending], tokenizer,
                       scenario.openai_render(tokenizer, messages, tools=None))


def _take(lines, count: int) -> list[str]:
    out = []
    for line in lines:
        out.append(line)
        if sum(1 for x in out if x) >= count:
            break
    return out


def test_a_prompt_with_no_room_left_streams_a_length_finish_without_sampling(stack, engine):
    session = open_session(stack)
    messages = [{"role": "user", "content": "word " * 5000}]  # past the stack's 4096-token trajectory length
    chunks = list(client_for(session).chat.completions.create(model="m", messages=messages, stream=True))
    assert [c.choices[0].finish_reason for c in chunks] == [None, "length"]
    with anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=session["api_key"],
                             max_retries=0).messages.stream(model="m", max_tokens=8, messages=messages) as events:
        message = events.get_final_message()
    assert message.stop_reason == "max_tokens" and message.content == []
    assert engine.requests == []
