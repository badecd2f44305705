"""What every tool parser shares: the protocol, the output type, JSON tool calls, and the
parser that finds none.

A parser is chosen by ``multi_turn.format`` (``--tool-format``) and must match the chat
template: the template renders tool calls in the very format the parser reads, which the
edge checks at startup (:func:`edge.tokens.fidelity.check_codec`). Text that does not
parse is returned as plain content with the reason in ``parse_error``, never an error.

The parsers by format, and :func:`edge.tokens.parsers.make_parser` (by name), live in the
rest of :mod:`edge.tokens.parsers`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import Protocol

import msgspec

from edge.chat.conversation import ToolSpec
from schemas.events import ToolCall

log = logging.getLogger(__name__)

_json = msgspec.json.Decoder()
# chat templates' tojson formatting (json.dumps' defaults, non-ASCII kept); one encoder, where json.dumps with
# an argument builds one a call
_arguments_json = json.JSONEncoder(ensure_ascii=False)

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
    whitespace aside. A parser may also have ``stream(call_id, tools) -> ToolStream``: its own
    way to stream (SGLang's ``parse_stream_chunk``), used instead of the one by markers."""

    name: str
    start_markers: tuple[str, ...]

    def parse(self, text: str, call_id: CallId, tools: Sequence[ToolSpec] = ()) -> ParsedOutput:
        """``tools``: the request's tools (parsers that convert values by their schema use them)."""
        ...


class ToolStream(Protocol):
    """A reply's text in pieces: :meth:`feed` gives the content that can be shown now,
    :meth:`finish` the content not shown yet and the parse of the whole text."""

    def feed(self, text: str) -> str: ...

    def finish(self) -> tuple[str, ParsedOutput]: ...


def settle(shown: str, parsed: ParsedOutput, parser: str) -> tuple[str, ParsedOutput]:
    """The end of a streamed reply: the content of ``parsed`` (the whole text's) not ``shown`` yet, and
    the record. Content already shown that the whole parse does not begin with is kept as shown (the
    client saw it), with a warning."""
    if parsed.content.startswith(shown):
        return parsed.content[len(shown):], parsed
    log.warning("tool parser %s changed content already streamed; recording what was shown", parser)
    return "", msgspec.structs.replace(parsed, content=shown)


def json_call(body: str | dict[str, object], call_id: str) -> ToolCall | str:
    """A tool call from a JSON object ``{"name", "arguments" | "parameters"}``, or why it is not one."""
    try:
        value = _json.decode(body) if isinstance(body, str) else body
    except msgspec.DecodeError as exc:
        return f"tool call is not JSON: {exc}"
    return call_from(value, call_id)


def call_from(value: object, call_id: str) -> ToolCall | str:
    """A tool call from a decoded JSON value ``{"name", "arguments"}``, or why it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return "tool call JSON has no string 'name'"
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        text = arguments
    elif isinstance(arguments, dict):
        text = _arguments_json.encode(arguments)
    else:
        return "tool call 'arguments' is neither an object nor a string"
    return ToolCall(id=call_id, name=value["name"], arguments=text)


class PlainParser:
    """No tool calls: everything is content (``tool_choice: none``)."""

    name = "none"
    start_markers: tuple[str, ...] = ()

    def parse(self, text: str, call_id: CallId, tools: Sequence[ToolSpec] = ()) -> ParsedOutput:
        return ParsedOutput(content=text)
