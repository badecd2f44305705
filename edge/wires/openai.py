"""OpenAI Chat Completions adapter: wire request -> :class:`Conversation`, outcome -> wire reply.

Decoding is strict about types and explicit about what rollbus does not serve
(``n > 1``, content parts other than text and images): those are 400s with the parameter named, never silently
ignored, and so are sampling values out of range and nesting past the bounds
(:mod:`edge.wires.strict`). ``tool_choice`` ``required`` and ``{"type": "function",
"function": {"name"}}`` (a tool the request defines; else a 400), ``parallel_tool_calls`` and
``response_format`` ``json_object`` / ``json_schema`` are decoded into the conversation, and the
turn is sampled under the constraint they imply (:mod:`edge.tokens.constraint`). ``image_url`` parts of
user and tool messages are the message's images (:mod:`edge.wires.images`), at the character of its text
where they stand.

Streaming (``stream: true``) sends ``chat.completion.chunk`` events: the role, then
``reasoning_content`` and ``content`` deltas as they come, each tool call as a delta with
its id and name then one with its arguments, a last chunk with ``finish_reason`` (and
the log probs of every token, when asked for), a usage chunk when
``stream_options.include_usage``, then ``data: [DONE]``. A failure mid-stream is a
``data: {"error": ...}`` event, which the OpenAI SDK raises.
"""

from __future__ import annotations

import msgspec

from edge.chat.cache import BoundedCache
from edge.chat.conversation import (
    Conversation,
    ImagePart,
    Message,
    NamedTool,
    OutputFormat,
    SamplingOverrides,
    ToolChoice,
    ToolSpec,
    TurnOutcome,
    checked_output_format,
    checked_tool_choice,
)
from edge.chat.deltas import ContentDelta, ReasoningDelta, StreamEvent, StreamFinished, StreamStarted, ToolCallReady
from edge.chat.digest import decode_history, tools_digest
from edge.http_errors import http_error
from edge.wires.adapter import TokenText, sse
from edge.wires.images import TextWithImages, from_url
from edge.wires.prefix import KnownPrefix, cut_holds, learn, skip_known
from edge.wires.strict import TOO_DEEP, check_json_text, check_max_tokens, check_sampling, decode_strict
from schemas.errors import MalformedRequest, RollbusError
from schemas.events import ToolCall
from schemas.values import check_free_form
from schemas.wire_openai import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    ContentPart,
    Delta,
    ErrorBody,
    ErrorResponse,
    FunctionDelta,
    FunctionOut,
    MessageIn,
    MessageOut,
    TokenLogprob,
    ToolCallDelta,
    ToolCallOut,
    ToolDef,
    Usage,
)

_encoder = msgspec.json.Encoder()

_IMAGE_ROLES = ("user", "tool")


def _content(content: str | list[ContentPart] | None, where: str, role: str) -> tuple[str, tuple[ImagePart, ...]]:
    """The message's text and its images (``image_url`` parts, in user and tool messages)."""
    if content is None or isinstance(content, str):
        return content or "", ()
    read = TextWithImages()
    for j, part in enumerate(content):
        if part.type == "text" and part.text is not None:
            read.text(part.text)
        elif part.type == "image_url" and part.image_url is not None and role in _IMAGE_ROLES:
            read.image(from_url(part.image_url.url, read.at, f"{where}[{j}].image_url.url"))
        elif part.type == "image_url":
            why = "needs its image_url" if part.image_url is None else f"is not supported in a {role} message"
            raise MalformedRequest(f"an image_url content part {why}", param=f"{where}[{j}]")
        else:
            raise MalformedRequest(f"content part type {part.type!r} is not supported", param=where)
    return read.content(), tuple(read.images)


def _message(index: int, m: MessageIn) -> Message:
    where = f"messages[{index}]"
    if m.role == "function":
        raise MalformedRequest("role 'function' is deprecated; use 'tool'", param=f"{where}.role")
    calls = tuple(
        ToolCall(id=c.id or f"call_{index}_{i}", name=c.function.name, arguments=c.function.arguments)
        for i, c in enumerate(m.tool_calls or ())
    )
    if calls and m.role != "assistant":
        raise MalformedRequest("only assistant messages carry tool_calls", param=f"{where}.tool_calls")
    for i, call in enumerate(calls):
        check_json_text(call.arguments, f"{where}.tool_calls[{i}].function.arguments")
    content, images = _content(m.content, f"{where}.content", m.role)
    return Message(
        role="system" if m.role == "developer" else m.role,
        content=content,
        images=images,
        tool_calls=calls,
        tool_call_id=m.tool_call_id,
        name=m.name,
        reasoning=m.reasoning_content,
    )


def _tool_choice(req: LazyRequest, tools: tuple[ToolSpec, ...]) -> ToolChoice:
    """``auto`` (also when absent), ``none``, ``required``, or ``{"type": "function", "function":
    {"name": ...}}`` naming one of the tools."""
    choice = req.tool_choice
    if choice is None or choice in ("auto", "none"):
        return choice or "auto"  # type: ignore[return-value]
    if choice == "required":
        return checked_tool_choice("required", tools, "tool_choice")
    if isinstance(choice, str):
        raise MalformedRequest("tool_choice must be 'auto', 'none', 'required' or a named function",
                               param="tool_choice")
    name = (choice.function or {}).get("name")
    if choice.type != "function" or not isinstance(name, str) or not name:
        raise MalformedRequest('a named tool_choice is {"type": "function", "function": {"name": ...}}',
                               param="tool_choice")
    return checked_tool_choice(NamedTool(name=name), tools, "tool_choice")


def _response_format(req: LazyRequest) -> OutputFormat | None:
    """``text`` (or none), ``json_object``, or ``json_schema`` with ``json_schema: {"name", "schema",
    "strict"}``; anything else is a 400."""
    value = req.response_format
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise MalformedRequest('response_format is {"type": "text" | "json_object" | "json_schema", ...}',
                               param="response_format")
    if value["type"] not in ("text", "json_object", "json_schema"):
        raise MalformedRequest(f"response_format type {value['type']!r} is not supported "
                               "(text, json_object, json_schema)", param="response_format.type")
    spec = value.get("json_schema")
    if value["type"] == "json_schema" and not isinstance(spec, dict):
        raise MalformedRequest("a json_schema response_format needs its json_schema object",
                               param="response_format.json_schema")
    spec = spec if isinstance(spec, dict) else {}
    name, strict = spec.get("name"), spec.get("strict")
    return checked_output_format(value["type"], spec.get("schema"), name if isinstance(name, str) else None,
                                 strict if isinstance(strict, bool) else None, "response_format.json_schema")


def _sampling(req: LazyRequest) -> SamplingOverrides:
    if req.n not in (None, 1):
        raise MalformedRequest("n must be 1 (start one session per sample)", param="n")
    check_max_tokens(req.max_completion_tokens, "max_completion_tokens")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    check_sampling(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, max_tokens=req.max_tokens,
                   stop=req.stop)
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop) if req.stop else None
    return SamplingOverrides(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                             max_tokens=max_tokens, stop=stop)


LazyRequest = ChatCompletionRequest[msgspec.Raw, msgspec.Raw]
_message_decoder = msgspec.json.Decoder(MessageIn)


def _decoded_message(index: int, raw: bytes) -> Message:
    try:
        wire = _message_decoder.decode(raw)
    except msgspec.DecodeError as exc:  # invalid JSON or UTF-8, or a wrong shape (ValidationError)
        raise MalformedRequest(f"invalid request: {exc} (in messages[{index}])", param=f"messages[{index}]") from exc
    except RecursionError:
        raise MalformedRequest(f"{TOO_DEEP} (in messages[{index}])", param=f"messages[{index}]") from None
    return _message(index, wire)


_tools_decoder = msgspec.json.Decoder(list[ToolDef] | None)
_TOOLS: BoundedCache[bytes, tuple[tuple[ToolSpec, ...], bytes]] = BoundedCache(max_items=1024)


def _cached_tools(raw: msgspec.Raw | None) -> tuple[tuple[ToolSpec, ...], bytes]:
    """The request's tools and their digest (:func:`tools_digest`), decoded once per distinct JSON (an agent sends
    the same tools every turn)."""
    if raw is None:
        return (), tools_digest(())
    key = bytes(raw)
    cached = _TOOLS.get(key)
    if cached is None:
        try:
            defs = _tools_decoder.decode(key)
        except msgspec.DecodeError as exc:  # a wrong shape, or invalid UTF-8 (which a Raw is not checked for)
            raise MalformedRequest(f"invalid request: {exc} (in tools)", param="tools") from exc
        except RecursionError:
            raise MalformedRequest(f"{TOO_DEEP} (in tools)", param="tools") from None
        for i, tool in enumerate(defs or ()):
            if tool.function.parameters is not None:
                check_free_form(tool.function.parameters, f"tools[{i}].function.parameters", ints=False)
        tools = tuple(ToolSpec(name=t.function.name, description=t.function.description,
                               parameters=t.function.parameters) for t in defs or ())
        cached = _TOOLS.put(key, (tools, tools_digest(tools)), 2 * len(key))
    return cached


def decode_request(body: bytes, known: KnownPrefix | None = None) -> Conversation:
    """The request as a conversation. ``known``: the session's last request's messages, which this
    body most likely starts with (:mod:`edge.wires.prefix`); only what follows them is parsed. A
    request refused on that path is decoded again in full, so its error names what it would have."""
    document, known, shift = skip_known(body, known)
    if known is None:
        return _decode(body, body, None, 0)
    try:
        return _decode(body, document, known, shift)
    except MalformedRequest:
        return _decode(body, body, None, 0)


def _decode(body: bytes, document: bytes, known: KnownPrefix | None, shift: int) -> Conversation:
    req = decode_strict(document, LazyRequest)
    if known is not None and not cut_holds(document, known, req.messages):
        return _decode(body, body, None, 0)
    tools, root = _cached_tools(req.tools)
    if known is not None and known.root != root:  # other tools: the known digests do not apply
        return _decode(body, body, None, 0)
    raws = req.messages
    if known is None:
        if not raws:
            raise MalformedRequest("messages must not be empty", param="messages")
        # Agents resend the whole history: each raw message is decoded (and hashed into the history
        # digests chain matching uses) once per history it follows.
        messages, digests = decode_history(root, map(bytes, raws), _decoded_message)
    else:
        new, new_digests = decode_history(known.tip, map(bytes, raws), _decoded_message, first_index=known.count)
        messages, digests = known.messages + new, known.digests + new_digests
    output_format = _response_format(req)
    prefix, digest = learn(body, document, shift, known, raws, root=root, messages=messages, digests=digests,
                           tip=bytes.fromhex(digests[-1]))
    return Conversation(
        messages=messages,
        history_digests=digests,
        tools=tools,
        tool_choice=_tool_choice(req, tools),
        parallel_tool_calls=req.parallel_tool_calls is not False,
        output_format=output_format,
        sampling=_sampling(req),
        stream=req.stream,
        stream_usage=bool(req.stream and req.stream_options is not None and req.stream_options.include_usage),
        logprobs=bool(req.logprobs),
        model=req.model,
        body_digest=digest,
        known=prefix,
    )


def _completion_id(session_id: str, request_no: int) -> str:
    return f"chatcmpl-{session_id[:12]}-{request_no}"


def _logprobs(outcome: TurnOutcome, token_text: list[str] | None) -> ChoiceLogprobs | None:
    if outcome.logprobs is None or token_text is None:
        return None
    return ChoiceLogprobs(content=[
        TokenLogprob(token=t, logprob=lp) for t, lp in zip(token_text, outcome.logprobs, strict=True)
    ])


def _usage(outcome: TurnOutcome) -> Usage:
    return Usage(prompt_tokens=outcome.prompt_tokens, completion_tokens=outcome.completion_tokens,
                 total_tokens=outcome.prompt_tokens + outcome.completion_tokens)


def encode_completion(outcome: TurnOutcome, *, model: str, logprobs: bool, token_text: list[str] | None) -> bytes:
    calls = [ToolCallOut(id=c.id, function=FunctionOut(name=c.name, arguments=c.arguments))
             for c in outcome.tool_calls]
    message = MessageOut(role="assistant", content=outcome.content if outcome.content or not calls else None,
                         tool_calls=calls or None, reasoning_content=outcome.reasoning)
    completion = ChatCompletion(
        id=_completion_id(outcome.session_id, outcome.request_no),
        created=outcome.created,
        model=model or "rollbus",
        choices=[Choice(index=0, message=message, finish_reason=outcome.finish_reason,
                        logprobs=_logprobs(outcome, token_text) if logprobs else None)],
        usage=_usage(outcome),
    )
    return _encoder.encode(completion)


def encode_error(exc: RollbusError) -> bytes:
    """OpenAI's error shape; ``type`` and ``code`` from the edge's table (:mod:`edge.http_errors`)."""
    row = http_error(exc)
    body = ErrorBody(message=exc.message, type=row.openai_type, param=exc.param, code=row.code)
    return _encoder.encode(ErrorResponse(error=body))


_EMPTY_CONTENT = b'"content":""'  # a text delta's place in its chunk


class OpenAIStream:
    """The ``chat.completion.chunk`` events of one streamed turn.

    A text delta (content or reasoning, most of a stream) is written from a template: the bytes of
    the turn's chunk around its delta, encoded once from the chunk struct when the stream starts,
    with only the delta's text encoded per event (the same bytes the struct encodes to)."""

    def __init__(self, conversation: Conversation, token_text: TokenText) -> None:
        self._conversation = conversation
        self._token_text = token_text
        self._id = ""
        self._created = 0
        self._head = self._tail = b""  # a text delta's chunk: head + b'"content":' + text + tail

    def _chunk(self, delta: Delta, finish_reason: str | None = None, logprobs: ChoiceLogprobs | None = None) -> bytes:
        choice = ChunkChoice(index=0, delta=delta, finish_reason=finish_reason, logprobs=logprobs)
        return sse(_encoder.encode(ChatCompletionChunk(id=self._id, created=self._created,
                                                       model=self._conversation.model or "rollbus",
                                                       choices=[choice])))

    def event(self, event: StreamEvent) -> bytes:
        if isinstance(event, ContentDelta):
            return b"".join((self._head, b'"content":', _encoder.encode(event.text), self._tail))
        if isinstance(event, ReasoningDelta):
            return b"".join((self._head, b'"reasoning_content":', _encoder.encode(event.text), self._tail))
        if isinstance(event, ToolCallReady):
            call = event.call
            head = ToolCallDelta(index=event.index, id=call.id, type="function",
                                 function=FunctionDelta(name=call.name, arguments=""))
            body = ToolCallDelta(index=event.index, function=FunctionDelta(arguments=call.arguments))
            return self._chunk(Delta(tool_calls=[head])) + self._chunk(Delta(tool_calls=[body]))
        if isinstance(event, StreamStarted):
            self._id, self._created = _completion_id(event.session_id, event.request_no), event.created
            head, _, tail = self._chunk(Delta(content="")).rpartition(_EMPTY_CONTENT)  # no JSON string holds it
            self._head, self._tail = head, tail
            return self._chunk(Delta(role="assistant", content=""))
        return self._finish(event)

    def _finish(self, event: StreamFinished) -> bytes:
        outcome = event.outcome
        token_text = self._token_text(outcome.token_ids) if self._conversation.logprobs else None
        out = self._chunk(Delta(), outcome.finish_reason, _logprobs(outcome, token_text))
        if self._conversation.stream_usage:
            out += sse(_encoder.encode(ChatCompletionChunk(id=self._id, created=self._created,
                                                           model=self._conversation.model or "rollbus",
                                                           choices=[], usage=_usage(outcome))))
        return out + b"data: [DONE]\n\n"

    def error(self, exc: RollbusError) -> bytes:
        return sse(encode_error(exc))


class OpenAIWire:
    name = "openai"

    def decode(self, body: bytes, known: KnownPrefix | None = None) -> Conversation:
        return decode_request(body, known)

    def encode(self, outcome: TurnOutcome, conversation: Conversation, token_text: TokenText) -> bytes:
        text = token_text(outcome.token_ids) if conversation.logprobs else None
        return encode_completion(outcome, model=conversation.model, logprobs=conversation.logprobs, token_text=text)

    def encode_error(self, exc: RollbusError) -> bytes:
        return encode_error(exc)

    def stream(self, conversation: Conversation, token_text: TokenText) -> OpenAIStream:
        return OpenAIStream(conversation, token_text)
