"""ReAct agents: call the model, run the tool calls it makes, feed back the observations, repeat.

- ``openai`` (:class:`OpenAIReAct`): the official ``openai`` SDK's Chat Completions with
  ``tools``, on ``session.base_url``; observations go back as ``tool`` messages.
- ``anthropic`` (:class:`AnthropicReAct`): the official ``anthropic`` SDK's Messages with
  ``tools``, on ``session.anthropic_base_url``; ``tool_use`` blocks answered by
  ``tool_result`` blocks.

Tool-call ids are the server's (rollbus derives them from the request number) and are
echoed back unchanged. An episode ends when:

- ``submit`` is called (``stop="submit"``, finished, its ``answer``);
- the model answers without a tool call (``"final_text"``, finished, that text);
- a reply was cut by its token limit, including the edge's ``finish_reason: "length"``
  when the trajectory is full (``"length"``, not finished);
- ``max_turns`` model calls were made (``"max_turns"``, not finished).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import msgspec
from openai import AsyncOpenAI

from agent_framework.builtin.config import AgentConfig
from agent_framework.builtin.registry import Registry
from agent_framework.builtin.sandbox import Sandbox
from agent_framework.builtin.tools import Tool, ToolOutcome, call_tool
from agent_framework.session import SessionHandle

Message = dict[str, Any]
Stop = Literal["submit", "final_text", "length", "max_turns"]


class Episode(msgspec.Struct, frozen=True, kw_only=True):
    answer: str | None
    finished: bool
    stop: Stop
    turns: int  # model calls
    tool_calls: int = 0
    tool_errors: int = 0


class _Tally:
    """What an agent counts while it loops."""

    def __init__(self) -> None:
        self.turns = self.calls = self.errors = 0

    def add(self, outcome: ToolOutcome) -> None:
        self.calls += 1
        self.errors += outcome.error

    def end(self, stop: Stop, answer: str | None = None) -> Episode:
        return Episode(answer=answer, finished=stop in ("submit", "final_text"), stop=stop, turns=self.turns,
                       tool_calls=self.calls, tool_errors=self.errors)


class Agent(ABC):
    def __init__(self, config: AgentConfig) -> None:
        self.config = config

    @abstractmethod
    async def run(self, session: SessionHandle, messages: Sequence[Message], tools: Mapping[str, Tool],
                  sandbox: Sandbox) -> Episode:
        """Drive one episode from ``messages`` (chat messages, a system one first when there is one)."""

    def _sampling(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"model": self.config.model, "max_tokens": self.config.max_tokens}
        if self.config.temperature is not None:
            extra["temperature"] = self.config.temperature
        return extra



AGENTS: Registry[type[Agent]] = Registry("agent")
register_agent = AGENTS.register

@register_agent("openai")
class OpenAIReAct(Agent):
    async def run(self, session: SessionHandle, messages: Sequence[Message], tools: Mapping[str, Tool],
                  sandbox: Sandbox) -> Episode:
        history = [dict(m) for m in messages]
        schemas = [tool.schema for tool in tools.values()]
        tally = _Tally()
        async with AsyncOpenAI(base_url=session.base_url, api_key=session.api_key or "EMPTY",
                               timeout=self.config.timeout_s, max_retries=self.config.max_retries) as client:
            while tally.turns < self.config.max_turns:
                reply = await client.chat.completions.create(messages=history, tools=schemas, **self._sampling())
                tally.turns += 1
                choice = reply.choices[0]
                history.append(choice.message.model_dump(exclude_none=True))
                if choice.finish_reason == "length":
                    return tally.end("length")
                if not choice.message.tool_calls:
                    return tally.end("final_text", choice.message.content or "")
                for call in choice.message.tool_calls:
                    name, arguments = _function(call)
                    outcome = await call_tool(tools, sandbox, name, arguments)
                    tally.add(outcome)
                    if outcome.answer is not None:
                        return tally.end("submit", outcome.answer)
                    history.append({"role": "tool", "tool_call_id": call.id, "content": outcome.observation})
        return tally.end("max_turns")


def _function(call: Any) -> tuple[str, str]:
    """A tool call's function name and raw arguments (a custom, non-function call has neither)."""
    function = getattr(call, "function", None)
    if function is None:
        return getattr(call, "type", "?"), ""
    return function.name, function.arguments


@register_agent("anthropic")
class AnthropicReAct(Agent):
    async def run(self, session: SessionHandle, messages: Sequence[Message], tools: Mapping[str, Tool],
                  sandbox: Sandbox) -> Episode:
        if not session.anthropic_base_url:
            raise ValueError(f"the anthropic agent needs the session's anthropic_base_url (session "
                             f"{session.session_id} has none)")
        try:
            from anthropic import AsyncAnthropic  # a dev extra: only this agent needs it
        except ImportError as exc:
            raise ImportError("the anthropic agent needs the anthropic SDK: pip install anthropic") from exc
        system, history = split_system(messages)
        schemas = [anthropic_tool(tool) for tool in tools.values()]
        extra = {"system": system} if system else {}
        tally = _Tally()
        async with AsyncAnthropic(base_url=session.anthropic_base_url, api_key=session.api_key or "EMPTY",
                                  timeout=self.config.timeout_s, max_retries=self.config.max_retries) as client:
            while tally.turns < self.config.max_turns:
                reply = await client.messages.create(messages=history, tools=schemas, **extra, **self._sampling())
                tally.turns += 1
                history.append({"role": "assistant", "content": [_block(b) for b in reply.content]})
                if reply.stop_reason == "max_tokens":
                    return tally.end("length")
                uses = [block for block in reply.content if block.type == "tool_use"]
                if not uses:
                    return tally.end("final_text", "".join(b.text for b in reply.content if b.type == "text"))
                results: list[Message] = []
                for use in uses:
                    outcome = await call_tool(tools, sandbox, use.name, use.input)
                    tally.add(outcome)
                    if outcome.answer is not None:
                        return tally.end("submit", outcome.answer)
                    results.append({"type": "tool_result", "tool_use_id": use.id, "content": outcome.observation})
                history.append({"role": "user", "content": results})
        return tally.end("max_turns")


def split_system(messages: Sequence[Message]) -> tuple[str, list[Message]]:
    """Chat messages as Anthropic's (system text, user/assistant messages)."""
    system = [str(m["content"]) for m in messages if m.get("role") == "system"]
    rest = [{"role": m["role"], "content": m["content"]} for m in messages if m.get("role") != "system"]
    unknown = sorted({str(m["role"]) for m in rest} - {"user", "assistant"})
    if unknown:
        raise ValueError(f"the anthropic agent takes system, user and assistant messages, got role(s) {unknown}")
    return "\n\n".join(system), rest


def anthropic_tool(tool: Tool) -> dict[str, Any]:
    return {"name": tool.name, "description": tool.description, "input_schema": tool.parameters}


def _block(block: Any) -> dict[str, Any]:
    """A reply's content block as a request block (only the fields the wire takes back)."""
    if block.type == "text":
        return {"type": "text", "text": block.text}
    if block.type == "tool_use":
        return {"type": "tool_use", "id": block.id, "name": block.name, "input": block.input}
    if block.type == "thinking":
        return {"type": "thinking", "thinking": block.thinking, "signature": block.signature}
    raise ValueError(f"the anthropic agent cannot send back a {block.type!r} block")
