"""The model-facing routes, generic over the wire: one handler, one adapter per wire.

``POST /sessions/{id}/v1/chat/completions`` (OpenAI) and ``POST /sessions/{id}/v1/messages``
(Anthropic): authorize the request from its headers (:meth:`EdgeService.authorize`, before any
of the body is read), read the body (at a minimum rate, decoded from its ``Content-Encoding``:
:func:`edge.routes.handling.receive_body`), decode the wire's request with its adapter, run the turn
(plain or streamed) in the authorized session, answer in the adapter's shape. Errors raised
before a stream starts (no key, bad request, closed session, engine down) are HTTP errors in
the wire's error shape; a failure after it started is the wire's in-stream
error event. A client that leaves a stream early abandons its turn (see
:mod:`edge.streaming`).

These routes are the hot path, so :class:`ModelRoutes` serves them as a thin ASGI front:
it matches the two paths with string operations and calls the handler directly (another
method than POST on them is a 405 in the wire's shape), and hands every other request to
the FastAPI app (admin, reward, health, metrics).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from edge.http_errors import http_error
from edge.idempotency import retry_count
from edge.metrics import EdgeMetrics
from edge.routes.handling import bearer, error_answer, json_response, receive_body
from edge.routes.sse import SSEReply
from edge.service import EdgeService
from edge.turns import Disconnect, TurnRequest
from edge.wires.adapter import WireAdapter
from observability.registry import Metrics, Tallied
from schemas.errors import MethodNotAllowed

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_PREFIX = "/sessions/"
_ANTHROPIC = "v1/messages"


def is_anthropic_path(path: str) -> bool:
    """``/sessions/{id}/v1/messages...``: the Anthropic wire's (its errors in Anthropic's shape)."""
    return path.startswith(_PREFIX) and path[len(_PREFIX):].partition("/")[2].startswith(_ANTHROPIC)


async def handle_model(service: EdgeService, adapter: WireAdapter, session_id: str, scope: Scope, receive: Receive,
                       disconnect: Disconnect) -> bytes | SSEReply:
    """One model request: the plain reply's body, or a streamed one's events (:mod:`edge.routes.sse`). A
    plain request is watched for its client leaving (``disconnect``).

    The session and its key are checked from the headers alone, before any of the body is read: a
    client without the key is answered 401 at once (the HTTP server then closes the connection
    rather than read a body nobody will look at), and ``Expect: 100-continue`` gets no ``100
    Continue`` (the server sends it when the body is first read)."""
    headers = _headers(scope)
    live = await service.authorize(session_id, bearer(headers))
    with live.in_use():  # its lease kept while the body arrives
        body = await receive_body(receive, headers, service.body_limits)
    conversation = adapter.decode(body, live.known.get(adapter.name))
    turn = TurnRequest(conversation=conversation, wire=adapter.name, body=body,
                       idempotency_key=headers.get("idempotency-key"), retry_count=retry_count(headers),
                       disconnect=None if conversation.stream else disconnect)
    if conversation.stream:
        stream, first = await service.stream(live, turn)
        return SSEReply(adapter.stream(conversation, service.token_strings), first, stream)
    unwatch = _watch(receive, disconnect)
    try:
        outcome = await service.complete(live, turn)
    finally:
        unwatch()
    return adapter.encode(outcome, conversation, service.token_strings)


def _watch(receive: Receive, disconnect: Disconnect) -> Callable[[], None]:
    """Have ``disconnect`` told when the client leaves (ASGI's ``http.disconnect``); returns what
    stops the watch. A listener starts once the turn has taken a moment (no task for a quick
    turn; the body is read by now, so the next message is the disconnect)."""
    listener: list[asyncio.Future[None]] = []
    timer = asyncio.get_running_loop().call_later(
        _LISTEN_AFTER_S, lambda: listener.append(asyncio.ensure_future(_listen(receive, disconnect))))

    def unwatch() -> None:
        timer.cancel()
        for task in listener:
            task.cancel()

    return unwatch


_LISTEN_AFTER_S = 0.5  # a turn done sooner needs no listener (and a loaded edge answers later than its engine)


async def _listen(receive: Receive, disconnect: Disconnect) -> None:
    """Tell ``disconnect`` when the client goes away."""
    while (await receive())["type"] != "http.disconnect":
        pass
    disconnect.client_gone()


def _headers(scope: Scope) -> dict[str, str]:
    """The request's headers by lowercase name (ASGI servers send names lowercased); of a repeated
    header, the first."""
    return {name.decode("latin-1"): value.decode("latin-1") for name, value in reversed(scope["headers"])}


class ModelRoutes:
    """ASGI front for the model routes; ``adapters`` maps the path after the session id
    (``v1/chat/completions``, ``v1/messages``) to its wire adapter."""

    def __init__(self, app: ASGIApp, service: EdgeService, metrics: Metrics, adapters: dict[str, WireAdapter]) -> None:
        self.app = app
        self._service = service
        self._metrics = metrics
        self._adapters = adapters
        self._requests = metrics.group(EdgeMetrics).http_requests
        self._counters: dict[tuple[str, int], Tallied] = {}  # requests' counters by route and status (children)
        self._latency = metrics.group(EdgeMetrics).http_seconds

    @property
    def paths(self) -> list[str]:
        """The paths this front serves (POST only), as path templates."""
        return [f"{_PREFIX}{{session_id}}/{tail}" for tail in self._adapters]

    def __getattr__(self, name: str) -> Any:  # ``state``, ``router``, ... of the wrapped app
        return getattr(self.app, name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope.get("path", "")
        if scope["type"] == "http" and path.startswith(_PREFIX):
            session_id, _, tail = path[len(_PREFIX):].partition("/")
            adapter = self._adapters.get(tail)
            if adapter is not None:
                if scope["method"] == "POST":
                    await self._serve(adapter, session_id, tail, scope, receive, send)
                else:
                    await _method_not_allowed(adapter, scope, receive, send)
                return
        await self.app(scope, receive, send)

    async def _serve(self, adapter: WireAdapter, session_id: str, tail: str, scope: Scope, receive: Receive,
                     send: Send) -> None:
        started = time.perf_counter()
        disconnect = Disconnect(self._service.settings.disconnect_grace_s)
        status = 200
        try:
            reply = await handle_model(self._service, adapter, session_id, scope, receive, disconnect)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not disconnect.gone or task is None or task.cancelling() > 1:
                raise  # not (only) the client leaving: shutdown
            task.uncancel()  # the client left while its turn sampled: the turn was abandoned; nobody to answer
            return
        except Exception as exc:
            status, body, extra = error_answer(exc, f"POST {scope['path']}", adapter.encode_error)
            await _send_json(send, status, body, extra)
        else:
            if isinstance(reply, bytes):
                await _send_json(send, 200, reply)
            else:
                await reply(receive, send)
        counted = self._counters.get((tail, status))
        if counted is None:
            counted = self._counters[(tail, status)] = self._requests.labels(f"/sessions/{{session_id}}/{tail}",
                                                                              str(status))
        counted.inc()
        self._latency.observe(time.perf_counter() - started)


async def _send_json(send: Send, status: int, body: bytes, extra: dict[str, str] | None = None) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(name.lower().encode(), value.encode()) for name, value in (extra or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _method_not_allowed(adapter: WireAdapter, scope: Scope, receive: Receive, send: Send) -> None:
    error = MethodNotAllowed(f"method {scope['method']} is not allowed on {scope['path']} (allowed: POST)")
    response = json_response(adapter.encode_error(error), http_error(error).status)
    response.headers["Allow"] = "POST"
    await response(scope, receive, send)


