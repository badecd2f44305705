"""Responses API input items and tools, as neutral messages and tool specs.

**Items** (each decoded strictly, once per distinct raw JSON: an agent resends its history):

- ``message``: ``user``, ``system``, ``developer`` (a system message, as on the chat wire) or
  ``assistant``; its content a string or text parts (``input_text``, ``output_text``), joined, and in a
  user message ``input_image`` parts (``image_url``: a data URL, or an http(s) URL the edge may fetch), the
  message's images where they stand (:mod:`edge.wires.images`);
- ``function_call`` (``call_id``, ``name``, ``arguments``, and ``namespace`` for a function of a
  namespace: the call's name is then ``<namespace>.<name>``, as the tools are flattened below);
- ``function_call_output`` (``call_id``; ``output`` a string or text and ``input_image`` parts): a tool message;
- ``reasoning``: its ``content`` (``reasoning_text`` parts), else its ``summary``
  (``summary_text`` parts, joined by a blank line), is the assistant message's reasoning; an
  ``encrypted_content`` must be a reference rollbus issued (:mod:`edge.wires.reasoning_refs`):
  the turn it names is the reasoning's, whatever text came with it.

The assistant items of one response (reasoning, then a message, then function calls: the order
rollbus writes them) become **one assistant message**, the reply the session's chain holds, so a
history sent back item by item continues its chain. A reasoning item after an assistant message
or call, or a message after a call, starts the next assistant message. Any other item type
(``item_reference``, files, an image by ``file_id``, hosted tools' calls, ``custom_tool_call``) is a 400
naming it.

**Tools**: ``function`` tools as they are (``strict`` accepted; rollbus does not constrain the
arguments). A ``namespace`` groups functions the model calls as ``<namespace>.<function>``: that
is how OpenAI's own open-weight format shows them (harmony renders each namespace as a block
``namespace crm { ... }`` and the model addresses ``crm.list_orders``, as it addresses plain
functions as ``functions.get_weather``). A chat template has one flat list of functions, so each
function of a namespace is listed as ``<namespace>.<function>``, its description the namespace's
description, a blank line, and its own; a call of that name is answered as a ``function_call``
with ``namespace`` and the bare ``name``. Tools rollbus cannot run (``web_search``, ``file_search``,
``code_interpreter``, ``computer_use_preview``, ``image_generation``, ``mcp``, ``custom``, ...)
are left out of the prompt (the logged request keeps them); forcing one is a 400.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import msgspec

from edge.chat.cache import BoundedCache
from edge.chat.conversation import ImagePart, Message, ToolSpec
from edge.chat.digest import extend
from edge.wires.images import TextWithImages, from_url
from edge.wires.reasoning_refs import ReasoningRefs
from edge.wires.strict import TOO_DEEP, check_json_text
from schemas.errors import ImageRefused, MalformedRequest
from schemas.events import ToolCall
from schemas.values import check_free_form
from schemas.wire_responses import InputItem, Part, ToolParam

Kind = Literal["message", "reasoning", "text", "call"]
_TEXT_PARTS = ("input_text", "output_text")
_ASSISTANT_STAGE = {"reasoning": 0, "text": 1, "call": 2}


class Piece(msgspec.Struct, frozen=True):
    """One input item, converted: a whole message, or a part of an assistant message."""

    kind: Kind
    message: Message | None = None  # "message"
    text: str | None = None  # "text", "reasoning"
    call: ToolCall | None = None  # "call"
    ref: tuple[str, int] | None = None  # "reasoning": (session_id, request_no) of its reference

    @property
    def assistant(self) -> bool:
        return self.kind != "message"


def _parts_text(parts: str | list[Part] | None, where: str, allowed: tuple[str, ...] = _TEXT_PARTS) -> str:
    if parts is None or isinstance(parts, str):
        return parts or ""
    texts = []
    for j, part in enumerate(parts):
        if part.type not in allowed or part.text is None:
            raise MalformedRequest(f"content part type {part.type!r} is not supported", param=f"{where}[{j}].type")
        texts.append(part.text)
    return "".join(texts)


def _parts_content(parts: str | list[Part] | None, where: str) -> tuple[str, tuple[ImagePart, ...]]:
    """Text parts joined, and ``input_image`` parts as the images where they stand."""
    if parts is None or isinstance(parts, str):
        return parts or "", ()
    read = TextWithImages()
    for j, part in enumerate(parts):
        if part.type in _TEXT_PARTS and part.text is not None:
            read.text(part.text)
        elif part.type == "input_image" and part.image_url is not None:
            read.image(from_url(part.image_url, read.at, f"{where}[{j}].image_url"))
        elif part.type == "input_image":
            raise ImageRefused("an input_image needs an image_url (a data URL; rollbus holds no files)",
                               param=f"{where}[{j}].image_url")
        else:
            raise MalformedRequest(f"content part type {part.type!r} is not supported", param=f"{where}[{j}].type")
    return read.content(), tuple(read.images)


def _required(value: str | None, what: str, where: str) -> str:
    if not value:
        raise MalformedRequest(f"a {what} needs a non-empty {where.rpartition('.')[2]}", param=where)
    return value


def _message(item: InputItem, where: str) -> Piece:
    if item.role is None:
        raise MalformedRequest("a message needs a role", param=f"{where}.role")
    if item.role == "assistant":
        return Piece("text", text=_parts_text(item.content, f"{where}.content"))
    if item.role != "user":
        return Piece("message", message=Message(role="system", content=_parts_text(item.content, f"{where}.content")))
    text, images = _parts_content(item.content, f"{where}.content")
    return Piece("message", message=Message(role="user", content=text, images=images))


def _call(item: InputItem, where: str) -> Piece:
    call_id = _required(item.call_id, "function_call", f"{where}.call_id")
    name = _required(item.name, "function_call", f"{where}.name")
    if item.arguments is None:
        raise MalformedRequest("a function_call needs its arguments", param=f"{where}.arguments")
    check_json_text(item.arguments, f"{where}.arguments")
    qualified = f"{item.namespace}.{name}" if item.namespace else name
    return Piece("call", call=ToolCall(id=call_id, name=qualified, arguments=item.arguments))


def _output(item: InputItem, where: str) -> Piece:
    call_id = _required(item.call_id, "function_call_output", f"{where}.call_id")
    text, images = _parts_content(item.output, f"{where}.output")
    return Piece("message", message=Message(role="tool", content=text, tool_call_id=call_id, images=images))


def _reasoning(item: InputItem, where: str, refs: ReasoningRefs) -> Piece:
    if item.content:
        text = _parts_text(item.content, f"{where}.content", ("reasoning_text",))
    else:
        summary = item.summary or []
        text = "\n\n".join(_parts_text([part], f"{where}.summary", ("summary_text",)) for part in summary)
    ref = refs.check(item.encrypted_content, f"{where}.encrypted_content") if item.encrypted_content else None
    return Piece("reasoning", text=text or None, ref=ref)


_item_decoder = msgspec.json.Decoder(InputItem)


def decode_piece(index: int, raw: bytes, refs: ReasoningRefs) -> Piece:
    """``input[index]`` (its raw JSON) as a piece."""
    where = f"input[{index}]"
    try:
        item = _item_decoder.decode(raw)
    except msgspec.DecodeError as exc:  # invalid JSON or UTF-8, or a wrong shape (ValidationError)
        raise MalformedRequest(f"invalid request: {exc} (in {where})", param=where) from exc
    except RecursionError:
        raise MalformedRequest(f"{TOO_DEEP} (in {where})", param=where) from None
    if item.type == "message":
        return _message(item, where)
    if item.type == "function_call":
        return _call(item, where)
    if item.type == "function_call_output":
        return _output(item, where)
    if item.type == "reasoning":
        return _reasoning(item, where, refs)
    raise MalformedRequest(f"input item type {item.type!r} is not supported", param=f"{where}.type")


class _Assistant:
    """The assistant message being gathered from consecutive assistant items."""

    __slots__ = ("calls", "reasoning", "ref", "stage", "texts")

    def __init__(self) -> None:
        self.stage = -1
        self.reasoning: list[str] = []
        self.ref: int | None = None
        self.texts: list[str] = []
        self.calls: list[ToolCall] = []

    def takes(self, piece: Piece) -> bool:
        """Whether ``piece`` belongs to this message (else it starts the next one)."""
        return _ASSISTANT_STAGE[piece.kind] >= self.stage

    def add(self, piece: Piece) -> None:
        self.stage = max(self.stage, _ASSISTANT_STAGE[piece.kind])
        if piece.kind == "reasoning":
            if piece.text:
                self.reasoning.append(piece.text)
            if piece.ref is not None and self.ref is None:
                self.ref = piece.ref[1]
        elif piece.kind == "text":
            self.texts.append(piece.text or "")
        elif piece.call is not None:
            self.calls.append(piece.call)

    def message(self) -> Message:
        return Message(role="assistant", content="".join(self.texts), tool_calls=tuple(self.calls),
                       reasoning="\n\n".join(self.reasoning) or None, reasoning_ref=self.ref)


class History(msgspec.Struct, frozen=True):
    messages: tuple[Message, ...]
    digests: tuple[str, ...]  # hex history digests of the messages (after those before them)
    tip: bytes  # the digest after the last message (``start`` when there is none)
    refers_to: str | None  # the session the pieces' references name
    last_assistant: bool  # the last piece is an assistant one (the next items may join its message)


def gather(pieces: Iterable[Piece], start: bytes) -> History:
    """Neutral messages from pieces in order, with their history digests from ``start``."""
    messages: list[Message] = []
    assistant: _Assistant | None = None
    sessions: set[str] = set()
    last_assistant = False
    for piece in pieces:
        last_assistant = piece.assistant
        if piece.ref is not None:
            sessions.add(piece.ref[0])
        if not piece.assistant:
            if assistant is not None:
                messages.append(assistant.message())
                assistant = None
            messages.append(piece.message)  # type: ignore[arg-type]
            continue
        if assistant is not None and not assistant.takes(piece):
            messages.append(assistant.message())
            assistant = None
        if assistant is None:
            assistant = _Assistant()
        assistant.add(piece)
    if assistant is not None:
        messages.append(assistant.message())
    if len(sessions) > 1:
        raise MalformedRequest("the reasoning items' encrypted_content name different sessions", param="input")
    digests, current = [], start
    for message in messages:
        current = extend(current, message)
        digests.append(current.hex())
    return History(tuple(messages), tuple(digests), current, next(iter(sessions), None), last_assistant)


# --- tools -----------------------------------------------------------------------------------


class ToolSet(msgspec.Struct, frozen=True):
    specs: tuple[ToolSpec, ...]  # what the model is shown
    namespaced: dict[str, tuple[str, str]]  # "<namespace>.<name>" -> (namespace, name)
    unserved: frozenset[str]  # types (and names) of the tools left out of the prompt
    echo: msgspec.Raw = msgspec.Raw(b"[]")  # the tools as sent, for answers (its own bytes, not the body's)


def _function(tool: ToolParam, where: str, namespace: ToolParam | None = None) -> ToolSpec:
    name = _required(tool.name, "function tool", f"{where}.name")
    if tool.parameters is not None:
        check_free_form(tool.parameters, f"{where}.parameters", ints=False)
    if namespace is None:
        return ToolSpec(name=name, description=tool.description, parameters=tool.parameters)
    about = "\n\n".join(d for d in (namespace.description, tool.description) if d) or None
    return ToolSpec(name=f"{namespace.name}.{name}", description=about, parameters=tool.parameters)


def tool_set(defs: list[ToolParam]) -> ToolSet:
    specs: list[ToolSpec] = []
    namespaced: dict[str, tuple[str, str]] = {}
    unserved: set[str] = set()
    for i, tool in enumerate(defs):
        where = f"tools[{i}]"
        if tool.type == "function":
            specs.append(_function(tool, where))
        elif tool.type == "namespace":
            name = _required(tool.name, "namespace tool", f"{where}.name")
            for j, inner in enumerate(tool.tools or ()):
                if inner.type != "function":
                    unserved.update((inner.type, f"{name}.{inner.name}"))
                    continue
                spec = _function(inner, f"{where}.tools[{j}]", tool)
                specs.append(spec)
                namespaced[spec.name] = (name, inner.name or "")
        else:
            unserved.update((tool.type, *((tool.name,) if tool.name else ())))
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        duplicate = next(n for n in names if names.count(n) > 1)
        raise MalformedRequest(f"tool {duplicate!r} is defined twice", param="tools")
    return ToolSet(tuple(specs), namespaced, frozenset(unserved))


_tools_decoder = msgspec.json.Decoder(list[ToolParam] | None)
_TOOLS: BoundedCache[bytes, ToolSet] = BoundedCache(max_items=1024)
_NO_TOOLS = ToolSet((), {}, frozenset())


def cached_tools(raw: bytes) -> ToolSet:
    """The request's tools, decoded once per distinct JSON (an agent sends the same tools every turn)."""
    if not raw:
        return _NO_TOOLS
    tools = _TOOLS.get(raw)
    if tools is None:
        try:
            defs = _tools_decoder.decode(raw)
        except msgspec.DecodeError as exc:
            raise MalformedRequest(f"invalid request: {exc} (in tools)", param="tools") from exc
        except RecursionError:
            raise MalformedRequest(f"{TOO_DEEP} (in tools)", param="tools") from None
        tools = _TOOLS.put(raw, msgspec.structs.replace(tool_set(defs or []), echo=msgspec.Raw(raw)), 3 * len(raw))
    return tools
