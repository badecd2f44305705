"""Sampled text -> what the client is shown: reasoning, content, tool calls.

:meth:`ReplyParser.parse` reads a whole reply: reasoning first (:mod:`edge.codec.reasoning`),
then tool calls out of the rest (the session's :class:`ToolParser`). :meth:`ReplyParser.stream`
does the same for text that arrives in pieces, and ends with the very same
:class:`ParsedOutput` however the text was cut (tested):

- reasoning goes out as it comes;
- content goes out up to where a tool call could start (a parser's ``start_markers``,
  or a partial one at the end of the text), holding back trailing whitespace (parsers
  strip it before a call), so tool-call markup never shows as content;
- everything from the first marker on waits for the end: a call is only certain once the
  parser has seen the whole text (a malformed later call makes the whole reply content,
  as it does without streaming). Then the rest of the content and each call go out.
"""

from __future__ import annotations

import logging

import msgspec

from edge.codec.deltas import ContentDelta, Delta, ReasoningDelta, ToolCallReady
from edge.codec.reasoning import ReasoningStream, marker_prefix_len, split_reasoning
from edge.codec.tool_parsers import CallId, ParsedOutput, PlainParser, ToolParser

log = logging.getLogger(__name__)

_PLAIN = PlainParser()


def call_ids(request_no: int) -> CallId:
    """Tool-call ids derived from the request number (never random, so replay is deterministic)."""
    return lambda index: f"call_{request_no}_{index}"


class ReplyParser:
    def __init__(self, tools: ToolParser, *, starts_in_reasoning: bool = False) -> None:
        self.tools = tools
        self.starts_in_reasoning = starts_in_reasoning

    def parse(self, text: str, call_id: CallId, *, use_tools: bool = True) -> ParsedOutput:
        reasoning, content = split_reasoning(text, starts_open=self.starts_in_reasoning)
        parsed = (self.tools if use_tools else _PLAIN).parse(content, call_id)
        return msgspec.structs.replace(parsed, reasoning=reasoning) if reasoning is not None else parsed

    def stream(self, call_id: CallId, *, use_tools: bool = True) -> ReplyStream:
        return ReplyStream(ReasoningStream(starts_open=self.starts_in_reasoning),
                           ToolCallStream(self.tools if use_tools else _PLAIN, call_id))


class ToolCallStream:
    """Content shown as it comes, up to the first possible tool-call marker; parsed at the end."""

    def __init__(self, parser: ToolParser, call_id: CallId) -> None:
        self._parser = parser
        self._call_id = call_id
        self._markers = parser.start_markers
        self._text = ""
        self._sent = 0  # length of the content already shown
        self._held = False  # a marker was seen: nothing more is shown before the end

    def feed(self, text: str) -> str:
        """The content that can be shown now."""
        self._text += text
        if self._held:
            return ""
        end = self._safe_end()
        shown = self._text[self._sent:end]
        self._sent = max(self._sent, end)
        return shown

    def _safe_end(self) -> int:
        if not self._markers:
            return len(self._text)
        found = [i for i in (self._text.find(m, self._sent) for m in self._markers) if i >= 0]
        if found:
            self._held = True
            end = min(found)
        else:
            end = len(self._text) - max(marker_prefix_len(self._text, m) for m in self._markers)
        return max(self._sent, len(self._text[:end].rstrip()))

    def finish(self) -> tuple[str, ParsedOutput]:
        """The content not shown yet, and the parse of the whole text."""
        parsed = self._parser.parse(self._text, self._call_id)
        shown = self._text[:self._sent]
        if parsed.content.startswith(shown):
            return parsed.content[self._sent:], parsed
        log.warning("tool parser %s changed content already streamed; recording what was shown", self._parser.name)
        return "", msgspec.structs.replace(parsed, content=shown)


class ReplyStream:
    """Text pieces in, :class:`Delta` s out; :meth:`finish` gives the last deltas and the parse."""

    def __init__(self, reasoning: ReasoningStream, tools: ToolCallStream) -> None:
        self._reasoning = reasoning
        self._tools = tools
        self._reasoning_text: list[str] = []

    def feed(self, text: str) -> list[Delta]:
        return self._route(self._reasoning.feed(text)) if text else []

    def finish(self) -> tuple[list[Delta], ParsedOutput]:
        out = self._route(self._reasoning.finish())
        rest, parsed = self._tools.finish()
        if rest:
            out.append(ContentDelta(rest))
        out.extend(ToolCallReady(index, call) for index, call in enumerate(parsed.tool_calls))
        reasoning = "".join(self._reasoning_text) or None
        return out, msgspec.structs.replace(parsed, reasoning=reasoning)

    def _route(self, pieces: list[tuple[str, str]]) -> list[Delta]:
        out: list[Delta] = []
        for kind, text in pieces:
            if kind == "reasoning":
                self._reasoning_text.append(text)
                out.append(ReasoningDelta(text))
            elif shown := self._tools.feed(text):
                out.append(ContentDelta(shown))
        return out
