"""Chains end to end, through the OpenAI SDK and the scripted engine: a rewritten reply rolled
back, concurrent requests on one chain, and a chain that reaches its capacity."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from openai import OpenAI

from rollbus.testing.scripted import ScriptedReply
from tests.e2e.test_openai_session import TOOLS, call_text, full_render, open_session, reply, wait_for_parquet


def finalize(stack, session) -> dict:
    httpx.post(f"{stack.url}/sessions/{session['session_id']}/finalize", headers=stack.admin)
    return {row["trajectory_index"]: row for row in wait_for_parquet(stack.trajectories, session["session_id"])}


def test_a_rewritten_reply_is_rolled_back_and_kept_as_context(stack, engine, tokenizer):
    session = open_session(stack)
    client = OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    first, second, third = (reply(tokenizer, call_text("1+1")), reply(tokenizer, call_text("2+2")),
                            reply(tokenizer, "Done."))
    engine.push(first, second, third)
    messages = [{"role": "user", "content": "add things"}]
    for _ in range(2):
        message = client.chat.completions.create(model="m", messages=messages, tools=TOOLS).choices[0].message
        messages += [message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "ok"}]
    # The agent rewrites the second reply (other arguments) before going on.
    messages[3]["tool_calls"][0]["function"]["arguments"] = json.dumps({"expression": "3+3"})
    final = client.chat.completions.create(model="m", messages=messages, tools=TOOLS).choices[0].message
    assert final.content == "Done."
    messages.append(final.model_dump(exclude_none=True))

    (row,) = finalize(stack, session).values()
    inputs = [r["input_ids"] for r in engine.requests]
    kept = len(inputs[1])  # the chain before the rolled-back reply: it ends at that reply's generation prompt
    assert inputs[2][:kept] == inputs[1]  # ... then the rewritten reply, as context
    assert tokenizer.decode(inputs[2][kept:]).startswith(call_text("3+3"))
    assert row["input_ids"] == inputs[2] + third.token_ids
    sampled = [tok for tok, m in zip(row["responses"], row["response_mask"], strict=True) if m]
    assert sampled == first.token_ids + third.token_ids  # the rewritten reply is context (mask 0)
    assert tokenizer.decode(row["prompts"] + row["responses"]) + "\n" == full_render(tokenizer, messages)
    assert row["num_turns"] == 1 + 3 + 1  # user, three replies (one rewritten), +1


def test_concurrent_requests_on_one_chain_never_interleave(stack, engine, tokenizer):
    session = open_session(stack)
    client = OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    engine.push(reply(tokenizer, call_text("1+1")))
    messages = [{"role": "user", "content": "go"}]
    message = client.chat.completions.create(model="m", messages=messages, tools=TOOLS).choices[0].message
    messages += [message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "2"}]
    slow = reply(tokenizer, "slow")
    engine.push(ScriptedReply(token_ids=slow.token_ids, logprobs=slow.logprobs, delay_s=1.0),
                reply(tokenizer, "fast"))
    answers: dict[str, str] = {}

    def ask(name: str) -> None:
        completion = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        answers[name] = completion.choices[0].message.content

    threads = [threading.Thread(target=ask, args=(name,)) for name in ("a", "b")]
    threads[0].start()
    while len(engine.requests) < 2:  # the first continuation is in the engine: the chain is busy
        threading.Event().wait(0.01)
    threads[1].start()
    for thread in threads:
        thread.join(30)
    assert sorted(answers.values()) == ["fast", "slow"]
    rows = finalize(stack, session)
    assert len(rows) == 2  # the second request could not interleave: it started a chain of its own
    continued, sibling = rows[0], rows[1]
    assert continued["input_ids"][: len(engine.requests[1]["input_ids"])] == engine.requests[1]["input_ids"]
    assert sibling["prompts"] == engine.requests[2]["input_ids"]  # rendered whole, as a new chain
    assert sum(sibling["response_mask"]) == len(sibling["responses"])


@pytest.fixture
def small_stack(make_stack):
    return make_stack(max_trajectory_length=120)


def test_a_chain_at_capacity_closes_with_max_trajectory_length(small_stack, engine, tokenizer):
    stack = small_stack
    session = open_session(stack)
    client = OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    messages = [{"role": "user", "content": "tell me a long story"}]
    prompt_len = len(tokenizer.encode(tokenizer.chat_template.render(messages, add_generation_prompt=True)))
    engine.push(ScriptedReply(token_ids=tokenizer.encode("once upon a time " * 60)))
    first = client.chat.completions.create(model="m", messages=messages, max_tokens=1000)
    assert first.choices[0].finish_reason == "length"
    assert engine.requests[0]["sampling_params"]["max_new_tokens"] == 120 - prompt_len  # clamped to the room left
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
    again = client.chat.completions.create(model="m", messages=messages)
    assert again.choices[0].finish_reason == "length" and again.choices[0].message.content in (None, "")
    assert len(engine.requests) == 1  # the closed chain sent nothing more to the engine
    (row,) = finalize(stack, session).values()
    assert row["materialization_reason"] == "max_trajectory_length" and row["seq_len"] == 120
