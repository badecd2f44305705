"""Anthropic Messages adapter: wire request -> :class:`Conversation`, outcome -> wire reply.

Decoding, into the same neutral messages as OpenAI's (so the same conversation renders
the same tokens on either wire):

- ``system`` (a string or text blocks) becomes a leading system message, without Claude Code's
  request-scoped first line ``x-anthropic-billing-header: ...`` (of the string, or of its first
  text block), which changes on every request: kept, it would start a new chain every turn and
  be trained as prompt (the raw request event still holds the body byte for byte);
- a ``system`` message inside ``messages`` (Claude Code sends them mid-conversation: a string or
  text blocks) becomes a system message where it stands, which the template renders with its
  system role (one that cannot is refused per request: :meth:`TemplateCodec.check_system_placement`);
- a user message's blocks become, in order, a user message per run of text and ``image`` blocks
  (empty text blocks are dropped; the images stand where they were among the text, :mod:`edge.wires.images`)
  and a tool message per ``tool_result`` (its text, or its text and image blocks; ``is_error`` is accepted
  but the chat template has no slot for it);
- an assistant message's ``thinking`` blocks become its reasoning, its text blocks its
  content, its ``tool_use`` blocks its tool calls (``input`` as JSON text);
- a ``tool_use`` block needs its ``id`` and ``name``, a ``tool_result`` its ``tool_use_id``
  (non-empty strings, as on Anthropic's API): without them, a 400 naming the block's field;
- tools ``{name, description, input_schema}``; ``tool_choice`` ``auto`` / ``none`` / ``any`` /
  ``{"type": "tool", "name"}`` (a tool the request defines, else a 400) with
  ``disable_parallel_tool_use``: a forced choice is sampled under a constraint
  (:mod:`edge.tokens.constraint`); ``stop_sequences``, ``max_tokens`` (required), ``temperature``, ``top_p``, ``top_k``;
- a ``count_tokens`` body is the same request without ``max_tokens`` (:func:`decode_count_request`).

Refused with a 400 naming the field: documents and other block types, an image source other than
``base64`` or ``url``,
``redacted_thinking``, server tools, a final assistant message (prefill), sampling values
out of range and nesting past the bounds (:mod:`edge.wires.strict`). ``thinking`` (the request
option), ``metadata``, ``context_management`` and ``output_config`` are accepted and have no
effect: whether the model reasons is the chat template's business.

Agents resend the whole history on every request, so it is decoded lazily, as OpenAI's is:
each message (and the system prompt) stays raw JSON, and is decoded, converted and hashed
into the history digests once per (previous history digest, index, raw JSON); a request
that way refuses is decoded again by value, which words the refusal (:func:`decode_request`).

Encoding: ``content`` is ``[thinking?, text?, tool_use...]`` (a thinking block carries
an empty ``signature``: rollbus does not sign), ``stop_reason`` is ``tool_use``,
``max_tokens``, ``stop_sequence`` (the reply ends with one of the request's
``stop_sequences``) or ``end_turn``. A tool call whose arguments are not a JSON object
(Anthropic's ``input`` must be one) is sent as ``{"arguments": <text>}``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import msgspec

from edge.chat.cache import BoundedCache
from edge.chat.conversation import (
    Conversation,
    ImagePart,
    Message,
    NamedTool,
    SamplingOverrides,
    ToolChoice,
    ToolSpec,
    TurnOutcome,
    checked_tool_choice,
)
from edge.chat.deltas import ContentDelta, ReasoningDelta, StreamEvent, StreamFinished, StreamStarted, ToolCallReady
from edge.chat.digest import decode_expanding_history, tools_digest
from edge.http_errors import http_error
from edge.wires.adapter import TokenText, sse
from edge.wires.images import TextWithImages, from_base64, from_url
from edge.wires.prefix import KnownPrefix, cut_holds, learn, skip_known
from edge.wires.strict import check_sampling, decode_strict
from schemas import wire_anthropic as w
from schemas.errors import ImageRefused, MalformedRequest, RollbusError
from schemas.events import ToolCall
from schemas.values import check_free_form

log = logging.getLogger(__name__)
_encoder = msgspec.json.Encoder()

_STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}


def _unsupported(block: w.ContentBlock, where: str) -> MalformedRequest:
    return MalformedRequest(f"content block type {block.type!r} is not supported", param=f"{where}.type")


def _text_of(blocks: str | list[w.ContentBlock] | None, where: str) -> str:
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    texts = []
    for j, block in enumerate(blocks):
        if block.type != "text" or block.text is None:
            raise _unsupported(block, f"{where}[{j}]")
        texts.append(block.text)
    return "".join(texts)


def _image(block: w.ContentBlock, at: int, where: str) -> ImagePart:
    """An ``image`` block: its ``source``, base64 or a URL (a ``file`` source is refused)."""
    source = block.source
    if source is None:
        raise ImageRefused("an image block needs its source", param=f"{where}.source")
    if source.type == "base64" and source.data is not None:
        return from_base64(source.data, source.media_type, at, f"{where}.source.data")
    if source.type == "url" and source.url is not None:
        return from_url(source.url, at, f"{where}.source.url")
    raise ImageRefused(f"an image source of type {source.type!r} is not supported (base64, url)",
                       param=f"{where}.source.type")


def _content_of(blocks: str | list[w.ContentBlock] | None, where: str) -> tuple[str, tuple[ImagePart, ...]]:
    """A tool result's content: its text, and its image blocks where they stand."""
    if blocks is None or isinstance(blocks, str):
        return blocks or "", ()
    read = TextWithImages()
    for j, block in enumerate(blocks):
        if block.type == "text" and block.text is not None:
            read.text(block.text)
        elif block.type == "image":
            read.image(_image(block, read.at, f"{where}[{j}]"))
        else:
            raise _unsupported(block, f"{where}[{j}]")
    return read.content(), tuple(read.images)


def _user(where: str, content: str | list[w.ContentBlock]) -> tuple[Message, ...]:
    if isinstance(content, str):
        return (Message(role="user", content=content),)
    out: list[Message] = []
    run = TextWithImages()  # the text and image blocks since the last tool result
    for j, block in enumerate(content):
        if block.type == "text" and block.text is not None:
            run.text(block.text)
            continue
        if block.type == "image":
            run.image(_image(block, run.at, f"{where}[{j}]"))
            continue
        if block.type != "tool_result":
            raise _unsupported(block, f"{where}[{j}]")
        if not block.tool_use_id:
            raise MalformedRequest("a tool_result block needs the tool_use_id of its tool_use",
                                   param=f"{where}[{j}].tool_use_id")
        if run:
            out.append(Message(role="user", content=run.content(), images=tuple(run.images)))
        run = TextWithImages()
        text, images = _content_of(block.content, f"{where}[{j}].content")
        out.append(Message(role="tool", content=text, tool_call_id=block.tool_use_id, images=images))
    if run or not out:
        out.append(Message(role="user", content=run.content(), images=tuple(run.images)))
    return tuple(out)


def _assistant(where: str, content: str | list[w.ContentBlock]) -> Message:
    if isinstance(content, str):
        return Message(role="assistant", content=content)
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[ToolCall] = []
    for j, block in enumerate(content):
        if block.type == "text" and block.text is not None:
            texts.append(block.text)
        elif block.type == "thinking" and block.thinking is not None:
            reasoning.append(block.thinking)
        elif block.type == "tool_use":
            calls.append(_tool_use(block, f"{where}[{j}]"))
        else:
            raise _unsupported(block, f"{where}[{j}]")
    return Message(role="assistant", content="".join(texts), tool_calls=tuple(calls),
                   reasoning="".join(reasoning) or None)


def _tool_use(block: w.ContentBlock, where: str) -> ToolCall:
    """A ``tool_use`` block as a tool call: its id and name required (the tool_result names the id)."""
    if not block.id:
        raise MalformedRequest("a tool_use block needs an id", param=f"{where}.id")
    if not block.name:
        raise MalformedRequest("a tool_use block needs a name", param=f"{where}.name")
    if block.input:
        check_free_form(block.input, f"{where}.input", ints=False)
    return ToolCall(id=block.id, name=block.name, arguments=json.dumps(block.input or {}, ensure_ascii=False))


BILLING_HEADER = "x-anthropic-billing-header:"


def _without_first_line(text: str) -> str:
    newline = text.find("\n")
    return "" if newline < 0 else text[newline + 1:]


def _without_billing_header(system: str | list[w.ContentBlock] | None) -> str | list[w.ContentBlock] | None:
    """``system`` without Claude Code's billing header line: the first line of the string, or of the
    first block when that is a text block, if it starts with ``x-anthropic-billing-header:``."""
    if isinstance(system, str):
        return _without_first_line(system) if system.startswith(BILLING_HEADER) else system
    if not system:
        return system
    first = system[0]
    if first.type != "text" or first.text is None or not first.text.startswith(BILLING_HEADER):
        return system
    return [msgspec.structs.replace(first, text=_without_first_line(first.text)), *system[1:]]


def _system(system: str | list[w.ContentBlock] | None) -> tuple[Message, ...]:
    """The system prompt (without a billing header line) as a leading system message; none when it
    is absent or empty."""
    text = _text_of(_without_billing_header(system), "system")
    return (Message(role="system", content=text),) if text else ()


def _message(index: int, m: w.MessageParam) -> tuple[Message, ...]:
    """``messages[index]`` as neutral messages. What comes out depends on the message (and, in
    what a refusal names, its index), on nothing else in the request."""
    where = f"messages[{index}].content"
    if m.role == "system":  # where it stands: the chat template's system role
        return (Message(role="system", content=_text_of(m.content, where)),)
    return _user(where, m.content) if m.role == "user" else (_assistant(where, m.content),)


def neutral_messages(req: w.MessagesRequest | w.CountTokensRequest) -> tuple[Message, ...]:
    """The request's system prompt and messages as neutral messages."""
    out = list(_system(req.system))
    for i, m in enumerate(req.messages):
        out += _message(i, m)
    return tuple(out)


def _tool_specs(tools: Sequence[w.ToolParam]) -> tuple[ToolSpec, ...]:
    for i, tool in enumerate(tools):
        if tool.type not in (None, "custom"):
            raise MalformedRequest(f"server tool {tool.type!r} is not supported", param=f"tools[{i}].type")
        if tool.input_schema is not None:
            check_free_form(tool.input_schema, f"tools[{i}].input_schema", ints=False)
    return tuple(ToolSpec(name=t.name, description=t.description, parameters=t.input_schema) for t in tools)


def _tool_choice(req: w.MessagesRequest | w.LazyMessagesRequest, tools: tuple[ToolSpec, ...]) -> ToolChoice:
    """``auto`` (also when absent), ``none``, ``any`` (as ``required``) or ``tool`` with the name of
    one of the tools."""
    choice = req.tool_choice
    if choice is None or choice.type in ("auto", "none"):
        return choice.type if choice is not None else "auto"  # type: ignore[return-value]
    if choice.type == "any":
        return checked_tool_choice("required", tools, "tool_choice")
    if choice.type != "tool":
        raise MalformedRequest("tool_choice.type must be 'auto', 'none', 'any' or 'tool'", param="tool_choice.type")
    if not choice.name:
        raise MalformedRequest("a tool_choice of type 'tool' needs the tool's name", param="tool_choice.name")
    return checked_tool_choice(NamedTool(name=choice.name), tools, "tool_choice.name")


def _parallel(req: w.MessagesRequest | w.LazyMessagesRequest) -> bool:
    return not (req.tool_choice is not None and req.tool_choice.disable_parallel_tool_use)


def _sampling(req: w.MessagesRequest | w.LazyMessagesRequest) -> SamplingOverrides:
    check_sampling(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                   stop=req.stop_sequences, stop_param="stop_sequences")
    stop = tuple(req.stop_sequences) if req.stop_sequences else None
    return SamplingOverrides(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                             max_tokens=req.max_tokens, stop=stop)


def decode_request(body: bytes, known: KnownPrefix | None = None) -> Conversation:
    """Incrementally (:func:`_decode_incrementally`); a request that way refuses, or fails on, is
    decoded by value (:func:`_decode_by_value`), whose answer it gets: the same error, raised in
    the same order of checks (the whole request's types first, then its messages in order, then
    tools, tool_choice and sampling), or (were the incremental way stricter) the same conversation."""
    try:
        return _decode_incrementally(body, known)
    except Exception:
        return _decode_by_value(body)


def _prompt_messages(req: w.MessagesRequest | w.CountTokensRequest) -> tuple[Message, ...]:
    if not req.messages:
        raise MalformedRequest("messages must not be empty", param="messages")
    if req.messages[-1].role == "assistant":
        raise MalformedRequest("a final assistant message (prefill) is not supported", param="messages")
    return neutral_messages(req)


def decode_count_request(body: bytes) -> Conversation:
    """A ``count_tokens`` body: the conversation ``/v1/messages`` would render for it, with the same
    refusals (``tool_choice``, ``thinking`` and the like do not change the prompt)."""
    req = decode_strict(body, w.CountTokensRequest)
    return Conversation(messages=_prompt_messages(req), tools=_tool_specs(req.tools or ()), model=req.model)


def _decode_by_value(body: bytes) -> Conversation:
    req = decode_strict(body, w.MessagesRequest)
    messages = _prompt_messages(req)
    tools = _tool_specs(req.tools or ())
    return Conversation(messages=messages, tools=tools, tool_choice=_tool_choice(req, tools),
                        parallel_tool_calls=_parallel(req), sampling=_sampling(req), stream=req.stream,
                        model=req.model)


_SYSTEM = -1  # the system prompt's index in the history (the key its decoding is remembered by)
_message_decoder = msgspec.json.Decoder(w.MessageParam)
_system_decoder = msgspec.json.Decoder(str | list[w.ContentBlock] | None)
_tools_decoder = msgspec.json.Decoder(list[w.ToolParam] | None)
_TOOLS: BoundedCache[bytes, tuple[tuple[ToolSpec, ...], bytes]] = BoundedCache(max_items=1024)


def _decoded(index: int, raw: bytes) -> tuple[Message, ...]:
    """A history entry's raw JSON (``messages[index]``, or the system prompt) as neutral messages."""
    if index == _SYSTEM:
        return _system(_system_decoder.decode(raw))
    return _message(index, _message_decoder.decode(raw))


def _history(req: w.LazyMessagesRequest) -> list[tuple[int, bytes]]:
    history = list(enumerate(map(bytes, req.messages)))
    if req.system:
        history.insert(0, (_SYSTEM, bytes(req.system)))
    return history


def _cached_tools(raw: msgspec.Raw) -> tuple[tuple[ToolSpec, ...], bytes]:
    """The request's tools and their digest (:func:`tools_digest`), decoded once per distinct JSON (an agent sends
    the same tools every turn)."""
    if not raw:
        return (), tools_digest(())
    key = bytes(raw)
    cached = _TOOLS.get(key)
    if cached is None:
        tools = _tool_specs(_tools_decoder.decode(key) or ())
        cached = _TOOLS.put(key, (tools, tools_digest(tools)), 2 * len(key))
    return cached


def _system_key(raw: bytes) -> bytes:
    """What the history depends on in the raw system prompt: the raw JSON itself, or, when it may
    hold a billing header line (which changes every request), the system message it becomes (so a
    new header does not make the session's known prefix stale)."""
    if BILLING_HEADER.encode() not in raw:
        return raw
    try:
        return b"\0" + _encoder.encode(_decoded(_SYSTEM, raw))
    except Exception:  # refused: the full decoding words it
        return raw


def _decode_incrementally(body: bytes, known: KnownPrefix | None = None) -> Conversation:
    """The request with its history decoded, converted and hashed once per (previous history
    digest, index, raw JSON) of each message (:func:`decode_expanding_history`): a resent history
    costs a lookup a message, and what the session's last request had is not even parsed
    (``known``, :mod:`edge.wires.prefix`). Any refusal here is the by-value decoding's to word."""
    document, known, shift = skip_known(body, known)
    req = decode_strict(document, w.LazyMessagesRequest)
    if known is not None and not cut_holds(document, known, req.messages):
        return _decode_incrementally(body)
    tools, root = _cached_tools(req.tools)
    system = _system_key(bytes(req.system)) if req.system else b""
    if known is not None and (known.root != root or known.extra != system):  # the history's root moved
        return _decode_incrementally(body)
    if known is None:
        if not req.messages:
            raise MalformedRequest("messages must not be empty", param="messages")
        messages, digests, tip = decode_expanding_history(root, _history(req), _decoded)
    else:
        new, new_digests, tip = decode_expanding_history(
            known.tip, enumerate(map(bytes, req.messages), known.count), _decoded)
        messages, digests = known.messages + new, known.digests + new_digests
    # The last message is an assistant one exactly when the last wire message is: an assistant
    # message becomes one assistant message, a user message only user and tool messages.
    if messages[-1].role == "assistant":
        raise MalformedRequest("a final assistant message (prefill) is not supported", param="messages")
    prefix, digest = learn(body, document, shift, known, req.messages, root=root, messages=messages,
                           digests=digests, tip=tip, extra=system)
    return Conversation(messages=messages, history_digests=digests, tools=tools,
                        tool_choice=_tool_choice(req, tools), parallel_tool_calls=_parallel(req),
                        sampling=_sampling(req), stream=req.stream, model=req.model, body_digest=digest,
                        known=prefix)


# --- encoding -------------------------------------------------------------------------------


def _input(call: ToolCall) -> dict[str, Any]:
    try:
        value = json.loads(call.arguments)
    except ValueError:
        value = None
    if isinstance(value, dict):
        return value
    log.warning("tool call %s: arguments are not a JSON object; sent as {'arguments': text}", call.id)
    return {"arguments": call.arguments}


def _stop(outcome: TurnOutcome, conversation: Conversation) -> tuple[str, str | None]:
    if outcome.finish_reason in _STOP_REASONS:
        return _STOP_REASONS[outcome.finish_reason], None
    for stop in conversation.sampling.stop or ():
        if outcome.content.endswith(stop):
            return "stop_sequence", stop
    return "end_turn", None


def _message_id(session_id: str, request_no: int) -> str:
    return f"msg_{session_id[:12]}_{request_no}"


def _blocks(outcome: TurnOutcome) -> list[w.BlockOut]:
    blocks: list[w.BlockOut] = [w.ThinkingOut(thinking=outcome.reasoning)] if outcome.reasoning else []
    if outcome.content:
        blocks.append(w.TextOut(text=outcome.content))
    blocks.extend(w.ToolUseOut(id=c.id, name=c.name, input=_input(c)) for c in outcome.tool_calls)
    return blocks


def encode_message(outcome: TurnOutcome, conversation: Conversation) -> bytes:
    stop_reason, stop_sequence = _stop(outcome, conversation)
    return _encoder.encode(w.Message(
        id=_message_id(outcome.session_id, outcome.request_no), model=conversation.model or "rollbus",
        content=_blocks(outcome), stop_reason=stop_reason, stop_sequence=stop_sequence,
        usage=w.Usage(input_tokens=outcome.prompt_tokens, output_tokens=outcome.completion_tokens)))


def encode_error(exc: RollbusError) -> bytes:
    """Anthropic's shape has no ``param``: the field is named at the head of the message. ``type``
    from the edge's table (:mod:`edge.http_errors`)."""
    kind = http_error(exc).anthropic_type
    message = f"{exc.param}: {exc.message}" if exc.param else exc.message
    return _encoder.encode(w.ErrorResponse(error=w.ErrorBody(type=kind, message=message)))


_TEXT_BLOCKS: dict[str, tuple[w.BlockOut, w.TextDelta | w.ThinkingDelta]] = {  # a block's start, an empty delta
    "text": (w.TextOut(text=""), w.TextDelta(text="")),
    "thinking": (w.ThinkingOut(thinking=""), w.ThinkingDelta(thinking="")),
}


class AnthropicStream:
    """``message_start``, content blocks (thinking, text, tool_use) as they come, then
    ``message_delta`` and ``message_stop``.

    A text or thinking delta (most of a stream) is written from a template: the bytes of its
    ``content_block_delta`` event around the text, encoded once from the event struct when its block
    opens, with only the text encoded per event (the same bytes the struct encodes to)."""

    def __init__(self, conversation: Conversation) -> None:
        self._conversation = conversation
        self._index = -1
        self._open: str | None = None  # type of the block being written
        self._head = self._tail = b""  # the open text/thinking block's delta event: head + text + tail

    def _send(self, event: w.StreamEvent) -> bytes:
        return sse(_encoder.encode(event), type(event).__struct_config__.tag)  # type: ignore[arg-type]

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        self._open = None
        return self._send(w.ContentBlockStop(index=self._index))

    def _block(self, kind: str, start: w.BlockOut) -> bytes:
        if self._open == kind:
            return b""
        out = self._close()
        self._index += 1
        self._open = kind
        return out + self._send(w.ContentBlockStart(index=self._index, content_block=start))

    def _text_block(self, kind: str, text: str) -> bytes:
        """A text or thinking delta, its block opened first when it is not the open one."""
        out = b""
        if self._open != kind:
            start, empty = _TEXT_BLOCKS[kind]
            out = self._block(kind, start)
            probe = self._send(w.ContentBlockDelta(index=self._index, delta=empty))
            self._head, _, self._tail = probe.rpartition(b'""')  # the empty text: the event's last string
        return b"".join((out, self._head, _encoder.encode(text), self._tail))

    def event(self, event: StreamEvent) -> bytes:
        if isinstance(event, ReasoningDelta):
            return self._text_block("thinking", event.text)
        if isinstance(event, ContentDelta):
            return self._text_block("text", event.text)
        if isinstance(event, ToolCallReady):
            call = event.call
            out = self._block(f"tool_use:{event.index}", w.ToolUseOut(id=call.id, name=call.name, input={}))
            partial = _encoder.encode(_input(call)).decode()
            return out + self._send(w.ContentBlockDelta(index=self._index, delta=w.InputJsonDelta(
                partial_json=partial))) + self._close()
        if isinstance(event, StreamStarted):
            return self._send(w.MessageStart(message=w.Message(
                id=_message_id(event.session_id, event.request_no), model=self._conversation.model or "rollbus",
                content=[], stop_reason=None, stop_sequence=None,
                usage=w.Usage(input_tokens=event.prompt_tokens, output_tokens=0))))
        return self._finish(event)

    def _finish(self, event: StreamFinished) -> bytes:
        outcome = event.outcome
        stop_reason, stop_sequence = _stop(outcome, self._conversation)
        return self._close() + self._send(w.MessageDelta(
            delta=w.StopDelta(stop_reason=stop_reason, stop_sequence=stop_sequence),
            usage=w.OutputUsage(output_tokens=outcome.completion_tokens))) + self._send(w.MessageStop())

    def error(self, exc: RollbusError) -> bytes:
        return sse(encode_error(exc), "error")


class AnthropicWire:
    name = "anthropic"

    def decode(self, body: bytes, known: KnownPrefix | None = None) -> Conversation:
        return decode_request(body, known)

    def encode(self, outcome: TurnOutcome, conversation: Conversation, token_text: TokenText) -> bytes:
        return encode_message(outcome, conversation)

    def encode_error(self, exc: RollbusError) -> bytes:
        return encode_error(exc)

    def stream(self, conversation: Conversation, token_text: TokenText) -> AnthropicStream:
        return AnthropicStream(conversation)
