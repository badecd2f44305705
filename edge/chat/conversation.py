"""The wire-neutral conversation: what every wire adapter decodes into.

OpenAI Chat Completions, Anthropic Messages and OpenAI Responses requests all become a list
of :class:`Message` and a list of :class:`ToolSpec`; the rest of the edge never sees a
wire shape. What a request forces the reply to be is wire-neutral too: :data:`ToolChoice`
(``auto``, ``none``, ``required`` or a :class:`NamedTool`, checked against the tools by
:func:`checked_tool_choice`), whether several calls may come at once
(``parallel_tool_calls``), and an :class:`OutputFormat` (JSON, or JSON valid for a schema).
:mod:`edge.tokens.constraint` derives the engine's constraint from them.

A request may name what the session already holds instead of sending it (the Responses API's
``previous_response_id`` and reasoning references): :attr:`Conversation.continues` and
:attr:`Message.reasoning_ref`, resolved by the edge against the session before the turn
(:mod:`edge.stored`), after it checked that the session they name (:attr:`Conversation.refers_to`)
is the one the request was sent to. :func:`template_message` turns a message into the Hugging Face chat-template
form (``{"role", "content", "tool_calls": [{"type": "function", "function": ...}]}``).

A message's images (:class:`ImagePart`, :attr:`Message.images`) stand apart from its text: each at a
character offset of :attr:`Message.content`, where the template gets the processor's placeholder text
(:func:`template_message`); the edge expands its image pad into the image's tokens (:mod:`edge.tokens.images`).
Text that spells the placeholder's special tokens is never taken for an image.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from schemas.errors import MalformedRequest
from schemas.events import ToolCall
from schemas.values import check_free_form
from vision.images import ImageInfo

Role = Literal["system", "user", "assistant", "tool"]


class ToolSpec(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class NamedTool(msgspec.Struct, frozen=True, kw_only=True):
    """A forced call of this tool (OpenAI ``{"type": "function", "function": {"name"}}``, Anthropic
    ``{"type": "tool", "name"}``)."""

    name: str


ToolChoice = Literal["auto", "none", "required"] | NamedTool
"""``required``: some tool must be called (Anthropic ``any``); a :class:`NamedTool`: that one."""


class OutputFormat(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What the reply's text must be: any JSON object (``json_object``), or JSON valid for ``schema``
    (``json_schema``, with its ``name`` and ``strict`` as the agent sent them)."""

    type: Literal["json_object", "json_schema"]
    schema: dict[str, Any] | None = None
    name: str | None = None
    strict: bool | None = None


def checked_tool_choice(choice: ToolChoice, tools: tuple[ToolSpec, ...], param: str) -> ToolChoice:
    """``choice`` when the tools can satisfy it; a 400 naming ``param`` when it forces a call of a
    tool the request does not define, or any call with no tools at all."""
    if isinstance(choice, NamedTool):
        if not any(tool.name == choice.name for tool in tools):
            known = ", ".join(repr(tool.name) for tool in tools[:20]) or "none"
            raise MalformedRequest(f"tool_choice names {choice.name!r}, which is not among the tools ({known})",
                                   param=param)
    elif choice == "required" and not tools:
        raise MalformedRequest("tool_choice forces a tool call, but the request defines no tools", param=param)
    return choice


def checked_output_format(kind: str, schema: Any, name: str | None, strict: bool | None,
                          param: str) -> OutputFormat | None:
    """The wire's response format as an :class:`OutputFormat` (``text``: None); a 400 naming ``param``
    for another type, or a ``json_schema`` without an object ``schema``."""
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputFormat(type="json_object")
    if kind != "json_schema":
        raise MalformedRequest(f"response format type {kind!r} is not supported (text, json_object, json_schema)",
                               param=f"{param}.type")
    if not isinstance(schema, dict):
        raise MalformedRequest("a json_schema response format needs its schema, a JSON object", param=param)
    check_free_form(schema, f"{param}.schema", ints=False)
    return OutputFormat(type="json_schema", schema=schema, name=name, strict=strict)


class ImagePart(msgspec.Struct, frozen=True, kw_only=True):
    """An image of a message, standing at character ``at`` of its text. A data URL (or base64 source) is
    decoded into ``data`` by the wire adapter; an http(s) URL is ``url`` until the edge fetches it (only
    from the hosts it is allowed to: :mod:`edge.images`). ``info`` is filled by the edge once the image's
    header is read and checked against the limits; ``param`` names the request field it came from."""

    at: int
    param: str
    data: bytes = b""
    media_type: str = ""  # as declared by the request (the header's own is ``info.media_type``)
    url: str = ""
    info: ImageInfo | None = None


class Message(msgspec.Struct, frozen=True, kw_only=True):
    role: Role
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    reasoning: str | None = None
    # The reasoning was sampled by this session's request ``reasoning_ref``: the edge renders that
    # turn's reasoning (``reasoning`` is then what the agent sent with the reference, if anything).
    reasoning_ref: int | None = None
    images: tuple[ImagePart, ...] = ()  # in order of ``at`` (non-decreasing)


class Continuation(msgspec.Struct, frozen=True):
    """A request that continues the stored conversation of an earlier response of a session."""

    session_id: str
    request_no: int


class SamplingOverrides(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What the agent asked for; only these keys ever reach the engine."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] | None = None


class Conversation(msgspec.Struct, frozen=True, kw_only=True):
    """A decoded model request, whatever wire it came from."""

    messages: tuple[Message, ...]
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True  # False: at most one call a reply (what a forced choice admits)
    output_format: OutputFormat | None = None  # None: free text
    sampling: SamplingOverrides = SamplingOverrides()
    stream: bool = False
    stream_usage: bool = False  # OpenAI stream_options.include_usage
    logprobs: bool = False
    model: str = ""
    # Hex digests of messages[: i + 1] (edge.chat.digest.prefix_digests under the tools' digest),
    # when the adapter computed them while decoding; () when not.
    history_digests: tuple[str, ...] = ()
    body_digest: str = ""  # sha256 hex of the body, when the adapter computed it while decoding
    known: Any = None  # what the session's next request is decoded against (edge.wires.prefix.KnownPrefix)
    # Continues the stored conversation of that response: ``messages[:head]`` (the request's own
    # instructions) go first, then the stored messages, then ``messages[head:]`` (edge.stored).
    continues: Continuation | None = None
    head: int = 0
    store: bool = False  # keep this conversation, with its reply, for requests that continue it
    refers_to: str | None = None  # the session the request's references name (checked by the edge)
    options: Any = None  # the adapter's own: what its answer echoes from the request


_json = msgspec.json.Decoder()


def _arguments(text: str) -> Any:
    """Tool-call arguments for the template: a JSON object when they parse, else the text. Parsed
    strictly, as the edge checks and digests them (:func:`edge.wires.strict.check_json_text`,
    :func:`edge.chat.digest.canonical_arguments`): a laxer parser (``json.loads``) would hand the
    template what those refused as text, such as a lone surrogate (``"\\ud800"``), which no encoder
    takes, or ``NaN``, at a depth no bound was checked for."""
    try:
        value = _json.decode(text)
    except (msgspec.DecodeError, RecursionError):
        return text
    return value if isinstance(value, dict) else text


def content_with_images(message: Message, placeholder: str) -> str:
    """The message's text with ``placeholder`` (the processor's, e.g. Qwen2.5-VL's
    ``<|vision_start|><|image_pad|><|vision_end|>``) where each of its images stands."""
    if not message.images:
        return message.content
    text, pieces, cut = message.content, [], 0
    for image in message.images:
        pieces += (text[cut:image.at], placeholder)
        cut = image.at
    pieces.append(text[cut:])
    return "".join(pieces)


def template_message(message: Message, image_placeholder: str = "") -> dict[str, Any]:
    """``image_placeholder``: what the template gets where an image stands (see :func:`content_with_images`)."""
    out: dict[str, Any] = {"role": message.role, "content": content_with_images(message, image_placeholder)}
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
            for c in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    if message.reasoning is not None:
        out["reasoning_content"] = message.reasoning
    return out


def template_tools(tools: tuple[ToolSpec, ...]) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    return [{"type": "function", "function": msgspec.to_builtins(t)} for t in tools]


class TurnOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """A turn's answer, wire-neutral: adapters turn it into OpenAI or Anthropic shapes."""

    session_id: str
    request_no: int
    content: str
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    finish_reason: str  # "stop" | "length" | "tool_calls"
    prompt_tokens: int
    completion_tokens: int
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] | None = None
    created: int
