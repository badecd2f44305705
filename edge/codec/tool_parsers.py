"""Tool parsers: sampled text -> (content, tool calls).

A parser is chosen by ``multi_turn.format`` and must match the chat template (the
template renders tool calls in the very format the parser reads). Text that does not
parse is returned as plain content with the reason recorded, never an error.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Protocol

import msgspec

from schemas.events import ToolCall

CallId = Callable[[int], str]


class ParsedOutput(msgspec.Struct, frozen=True, kw_only=True):
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning: str | None = None
    parse_error: str | None = None  # why tool-call-looking text was returned as content


class ToolParser(Protocol):
    name: str

    def parse(self, text: str, call_id: CallId) -> ParsedOutput: ...


class HermesParser:
    """Qwen2.5 / Hermes: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``."""

    name = "hermes"
    _block = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str, call_id: CallId) -> ParsedOutput:
        start = text.find("<tool_call>")
        if start < 0:
            return ParsedOutput(content=text)
        calls: list[ToolCall] = []
        for index, match in enumerate(self._block.finditer(text)):
            call = _json_call(match.group(1), call_id(index))
            if isinstance(call, str):
                return ParsedOutput(content=text, parse_error=call)
            calls.append(call)
        if not calls:
            return ParsedOutput(content=text, parse_error="unterminated <tool_call>")
        leftover = self._block.sub("", text[start:]).strip()
        content = text[:start].rstrip("\n")
        if leftover:
            content = f"{content}\n{leftover}" if content else leftover
        return ParsedOutput(content=content, tool_calls=tuple(calls))


def _json_call(body: str, call_id: str) -> ToolCall | str:
    """A tool call from a JSON object ``{"name", "arguments"}``, or why it is not one."""
    try:
        value = json.loads(body)
    except ValueError as exc:
        return f"tool call is not JSON: {exc}"
    return _call_from(value, call_id)


def _call_from(value: object, call_id: str) -> ToolCall | str:
    """A tool call from a decoded JSON value ``{"name", "arguments"}``, or why it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return "tool call JSON has no string 'name'"
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        text = arguments
    elif isinstance(arguments, dict):
        text = json.dumps(arguments, ensure_ascii=False)
    else:
        return "tool call 'arguments' is neither an object nor a string"
    return ToolCall(id=call_id, name=value["name"], arguments=text)


class SmolLM2Parser:
    """SmolLM2-Instruct: ``<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>``.

    One block holding a JSON list of calls (a lone object is read as a list of one; ``[]``
    is no call). Text around the block is the content.
    """

    name = "smollm2"
    _block = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str, call_id: CallId) -> ParsedOutput:
        match = self._block.search(text)
        if match is None:
            error = "unterminated <tool_call>" if "<tool_call>" in text else None
            return ParsedOutput(content=text, parse_error=error)
        try:
            value = json.loads(match.group(1))
        except ValueError as exc:
            return ParsedOutput(content=text, parse_error=f"tool calls are not JSON: {exc}")
        calls: list[ToolCall] = []
        for index, item in enumerate(value if isinstance(value, list) else [value]):
            call = _call_from(item, call_id(index))
            if isinstance(call, str):
                return ParsedOutput(content=text, parse_error=call)
            calls.append(call)
        before, after = text[: match.start()].rstrip("\n"), text[match.end() :].strip()
        content = f"{before}\n{after}" if before and after else before or after
        return ParsedOutput(content=content, tool_calls=tuple(calls))


class PlainParser:
    """No tool calls: everything is content (``tool_choice: none``)."""

    name = "none"

    def parse(self, text: str, call_id: CallId) -> ParsedOutput:
        return ParsedOutput(content=text)


_PARSERS: dict[str, Callable[[], ToolParser]] = {
    "hermes": HermesParser,
    "qwen2_5": HermesParser,
    "qwen25": HermesParser,
    "smollm2": SmolLM2Parser,
    "none": PlainParser,
}


def get_parser(name: str) -> ToolParser:
    try:
        return _PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool format {name!r}; expected one of {sorted(_PARSERS)}") from None
