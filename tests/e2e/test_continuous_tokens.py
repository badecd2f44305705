"""``rollbus up --tokenizer DIR`` with a chat template that strips the reasoning of earlier turns (Qwen3's
and DeepSeek-R1's way): it starts in continuous-tokens mode and says why (banner, ``/healthz``), and a
20-turn tool session through the official OpenAI SDK and the same through the official Anthropic SDK
leave identical, token-exact records: the engine's sampled tokens as generated plus the increments the
template renders for each request's new messages alone; every turn's engine input a prefix of the record."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
from openai import OpenAI

from edge.codec.conversation import template_message, template_tools
from edge.codec.openai_wire import decode_request
from edge.codec.tokenizer import Tokenizer, load_tokenizer
from rollbus.testing.scripted import ScriptedEngineServer, ScriptedReply
from tests.continuous_templates import STRIPS_REASONING, tokenizer_dir
from tests.e2e import scenario
from tests.e2e.test_cli import Up
from tests.e2e.test_openai_session import TOOLS, call_text, reply, wait_for_parquet

TURNS = 20
SYSTEM = "Count with the calculator."
QUESTION = "Add one, twenty times."
ADMIN = {"Authorization": "Bearer tok"}
EOS = "<|im_end|>"


def _nudged(turn: int) -> bool:
    """Whether the agent adds a user message after this turn's tool result (then the template strips the
    reasoning of every turn before it)."""
    return turn % 5 == 4


def _result(turn: int) -> str:
    return f"{turn + 1}"


def _replies(tokenizer: Tokenizer) -> list[ScriptedReply]:
    calls = [reply(tokenizer, f"<think>\nStep {t}: add one.\n</think>\n\n{call_text(f'{t}+1')}")
             for t in range(TURNS - 1)]
    return [*calls, reply(tokenizer, "<think>\nDone counting.\n</think>\n\nThe count is 19.")]


def _run_openai(client: OpenAI) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    for turn in range(TURNS):
        choice = client.chat.completions.create(model="m", messages=messages, tools=TOOLS).choices[0]
        message = choice.message.model_dump(exclude_none=True)
        assert message["reasoning_content"].startswith(("Step", "Done"))
        messages.append(message)
        if turn == TURNS - 1:
            assert choice.finish_reason == "stop" and message["content"] == "The count is 19."
            break
        (call,) = message["tool_calls"]
        assert choice.finish_reason == "tool_calls" and json.loads(call["function"]["arguments"]) == {
            "expression": f"{turn}+1"}
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": _result(turn)})
        if _nudged(turn):
            messages.append({"role": "user", "content": "Keep going."})
    return messages


def _run_anthropic(client: anthropic.Anthropic) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    for turn in range(TURNS):
        message = client.messages.create(model="m", max_tokens=512, system=SYSTEM, tools=scenario.ANTHROPIC_TOOLS,
                                         messages=messages)
        blocks = [b.model_dump(exclude_none=True) for b in message.content]
        assert blocks[0]["type"] == "thinking"
        messages.append({"role": "assistant", "content": blocks})
        if turn == TURNS - 1:
            assert message.stop_reason == "end_turn" and blocks[-1]["text"] == "The count is 19."
            break
        (use,) = [b for b in blocks if b["type"] == "tool_use"]
        assert message.stop_reason == "tool_use" and use["input"] == {"expression": f"{turn}+1"}
        content: list[dict[str, Any]] = [{"type": "tool_result", "tool_use_id": use["id"], "content": _result(turn)}]
        if _nudged(turn):
            content.append({"type": "text", "text": "Keep going."})
        messages.append({"role": "user", "content": content})


def _increment(turn: int) -> str:
    """What the template writes for the new messages of the request after ``turn``, alone."""
    nudge = "<|im_start|>user\nKeep going.<|im_end|>\n" if _nudged(turn) else ""
    return (f"\n<|im_start|>user\n<tool_response>\n{_result(turn)}\n</tool_response><|im_end|>\n{nudge}"
            "<|im_start|>assistant\n")


def _check_tokens(row: dict[str, Any], inputs: list[list[int]], replies: list[ScriptedReply],
                  tokenizer: Tokenizer, render: str) -> None:
    """The record is the first prompt, then each turn's sampled tokens as generated and the increment for
    the next request's new messages: each engine input is what came before it, plus one increment."""
    record: list[int] = list(inputs[0])
    for turn, sampled in enumerate(replies):
        record += sampled.token_ids
        if turn + 1 < len(inputs):
            assert inputs[turn + 1][: len(record)] == record, turn
            increment = inputs[turn + 1][len(record):]
            assert tokenizer.decode(increment) == _increment(turn), turn
            assert increment == tokenizer.encode(_increment(turn)), turn
            record += increment
    assert row["input_ids"] == record
    text = tokenizer.decode(record)
    assert all(f"<think>\nStep {t}: add one.\n</think>" in text for t in range(TURNS - 1))  # as sampled
    assert "Step 0: add one." not in render and text + "\n" != render  # the template's render strips them


def test_rollbus_up_serves_a_reasoning_stripping_template_as_continuous_tokens(tmp_path: Path) -> None:
    spec = tokenizer_dir(tmp_path / "tokenizer", STRIPS_REASONING)
    tokenizer = load_tokenizer(spec)
    data = tmp_path / "data"
    with ScriptedEngineServer() as engine:
        up = Up(data, engine.url, "--tokenizer", spec, "--max-trajectory-length", "16384")
        try:
            banner = "".join(up.lines)
            assert ("  template:     continuous tokens: not prefix-stable (tools, reasoning, parallel calls): "
                    "request 3: stored tokens + increment do not decode to the full render, at character") in banner
            health = httpx.get(f"{up.url}/healthz").json()
            assert health["status"] == "ok" and health["chat_template"]["mode"] == "continuous tokens"
            assert health["chat_template"]["reason"] in banner
            rows = []
            for wire in ("openai", "anthropic"):
                replies = _replies(tokenizer)
                engine.push(*replies)
                start = len(engine.requests)
                session = httpx.post(f"{up.url}/sessions", json={"uid": wire}, headers=ADMIN).json()
                if wire == "openai":
                    client = OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
                    render = _render(tokenizer, _run_openai(client))  # the same conversation on both wires
                else:
                    _run_anthropic(anthropic.Anthropic(base_url=session["anthropic_base_url"],
                                                       api_key=session["api_key"], max_retries=0))
                final = httpx.post(f"{up.url}/sessions/{session['session_id']}/finalize", headers=ADMIN).json()
                assert final["trajectories"] == 1, final
                (row,) = wait_for_parquet(data / "trajectories", session["session_id"], timeout=60)
                requests = engine.requests[start:]
                assert len(requests) == TURNS
                scenario.check_row(row, requests, replies, tokenizer, None)  # masks, log probs, engine prefixes
                _check_tokens(row, [r["input_ids"] for r in requests], replies, tokenizer, render)
                rows.append(row)
        finally:
            assert up.stop() == 0, "".join(up.lines)
    for field in scenario.TRAINING_FIELDS:
        assert rows[0][field] == rows[1][field], field


def _render(tokenizer: Tokenizer, messages: list[dict[str, Any]]) -> str:
    """The template's render of the whole conversation, ``messages`` on the OpenAI wire."""
    conversation = decode_request(json.dumps({"messages": messages, "tools": TOOLS}).encode())
    return tokenizer.chat_template.render([template_message(m) for m in conversation.messages],
                                          tools=template_tools(conversation.tools), add_generation_prompt=False)
