"""The wire-adapter seam: one adapter per model API, one generic route handler for all.

An adapter decodes its wire's request into the wire-neutral :class:`Conversation`,
encodes a :class:`TurnOutcome` (or a ``RollbusError``) in its wire's shape, and turns
a streamed turn's events (:mod:`edge.chat.deltas`) into its wire's server-sent events.
Adapters are pure: no I/O, no session logic. :mod:`edge.routes.model` serves them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from edge.chat.conversation import Conversation, TurnOutcome
from edge.chat.deltas import StreamEvent
from schemas.errors import RollbusError

TokenText = Callable[[Sequence[int]], list[str]]  # each sampled token as text (for log probs)


def sse(data: bytes, event: str | None = None) -> bytes:
    """One server-sent event."""
    head = b"event: " + event.encode() + b"\n" if event is not None else b""
    return head + b"data: " + data + b"\n\n"


class StreamEncoder(Protocol):
    """The server-sent events of one streamed turn (stateful: block indexes, ids)."""

    def event(self, event: StreamEvent) -> bytes: ...

    def error(self, exc: RollbusError) -> bytes: ...


class WireAdapter(Protocol):
    name: str  # recorded with each request: "openai" | "anthropic" | "responses"

    def decode(self, body: bytes, known: Any = None) -> Conversation:
        """``known``: the last :attr:`Conversation.known` of the session on this wire, or None."""
        ...

    def encode(self, outcome: TurnOutcome, conversation: Conversation, token_text: TokenText) -> bytes: ...

    def encode_error(self, exc: RollbusError) -> bytes: ...

    def stream(self, conversation: Conversation, token_text: TokenText) -> StreamEncoder: ...
