"""Answering errors as HTTP in each route's wire shape.

Every router is built with :func:`wire_route` and the error encoder of its wire, so a
route answers in its own shape without looking at the URL. Only ``RollbusError`` is
mapped, by the edge's one table (:mod:`edge.http_errors`: status, wire types, Retry-After):
anything else is a bug, logged and answered 500 in the same shape.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, MutableMapping
from typing import Any, TypeVar

from fastapi import Request, Response
from fastapi.routing import APIRoute

from edge.http_errors import http_error, retry_after_headers
from edge.metrics import EdgeMetrics
from edge.routes.encoding import decoded
from edge.service import same_secret
from edge.settings import BodyLimits, body_limits
from schemas.errors import MalformedRequest, PayloadTooLarge, RollbusError, Unauthorized

log = logging.getLogger(__name__)

ErrorEncoder = Callable[[RollbusError], bytes]
T = TypeVar("T")
JSON = "application/json"


def json_response(body: bytes, status: int = 200) -> Response:
    return Response(content=body, status_code=status, media_type=JSON)


def wire_route(encode_error: ErrorEncoder) -> type[APIRoute]:
    """A FastAPI route class answering errors in ``encode_error``'s wire shape, with metrics."""

    class WireRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()
            path = self.path

            async def handle(request: Request) -> Response:
                started = time.perf_counter()
                response = await guarded(handler(request), f"{request.method} {request.url.path}", encode_error)
                metrics = request.app.state.metrics.group(EdgeMetrics)
                metrics.http_requests.labels(path, str(response.status_code)).inc()
                metrics.http_seconds.observe(time.perf_counter() - started)
                return response

            return handle

    return WireRoute


async def guarded(handling: Awaitable[T], where: str, encode_error: ErrorEncoder) -> T | Response:
    """The handler's result, or its error in the wire's shape as a response (a non-rollbus error is
    a logged 500); ``where`` names the request in logs (``"POST /path"``)."""
    try:
        return await handling
    except Exception as exc:
        return error_response(exc, where, encode_error)


def error_response(exc: Exception, where: str, encode_error: ErrorEncoder) -> Response:
    """A handler's error in the wire's shape (a non-rollbus error is a logged 500). Called from an
    ``except`` block (an unexpected error is logged with its traceback)."""
    status, body, headers = error_answer(exc, where, encode_error)
    response = json_response(body, status)
    response.headers.update(headers)
    return response


def error_answer(exc: Exception, where: str, encode_error: ErrorEncoder) -> tuple[int, bytes, dict[str, str]]:
    """:func:`error_response`'s status, body and extra headers (``Retry-After``, honoured by the openai and
    anthropic SDKs' retries), for a route that answers in ASGI messages."""
    if not isinstance(exc, RollbusError):
        log.exception("unhandled error in %s", where)
        return 500, encode_error(RollbusError("internal error")), {}
    row = http_error(exc)
    if row.status >= 500:
        log.warning("%s -> %d: %s", where, row.status, exc.message)
    return row.status, encode_error(exc), retry_after_headers(exc, row)


Message = MutableMapping[str, Any]


async def read_body(request: Request, limit: int) -> bytes:
    """The request body (:func:`receive_body`), at most ``limit`` bytes."""
    limits = body_limits(request.app.state.service.settings, limit)
    return await receive_body(request.receive, request.headers, limits)


async def receive_body(receive: Callable[[], Awaitable[Message]], headers: Mapping[str, str],
                       limits: BodyLimits) -> bytes:
    """An ASGI request's body, decoded from its ``Content-Encoding`` (:mod:`edge.routes.encoding`) and
    checked to be UTF-8 (:func:`check_utf8`): 413 past
    ``limits.max_bytes`` (declared, as it arrives, or as it is decoded); 400 when the client leaves before
    it is whole, sends nothing for ``limits.silence_s`` seconds, or has not sent it all within
    ``limits.time_allowed`` (the HTTP server bounds only the time to the headers; a body that stalls or
    trickles would hold its request for as long as its client likes)."""
    declared = check_declared_size(headers, limits.max_bytes)
    allowed = limits.time_allowed(declared)
    watch = BodyWatch(limits.silence_s, allowed)
    chunks: list[bytes] = []
    size = 0
    try:
        while True:
            message = await receive()
            watch.arrived()
            if message["type"] == "http.disconnect":
                raise MalformedRequest("the client disconnected before sending the whole body")
            chunk: bytes = message.get("body", b"")
            size += len(chunk)
            if size > limits.max_bytes:
                raise PayloadTooLarge(f"request body exceeds {limits.max_bytes} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
    except asyncio.CancelledError:
        if not watch.took_over():
            raise
        if watch.expired == BodyWatch.SLOW:
            of = f" of {declared}" if declared is not None else ""
            raise MalformedRequest(f"the request body came too slowly: {size}{of} bytes in {allowed:.3g} s "
                                   f"(it must arrive at {limits.min_rate:g} bytes/s)") from None
        raise MalformedRequest(f"the request body stalled: nothing arrived for {limits.silence_s:g} s") from None
    finally:
        watch.stop()
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    return check_utf8(await decoded(body, headers.get("content-encoding"), limits.max_bytes))


class BodyWatch:
    """The time limits of one body's arrival (:func:`receive_body`): none of its parts later than ``silence_s``
    after the previous one (or the start), all of it within ``allowed`` seconds. One timer for the whole body,
    moved on only when it fires (ASGI hands a body over in at least two messages, and a timeout armed and
    cancelled around each cost a turn ~20 us); when a limit is passed, the reading task is cancelled and
    :meth:`took_over` turns that cancellation into the refusal."""

    SLOW, STALLED = "slow", "stalled"

    def __init__(self, silence_s: float, allowed: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._silence = silence_s
        now = self._loop.time()
        self._deadline = now + allowed
        self._last = now
        self.expired: str | None = None
        self._timer: asyncio.TimerHandle | None = self._loop.call_at(min(now + silence_s, self._deadline), self._due)

    def arrived(self) -> None:
        self._last = self._loop.time()

    def _due(self) -> None:
        now = self._loop.time()
        if now >= self._deadline or now - self._last >= self._silence:
            self._timer = None
            self.expired = self.SLOW if now >= self._deadline else self.STALLED
            if self._task is not None:
                self._task.cancel()
            return
        self._timer = self._loop.call_at(min(self._last + self._silence, self._deadline), self._due)

    def took_over(self) -> bool:
        """Whether the reading task's cancellation is this watch's alone (then undone: the caller refuses the
        body instead); a cancellation from elsewhere as well (shutdown) stays."""
        if self.expired is None or self._task is None:
            return False
        return self._task.uncancel() == 0

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def check_utf8(body: bytes) -> bytes:
    """``body``, refused (400) unless it is UTF-8 (RFC 8259 §8.1). The JSON decoder checks the strings
    it decodes but not those it skips (an unknown field's name or value) nor those it keeps as raw
    bytes to echo back (the tools a response repeats): one stray byte there would reach an answer and
    the log. ASCII, the usual body, is checked without a copy."""
    if not body.isascii():
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise MalformedRequest(f"request body is not valid UTF-8: {exc.reason} at byte {exc.start}") from None
    return body


def check_declared_size(headers: Mapping[str, str], limit: int) -> int | None:
    """The body's declared size (``Content-Length``); refused (413) over ``limit`` before any of it is read."""
    declared = headers.get("content-length")
    if declared is None or not (declared.isascii() and declared.isdigit()):
        return None  # not a number: the HTTP server refuses it, else the body is counted as it is read
    digits = declared.lstrip("0")
    if len(digits) > 18 or int(digits or "0") > limit:  # int() refuses a few thousand digits
        raise PayloadTooLarge(f"request body is {declared} bytes (limit {limit})")
    return int(digits or "0")


def bearer(headers: Mapping[str, str]) -> str | None:
    """The key from ``Authorization: Bearer`` or ``x-api-key``."""
    auth = headers.get("authorization")
    if auth is not None:
        scheme, _, token = auth.partition(" ")
        return token.strip() if scheme.lower() == "bearer" else None
    return headers.get("x-api-key")


def require_admin(request: Request, admin_token: str) -> None:
    token = bearer(request.headers)
    if admin_token and (token is None or not same_secret(token, admin_token)):
        raise Unauthorized("admin token required")
