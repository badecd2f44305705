"""The wire-neutral conversation: what every wire adapter decodes into.

OpenAI Chat Completions, Anthropic Messages and OpenAI Responses requests all become a list
of :class:`Message` and a list of :class:`ToolSpec`; the rest of the edge never sees a
wire shape.

A request may name what the session already holds instead of sending it (the Responses API's
``previous_response_id`` and reasoning references): :attr:`Conversation.continues` and
:attr:`Message.reasoning_ref`, resolved by the edge against the session before the turn
(:mod:`edge.stored`), after it checked that the session they name (:attr:`Conversation.refers_to`)
is the one the request was sent to. :func:`template_message` turns a message into the Hugging Face chat-template
form (``{"role", "content", "tool_calls": [{"type": "function", "function": ...}]}``).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from schemas.events import ToolCall

Role = Literal["system", "user", "assistant", "tool"]


class ToolSpec(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


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
    tool_choice: Literal["auto", "none"] = "auto"
    sampling: SamplingOverrides = SamplingOverrides()
    stream: bool = False
    stream_usage: bool = False  # OpenAI stream_options.include_usage
    logprobs: bool = False
    model: str = ""
    # Hex digests of messages[: i + 1] (edge.codec.digest.prefix_digests under the tools' digest),
    # when the adapter computed them while decoding; () when not.
    history_digests: tuple[str, ...] = ()
    body_digest: str = ""  # sha256 hex of the body, when the adapter computed it while decoding
    known: Any = None  # what the session's next request is decoded against (edge.codec.prefix.KnownPrefix)
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
    strictly, as the edge checks and digests them (:func:`edge.codec.strict.check_json_text`,
    :func:`edge.codec.digest.canonical_arguments`): a laxer parser (``json.loads``) would hand the
    template what those refused as text, such as a lone surrogate (``"\\ud800"``), which no encoder
    takes, or ``NaN``, at a depth no bound was checked for."""
    try:
        value = _json.decode(text)
    except (msgspec.DecodeError, RecursionError):
        return text
    return value if isinstance(value, dict) else text


def template_message(message: Message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.content}
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
