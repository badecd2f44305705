"""Sampled text -> what the client is shown: reasoning, content, tool calls.

:meth:`ReplyParser.parse` reads a whole reply: reasoning first (:mod:`edge.tokens.reasoning`),
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

from collections.abc import Sequence

import msgspec

from edge.chat.conversation import ToolSpec
from edge.chat.deltas import ContentDelta, Delta, ReasoningDelta, ToolCallReady
from edge.tokens.parsers.base import CallId, ParsedOutput, PlainParser, ToolParser, ToolStream, settle
from edge.tokens.reasoning import PieceStream, ReasoningFormat, ThinkReasoning, marker_prefix_len

_PLAIN = PlainParser()


def call_ids(request_no: int) -> CallId:
    """Tool-call ids derived from the request number (never random, so replay is deterministic)."""
    return lambda index: f"call_{request_no}_{index}"


class ReplyParser:
    """``reasoning``: the ``--reasoning-format`` (the built-in ``<think>`` one when None)."""

    def __init__(self, tools: ToolParser, *, starts_in_reasoning: bool = False,
                 reasoning: ReasoningFormat | None = None) -> None:
        self.tools = tools
        self.starts_in_reasoning = starts_in_reasoning
        self.reasoning = reasoning if reasoning is not None else ThinkReasoning(starts_open=starts_in_reasoning)

    def parse(self, text: str, call_id: CallId, *, use_tools: bool = True,
              tools: Sequence[ToolSpec] = ()) -> ParsedOutput:
        """``tools``: the request's tool specs (parsers that type arguments by schema use them)."""
        reasoning, content = self.reasoning.split(text)
        parsed = (self.tools if use_tools else _PLAIN).parse(content, call_id, tools)
        return msgspec.structs.replace(parsed, reasoning=reasoning) if reasoning is not None else parsed

    def stream(self, call_id: CallId, *, use_tools: bool = True, tools: Sequence[ToolSpec] = ()) -> ReplyStream:
        """A parser with a ``stream`` of its own (SGLang's) streams its way; the others by ``start_markers``."""
        parser = self.tools if use_tools else _PLAIN
        own = getattr(parser, "stream", None)
        tool_stream: ToolStream = own(call_id, tools) if callable(own) else ToolCallStream(parser, call_id, tools)
        return ReplyStream(self.reasoning.stream(), tool_stream)


class ToolCallStream:
    """Content shown as it comes, up to the first possible tool-call marker; parsed at the end."""

    def __init__(self, parser: ToolParser, call_id: CallId, tools: Sequence[ToolSpec] = ()) -> None:
        self._parser = parser
        self._call_id = call_id
        self._tools = tools
        self._markers = parser.start_markers
        self._shown: list[str] = []  # content already shown
        self._pending = ""  # text not shown yet: trailing whitespace, a (partial) marker and what follows
        self._held: list[str] | None = None  # text after the pending text, once a marker was seen

    def feed(self, text: str) -> str:
        """The content that can be shown now."""
        if self._held is not None:
            self._held.append(text)
            return ""
        pending = self._pending + text
        end = self._safe_end(pending)
        shown, self._pending = pending[:end], pending[end:]
        if shown:
            self._shown.append(shown)
        return shown

    def _safe_end(self, pending: str) -> int:
        if not self._markers:
            return len(pending)
        found = [i for i in (pending.find(m) for m in self._markers) if i >= 0]
        if found:
            end = min(found)
            self._held = []  # from now on, text joins the pending text unseen
        else:
            end = len(pending) - max(marker_prefix_len(pending, m) for m in self._markers)
        return len(pending[:end].rstrip())

    def finish(self) -> tuple[str, ParsedOutput]:
        """The content not shown yet, and the parse of the whole text."""
        shown = "".join(self._shown)
        held = "".join(self._held) if self._held is not None else ""
        parsed = self._parser.parse(shown + self._pending + held, self._call_id, self._tools)
        return settle(shown, parsed, self._parser.name)


class ReplyStream:
    """Text pieces in, :class:`Delta` s out; :meth:`finish` gives the last deltas and the parse."""

    def __init__(self, reasoning: PieceStream, tools: ToolStream) -> None:
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
