"""Reading reasoning out of sampled text: ``<think> … </think>`` ahead of the reply.

A thinking model writes its reasoning first, between ``<think>`` and ``</think>`` (Qwen3:
token ids 151667 / 151668), then its reply. When the generation prompt already opened
``<think>`` (templates that force thinking), the sampled text starts *inside* the
reasoning and only ``</think>`` is sampled: :func:`opens_reasoning` tells from the prompt.

The rules, the same for a whole text (:func:`split_reasoning`) and for a stream of text
pieces (:class:`ReasoningStream`; tested to agree however the text is cut):

- reasoning opens only at the start of the reply: ``<think>`` after nothing but
  whitespace (or at once, when the prompt opened it); a ``<think>`` later on is content;
- it ends at the first ``</think>``; a reply cut off before one is all reasoning;
- the newlines around the reasoning are not part of it (``strip("\\n")``), nor are those
  between ``</think>`` and the content (``lstrip("\\n")``): Qwen3's template writes
  ``<think>\\n{reasoning}\\n</think>\\n\\n{content}``;
- empty reasoning is ``None``.

Only what the client is shown is decided here: the sampled tokens stay as they are.
"""

from __future__ import annotations

from typing import Literal, Protocol

OPEN = "<think>"
CLOSE = "</think>"

Kind = Literal["reasoning", "content"]
Piece = tuple[Kind, str]


class PieceStream(Protocol):
    """A reply's text in pieces in, the ``(kind, text)`` pieces that are certain out."""

    def feed(self, text: str) -> list[Piece]: ...

    def finish(self) -> list[Piece]: ...


class ReasoningFormat(Protocol):
    """How reasoning is read out of a reply (``--reasoning-format``): whole, or streamed."""

    name: str

    def split(self, text: str) -> tuple[str | None, str]: ...

    def stream(self) -> PieceStream: ...


class ThinkReasoning:
    """The built-in format (``--reasoning-format think``): ``<think> … </think>`` by the rules above."""

    name = "think"

    def __init__(self, *, starts_open: bool = False) -> None:
        self.starts_open = starts_open

    def split(self, text: str) -> tuple[str | None, str]:
        return split_reasoning(text, starts_open=self.starts_open)

    def stream(self) -> ReasoningStream:
        return ReasoningStream(starts_open=self.starts_open)


def opens_reasoning(generation_prompt: str, open_marker: str = OPEN, close_marker: str = CLOSE) -> bool:
    """True when the generation prompt leaves a ``<think>`` open: replies start inside reasoning."""
    return generation_prompt.rfind(open_marker) > generation_prompt.rfind(close_marker)


def split_reasoning(text: str, *, starts_open: bool = False, open_marker: str = OPEN,
                    close_marker: str = CLOSE) -> tuple[str | None, str]:
    """``(reasoning, content)`` of a whole reply, by the rules in the module docstring."""
    if starts_open:
        start = 0
    else:
        stripped = text.lstrip()
        if not stripped.startswith(open_marker):
            return None, text
        start = len(text) - len(stripped) + len(open_marker)
    end = text.find(close_marker, start)
    if end < 0:
        return text[start:].strip("\n") or None, ""
    return text[start:end].strip("\n") or None, text[end + len(close_marker):].lstrip("\n")


def marker_prefix_len(text: str, marker: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    start = text.find(marker[0], max(0, len(text) - len(marker) + 1))
    while start >= 0:
        if marker.startswith(text[start:]):
            return len(text) - start
        start = text.find(marker[0], start + 1)
    return 0


class ReasoningStream:
    """:func:`split_reasoning` for text that arrives in pieces.

    :meth:`feed` returns the ``("reasoning" | "content", text)`` pieces that are certain;
    text that may still turn out to be a marker, or newlines that may turn out to trail
    the reasoning, wait for more text or for :meth:`finish`.
    """

    def __init__(self, *, starts_open: bool = False, open_marker: str = OPEN, close_marker: str = CLOSE) -> None:
        self._open = open_marker
        self._close = close_marker
        self._state: Literal["start", "reasoning", "after", "content"] = "reasoning" if starts_open else "start"
        self._buffer = ""
        self._reasoning_started = False

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        out: list[Piece] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        if self._state == "start" and self._buffer:
            out.append(("content", self._buffer))
        elif self._state == "reasoning":
            self._emit_reasoning(self._buffer, out, final=True)
        self._buffer = ""
        return out

    def _step(self, out: list[Piece]) -> bool:
        """Advance one state on the buffer; False when it must wait for more text."""
        if self._state == "start":
            return self._start()
        if self._state == "reasoning":
            return self._reasoning(out)
        if self._state == "after":
            rest = self._buffer.lstrip("\n")
            self._buffer = rest
            if rest:
                self._state = "content"
            return bool(rest)
        if self._buffer:
            out.append(("content", self._buffer))
            self._buffer = ""
        return False

    def _start(self) -> bool:
        stripped = self._buffer.lstrip()
        if stripped.startswith(self._open):
            self._buffer = stripped[len(self._open):]
            self._state = "reasoning"
            return True
        if not stripped or self._open.startswith(stripped):
            return False  # only whitespace or a partial marker so far
        self._state = "content"
        return True

    def _reasoning(self, out: list[Piece]) -> bool:
        end = self._buffer.find(self._close)
        if end >= 0:
            self._emit_reasoning(self._buffer[:end], out, final=True)
            self._buffer = self._buffer[end + len(self._close):]
            self._state = "after"
            return True
        partial = marker_prefix_len(self._buffer, self._close)
        body = self._buffer[: len(self._buffer) - partial]
        keep = len(self._buffer) - len(body.rstrip("\n"))  # trailing newlines, then a partial marker
        self._emit_reasoning(self._buffer[: len(self._buffer) - keep], out, final=False)
        self._buffer = self._buffer[len(self._buffer) - keep:]
        return False

    def _emit_reasoning(self, text: str, out: list[Piece], *, final: bool) -> None:
        if not self._reasoning_started:
            text = text.lstrip("\n")
        if final:
            text = text.rstrip("\n")
        if text:
            self._reasoning_started = True
            out.append(("reasoning", text))
