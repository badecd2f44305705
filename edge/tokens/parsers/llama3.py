"""Llama-3's JSON tool calls.

::

    {"name": "get_weather", "parameters": {"city": "Zürich"}}
    <|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}

A reply is a tool call when it starts with ``{`` (after whitespace) or holds
``<|python_tag|>``: then it is one JSON object ``{"name", "parameters" | "arguments"}``
or several separated by ``;``. Text before the tag is content, and so is text after the
last object. A reply that starts like a call but is not one is returned as content with
``parse_error`` set.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from edge.chat.conversation import ToolSpec
from edge.tokens.parsers.base import CallId, ParsedOutput, json_call
from schemas.events import ToolCall

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


class Llama3JsonParser:
    name = "llama3"
    start_markers = (PYTHON_TAG, "{")

    def parse(self, text: str, call_id: CallId, tools: Sequence[ToolSpec] = ()) -> ParsedOutput:
        if PYTHON_TAG in text:
            content, _, body = text.partition(PYTHON_TAG)
        elif text.lstrip().startswith("{"):
            content, body = "", text
        else:
            return ParsedOutput(content=text)
        calls, rest = _calls(body, call_id)
        if isinstance(calls, str):
            return ParsedOutput(content=text, parse_error=calls)
        content = content.rstrip()
        if rest:
            content = f"{content}\n{rest}" if content else rest
        return ParsedOutput(content=content, tool_calls=tuple(calls))


def _calls(body: str, call_id: CallId) -> tuple[list[ToolCall] | str, str]:
    """The ``;``-separated calls at the start of ``body`` and the text after them, or why not."""
    calls: list[ToolCall] = []
    position = 0
    while True:
        position = _skip_space(body, position)
        try:
            value, position = _DECODER.raw_decode(body, position)
        except ValueError as exc:
            return f"tool call is not JSON: {exc}", ""
        if not isinstance(value, dict):
            return "tool call JSON is not an object", ""
        call = json_call(value, call_id(len(calls)))
        if isinstance(call, str):
            return call, ""
        calls.append(call)
        position = _skip_space(body, position)
        if not body.startswith(";", position):
            return calls, body[position:].strip()
        position = _skip_space(body, position + 1)
        if position == len(body):  # a trailing separator
            return calls, ""


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position].isspace():
        position += 1
    return position
