"""Forced tool calls and JSON replies as a grammar: what the engine may sample, derived purely from
the session's tool format, the request's tools, its tool choice and its output format.

:func:`derive_constraint` answers None when nothing is forced (``tool_choice`` ``auto`` or
``none`` and no output format), else a :class:`~edge.engines.base.Constraint`:

- a forced choice (``required``, or a named tool) admits only tool calls, in the model's **own**
  format (the session's tool parser, so the call parses as any other and the trained tokens are
  the ones the model would write), each call's arguments valid for the tool's JSON schema, one
  call, or several when parallel calls are allowed, then the end of the turn:

  ===============  ===================================================================
  format           admitted text (``NAME``, ``ARGS``: a tool's name and schema-valid arguments)
  ===============  ===================================================================
  ``hermes``       ``<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>``, calls
                   joined by ``\\n``
  ``llama3``       ``{"name": "NAME", "parameters": ARGS}``, calls joined by ``; ``
  ``smollm2``      ``<tool_call>[{"name": "NAME", "arguments": ARGS}, ...]</tool_call>``
  ``qwen3_coder``  ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...``
                   ``</function>\\n</tool_call>``: the schema's properties in its order,
                   required ones present; a value typed by its property (integer, number,
                   boolean, null, an enum of strings, JSON for objects and arrays), a string
                   as text without ``<``
  ===============  ===================================================================

- an output format admits one JSON value: any object (``json_object``) or one valid for the schema
  (``json_schema``); with ``tool_choice: auto`` and tools, a tool call as above is admitted instead.

JSON is written as the chat templates write it (``", "`` and ``": "``, no other whitespace), and
schema keywords the grammar library cannot enforce are ignored rather than refused (llguidance's
``lenient`` mode): the arguments are valid for the schema "where the library supports it".
A marker that is one token of its own in the session's tokenizer (Qwen's ``<tool_call>``) is
required as that token (``token_markers``). When the generation prompt opens the reasoning
(``<think>``), reasoning text and ``</think>`` come first.

A forced choice (or a JSON format beside tools) in a tool format that has no grammar here (``none``,
SGLang's parsers) is refused (:class:`Unconstrainable`, a 400): it would otherwise go unenforced.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from edge.chat.conversation import NamedTool, OutputFormat, ToolChoice, ToolSpec
from edge.engines.base import Constraint
from edge.tokens.parsers.schema_values import schema_types
from schemas.errors import Unconstrainable

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}
"""llguidance's JSON options: the templates' separators, no free whitespace, unknown keywords ignored."""

FORMATS = ("hermes", "llama3", "smollm2", "qwen3_coder")
MARKERS = ("<tool_call>", "</tool_call>", "</think>")
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def derive_constraint(tool_format: str, tools: Sequence[ToolSpec], choice: ToolChoice, *,
                      parallel: bool = True, output_format: OutputFormat | None = None,
                      token_markers: frozenset[str] = frozenset(), reasoning_open: bool = False) -> Constraint | None:
    """The constraint the request implies (see the module docstring), or None when it forces nothing.
    ``tool_format``: the session's tool parser's name; ``token_markers``: the markers (of
    :data:`MARKERS`) that are single tokens of the session's tokenizer; ``reasoning_open``: the
    generation prompt leaves a ``<think>`` open."""
    forced = choice == "required" or isinstance(choice, NamedTool)
    if not forced and output_format is None:
        return None  # (most turns: nothing to build)
    rules = _Rules(token_markers)
    if forced:
        chosen = [t for t in tools if not isinstance(choice, NamedTool) or t.name == choice.name]
        body = _calls(rules, tool_format, chosen, parallel, param="tool_choice")
        label = f"tool:{choice.name}" if isinstance(choice, NamedTool) else "tool:required"
        single_json = tool_format == "llama3" and not parallel  # the whole text is one JSON object
        json_schema = _one_of([_call_schema(t, "parameters") for t in chosen]) if single_json else None
    elif output_format is not None:
        json_schema = output_schema(output_format)
        body = rules.add("reply", rules.json(json_schema))
        label = output_format.type + (f":{output_format.name}" if output_format.name else "")
        if choice == "auto" and tools:
            calls = _calls(rules, tool_format, list(tools), parallel, param="response_format")
            body, json_schema = rules.add("answer", f"{calls} | {body}"), None
    prefix = ""
    if reasoning_open and "</think>" in token_markers:
        prefix, json_schema = rules.add("reasoning", r'/(?s:.*)/ </think> /\n*/') + " ", None
    return Constraint(label=label, grammar=rules.grammar(f"start: {prefix}{body}"), json_schema=json_schema)


def output_schema(output_format: OutputFormat) -> dict[str, Any]:
    """The JSON schema an output format admits: any object, or the format's schema."""
    return output_format.schema if output_format.schema is not None else _ANY_OBJECT


def _one_of(schemas: list[dict[str, Any]]) -> dict[str, Any]:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def _call_schema(tool: ToolSpec, arguments_key: str) -> dict[str, Any]:
    """``{"name": <the tool's name>, <arguments_key>: <arguments valid for its schema>}``, in that order."""
    return {"type": "object", "properties": {"name": {"const": tool.name},
                                             arguments_key: tool.parameters or _ANY_OBJECT},
            "required": ["name", arguments_key], "additionalProperties": False}


class _Rules:
    """A Lark grammar (llguidance's dialect) under construction: numbered rules, markers as tokens."""

    def __init__(self, token_markers: frozenset[str]) -> None:
        self._token_markers = token_markers
        self._lines: list[str] = []

    def add(self, name: str, body: str) -> str:
        """A new rule ``name_<n>: body``; its name."""
        rule = f"{name}_{len(self._lines)}"
        self._lines.append(f"{rule}: {body}")
        return rule

    def marker(self, text: str) -> str:
        """A marker: its token (``<tool_call>``) when it is one of its own, else its text."""
        return text if text in self._token_markers else literal(text)

    @staticmethod
    def json(schema: dict[str, Any]) -> str:
        return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)

    def grammar(self, start: str) -> str:
        return "\n".join([start, *self._lines]) + "\n"


def literal(text: str) -> str:
    """A Lark string literal for ``text``."""
    return json.dumps(text, ensure_ascii=False)


def _repeated(rules: _Rules, name: str, item: str, separator: str, parallel: bool) -> str:
    """``item``, or with parallel calls ``item (separator item)*``, as a rule."""
    return rules.add(name, f"{item} ({literal(separator)} {item})*" if parallel else item)


def _calls(rules: _Rules, tool_format: str, tools: list[ToolSpec], parallel: bool, *, param: str) -> str:
    """The rule admitting the tool calls of ``tools`` in ``tool_format`` (see the module docstring)."""
    if tool_format not in FORMATS:
        raise Unconstrainable(f"the session's tool format {tool_format!r} has no grammar for forced tool calls "
                              f"(formats with one: {', '.join(FORMATS)})", param=param)
    if tool_format == "qwen3_coder":
        return _xml_calls(rules, tools, parallel)
    key = "parameters" if tool_format == "llama3" else "arguments"
    call = rules.add("call", " | ".join(rules.json(_call_schema(t, key)) for t in tools))
    if tool_format == "llama3":
        return _repeated(rules, "calls", call, "; ", parallel)
    if tool_format == "smollm2":
        items = _repeated(rules, "items", call, ", ", parallel)
        return rules.add("calls", f'{rules.marker("<tool_call>")} "[" {items} "]" {rules.marker("</tool_call>")}')
    block = rules.add("block", f'{rules.marker("<tool_call>")} "\\n" {call} "\\n" {rules.marker("</tool_call>")}')
    return _repeated(rules, "calls", block, "\n", parallel)


def _xml_calls(rules: _Rules, tools: list[ToolSpec], parallel: bool) -> str:
    """Qwen3-Coder's ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...``."""
    functions = [_xml_function(rules, tool) for tool in tools]
    function = rules.add("function", " | ".join(functions))
    block = rules.add("block", f'{rules.marker("<tool_call>")} "\\n" {function} "\\n" {rules.marker("</tool_call>")}')
    return _repeated(rules, "calls", block, "\n", parallel)


def _xml_function(rules: _Rules, tool: ToolSpec) -> str:
    schema = tool.parameters or {}
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = schema.get("required") if isinstance(schema.get("required"), list) else []
    parts = [literal(f"<function={tool.name}>\n")]
    for key, subschema in (properties or {}).items():
        head, value = literal(f"<parameter={key}>\n"), _xml_value(rules, subschema)
        parameter = rules.add("parameter", f'{head} {value} "</parameter>\\n"')
        parts.append(parameter if key in required else f"{parameter}?")
    parts.append(literal("</function>"))
    return rules.add("function", " ".join(parts))


_XML_TYPES = {"integer": r"/-?(0|[1-9][0-9]*)\n/", "number": r"/-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?\n/",
              "boolean": '"true\\n" | "false\\n"', "null": '"null\\n"', "string": r"/[^<]*\n/"}
"""A value and the newline after it, in one: a string's text runs (greedily) up to the ``<`` of
``</parameter>``, so the newline before it must be part of its lexeme."""


def _xml_value(rules: _Rules, schema: Any) -> str:
    """A parameter's value as Qwen3-Coder's template writes it (a string as it is, anything else as
    JSON), then its newline."""
    if isinstance(schema, dict) and isinstance(schema.get("enum"), list) and schema["enum"] \
            and all(isinstance(v, str) and "<" not in v for v in schema["enum"]):
        return rules.add("value", " | ".join(literal(v + "\n") for v in schema["enum"]))
    kinds = list(dict.fromkeys(schema_types(schema))) or ["string"]
    options = [f'{rules.json(schema)} "\\n"' if kind in ("object", "array") else
               _XML_TYPES.get(kind, _XML_TYPES["string"]) for kind in kinds]
    return rules.add("value", " | ".join(options))


__all__ = ["FORMATS", "JSON_OPTIONS", "MARKERS", "derive_constraint", "output_schema"]
