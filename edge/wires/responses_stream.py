"""The server-sent events of one streamed Responses API turn (``stream: true``).

``response.created`` and ``response.in_progress`` when the engine starts; then each output item
as the model writes it, every event numbered (``sequence_number``, from 0):

- reasoning: ``response.output_item.added`` (a ``reasoning`` item), its text as
  ``response.reasoning_text.delta`` / ``.done`` (or, when the request asked for a summary,
  ``response.reasoning_summary_part.added``, ``response.reasoning_summary_text.delta`` /
  ``.done``, ``response.reasoning_summary_part.done``), ``response.output_item.done``;
- content: ``response.output_item.added`` (a ``message``), ``response.content_part.added``,
  ``response.output_text.delta``..., ``response.output_text.done``, ``response.content_part.done``,
  ``response.output_item.done`` (an empty message when the reply has neither text nor calls, as
  the plain answer has one);
- each tool call, once the reply is whole: ``response.output_item.added`` (a ``function_call``),
  one ``response.function_call_arguments.delta``, ``response.function_call_arguments.done``,
  ``response.output_item.done``;

then, once the turn is in the log, ``response.completed`` (``response.incomplete`` when it was cut
short) with the whole response. A failure after the stream started is ``response.failed`` (the
response with ``error``). Text deltas are written from per-item byte templates (only the text and
the sequence number are encoded per event), as the other wires' are.
"""

from __future__ import annotations

import msgspec

from edge.chat.deltas import ContentDelta, ReasoningDelta, StreamEvent, StreamFinished, StreamStarted, ToolCallReady
from edge.http_errors import http_error
from edge.wires.adapter import TokenText, sse
from edge.wires.reasoning_refs import ReasoningRefs
from edge.wires.responses_encode import (
    ResponsesOptions,
    finished,
    function_call,
    item_ids,
    reasoning_item,
    response_object,
)
from schemas import wire_responses as w
from schemas.errors import RollbusError

_encoder = msgspec.json.Encoder()
_EMPTY_TEXT = w.OutputText(text="")
_EMPTY_SUMMARY = w.SummaryText(text="")


def _event(kind: str, event: msgspec.Struct) -> bytes:
    return sse(_encoder.encode(event), kind)


class ResponsesStream:
    def __init__(self, options: ResponsesOptions, refs: ReasoningRefs, token_text: TokenText) -> None:
        self._options = options
        self._refs = refs
        self._token_text = token_text
        self._seq = -1
        self._session = ""
        self._request_no = 0
        self._created = 0
        self._index = -1  # output index of the last item opened
        self._open: str | None = None  # "reasoning" | "message": the item taking deltas
        self._texts: list[str] = []  # the open item's text so far
        self._head = self._mid = b""  # the open item's delta event: head + text + mid + sequence number + "}"
        self._message = False  # a message item went out
        self._ids = ("", "", "")  # the reasoning item's, the message's, the calls' (with _<index>)

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def _lifecycle(self, kind: str, response: bytes) -> bytes:
        """``response.created``, ``.in_progress``, ``.completed``, ...: ``response`` is the encoded response."""
        name = kind.encode()
        return b"".join((b"event: ", name, b'\ndata: {"type":"', name, b'","response":', response,
                         b',"sequence_number":', str(self._next()).encode(), b"}\n\n"))

    def _item(self, kind: str, item: object) -> bytes:
        return _event(kind, w.ItemEvent(type=kind, output_index=self._index, item=item, sequence_number=self._next()))

    def _template(self, kind: str, item_id: str, index_field: str) -> None:
        fields = (b'{"type":"' + kind.encode() + b'","item_id":' + _encoder.encode(item_id) + b',"output_index":'
                  + str(self._index).encode() + b',"' + index_field.encode() + b'":0,"delta":')
        self._head = b"event: " + kind.encode() + b"\ndata: " + fields
        self._mid = (b',"logprobs":[]' if kind == "response.output_text.delta" else b"") + b',"sequence_number":'

    def _delta(self, text: str) -> bytes:
        self._texts.append(text)
        return b"".join((self._head, _encoder.encode(text), self._mid, str(self._next()).encode(), b"}\n\n"))

    def event(self, event: StreamEvent) -> bytes:
        if isinstance(event, ContentDelta):
            return (b"" if self._open == "message" else self._open_message()) + self._delta(event.text)
        if isinstance(event, ReasoningDelta):
            return (b"" if self._open == "reasoning" else self._open_reasoning()) + self._delta(event.text)
        if isinstance(event, ToolCallReady):
            return self._close() + self._call(event)
        if isinstance(event, StreamStarted):
            return self._started(event)
        return self._finish(event)

    def _started(self, event: StreamStarted) -> bytes:
        self._session, self._request_no, self._created = event.session_id, event.request_no, event.created
        self._ids = item_ids(self._session, self._request_no)
        response = _encoder.encode(response_object(self._session, self._request_no, self._created, self._options))
        return self._lifecycle("response.created", response) + self._lifecycle("response.in_progress", response)

    def _open_reasoning(self) -> bytes:
        out = self._close()
        self._index += 1
        self._open, self._texts = "reasoning", []
        item_id = self._ids[0]
        out += self._item("response.output_item.added", w.ReasoningOut(id=item_id, summary=[], content=[],
                                                                      status="in_progress"))
        if self._options.summary:
            out += _event("response.reasoning_summary_part.added", w.SummaryPartEvent(
                type="response.reasoning_summary_part.added", item_id=item_id, output_index=self._index,
                summary_index=0, part=_EMPTY_SUMMARY, sequence_number=self._next()))
            self._template("response.reasoning_summary_text.delta", item_id, "summary_index")
        else:
            self._template("response.reasoning_text.delta", item_id, "content_index")
        return out

    def _open_message(self) -> bytes:
        out = self._close()
        self._index += 1
        self._open, self._texts, self._message = "message", [], True
        item_id = self._ids[1]
        out += self._item("response.output_item.added", w.OutputMessage(id=item_id, status="in_progress", content=[]))
        out += _event("response.content_part.added", w.ContentPartEvent(
            type="response.content_part.added", item_id=item_id, output_index=self._index, content_index=0,
            part=_EMPTY_TEXT, sequence_number=self._next()))
        self._template("response.output_text.delta", item_id, "content_index")
        return out

    def _close(self, status: str = "completed") -> bytes:
        if self._open is None:
            return b""
        text, kind = "".join(self._texts), self._open
        self._open = None
        return self._close_reasoning(text, status) if kind == "reasoning" else self._close_message(text, status)

    def _close_reasoning(self, text: str, status: str) -> bytes:
        item_id, index = self._ids[0], self._index
        if self._options.summary:
            out = _event("response.reasoning_summary_text.done", w.SummaryTextDoneEvent(
                item_id=item_id, output_index=index, summary_index=0, text=text, sequence_number=self._next()))
            out += _event("response.reasoning_summary_part.done", w.SummaryPartEvent(
                type="response.reasoning_summary_part.done", item_id=item_id, output_index=index, summary_index=0,
                part=w.SummaryText(text=text), sequence_number=self._next()))
        else:
            out = _event("response.reasoning_text.done", w.TextDoneEvent(
                type="response.reasoning_text.done", item_id=item_id, output_index=index, content_index=0, text=text,
                sequence_number=self._next()))
        item = reasoning_item(self._session, self._request_no, text, self._options, self._refs, item_id, status)
        return out + self._item("response.output_item.done", item)

    def _close_message(self, text: str, status: str) -> bytes:
        item_id, index = self._ids[1], self._index
        part = w.OutputText(text=text)
        out = _event("response.output_text.done", w.TextDoneEvent(
            type="response.output_text.done", item_id=item_id, output_index=index, content_index=0, text=text,
            sequence_number=self._next(), logprobs=[]))
        out += _event("response.content_part.done", w.ContentPartEvent(
            type="response.content_part.done", item_id=item_id, output_index=index, content_index=0, part=part,
            sequence_number=self._next()))
        return out + self._item("response.output_item.done", w.OutputMessage(id=item_id, status=status, content=[part]))

    def _call(self, event: ToolCallReady) -> bytes:
        self._index += 1
        item_id = f"{self._ids[2]}_{event.index}"
        done = function_call(event.call, self._options, item_id)
        added = msgspec.structs.replace(done, arguments="", status="in_progress")
        out = self._item("response.output_item.added", added)
        out += _event("response.function_call_arguments.delta", w.ArgumentsDeltaEvent(
            item_id=item_id, output_index=self._index, delta=event.call.arguments, sequence_number=self._next()))
        out += _event("response.function_call_arguments.done", w.ArgumentsDoneEvent(
            item_id=item_id, output_index=self._index, name=done.name, arguments=event.call.arguments,
            sequence_number=self._next()))
        return out + self._item("response.output_item.done", done)

    def _finish(self, event: StreamFinished) -> bytes:
        outcome = event.outcome
        status = "incomplete" if outcome.finish_reason == "length" else "completed"
        out = self._close(status)
        if not self._message and not outcome.tool_calls:  # the plain answer's (empty) message
            out += self._open_message() + self._close(status)
        response = finished(outcome, self._options, self._refs, self._token_text)
        return out + self._lifecycle(f"response.{status}", _encoder.encode(response))

    def error(self, exc: RollbusError) -> bytes:
        failure = w.ResponseError(code=http_error(exc).code, message=exc.message)
        response = response_object(self._session, self._request_no, self._created, self._options, status="failed",
                                   error=failure)
        return self._lifecycle("response.failed", _encoder.encode(response))
