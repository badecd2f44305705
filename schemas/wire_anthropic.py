"""Anthropic Messages wire models (the subset rollbus serves), decoded strictly.

Unknown fields are ignored (agents send many: ``cache_control`` on any block or tool,
``defer_loading``, ...); known fields must have the right types, those accepted without effect
on the tokens too (``thinking``, ``metadata``, ``context_management``, ``output_config``).
Content blocks decode into one permissive :class:`ContentBlock` so that the adapter can name
an unsupported block type in a 400.
:class:`LazyMessagesRequest` is the same request with its history left as raw JSON.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class ImageSource(msgspec.Struct, frozen=True, kw_only=True):
    """An ``image`` block's ``source``: ``base64`` (``media_type``, ``data``) or ``url`` (``url``)."""

    type: str = ""
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class ContentBlock(msgspec.Struct, frozen=True, kw_only=True):
    """Any request content block; which fields matter depends on ``type``."""

    type: str
    text: str | None = None  # text
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use
    input: dict[str, Any] | None = None  # tool_use
    tool_use_id: str | None = None  # tool_result
    content: str | list[ContentBlock] | None = None  # tool_result
    is_error: bool | None = None  # tool_result
    thinking: str | None = None  # thinking
    signature: str | None = None  # thinking
    source: ImageSource | None = None  # image


class MessageParam(msgspec.Struct, frozen=True, kw_only=True):
    role: Literal["user", "assistant", "system"]  # "system": Claude Code's mid-conversation system messages
    content: str | list[ContentBlock]


class ToolParam(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # "custom" or absent; server tools (e.g. "bash_20250124") are refused


class ToolChoice(msgspec.Struct, frozen=True, kw_only=True):
    type: str  # "auto" | "none" | "any" | "tool" (with its name)
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(msgspec.Struct, frozen=True, kw_only=True):
    max_tokens: int  # required, as on Anthropic's API
    messages: list[MessageParam]
    model: str = ""
    system: str | list[ContentBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None  # accepted; whether the model reasons is the chat template's
    # Accepted (objects, as on Anthropic's API), without effect on the tokens: Claude Code sends them.
    metadata: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None


class CountTokensRequest(msgspec.Struct, frozen=True, kw_only=True):
    """``/v1/messages/count_tokens``: what of a Messages request makes its prompt (no ``max_tokens``)."""

    messages: list[MessageParam]
    model: str = ""
    system: str | list[ContentBlock] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None


class LazyMessagesRequest(msgspec.Struct, frozen=True, kw_only=True):
    """:class:`MessagesRequest` with each message, the system prompt and the tools left as raw
    JSON (the edge decodes only what it has not seen before): the same fields and defaults, but
    that an absent ``system`` or ``tools`` is an empty ``Raw``."""

    max_tokens: int
    messages: list[msgspec.Raw]
    model: str = ""
    system: msgspec.Raw = msgspec.Raw()
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: msgspec.Raw = msgspec.Raw()
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None


# --- responses -----------------------------------------------------------------------


class TextOut(msgspec.Struct, frozen=True, kw_only=True, tag="text", tag_field="type"):
    text: str


class ThinkingOut(msgspec.Struct, frozen=True, kw_only=True, tag="thinking", tag_field="type"):
    thinking: str
    signature: str = ""  # rollbus does not sign reasoning


class ToolUseOut(msgspec.Struct, frozen=True, kw_only=True, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]


BlockOut = TextOut | ThinkingOut | ToolUseOut


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    input_tokens: int
    output_tokens: int


class Message(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    model: str
    content: list[BlockOut]
    stop_reason: str | None  # end_turn | max_tokens | stop_sequence | tool_use; null in message_start
    stop_sequence: str | None
    usage: Usage
    type: str = "message"
    role: str = "assistant"


class ErrorBody(msgspec.Struct, frozen=True, kw_only=True):
    type: str
    message: str


class ErrorResponse(msgspec.Struct, frozen=True, kw_only=True):
    error: ErrorBody
    type: str = "error"


# --- stream events (``event: <type>`` + ``data: <json>``) ---------------------------------


class MessageStart(msgspec.Struct, frozen=True, kw_only=True, tag="message_start", tag_field="type"):
    message: Message


class ContentBlockStart(msgspec.Struct, frozen=True, kw_only=True, tag="content_block_start", tag_field="type"):
    index: int
    content_block: BlockOut


class TextDelta(msgspec.Struct, frozen=True, kw_only=True, tag="text_delta", tag_field="type"):
    text: str


class ThinkingDelta(msgspec.Struct, frozen=True, kw_only=True, tag="thinking_delta", tag_field="type"):
    thinking: str


class InputJsonDelta(msgspec.Struct, frozen=True, kw_only=True, tag="input_json_delta", tag_field="type"):
    partial_json: str


class ContentBlockDelta(msgspec.Struct, frozen=True, kw_only=True, tag="content_block_delta", tag_field="type"):
    index: int
    delta: TextDelta | ThinkingDelta | InputJsonDelta


class ContentBlockStop(msgspec.Struct, frozen=True, kw_only=True, tag="content_block_stop", tag_field="type"):
    index: int


class StopDelta(msgspec.Struct, frozen=True, kw_only=True):
    stop_reason: str
    stop_sequence: str | None


class OutputUsage(msgspec.Struct, frozen=True, kw_only=True):
    output_tokens: int


class MessageDelta(msgspec.Struct, frozen=True, kw_only=True, tag="message_delta", tag_field="type"):
    delta: StopDelta
    usage: OutputUsage


class MessageStop(msgspec.Struct, frozen=True, kw_only=True, tag="message_stop", tag_field="type"):
    pass


StreamEvent = MessageStart | ContentBlockStart | ContentBlockDelta | ContentBlockStop | MessageDelta | MessageStop
