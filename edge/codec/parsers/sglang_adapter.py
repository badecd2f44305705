"""SGLang's tool-call parsers, when ``sglang`` is installed.

``--tool-format sglang:NAME`` (or a bare ``NAME`` that no built-in parser claims) wraps
``sglang.srt.function_call.function_call_parser.FunctionCallParser`` with SGLang's
detector ``NAME`` (``kimi_k2``, ``deepseekv3``, ``glm45``, ``mistral``, ...): the same
code an SGLang server runs for ``--tool-call-parser NAME``. SGLang is not a dependency of
rollbus; :func:`sglang_parser_names` is empty when it is not importable.

The adapter uses SGLang's public, long-stable surface: ``FunctionCallParser(tools,
tool_call_parser)``, its ``ToolCallParserEnum`` of names, ``parse_non_stream(text) ->
(normal_text, [ToolCallItem(name, parameters: JSON text)])``, and the OpenAI protocol's
``Tool`` / ``Function`` models. A parser is built per reply (detectors keep streaming
state). Whatever SGLang raises while parsing becomes ``parse_error``: the text is
returned as content, as with every parser.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from edge.codec.conversation import ToolSpec
from edge.codec.parsers.base import CallId, ParsedOutput
from schemas.events import ToolCall

log = logging.getLogger(__name__)

PREFIX = "sglang:"
_PARSER_MODULE = "sglang.srt.function_call.function_call_parser"
_PROTOCOL_MODULE = "sglang.srt.entrypoints.openai.protocol"


@functools.cache
def _modules() -> tuple[ModuleType, ModuleType] | None:
    """SGLang's parser and protocol modules, or None when SGLang is not importable."""
    if importlib.util.find_spec("sglang") is None:
        return None
    try:
        return importlib.import_module(_PARSER_MODULE), importlib.import_module(_PROTOCOL_MODULE)
    except ImportError as exc:  # installed, but without what its parsers need
        log.warning("sglang is installed but its tool parsers do not import: %s", exc)
        return None


def sglang_parser_names() -> frozenset[str]:
    """SGLang's ``--tool-call-parser`` names; empty when SGLang is not importable."""
    modules = _modules()
    return frozenset(modules[0].FunctionCallParser.ToolCallParserEnum) if modules else frozenset()


class SGLangParser:
    """One of SGLang's detectors behind the :class:`~edge.codec.parsers.ToolParser` protocol."""

    def __init__(self, detector: str) -> None:
        modules = _modules()
        if modules is None:
            raise ValueError(f"tool format {PREFIX}{detector}: sglang is not installed (or does not import)")
        if detector not in modules[0].FunctionCallParser.ToolCallParserEnum:
            raise ValueError(f"sglang has no tool-call parser {detector!r}; it has {sorted(sglang_parser_names())}")
        self._parser_module, self._protocol = modules
        self.detector = detector
        self.name = PREFIX + detector
        self.start_markers = _start_markers(modules[0].FunctionCallParser.ToolCallParserEnum[detector])

    def parse(self, text: str, call_id: CallId, tools: Sequence[ToolSpec] = ()) -> ParsedOutput:
        try:
            parser = self._parser_module.FunctionCallParser(self._tools(tools), self.detector)
            normal, items = parser.parse_non_stream(text)
        except Exception as exc:  # third-party code: any failure is a parse failure
            return ParsedOutput(content=text, parse_error=f"sglang {self.detector} parser failed: {exc!r}")
        calls = []
        for index, item in enumerate(items):
            if not isinstance(item.name, str) or not isinstance(item.parameters, str):
                return ParsedOutput(content=text, parse_error=f"sglang {self.detector} returned an incomplete call")
            calls.append(ToolCall(id=call_id(index), name=item.name, arguments=item.parameters))
        return ParsedOutput(content=normal.rstrip() if calls else normal, tool_calls=tuple(calls))

    def _tools(self, tools: Sequence[ToolSpec]) -> list[Any]:
        function, tool = self._protocol.Function, self._protocol.Tool
        return [
            tool(type="function", function=function(name=t.name, description=t.description, parameters=t.parameters))
            for t in tools
        ]


def _start_markers(detector_class: Any) -> tuple[str, ...]:
    """The detector's begin-of-tool-call string (``bot_token`` or ``tool_call_start_token``), if it has one."""
    try:
        detector = detector_class()
    except Exception:  # third-party constructors may need a tokenizer
        return ()
    for attribute in ("bot_token", "tool_call_start_token"):
        token = getattr(detector, attribute, "")
        if isinstance(token, str) and token:
            return (token,)
    return ()
