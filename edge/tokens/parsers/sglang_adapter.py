"""SGLang's tool-call and reasoning parsers behind rollbus's parser protocols.

``--tool-format sglang:NAME`` wraps ``FunctionCallParser`` with SGLang's detector ``NAME``
(``kimi_k2``, ``deepseekv3``, ``glm45``, ``mistral``, ``gpt-oss``, ...) and
``--reasoning-format sglang:NAME`` wraps ``ReasoningParser`` (``qwen3``, ``deepseek-r1``,
``kimi_k2``, ...): the code an SGLang server runs for ``--tool-call-parser NAME`` and
``--reasoning-parser NAME``. ``sglang`` comes with the ``sglang`` extra (README, Install).

Whole replies go through ``parse_non_stream``, the text before the calls given back its
leading whitespace (:func:`_text_before`); streamed ones through ``parse_stream_chunk``,
one parser per reply (SGLang's parsers keep streaming state):

- tool calls (:class:`SGLangToolStream`): the normal text the detector releases is shown as
  it comes, holding back trailing whitespace and stopping at the first call; at the end the
  whole text is parsed, which the record and the calls come from, and the rest of its
  content is shown. So a streamed reply ends with the same record as a whole one (tested for
  nine formats however the text is cut, ``tests/unit/test_parser_differential.py``), though
  SGLang's own streams lose calls when a piece spans two; where SGLang's stream showed text
  its whole parse does not have, what was shown is kept, as for every parser
  (:func:`edge.tokens.parsers.base.settle`);
- reasoning (:class:`SGLangReasoningStream`): what the detector calls reasoning and normal
  text goes out as it comes.

Importing SGLang is a configuration matter, checked once: whatever the import raises (not
only ``ImportError``: a CUDA build of torchvision makes it raise ``RuntimeError``) becomes a
:class:`ValueError` naming the cause, which the CLI prints as one line. Whatever SGLang raises
while parsing becomes ``parse_error`` (the text is returned as content), as with every parser.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, NamedTuple

from edge.chat.conversation import ToolSpec
from edge.tokens.parsers.base import CallId, ParsedOutput, settle
from edge.tokens.reasoning import Piece
from schemas.events import ToolCall

log = logging.getLogger(__name__)

PREFIX = "sglang:"
_TOOL_MODULE = "sglang.srt.function_call.function_call_parser"
_REASONING_MODULE = "sglang.srt.parser.reasoning_parser"
_PROTOCOL_MODULE = "sglang.srt.entrypoints.openai.protocol"


class _Modules(NamedTuple):
    tools: ModuleType
    reasoning: ModuleType
    protocol: ModuleType


@functools.cache
def _load() -> _Modules | str:
    """SGLang's parser modules, or why they do not import."""
    try:
        return _Modules(*(importlib.import_module(m) for m in (_TOOL_MODULE, _REASONING_MODULE, _PROTOCOL_MODULE)))
    except Exception as exc:  # any failure of a third-party import is a configuration error, named
        return " ".join(f"{type(exc).__name__}: {exc}".split())  # one line


def _modules(what: str) -> _Modules:
    """SGLang's modules; :class:`ValueError` naming why not, for ``what`` (``--tool-format sglang:NAME``)."""
    loaded = _load()
    if isinstance(loaded, str):
        raise ValueError(f"{what}: sglang does not import ({loaded}); install the sglang extra (README, Install)")
    return loaded


def tool_parser_names() -> frozenset[str]:
    """SGLang's ``--tool-call-parser`` names (imports SGLang: seconds)."""
    return frozenset(_modules("sglang's tool parsers").tools.FunctionCallParser.ToolCallParserEnum)


def reasoning_parser_names() -> frozenset[str]:
    """SGLang's ``--reasoning-parser`` names (imports SGLang: seconds)."""
    return frozenset(_modules("sglang's reasoning parsers").reasoning.ReasoningParser.DetectorMap)


class SGLangParser:
    """One of SGLang's tool-call detectors behind the :class:`~edge.tokens.parsers.ToolParser` protocol."""

    def __init__(self, detector: str) -> None:
        modules = _modules(f"--tool-format {PREFIX}{detector}")
        detectors = modules.tools.FunctionCallParser.ToolCallParserEnum
        if detector not in detectors:
            raise ValueError(f"sglang has no tool-call parser {detector!r}; it has {sorted(detectors)}")
        self._modules = modules
        self.detector = detector
        self.name = PREFIX + detector
        self.start_markers = _start_markers(detectors[detector])
        _built(lambda: self.new(()), f"--tool-format {self.name}")

    def new(self, tools: Sequence[ToolSpec]) -> Any:
        """A fresh ``FunctionCallParser`` for one reply to a request with ``tools``."""
        function, tool = self._modules.protocol.Function, self._modules.protocol.Tool
        specs = [tool(type="function", function=function(name=t.name, description=t.description,
                                                         parameters=t.parameters)) for t in tools]
        return self._modules.tools.FunctionCallParser(specs, self.detector)

    def parse(self, text: str, call_id: CallId, tools: Sequence[ToolSpec] = ()) -> ParsedOutput:
        try:
            normal, items = self.new(tools).parse_non_stream(text)
        except Exception as exc:  # third-party code: any failure is a parse failure
            return ParsedOutput(content=text, parse_error=f"sglang {self.detector} parser failed: {exc!r}")
        calls = []
        for index, item in enumerate(items):
            if not isinstance(item.name, str) or not isinstance(item.parameters, str):
                return ParsedOutput(content=text, parse_error=f"sglang {self.detector} returned an incomplete call")
            calls.append(ToolCall(id=call_id(index), name=item.name, arguments=item.parameters))
        return ParsedOutput(content=_text_before(text, normal) if calls else normal, tool_calls=tuple(calls))

    def stream(self, call_id: CallId, tools: Sequence[ToolSpec] = ()) -> SGLangToolStream:
        return SGLangToolStream(self, call_id, tools)


class SGLangToolStream:
    """Content as SGLang's ``parse_stream_chunk`` releases it, up to the first call; the whole parse at the end."""

    def __init__(self, parser: SGLangParser, call_id: CallId, tools: Sequence[ToolSpec]) -> None:
        self._parser = parser
        self._call_id = call_id
        self._tools = tools
        self._text: list[str] = []  # everything fed
        self._shown: list[str] = []
        self._pending = ""  # released normal text not shown yet: trailing whitespace
        self._held = False  # a call began (or the detector failed): nothing more is shown before the end
        try:
            self._stream = parser.new(tools)
        except Exception as exc:
            log.warning("sglang %s parser failed to start: %r", parser.detector, exc)
            self._held = True

    def feed(self, text: str) -> str:
        """The content that can be shown now."""
        self._text.append(text)
        if self._held:
            return ""
        try:
            normal, items = self._stream.parse_stream_chunk(text)
        except Exception as exc:  # the whole parse at the end decides, as for a reply that does not parse
            log.warning("sglang %s streaming parser failed: %r", self._parser.detector, exc)
            self._held = True
            return ""
        pending = self._pending + normal
        shown = pending.rstrip()
        self._pending = pending[len(shown):]
        self._held = bool(items)
        if shown:
            self._shown.append(shown)
        return shown

    def finish(self) -> tuple[str, ParsedOutput]:
        """The content not shown yet, and the parse of the whole text."""
        parsed = self._parser.parse("".join(self._text), self._call_id, self._tools)
        return settle("".join(self._shown), parsed, self._parser.name)


class SGLangReasoning:
    """One of SGLang's reasoning detectors: ``split`` a whole reply, ``stream`` one in pieces."""

    def __init__(self, detector: str, *, starts_open: bool = False) -> None:
        modules = _modules(f"--reasoning-format {PREFIX}{detector}")
        detectors = modules.reasoning.ReasoningParser.DetectorMap
        if detector not in detectors:
            raise ValueError(f"sglang has no reasoning parser {detector!r}; it has {sorted(detectors)}")
        self._class = modules.reasoning.ReasoningParser
        self.detector = detector
        self.name = PREFIX + detector
        self._force = True if starts_open else None  # None: the detector's own default
        _built(self.new, f"--reasoning-format {self.name}")

    def new(self) -> Any:
        """A fresh ``ReasoningParser`` for one reply."""
        return self._class(self.detector, stream_reasoning=True, force_reasoning=self._force)

    def split(self, text: str) -> tuple[str | None, str]:
        """``(reasoning, content)`` of a whole reply; all content when SGLang's parser fails."""
        try:
            reasoning, normal = self.new().parse_non_stream(text)
        except Exception as exc:
            log.warning("sglang %s reasoning parser failed: %r", self.detector, exc)
            return None, text
        return reasoning or None, normal or ""

    def stream(self) -> SGLangReasoningStream:
        return SGLangReasoningStream(self.new(), self.detector)


class SGLangReasoningStream:
    """``("reasoning" | "content", text)`` pieces as SGLang's ``parse_stream_chunk`` releases them."""

    def __init__(self, parser: Any, detector: str) -> None:
        self._parser = parser
        self._detector = detector
        self._failed = False

    def feed(self, text: str) -> list[Piece]:
        if self._failed:
            return [("content", text)]
        try:
            return _pieces(*self._parser.parse_stream_chunk(text))
        except Exception as exc:
            log.warning("sglang %s streaming reasoning parser failed: %r", self._detector, exc)
            self._failed = True
            return [("content", text)]

    def finish(self) -> list[Piece]:
        if self._failed:
            return []
        try:
            return _pieces(*self._parser.parse_stream_end())
        except Exception as exc:
            log.warning("sglang %s streaming reasoning parser failed at the end: %r", self._detector, exc)
            return []


def _built(build: Callable[[], object], what: str) -> None:
    """Refuse, naming why, a parser SGLang cannot build from a name alone (``response_template``
    wants the model's template)."""
    try:
        build()
    except Exception as exc:
        raise ValueError(f"{what}: sglang cannot build it here ({' '.join(str(exc).split())})") from exc


def _pieces(reasoning: str | None, normal: str | None) -> list[Piece]:
    out: list[Piece] = []
    if reasoning:
        out.append(("reasoning", reasoning))
    if normal:
        out.append(("content", normal))
    return out


def _text_before(text: str, normal: str) -> str:
    """The content of a reply with calls, by the :class:`~edge.tokens.parsers.ToolParser` protocol: the
    text as written, trailing whitespace aside. SGLang's detectors strip it; its leading whitespace
    (the newlines after ``</think>``) is given back when the text begins with what they kept."""
    content = normal.rstrip()
    body = text.lstrip()
    if content and body.startswith(content.lstrip()):
        return text[:len(text) - len(body)] + content.lstrip()
    return content


def _start_markers(detector_class: Any) -> tuple[str, ...]:
    """The detector's begin-of-tool-call string (``bot_token`` or ``tool_call_start_token``), if it has one."""
    try:
        detector = detector_class()
    except Exception:  # third-party constructors may need arguments
        return ()
    for attribute in ("bot_token", "tool_call_start_token"):
        token = getattr(detector, attribute, "")
        if isinstance(token, str) and token:
            return (token,)
    return ()
