"""OpenAI Chat Completions wire models (the subset rollbus serves), decoded strictly.

Unknown fields are ignored (agents send many); known fields must have the right types.
"""

from __future__ import annotations

from typing import Any, Generic, Literal, TypeVar

import msgspec


class ImageURL(msgspec.Struct, frozen=True, kw_only=True):
    url: str  # a data URL (data:image/png;base64,...) or an http(s) URL
    detail: str | None = None  # accepted; the processor decides the image's tokens


class ContentPart(msgspec.Struct, frozen=True, kw_only=True):
    type: str
    text: str | None = None
    image_url: ImageURL | None = None  # type "image_url"


class FunctionCall(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    arguments: str = ""


class ToolCallIn(msgspec.Struct, frozen=True, kw_only=True):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class MessageIn(msgspec.Struct, frozen=True, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDef(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(msgspec.Struct, frozen=True, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedToolChoice(msgspec.Struct, frozen=True, kw_only=True):
    type: str
    function: dict[str, Any] | None = None


class StreamOptions(msgspec.Struct, frozen=True, kw_only=True):
    include_usage: bool = False


M = TypeVar("M")
T = TypeVar("T")


class ChatCompletionRequest(msgspec.Struct, Generic[M, T], frozen=True, kw_only=True):
    """``ChatCompletionRequest[MessageIn, list[ToolDef] | None]`` decodes everything;
    ``[msgspec.Raw, msgspec.Raw]`` leaves each message, and the tools, as raw JSON (the edge
    decodes only what it has not seen before). ``tools`` is None when absent."""

    messages: list[M]
    model: str = ""
    tools: T = None  # type: ignore[assignment]
    tool_choice: str | NamedToolChoice | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stop: str | list[str] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    n: int | None = None
    seed: int | None = None
    parallel_tool_calls: bool | None = None
    user: str | None = None
    response_format: Any = None  # text, json_object or json_schema (edge.wires.openai checks the shape)


# --- responses -----------------------------------------------------------------------


class FunctionOut(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    arguments: str


class ToolCallOut(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    function: FunctionOut
    type: str = "function"


class MessageOut(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    role: str  # required, so always on the wire
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | None = None


class TokenLogprob(msgspec.Struct, frozen=True, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[Any] = []


class ChoiceLogprobs(msgspec.Struct, frozen=True, kw_only=True):
    content: list[TokenLogprob]


class Choice(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    message: MessageOut
    finish_reason: str
    logprobs: ChoiceLogprobs | None = None


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    object: str = "chat.completion"


class ErrorBody(msgspec.Struct, frozen=True, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct, frozen=True, kw_only=True):
    error: ErrorBody


# --- streaming chunks ------------------------------------------------------------------


class FunctionDelta(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionDelta | None = None


class Delta(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"
