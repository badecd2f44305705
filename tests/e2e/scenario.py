"""One tool-using conversation, driven through the official SDKs of both wires, plain or
streamed, sync or async; and the token-by-token check of the record it leaves."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import numpy as np

from edge.chat.conversation import Conversation, template_message, template_tools
from edge.wires.anthropic import decode_request as decode_anthropic
from edge.wires.anthropic import neutral_messages
from edge.wires.openai import decode_request as decode_openai
from rollbus.testing.scripted import ScriptedReply
from schemas.wire_anthropic import MessagesRequest
from tests.e2e.test_openai_session import TOOLS, _expected_mask, call_text, reply, wait_for_parquet

SYSTEM = "Use the calculator."
QUESTION = "What is 6*7? ünïcödé ✓"
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]
EXPRESSIONS = ("6*7", "42+0")
ANSWER = "The answer is 42, computed step by step with the calculator tool."
THOUGHT = "The user wants 6*7. I will use the tool."


def scripted(tokenizer, *, reasoning: bool = False) -> list[ScriptedReply]:
    """Two tool calls, then a long answer (many stream chunks); optionally each turn thinks first."""
    think = f"<think>\n{THOUGHT}\n</think>\n\n" if reasoning else ""
    return [reply(tokenizer, think + "Let me compute.\n" + call_text(EXPRESSIONS[0])),
            reply(tokenizer, think + call_text(EXPRESSIONS[1])),
            reply(tokenizer, think + ANSWER)]


# --- OpenAI ----------------------------------------------------------------------------


def openai_start() -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]


def openai_accumulate(chunks: list[Any]) -> tuple[dict[str, Any], str, list[str]]:
    """A streamed reply as an assistant message, its finish reason, and its content deltas."""
    content, reasoning, deltas = [], [], []
    calls: dict[int, dict[str, Any]] = {}
    finish = ""
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                content.append(delta.content)
                deltas.append(delta.content)
            if (extra := (delta.model_extra or {}).get("reasoning_content")) is not None:
                reasoning.append(extra)
            for call in delta.tool_calls or ():
                entry = calls.setdefault(call.index, {"id": call.id, "type": "function",
                                                      "function": {"name": "", "arguments": ""}})
                entry["function"]["name"] += call.function.name or ""
                entry["function"]["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content) or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    return message, finish, deltas


def _openai_step(messages: list[dict], message: dict, finish: str, turn: int) -> None:
    if turn < len(EXPRESSIONS):
        assert finish == "tool_calls", finish
        (call,) = message["tool_calls"]
        assert json.loads(call["function"]["arguments"]) == {"expression": EXPRESSIONS[turn]}
    else:
        assert finish == "stop" and message["content"] == ANSWER
    messages.append({k: v for k, v in message.items() if v is not None})
    if turn < len(EXPRESSIONS):
        messages.append({"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "42"})


def _plain_message(completion: Any) -> tuple[dict[str, Any], str]:
    choice = completion.choices[0]
    return choice.message.model_dump(exclude_none=True), choice.finish_reason


def run_openai(client: Any, *, stream: bool) -> list[dict[str, Any]]:
    messages = openai_start()
    for turn in range(3):
        if stream:
            chunks = list(client.chat.completions.create(model="m", messages=messages, tools=TOOLS, stream=True,
                                                         stream_options={"include_usage": True}))
            assert chunks[-1].usage is not None and chunks[-1].choices == []
            message, finish, _ = openai_accumulate(chunks)
        else:
            message, finish = _plain_message(client.chat.completions.create(model="m", messages=messages,
                                                                            tools=TOOLS))
        _openai_step(messages, message, finish, turn)
    return messages


async def run_openai_async(client: Any, *, stream: bool) -> list[dict[str, Any]]:
    messages = openai_start()
    for turn in range(3):
        if stream:
            chunks = [c async for c in await client.chat.completions.create(model="m", messages=messages,
                                                                            tools=TOOLS, stream=True)]
            message, finish, _ = openai_accumulate(chunks)
        else:
            message, finish = _plain_message(await client.chat.completions.create(model="m", messages=messages,
                                                                                  tools=TOOLS))
        _openai_step(messages, message, finish, turn)
    return messages


# --- Anthropic -------------------------------------------------------------------------


def _anthropic_step(messages: list[dict], message: Any, turn: int) -> None:
    blocks = [b.model_dump(exclude_none=True) for b in message.content]
    uses = [b for b in blocks if b["type"] == "tool_use"]
    if turn < len(EXPRESSIONS):
        assert message.stop_reason == "tool_use" and [u["input"] for u in uses] == [{"expression": EXPRESSIONS[turn]}]
    else:
        assert message.stop_reason == "end_turn" and [b["text"] for b in blocks if b["type"] == "text"] == [ANSWER]
    messages.append({"role": "assistant", "content": blocks})
    if uses:
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": uses[0]["id"], "content": [{"type": "text", "text": "42"}]}]})


def _request(messages: list[dict]) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 512, "system": SYSTEM, "tools": ANTHROPIC_TOOLS, "messages": messages}


def run_anthropic(client: Any, *, stream: bool) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    for turn in range(3):
        if stream:
            with client.messages.stream(**_request(messages)) as events:
                kinds = [event.type for event in events]
                message = events.get_final_message()
            assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
        else:
            message = client.messages.create(**_request(messages))
        _anthropic_step(messages, message, turn)
    return messages


async def run_anthropic_async(client: Any, *, stream: bool) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    for turn in range(3):
        if stream:
            async with client.messages.stream(**_request(messages)) as events:
                text = [t async for t in events.text_stream]
                message = await events.get_final_message()
            assert len(text) > 1 or turn < len(EXPRESSIONS)
        else:
            message = await client.messages.create(**_request(messages))
        _anthropic_step(messages, message, turn)
    return messages


# --- records -----------------------------------------------------------------------------


def render(tokenizer, conversation: Conversation) -> str:
    return tokenizer.chat_template.render([template_message(m) for m in conversation.messages],
                                          tools=template_tools(conversation.tools), add_generation_prompt=False)


def openai_render(tokenizer, messages: list[dict], tools: list[dict] | None = TOOLS) -> str:
    return render(tokenizer, decode_openai(json.dumps({"messages": messages, "tools": tools}).encode()))


def anthropic_render(tokenizer, messages: list[dict]) -> str:
    """(The whole conversation ends with an assistant turn, which a request may not.)"""
    request = msgspec.json.decode(json.dumps(_request(messages)), type=MessagesRequest)
    tools = decode_anthropic(json.dumps(_request(messages[:1])).encode()).tools
    return render(tokenizer, Conversation(messages=neutral_messages(request), tools=tools))


def read_row(stack, session_id: str) -> dict[str, Any]:
    (row,) = wait_for_parquet(stack.trajectories, session_id)
    return row


def check_row(row: dict[str, Any], requests: list[dict], replies: list[ScriptedReply], tokenizer,
              rendered: str | None) -> None:
    """The record holds exactly the engine's prompt, its sampled tokens (mask 1, their log
    probs) and the continuation tokens (mask 0); decoded, it is the template's render."""
    inputs = [r["input_ids"] for r in requests]
    assert row["prompts"] == inputs[0] and row["input_ids"] == row["prompts"] + row["responses"]
    for later in inputs[1:]:
        assert later == row["input_ids"][: len(later)]
    mask, logprobs = _expected_mask(inputs, [r.token_ids for r in replies])
    assert row["response_mask"] == mask
    np.testing.assert_allclose(row["rollout_log_probs"], logprobs, rtol=1e-6)
    sampled = [t for t, m in zip(row["responses"], mask, strict=True) if m]
    assert sampled == [t for r in replies for t in r.token_ids]
    if rendered is not None:
        assert tokenizer.decode(row["input_ids"]) + "\n" == rendered


TRAINING_FIELDS = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask",
                   "loss_mask", "rm_scores", "rollout_log_probs", "num_turns", "prompt_len", "response_len")
