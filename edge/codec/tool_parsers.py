"""Tool parsers: sampled text -> (content, tool calls).

A parser is chosen by ``multi_turn.format`` (``--tool-format``) and must match the chat
template: the template renders tool calls in the very format the parser reads, which the
edge checks at startup (:func:`edge.codec.fidelity.check_codec`). Text that does not
parse is returned as plain content with the reason in ``parse_error``, never an error.

This module holds the protocol, the output type, the Hermes / Qwen2.5 parser and
:func:`get_parser`; the other formats (Qwen3-Coder XML, Llama-3 JSON, SGLang's parsers)
and the registry of names live in :mod:`edge.codec.parsers`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Protocol

import msgspec

from edge.codec.conversation import ToolSpec
from schemas.events import ToolCall

_json = msgspec.json.Decoder()

CallId = Callable[[int], str]


class ParsedOutput(msgspec.Struct, frozen=True, kw_only=True):
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning: str | None = None
    parse_error: str | None = None  # why tool-call-looking text was returned as content


class ToolParser(Protocol):
    """``start_markers``: the strings that can begin a tool call (``<tool_call>``). A
    streamed reply shows content up to the first one and parses the rest at the end, so
    ``parse(text).content`` must begin with the text before the first marker, trailing
    whitespace aside."""

    name: str
    start_markers: tuple[str, ...]

    def parse(self, text: str, call_id: CallId, tools: Sequence[ToolSpec] = ()) -> ParsedOutput:
        """``tools``: the request's tools (parsers that convert values by their schema use them)."""
        ...


class HermesParser:
    """Qwen2.5 / Hermes: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``."""

    name = "hermes"
    start_markers = ("<tool_call>",)
    _block = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str, call_id: CallId, tools: Sequence[ToolSpec] = ()) -> ParsedOutput:
        start = text.find("<tool_call>")
        if start < 0:
            return ParsedOutput(content=text)
        calls: list[ToolCall] = []
        for index, match in enumerate(self._block.finditer(text)):
            call = json_call(match.group(1), call_id(index))
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


def json_call(body: str | dict[str, object], call_id: str) -> ToolCall | str:
    """A tool call from a JSON object ``{"name", "arguments" | "parameters"}``, or why it is not one."""
    try:
        value = _json.decode(body) if isinstance(body, str) else body
    except msgspec.DecodeError as exc:
        return f"tool call is not JSON: {exc}"
    return call_from(value, call_id)


_dump_arguments = json.JSONEncoder(ensure_ascii=False).encode  # json.dumps(..., ensure_ascii=False), built once


def call_from(value: object, call_id: str) -> ToolCall | str:
    """A tool call from a decoded JSON value ``{"name", "arguments"}``, or why it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return "tool call JSON has no string 'name'"
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        text = arguments
    elif isinstance(arguments, dict):
        text = _dump_arguments(arguments)  # the formatting chat templates' tojson uses
    else:
        return "tool call 'arguments' is neither an object nor a string"
    return ToolCall(id=call_id, name=value["name"], arguments=text)


class PlainParser:
    """No tool calls: everything is content (``tool_choice: none``)."""

    name = "none"
    start_markers: tuple[str, ...] = ()

    def parse(self, text: str, call_id: CallId, tools: Sequence[ToolSpec] = ()) -> ParsedOutput:
        return ParsedOutput(content=text)


def get_parser(name: str) -> ToolParser:
    """The parser for ``--tool-format NAME``; see :func:`edge.codec.parsers.make_parser`."""
    from edge.codec.parsers import make_parser  # deferred: the parsers import this module's types

    return make_parser(name)
