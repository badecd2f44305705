"""What a streamed turn tells its client, wire-neutral: each wire adapter turns these into
its own events (OpenAI chunks, Anthropic ``message_start`` … ``message_stop``).

A stream is one :class:`StreamStarted`, then any number of :class:`ReasoningDelta`,
:class:`ContentDelta` and :class:`ToolCallReady` (in the order the model wrote them),
then one :class:`StreamFinished` once the turn is in the log, or a ``RollbusError``.
"""

from __future__ import annotations

import msgspec

from edge.chat.conversation import TurnOutcome
from schemas.events import ToolCall


class StreamStarted(msgspec.Struct, frozen=True, kw_only=True):
    session_id: str
    request_no: int
    created: int
    prompt_tokens: int


class ReasoningDelta(msgspec.Struct, frozen=True):
    text: str


class ContentDelta(msgspec.Struct, frozen=True):
    text: str


class ToolCallReady(msgspec.Struct, frozen=True):
    index: int
    call: ToolCall


class StreamFinished(msgspec.Struct, frozen=True):
    outcome: TurnOutcome


Delta = ReasoningDelta | ContentDelta | ToolCallReady
StreamEvent = StreamStarted | ReasoningDelta | ContentDelta | ToolCallReady | StreamFinished
