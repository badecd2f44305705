"""OpenAI Responses API wire models (the subset rollbus serves), decoded strictly.

Unknown fields are ignored (agents send many: ``id`` and ``status`` on echoed items, ``phase``,
``strict``, ...); known fields must have the right types. Input items decode into one permissive
:class:`InputItem` and tools into one :class:`ToolParam`, so that the adapter can name an item or
tool type it does not serve in a 400. :class:`ResponsesRequest` leaves ``input`` items and
``tools`` as raw JSON (the edge decodes only what it has not seen before).

The answer's shapes (:class:`ResponseObject`, its output items and the stream's events) are
encoded only; their field order is the API's.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

# --- requests ----------------------------------------------------------------------------------


class Part(msgspec.Struct, frozen=True, kw_only=True):
    """A content part (``input_text``, ``output_text``, ...), a summary part (``summary_text``) or a
    reasoning content part (``reasoning_text``): which types are served depends on where it stands."""

    type: str
    text: str | None = None
    image_url: str | None = None  # input_image: a data URL or an http(s) URL
    file_id: str | None = None  # input_image: refused (rollbus holds no files)
    detail: str | None = None  # input_image: accepted; the processor decides the image's tokens


class InputItem(msgspec.Struct, frozen=True, kw_only=True):
    """Any input item; which fields matter depends on ``type`` (a message may leave it out)."""

    type: str = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None  # message
    content: str | list[Part] | None = None  # message; reasoning (reasoning_text parts)
    call_id: str | None = None  # function_call, function_call_output
    name: str | None = None  # function_call
    namespace: str | None = None  # function_call of a function in a namespace
    arguments: str | None = None  # function_call
    output: str | list[Part] | None = None  # function_call_output
    summary: list[Part] | None = None  # reasoning
    encrypted_content: str | None = None  # reasoning


class ToolParam(msgspec.Struct, frozen=True, kw_only=True):
    """Any tool: ``function``, ``namespace`` (functions in ``tools``), or one rollbus cannot run."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    tools: list[ToolParam] | None = None  # namespace


class ToolChoiceParam(msgspec.Struct, frozen=True, kw_only=True):
    type: str  # "function" (with name), "allowed_tools", or a tool type ("web_search", ...)
    name: str | None = None


class ReasoningParam(msgspec.Struct, frozen=True, kw_only=True):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None  # the older name of summary


class TextFormatParam(msgspec.Struct, frozen=True, kw_only=True):
    type: str  # "text", "json_object" or "json_schema" (with name, schema and strict beside type)
    name: str | None = None
    schema: Any = None  # checked as free-form JSON (bounded) when decoded
    strict: bool | None = None
    description: str | None = None


class TextParam(msgspec.Struct, frozen=True, kw_only=True):
    format: TextFormatParam | None = None
    verbosity: str | None = None


class ResponsesRequest(msgspec.Struct, frozen=True, kw_only=True):
    """``input`` items and ``tools`` stay raw JSON; ``tools`` is an empty Raw when absent."""

    input: str | list[msgspec.Raw] | None = None
    model: str = ""
    instructions: str | None = None
    tools: msgspec.Raw = msgspec.Raw(b"")
    tool_choice: Literal["auto", "none", "required"] | ToolChoiceParam | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    reasoning: ReasoningParam | None = None
    text: TextParam | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    client_metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: str | None = None
    include: list[str] | None = None
    store: bool | None = None  # None: true, as on OpenAI's API
    stream: bool | None = None
    stream_options: dict[str, bool] | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    conversation: str | dict[str, str] | None = None
    prompt: dict[str, Any] | None = None


# --- answers ------------------------------------------------------------------------------------


class OutputText(msgspec.Struct, frozen=True, kw_only=True):
    type: str = "output_text"
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class OutputMessage(msgspec.Struct, frozen=True, kw_only=True):
    type: str = "message"
    id: str
    status: str
    role: str = "assistant"
    content: list[OutputText]


class FunctionCallOut(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """(Only ``namespace`` has a default: it is left out when None.)"""

    type: str
    id: str
    call_id: str
    name: str
    arguments: str
    status: str
    namespace: str | None = None


class SummaryText(msgspec.Struct, frozen=True, kw_only=True):
    type: str = "summary_text"
    text: str


class ReasoningText(msgspec.Struct, frozen=True, kw_only=True):
    type: str = "reasoning_text"
    text: str


class ReasoningOut(msgspec.Struct, frozen=True, kw_only=True):
    type: str = "reasoning"
    id: str
    summary: list[SummaryText]
    content: list[ReasoningText]
    encrypted_content: str | None = None
    status: str = "completed"


OutputItem = OutputMessage | FunctionCallOut | ReasoningOut


class InputTokensDetails(msgspec.Struct, frozen=True, kw_only=True):
    cached_tokens: int = 0


class OutputTokensDetails(msgspec.Struct, frozen=True, kw_only=True):
    reasoning_tokens: int = 0


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(msgspec.Struct, frozen=True, kw_only=True):
    reason: str


class ResponseError(msgspec.Struct, frozen=True, kw_only=True):
    code: str
    message: str


class ReasoningEcho(msgspec.Struct, frozen=True, kw_only=True):
    effort: str | None = None
    summary: str | None = None


class FormatEcho(msgspec.Struct, frozen=True, kw_only=True):
    type: str = "text"


class TextEcho(msgspec.Struct, frozen=True, kw_only=True):
    format: FormatEcho = FormatEcho()


class ResponseObject(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: str = "response"
    created_at: int
    status: str  # "in_progress" | "completed" | "incomplete" | "failed"
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[Any]
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: ReasoningEcho = ReasoningEcho()
    store: bool = True
    temperature: float | None = None
    text: TextEcho = TextEcho()
    tool_choice: Any = "auto"
    tools: msgspec.Raw = msgspec.Raw(b"[]")
    top_p: float | None = None
    truncation: str = "disabled"
    usage: Usage | None = None
    user: str | None = None
    metadata: dict[str, str] = {}
    service_tier: str | None = None


# --- stream events (text deltas and lifecycle events are written from byte templates:
# edge.wires.responses_stream) -------------------------------------------------------------------


class ItemEvent(msgspec.Struct, frozen=True, kw_only=True):
    """``response.output_item.added`` / ``.done``."""

    type: str
    output_index: int
    item: Any
    sequence_number: int


class ContentPartEvent(msgspec.Struct, frozen=True, kw_only=True):
    """``response.content_part.added`` / ``.done``."""

    type: str
    item_id: str
    output_index: int
    content_index: int
    part: OutputText
    sequence_number: int


class SummaryPartEvent(msgspec.Struct, frozen=True, kw_only=True):
    """``response.reasoning_summary_part.added`` / ``.done``."""

    type: str
    item_id: str
    output_index: int
    summary_index: int
    part: SummaryText
    sequence_number: int


class TextDoneEvent(msgspec.Struct, frozen=True, kw_only=True):
    """``response.output_text.done`` (``logprobs``), ``response.reasoning_text.done`` (without)."""

    type: str
    item_id: str
    output_index: int
    content_index: int
    text: str
    sequence_number: int
    logprobs: list[Any] | None = None


class SummaryTextDoneEvent(msgspec.Struct, frozen=True, kw_only=True):
    type: str = "response.reasoning_summary_text.done"
    item_id: str
    output_index: int
    summary_index: int
    text: str
    sequence_number: int


class ArgumentsDeltaEvent(msgspec.Struct, frozen=True, kw_only=True):
    type: str = "response.function_call_arguments.delta"
    item_id: str
    output_index: int
    delta: str
    sequence_number: int


class ArgumentsDoneEvent(msgspec.Struct, frozen=True, kw_only=True):
    type: str = "response.function_call_arguments.done"
    item_id: str
    output_index: int
    name: str
    arguments: str
    sequence_number: int
