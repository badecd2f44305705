"""Qwen2.5 / Hermes tool calls: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``."""

from __future__ import annotations

from collections.abc import Sequence

from edge.chat.conversation import ToolSpec
from edge.tokens.parsers.base import CallId, ParsedOutput, json_call
from schemas.events import ToolCall

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


class HermesParser:
    """Qwen2.5 / Hermes: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``."""

    name = "hermes"
    start_markers = ("<tool_call>",)

    def parse(self, text: str, call_id: CallId, tools: Sequence[ToolSpec] = ()) -> ParsedOutput:
        start = text.find(_OPEN)
        if start < 0:
            return ParsedOutput(content=text)
        # Each <tool_call> with the first </tool_call> after it is one block (the blocks do not
        # nest); what lies outside the blocks, after the first, is kept as content.
        calls: list[ToolCall] = []
        outside: list[str] = []
        position = start
        while (opened := text.find(_OPEN, position)) >= 0:
            closed = text.find(_CLOSE, opened + len(_OPEN))
            if closed < 0:
                break
            call = json_call(text[opened + len(_OPEN):closed], call_id(len(calls)))
            if isinstance(call, str):
                return ParsedOutput(content=text, parse_error=call)
            calls.append(call)
            outside.append(text[position:opened])
            position = closed + len(_CLOSE)
        if not calls:
            return ParsedOutput(content=text, parse_error="unterminated <tool_call>")
        leftover = "".join([*outside, text[position:]]).strip()
        content = text[:start].rstrip("\n")
        if leftover:
            content = f"{content}\n{leftover}" if content else leftover
        return ParsedOutput(content=content, tool_calls=tuple(calls))
