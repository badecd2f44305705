"""The model-facing handler, generic over the wire: one handler, one adapter per wire.

``POST`` a wire's request: decode it with the adapter, run the turn (plain or streamed)
through :class:`EdgeService`, answer in the adapter's shape. Errors raised before a
stream starts (bad request, bad key, unknown or closed session, engine down) are HTTP
errors in the wire's error shape (:func:`edge.routes.wire.wire_route`); a failure after
it started is the wire's in-stream error event. A client that leaves a stream early
abandons its turn (see :mod:`edge.streaming`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from edge.codec.adapter import StreamEncoder, WireAdapter
from edge.routes.wire import bearer, json_response, read_body, wire_route
from edge.service import EdgeService
from edge.streaming import Item, TurnStream
from edge.turns import TurnRequest
from schemas.errors import RollbusError

_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def model_router(adapter: WireAdapter, path: str) -> APIRouter:
    """A router serving ``path`` (with a ``{session_id}``) in ``adapter``'s wire."""
    router = APIRouter(route_class=wire_route(adapter.encode_error))

    @router.post(path)
    async def handle(session_id: str, request: Request) -> Response:
        service: EdgeService = request.app.state.service
        body = await read_body(request, service.settings.max_request_bytes)
        conversation = adapter.decode(body)
        turn = TurnRequest(conversation=conversation, wire=adapter.name, body=body,
                           idempotency_key=request.headers.get("idempotency-key"))
        if conversation.stream:
            stream, first = await service.stream(session_id, bearer(request), turn)
            events = _sse(adapter.stream(conversation, service.token_strings), first, stream)
            return StreamingResponse(events, media_type="text/event-stream", headers=_SSE_HEADERS)
        outcome = await service.complete(session_id, bearer(request), turn)
        return json_response(adapter.encode(outcome, conversation, service.token_strings))

    return router


async def _sse(encoder: StreamEncoder, first: Item, stream: TurnStream) -> AsyncIterator[bytes]:
    events = stream.events()
    try:
        yield _encode(encoder, first)
        async for batch in events:
            yield b"".join(_encode(encoder, item) for item in batch)
    finally:
        await events.aclose()  # a client gone: the stream abandons its turn (synchronously)
        stream.abandon()


def _encode(encoder: StreamEncoder, item: Item) -> bytes:
    return encoder.error(item) if isinstance(item, RollbusError) else encoder.event(item)
