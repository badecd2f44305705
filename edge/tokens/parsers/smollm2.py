"""SmolLM2-Instruct's tool calls: one ``<tool_call>`` block holding a JSON list of calls."""

from __future__ import annotations

import re
from collections.abc import Sequence

import msgspec

from edge.chat.conversation import ToolSpec
from edge.tokens.parsers.base import CallId, ParsedOutput, call_from
from schemas.events import ToolCall


class SmolLM2Parser:
    """SmolLM2-Instruct: ``<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>``.

    One block holding a JSON list of calls (a lone object is read as a list of one; ``[]``
    is no call). Text around the block is the content.
    """

    name = "smollm2"
    start_markers = ("<tool_call>",)
    _block = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str, call_id: CallId, tools: Sequence[ToolSpec] = ()) -> ParsedOutput:
        match = self._block.search(text)
        if match is None:
            error = "unterminated <tool_call>" if "<tool_call>" in text else None
            return ParsedOutput(content=text, parse_error=error)
        try:
            value = msgspec.json.decode(match.group(1))
        except msgspec.DecodeError as exc:
            return ParsedOutput(content=text, parse_error=f"tool calls are not JSON: {exc}")
        calls: list[ToolCall] = []
        for index, item in enumerate(value if isinstance(value, list) else [value]):
            call = call_from(item, call_id(index))
            if isinstance(call, str):
                return ParsedOutput(content=text, parse_error=call)
            calls.append(call)
        before, after = text[: match.start()].rstrip("\n"), text[match.end() :].strip()
        content = f"{before}\n{after}" if before and after else before or after
        return ParsedOutput(content=content, tool_calls=tuple(calls))
