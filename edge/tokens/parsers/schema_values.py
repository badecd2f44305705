"""Parameter values as text -> JSON values, by the tool's JSON schema.

Formats that write each parameter as bare text (Qwen3-Coder's XML) lose the JSON type:
``3``, ``true`` and ``{"a": 1}`` arrive as text. :func:`convert` reads the parameter's
schema (``type``, a list of types, ``anyOf`` / ``oneOf``, ``enum``, ``const``) and
converts the text to the first type it fits, in the schema's order; text that fits no
declared type, and any parameter without a schema, stays a string (the model's text, as
written). Python spellings that chat templates produce with ``| string`` (``True``,
``False``, ``None``) are read as JSON's ``true``, ``false``, ``null``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from edge.chat.conversation import ToolSpec

_UNCONVERTED = object()
_PYTHON_WORDS = {"True": "true", "False": "false", "None": "null"}


def parameter_schemas(tools: Sequence[ToolSpec], function: str) -> dict[str, Any]:
    """``{parameter: schema}`` of ``function`` among ``tools`` (empty when unknown)."""
    for tool in tools:
        if tool.name == function and isinstance(tool.parameters, dict):
            properties = tool.parameters.get("properties")
            return properties if isinstance(properties, dict) else {}
    return {}


def schema_types(schema: Any) -> list[str]:
    """The JSON types a schema allows, in its order (empty: anything)."""
    if not isinstance(schema, dict):
        return []
    declared = schema.get("type")
    if isinstance(declared, str):
        return [declared]
    if isinstance(declared, list):
        return [t for t in declared if isinstance(t, str)]
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            return [t for option in schema[key] for t in schema_types(option)]
    for key in ("enum", "const"):
        if key in schema:
            values = schema[key] if key == "enum" and isinstance(schema[key], list) else [schema[key]]
            return list(dict.fromkeys(_json_type(v) for v in values))
    return []


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), "string")


def convert(text: str, schema: Any) -> Any:
    """``text`` as the first type of ``schema`` it fits; else the text itself."""
    for kind in schema_types(schema):
        value = _CONVERTERS.get(kind, _as_string)(text)
        if value is not _UNCONVERTED:
            return value
    return text


def _as_json(text: str) -> Any:
    stripped = text.strip()
    try:
        return json.loads(_PYTHON_WORDS.get(stripped, stripped))
    except ValueError:
        return _UNCONVERTED


def _typed(*kinds: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = _as_json(text)
        fits = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
        return value if fits else _UNCONVERTED

    return parse


def _as_integer(text: str) -> Any:
    value = _typed(int, float)(text)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value if isinstance(value, int) else _UNCONVERTED


def _as_null(text: str) -> Any:
    return None if _as_json(text) is None else _UNCONVERTED


def _as_string(text: str) -> Any:
    return text


_CONVERTERS: dict[str, Callable[[str], Any]] = {
    "string": _as_string,
    "integer": _as_integer,
    "number": _typed(int, float),
    "boolean": _typed(bool),
    "null": _as_null,
    "object": _typed(dict),
    "array": _typed(list),
}
