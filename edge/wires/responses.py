"""OpenAI Responses API adapter: ``POST /sessions/{id}/v1/responses`` -> :class:`Conversation`,
outcome -> a response object (or its stream, :mod:`edge.wires.responses_stream`).

Decoding: ``instructions`` is a leading system message that belongs to this request only (a
request that continues an earlier response puts its own instructions first, as OpenAI's API
does: they are not carried over); ``input`` a string (one user message) or items
(:mod:`edge.wires.responses_items`, which also flattens ``tools``). Served: ``tool_choice``
``auto`` / ``none`` / ``required`` / ``{"type": "function", "name"}`` and ``text.format``
``json_object`` / ``json_schema`` (sampled under a constraint: :mod:`edge.tokens.constraint`),
``parallel_tool_calls``, ``max_output_tokens``, ``temperature``, ``top_p``, ``stream``, ``store``,
``previous_response_id``, ``include`` (``reasoning.encrypted_content``: reasoning references,
:mod:`edge.wires.reasoning_refs`; ``message.output_text.logprobs``), ``reasoning.summary`` (the
summary is the reasoning itself: rollbus does not summarize). Accepted, recorded, and without
effect on the tokens: ``reasoning.effort`` (whether the model reasons is
the chat template's business), ``text.format`` ``text``, ``text.verbosity``, ``metadata``,
``prompt_cache_key``, ``client_metadata``, ``user``, ``safety_identifier``, ``truncation``,
``service_tier``, ``max_tool_calls``, ``top_logprobs``, ``stream_options``. Refused with a 400
naming the field: a ``tool_choice`` forcing a tool rollbus cannot run or one the request does not
define, ``required`` without tools, a ``text.format`` of another type, ``background``, ``conversation``,
``prompt``, an empty ``input``, and what the items and tools refuse.

A history resent item by item is decoded as OpenAI's messages are: what the session's last request
on this wire had is not parsed again (:mod:`edge.wires.prefix`), the rest once per distinct item.

Encoding: ``output`` is ``[reasoning?, message?, function_call...]`` (a message, empty if need
be, whenever there is no call: the agent sends it back, and its chain continues); ``status``
``completed``, or ``incomplete`` with ``incomplete_details.reason`` ``max_output_tokens`` when the
reply was cut short (by ``max_output_tokens`` or the trajectory's length); ``usage`` with the
reasoning tokens. Ids derive from the session and request number: the response ``resp_<session
id>_<n>``, its items ``rs_`` / ``msg_`` / ``fc_``. Errors are OpenAI's shape.
"""

from __future__ import annotations

import re

import msgspec

from edge.chat.cache import BoundedCache
from edge.chat.conversation import (
    Continuation,
    Conversation,
    Message,
    NamedTool,
    OutputFormat,
    SamplingOverrides,
    ToolChoice,
    TurnOutcome,
    checked_output_format,
    checked_tool_choice,
)
from edge.chat.digest import extend, tools_digest
from edge.wires.adapter import TokenText
from edge.wires.openai import encode_error
from edge.wires.prefix import KnownPrefix, cut_holds, learn, skip_known
from edge.wires.reasoning_refs import ReasoningRefs
from edge.wires.responses_encode import ENCRYPTED, LOGPROBS, ResponsesOptions, encode_response
from edge.wires.responses_items import History, Piece, ToolSet, cached_tools, decode_piece, gather
from edge.wires.responses_stream import ResponsesStream
from edge.wires.strict import check_max_tokens, check_temperature, check_top_p, decode_strict
from schemas import wire_responses as w
from schemas.errors import MalformedRequest, ResponseNotFound, RollbusError

_RESPONSE_ID = re.compile(r"resp_([0-9a-z]{16,64})_([1-9][0-9]{0,9})")


def parse_response_id(text: str, param: str = "previous_response_id") -> Continuation:
    """The session and request number a response id names (a 404 naming ``param`` when it names none)."""
    match = _RESPONSE_ID.fullmatch(text) if len(text) < 100 else None
    if match is None:
        raise ResponseNotFound(f"no response {text[:100]!r}: rollbus response ids are resp_<session id>_<n>",
                               param=param)
    return Continuation(match[1], int(match[2]))


def _unserved(req: w.ResponsesRequest) -> None:
    """Options rollbus does not serve: a 400 naming each."""
    if req.background:
        raise MalformedRequest("background responses are not served", param="background")
    if req.conversation is not None:
        raise MalformedRequest("conversations are not served: send the history, or previous_response_id",
                               param="conversation")
    if req.prompt is not None:
        raise MalformedRequest("prompt templates are not served", param="prompt")


def _output_format(req: w.ResponsesRequest) -> OutputFormat | None:
    """``text.format``: ``text`` (or none), ``json_object``, or ``json_schema`` with ``name``, ``schema`` and
    ``strict`` beside its type (the Responses API's flat form); sampled under a constraint."""
    fmt = req.text.format if req.text is not None else None
    if fmt is None:
        return None
    return checked_output_format(fmt.type, fmt.schema, fmt.name, fmt.strict, "text.format")


def _tool_choice(req: w.ResponsesRequest, tools: ToolSet) -> ToolChoice:
    """``auto`` (also when absent), ``none``, ``required``, or ``{"type": "function", "name"}`` naming one of
    the functions (a namespaced one by its flattened ``<namespace>.<name>``); a forced call of a tool
    rollbus cannot run (a hosted one) is a 400."""
    choice = req.tool_choice
    if choice is None or choice in ("auto", "none", "required"):
        picked = choice or "auto"
        return checked_tool_choice(picked, tools.specs, "tool_choice")  # type: ignore[arg-type]
    if isinstance(choice, w.ToolChoiceParam) and choice.type in tools.unserved:
        raise MalformedRequest(f"tool_choice forces the {choice.type!r} tool, which rollbus cannot run",
                               param="tool_choice")
    if isinstance(choice, w.ToolChoiceParam) and choice.type == "function":
        if not choice.name:
            raise MalformedRequest("a tool_choice of type 'function' needs the function's name",
                                   param="tool_choice.name")
        return checked_tool_choice(NamedTool(name=choice.name), tools.specs, "tool_choice.name")
    raise MalformedRequest("tool_choice must be 'auto', 'none', 'required' or {\"type\": \"function\", \"name\"}",
                           param="tool_choice")


def _sampling(req: w.ResponsesRequest) -> SamplingOverrides:
    check_max_tokens(req.max_output_tokens, "max_output_tokens")
    check_temperature(req.temperature, "temperature")
    check_top_p(req.top_p, "top_p")
    return SamplingOverrides(temperature=req.temperature, top_p=req.top_p, max_tokens=req.max_output_tokens)


def _options(req: w.ResponsesRequest, tools: ToolSet) -> ResponsesOptions:
    include = req.include or ()
    reasoning = req.reasoning
    summary = reasoning.summary or reasoning.generate_summary if reasoning is not None else None
    return ResponsesOptions(
        model=req.model, instructions=req.instructions, max_output_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, parallel_tool_calls=req.parallel_tool_calls is not False,
        previous_response_id=req.previous_response_id, effort=reasoning.effort if reasoning is not None else None,
        summary=summary if summary != "none" else None, store=req.store is not False,
        tool_choice=msgspec.to_builtins(req.tool_choice) if req.tool_choice is not None else "auto",
        tools=tools.echo, truncation=req.truncation or "disabled",
        user=req.user, metadata=req.metadata or {}, service_tier=req.service_tier, namespaced=tools.namespaced,
        encrypted=ENCRYPTED in include, logprobs=LOGPROBS in include)


class ResponsesDecoder:
    """Requests -> conversations, with a cache of decoded items (their references checked under
    this decoder's key, so the cache is its own)."""

    def __init__(self, refs: ReasoningRefs) -> None:
        self._refs = refs
        self._pieces: BoundedCache[bytes, Piece] = BoundedCache()

    def decode(self, body: bytes, known: KnownPrefix | None = None) -> Conversation:
        """As :func:`edge.wires.openai.decode_request`: only what follows ``known``'s items is
        parsed; a request refused that way is decoded again in full, so its error names what it would."""
        document, known, shift = skip_known(body, known)
        if known is None:
            return self._decode(body, body, None, 0)
        try:
            return self._decode(body, document, known, shift)
        except MalformedRequest:
            return self._decode(body, body, None, 0)

    def _piece(self, index: int, raw: bytes) -> Piece:
        piece = self._pieces.get(raw)
        if piece is None:
            piece = self._pieces.put(raw, decode_piece(index, raw, self._refs), 2 * len(raw))
        return piece

    def _decode(self, body: bytes, document: bytes, known: KnownPrefix | None, shift: int) -> Conversation:
        req = decode_strict(document, w.ResponsesRequest)
        raws = req.input if isinstance(req.input, list) else None
        if known is not None and (raws is None or req.previous_response_id is not None
                                  or not cut_holds(document, known, raws)):
            return self._decode(body, body, None, 0)
        _unserved(req)
        tools = cached_tools(bytes(req.tools))
        choice = _tool_choice(req, tools)
        root = tools_digest(tools.specs)
        head = (Message(role="system", content=req.instructions),) if req.instructions else ()
        extra = b"\0" + req.instructions.encode("utf-8", "surrogatepass") if req.instructions is not None else b""
        if known is not None and (known.root != root or known.extra != extra):  # the history's root moved
            return self._decode(body, body, None, 0)
        history, digests = self._history(req, raws, known, root, head)
        if not history.messages:
            raise MalformedRequest("input must not be empty", param="input")
        continues = parse_response_id(req.previous_response_id) if req.previous_response_id is not None else None
        messages = (known.messages if known is not None else head) + history.messages
        prefix, digest = None, ""
        if raws and continues is None and not history.last_assistant:
            prefix, digest = learn(body, document, shift, known, raws, root=root, messages=messages, digests=digests,
                                   tip=history.tip, extra=extra)
        return Conversation(
            messages=messages, history_digests=digests if continues is None else (), tools=tools.specs,
            tool_choice=choice, parallel_tool_calls=req.parallel_tool_calls is not False,
            output_format=_output_format(req), sampling=_sampling(req), stream=bool(req.stream),
            logprobs=LOGPROBS in (req.include or ()), model=req.model, body_digest=digest, known=prefix,
            continues=continues, head=len(head), store=req.store is not False, refers_to=history.refers_to,
            options=_options(req, tools))

    def _history(self, req: w.ResponsesRequest, raws: list[msgspec.Raw] | None, known: KnownPrefix | None,
                 root: bytes, head: tuple[Message, ...]) -> tuple[History, tuple[str, ...]]:
        """The input's messages (after ``known``'s) and the digests of every message (head included)."""
        if raws is None:
            text = req.input if isinstance(req.input, str) else ""
            pieces: list[Piece] = [Piece("message", message=Message(role="user", content=text))] if text else []
        else:
            first = known.count if known is not None else 0
            pieces = [self._piece(index, bytes(raw)) for index, raw in enumerate(raws, first)]
        if known is not None:
            history = gather(pieces, known.tip)
            return history, known.digests + history.digests
        current, head_digests = root, []
        for message in head:
            current = extend(current, message)
            head_digests.append(current.hex())
        history = gather(pieces, current)
        return history, (*head_digests, *history.digests)


class ResponsesWire:
    name = "responses"

    def __init__(self, refs: ReasoningRefs) -> None:
        self.refs = refs
        self._decoder = ResponsesDecoder(refs)

    def decode(self, body: bytes, known: KnownPrefix | None = None) -> Conversation:
        return self._decoder.decode(body, known)

    def encode(self, outcome: TurnOutcome, conversation: Conversation, token_text: TokenText) -> bytes:
        return encode_response(outcome, conversation.options, self.refs, token_text)

    def encode_error(self, exc: RollbusError) -> bytes:
        return encode_error(exc)

    def stream(self, conversation: Conversation, token_text: TokenText) -> ResponsesStream:
        return ResponsesStream(conversation.options, self.refs, token_text)
