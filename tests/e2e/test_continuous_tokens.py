"""``rollbus up --tokenizer DIR`` with a chat template that strips the reasoning of earlier turns (Qwen3's
and DeepSeek-R1's way): it starts in continuous-tokens mode and says why (banner, ``/healthz``), and a
20-turn tool session through the official OpenAI SDK and the same through the official Anthropic SDK
leave identical, token-exact records: the engine's sampled tokens as generated plus the increments the
template renders for each request's new messages alone; every turn's engine input a prefix of the record.
The same, shorter, on a stack whose template marks the last user turn, and on one whose template drops the
analysis channel of every assistant turn but the last (gpt-oss's harmony way)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import httpx
from openai import OpenAI

from edge.chat.conversation import template_message, template_tools
from edge.tokens.tokenizer import Tokenizer, load_tokenizer
from edge.wires.openai import decode_request
from rollbus.testing.scripted import ScriptedEngineServer, ScriptedReply
from tests.continuous_templates import DROPS_ANALYSIS, MARKS_LAST_USER, STRIPS_REASONING, tokenizer_dir
from tests.e2e import scenario
from tests.e2e.test_cli import Up
from tests.e2e.test_openai_session import TOOLS, call_text, reply, wait_for_parquet
from tests.stack import StackThread

SYSTEM = "Count with the calculator."
QUESTION = "Add one, twenty times."
ADMIN = {"Authorization": "Bearer tok"}


class Served:
    """A running edge to drive sessions through: its URL, admin headers and trajectories directory."""

    def __init__(self, url: str, admin: dict[str, str], trajectories: Path, engine: ScriptedEngineServer,
                 tokenizer: Tokenizer, *, turns: int, mark: str = "") -> None:
        """``mark``: what the template appends to the last user message."""
        self.url, self.admin, self.trajectories, self.engine = url, admin, trajectories, engine
        self.tokenizer, self.turns, self.mark = tokenizer, turns, mark

    def replies(self) -> list[ScriptedReply]:
        calls = [reply(self.tokenizer, f"<think>\nStep {t}: add one.\n</think>\n\n{call_text(f'{t}+1')}")
                 for t in range(self.turns - 1)]
        return [*calls, reply(self.tokenizer, f"<think>\nDone counting.\n</think>\n\n{_answer(self.turns)}")]

    def increment(self, turn: int) -> str:
        """What the template writes for the new messages of the request after ``turn``, alone."""
        nudge = f"<|im_start|>user\nKeep going.{self.mark}<|im_end|>\n" if _nudged(turn) else ""
        return (f"\n<|im_start|>user\n<tool_response>\n{_result(turn)}\n</tool_response><|im_end|>\n{nudge}"
                "<|im_start|>assistant\n")

    def both_wires(self) -> tuple[list[dict[str, Any]], str]:
        """The session through the OpenAI SDK, then through the Anthropic SDK; each record checked token by
        token. Both rows, and the template's render of the whole conversation."""
        rows, render = [], ""
        for wire in ("openai", "anthropic"):
            replies = self.replies()
            self.engine.push(*replies)
            start = len(self.engine.requests)
            session = httpx.post(f"{self.url}/sessions", json={"uid": wire}, headers=self.admin).json()
            if wire == "openai":
                client = OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
                render = _render(self.tokenizer, _run_openai(client, self.turns))  # the same on both wires
            else:
                _run_anthropic(anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=session["api_key"],
                                                   max_retries=0), self.turns)
            final = httpx.post(f"{self.url}/sessions/{session['session_id']}/finalize", headers=self.admin).json()
            assert final["trajectories"] == 1, final
            (row,) = wait_for_parquet(self.trajectories, session["session_id"], timeout=60)
            requests = self.engine.requests[start:]
            assert len(requests) == self.turns
            scenario.check_row(row, requests, replies, self.tokenizer, None)  # masks, log probs, engine prefixes
            self.check_tokens(row, [r["input_ids"] for r in requests], replies)
            rows.append(row)
        for field in scenario.TRAINING_FIELDS:
            assert rows[0][field] == rows[1][field], field
        return rows, render

    def check_tokens(self, row: dict[str, Any], inputs: list[list[int]], replies: list[ScriptedReply]) -> None:
        """The record is the first prompt, then each turn's sampled tokens as generated and the increment for
        the next request's new messages: each engine input is what came before it, plus one increment."""
        record: list[int] = list(inputs[0])
        for turn, sampled in enumerate(replies):
            record += sampled.token_ids
            if turn + 1 < len(inputs):
                assert inputs[turn + 1][: len(record)] == record, turn
                increment = inputs[turn + 1][len(record):]
                assert self.tokenizer.decode(increment) == self.increment(turn), turn
                assert increment == self.tokenizer.encode(self.increment(turn)), turn
                record += increment
        assert row["input_ids"] == record


def _nudged(turn: int) -> bool:
    """Whether the agent adds a user message after this turn's tool result (then the template strips the
    reasoning of every turn before it, or moves the last user turn's mark)."""
    return turn % 5 == 4


def _result(turn: int) -> str:
    return f"{turn + 1}"


def _answer(turns: int) -> str:
    return f"The count is {turns - 1}."


def _run_openai(client: OpenAI, turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    for turn in range(turns):
        choice = client.chat.completions.create(model="m", messages=messages, tools=TOOLS).choices[0]
        message = choice.message.model_dump(exclude_none=True)
        assert message["reasoning_content"].startswith(("Step", "Done"))
        messages.append(message)
        if turn == turns - 1:
            assert choice.finish_reason == "stop" and message["content"] == _answer(turns)
            break
        (call,) = message["tool_calls"]
        assert choice.finish_reason == "tool_calls" and json.loads(call["function"]["arguments"]) == {
            "expression": f"{turn}+1"}
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": _result(turn)})
        if _nudged(turn):
            messages.append({"role": "user", "content": "Keep going."})
    return messages


def _run_anthropic(client: anthropic.Anthropic, turns: int) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    for turn in range(turns):
        message = client.messages.create(model="m", max_tokens=512, system=SYSTEM, tools=scenario.ANTHROPIC_TOOLS,
                                         messages=messages)
        blocks = [b.model_dump(exclude_none=True) for b in message.content]
        assert blocks[0]["type"] == "thinking"
        messages.append({"role": "assistant", "content": blocks})
        if turn == turns - 1:
            assert message.stop_reason == "end_turn" and blocks[-1]["text"] == _answer(turns)
            break
        (use,) = [b for b in blocks if b["type"] == "tool_use"]
        assert message.stop_reason == "tool_use" and use["input"] == {"expression": f"{turn}+1"}
        content: list[dict[str, Any]] = [{"type": "tool_result", "tool_use_id": use["id"], "content": _result(turn)}]
        if _nudged(turn):
            content.append({"type": "text", "text": "Keep going."})
        messages.append({"role": "user", "content": content})


def _render(tokenizer: Tokenizer, messages: list[dict[str, Any]]) -> str:
    """The template's render of the whole conversation, ``messages`` on the OpenAI wire."""
    conversation = decode_request(json.dumps({"messages": messages, "tools": TOOLS}).encode())
    return tokenizer.chat_template.render([template_message(m) for m in conversation.messages],
                                          tools=template_tools(conversation.tools), add_generation_prompt=False)


def test_rollbus_up_serves_a_reasoning_stripping_template_as_continuous_tokens(tmp_path: Path) -> None:
    spec = tokenizer_dir(tmp_path / "tokenizer", STRIPS_REASONING)
    tokenizer = load_tokenizer(spec)
    data = tmp_path / "data"
    with ScriptedEngineServer() as engine:
        up = Up(data, engine.url, "--tokenizer", spec)
        try:
            banner = "".join(up.lines)
            assert ("  template:     continuous tokens: not prefix-stable (tools, reasoning, parallel calls): "
                    "request 3: stored tokens + increment do not decode to the full render, at character") in banner
            health = httpx.get(f"{up.url}/healthz").json()
            assert health["status"] == "ok" and health["chat_template"]["mode"] == "continuous tokens"
            assert health["chat_template"]["reason"] in banner
            served = Served(up.url, ADMIN, data / "trajectories", engine, tokenizer, turns=20)
            rows, render = served.both_wires()
        finally:
            assert up.stop() == 0, "".join(up.lines)
    text = tokenizer.decode(rows[0]["input_ids"])
    assert all(f"<think>\nStep {t}: add one.\n</think>" in text for t in range(19))  # as sampled
    assert "Step 0: add one." not in render and text + "\n" != render  # the template's render strips them


def test_a_last_user_marking_template_keeps_the_marks_the_model_saw(
        make_stack: Callable[..., StackThread], engine: ScriptedEngineServer, tmp_path: Path) -> None:
    spec = tokenizer_dir(tmp_path / "tokenizer", MARKS_LAST_USER)
    tokenizer = load_tokenizer(spec)
    stack = make_stack(tokenizer=spec)
    health = httpx.get(f"{stack.url}/healthz").json()
    assert health["chat_template"]["mode"] == "continuous tokens"
    assert "U [latest]<|im_end|>" in health["chat_template"]["reason"]
    served = Served(stack.url, stack.admin, stack.trajectories, engine, tokenizer, turns=7, mark=" [latest]")
    rows, render = served.both_wires()
    text = tokenizer.decode(rows[0]["input_ids"])
    assert f"{QUESTION} [latest]<|im_end|>" in text and f"{QUESTION}<|im_end|>" in render  # marked when sent
    assert "Keep going. [latest]" in text and "Keep going. [latest]" in render  # still the last


def test_an_analysis_dropping_template_keeps_the_reasoning_the_model_sampled(
        make_stack: Callable[..., StackThread], engine: ScriptedEngineServer, tmp_path: Path) -> None:
    spec = tokenizer_dir(tmp_path / "tokenizer", DROPS_ANALYSIS)
    tokenizer = load_tokenizer(spec)
    stack = make_stack(tokenizer=spec)
    health = httpx.get(f"{stack.url}/healthz").json()
    assert health["chat_template"]["mode"] == "continuous tokens"
    assert "<|channel|>analysis" in health["chat_template"]["reason"]
    served = Served(stack.url, stack.admin, stack.trajectories, engine, tokenizer, turns=7)
    rows, render = served.both_wires()
    text = tokenizer.decode(rows[0]["input_ids"])
    assert all(f"<think>\nStep {t}: add one.\n</think>" in text for t in range(6))  # as sampled, every turn
    assert "Step 0: add one." not in render and "Step 5: add one." not in render  # the template dropped them
    assert "<|channel|>analysis<|message|>Done counting.<|end|>" in render  # only the last message keeps it
