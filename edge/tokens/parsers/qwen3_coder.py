"""Qwen3-Coder's XML tool calls.

::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Zürich
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

One ``<function=NAME>`` per ``<tool_call>`` block; each parameter's value is the text
between its tags less one leading and one trailing newline, converted to a JSON value
with the tool's schema (:mod:`edge.tokens.parsers.schema_values`; no schema: a string).
The arguments become a JSON object in the parameters' order. Content is the text before
the first block (trailing newlines dropped), plus any text after the blocks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from edge.chat.conversation import ToolSpec
from edge.tokens.parsers.base import CallId, ParsedOutput
from edge.tokens.parsers.schema_values import convert, parameter_schemas
from schemas.events import ToolCall

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>\n?(.*?)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>\s*", re.DOTALL)


class Qwen3CoderParser:
    name = "qwen3_coder"
    start_markers = ("<tool_call>",)

    def parse(self, text: str, call_id: CallId, tools: Sequence[ToolSpec] = ()) -> ParsedOutput:
        start = text.find("<tool_call>")
        if start < 0:
            return ParsedOutput(content=text)
        calls: list[ToolCall] = []
        for index, block in enumerate(_BLOCK.finditer(text)):
            call = _call(block.group(1), call_id(index), tools)
            if isinstance(call, str):
                return ParsedOutput(content=text, parse_error=call)
            calls.append(call)
        if not calls:
            return ParsedOutput(content=text, parse_error="unterminated <tool_call>")
        content = text[:start].rstrip("\n")
        leftover = _BLOCK.sub("", text[start:]).strip()
        if leftover:
            content = f"{content}\n{leftover}" if content else leftover
        return ParsedOutput(content=content, tool_calls=tuple(calls))


def _call(block: str, call_id: str, tools: Sequence[ToolSpec]) -> ToolCall | str:
    """The tool call in one ``<tool_call>`` block, or why it is not one."""
    function = _FUNCTION.fullmatch(block)
    if function is None:
        return "<tool_call> does not hold one <function=NAME>...</function>"
    name, body = function.group(1).strip(), function.group(2)
    arguments = _arguments(body, parameter_schemas(tools, name))
    if isinstance(arguments, str):
        return f"<function={name}>: {arguments}"
    return ToolCall(id=call_id, name=name, arguments=json.dumps(arguments, ensure_ascii=False))


def _arguments(body: str, schemas: dict[str, Any]) -> dict[str, Any] | str:
    arguments: dict[str, Any] = {}
    position = 0
    for parameter in _PARAMETER.finditer(body):
        if body[position : parameter.start()].strip():
            return f"unexpected text {body[position : parameter.start()].strip()[:40]!r}"
        key = parameter.group(1).strip()
        if key in arguments:
            return f"parameter {key!r} given twice"
        arguments[key] = convert(parameter.group(2), schemas.get(key))
        position = parameter.end()
    if body[position:].strip():
        return f"unexpected text {body[position:].strip()[:40]!r}"
    return arguments
