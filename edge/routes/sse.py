"""A streamed turn's answer, written as raw ASGI messages.

``http.response.start`` once, then one ``http.response.body`` (``more_body=True``) per batch of the
stream's events (:meth:`edge.streaming.TurnStream.events` hands over at once everything that is
waiting, so the frames of one engine chunk go out in one write), then the empty last body. This is
what Starlette's ``StreamingResponse`` does, less its per-response anyio task group, cancel scope
and tasks (about a seventh of a streamed turn's CPU in ``ops/bench/wire_turns.py``).

The edge's server does not raise when a body is sent to a client that has gone (granian drops it),
so the client leaving is heard as ASGI's ``http.disconnect``: a listener, a plain task, waits for it
and abandons the turn (:meth:`edge.streaming.TurnStream.abandon`); the stream then ends by itself
(``turn_abandoned`` recorded, the engine request aborted), and what is still written goes nowhere.
The listener starts when the route first waits for the turn's next events: until then the route is
writing, and a turn over by the time its events are all written has nothing left to abandon (a
client that left meanwhile is heard at once when the listener starts).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any, Protocol

from edge.streaming import Item
from edge.wires.adapter import StreamEncoder
from schemas.errors import RollbusError

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no")]


class EventSource(Protocol):
    """A :class:`edge.streaming.TurnStream` or :class:`edge.streaming.RecordedStream`."""

    def events(self, before_wait: Callable[[], None] | None = None) -> AsyncIterator[list[Item]]: ...

    def abandon(self) -> None: ...


class SSEReply:
    """The server-sent events of one streamed turn: ``first`` (already in hand), then the stream's."""

    __slots__ = ("_encoder", "_first", "_stream")

    def __init__(self, encoder: StreamEncoder, first: Item, stream: EventSource) -> None:
        self._encoder = encoder
        self._first = first
        self._stream = stream

    async def __call__(self, receive: Receive, send: Send) -> None:
        encoder, stream = self._encoder, self._stream
        listener: list[asyncio.Future[None]] = []
        events = stream.events(lambda: listener.append(asyncio.ensure_future(_listen(receive, stream))))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
            await send({"type": "http.response.body", "body": encode(encoder, self._first), "more_body": True})
            async for batch in events:
                body = encode(encoder, batch[0]) if len(batch) == 1 else b"".join(
                    [encode(encoder, item) for item in batch])
                await send({"type": "http.response.body", "body": body, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            for task in listener:
                task.cancel()
            await events.aclose()  # a stream left early abandons its turn (synchronously)
            stream.abandon()


async def _listen(receive: Receive, stream: EventSource) -> None:
    """Abandon the stream's turn when its client goes away (the body is read by now: the next
    message is the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    stream.abandon()


def encode(encoder: StreamEncoder, item: Item) -> bytes:
    return encoder.error(item) if isinstance(item, RollbusError) else encoder.event(item)
