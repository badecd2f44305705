"""The viewer's Starlette app: JSON under ``/api``, two static pages, no build step.

::

    GET /                                         the session list (static/index.html)
    GET /session/{id}                             one session (static/session.html)
    GET /api/sessions?uid=&status=&after=&limit=  a page of list rows, newest first; ``next`` is the cursor
    GET /api/sessions/{id}?known=N                the session; ``{"unchanged": true}`` while the log has
                                                  nothing past stream seq N (the page polls with it)
    GET /api/sessions/{id}/chains/{c}/tokens?part=prompt|response&offset=&limit=   a token window
    GET /api/sessions/{id}/requests/{n}           request n's raw body, byte for byte
    GET /api/sessions/{id}/images/{digest}        one of its images (from the log's object store, checked)

Errors are JSON, ``{"error": {"message", "code", "param"}}``, with the status and code the edge
gives the same error (:func:`edge.http_errors.http_error`): 400 for a bad parameter, 404 for an
unknown session, chain, request or path, 503 when the log does not answer.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from edge.http_errors import http_error
from schemas.errors import FoldError, MalformedRequest, RollbusError, SessionNotFound
from viewer.detail import session_detail
from viewer.listing import page, parse_limit, parse_status
from viewer.pieces import parse_window, window
from viewer.store import LogView

STATIC = Path(__file__).with_name("static")
MAX_UID = 256
IMAGE_TYPES = ("image/png", "image/jpeg", "image/webp", "image/gif")  # served as such; anything else as bytes
SECURITY_HEADERS = {"X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
                    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'"}


def _json(value: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(value), status_code=status, media_type="application/json",
                    headers=SECURITY_HEADERS)


def _error(status: int, code: str, message: str, param: str | None = None) -> Response:
    return _json({"error": {"message": message, "code": code, "param": param}}, status)


async def _rollbus_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RollbusError)
    row = http_error(exc)  # the edge's table: the same status and code for the same error
    message = f"the session's log does not fold: {exc.message}" if isinstance(exc, FoldError) else exc.message
    return _error(row.status, row.code, message, exc.param)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return _error(exc.status_code, "not_found_error" if exc.status_code == 404 else "invalid_request_error",
                  str(exc.detail))


def _query(request: Request, name: str, limit: int = 512) -> str | None:
    value = request.query_params.get(name)
    if value is not None and len(value) > limit:
        raise MalformedRequest(f"{name}: at most {limit} characters", param=name)
    return value


def create_app(view: LogView) -> Starlette:
    async def sessions(request: Request) -> Response:
        uid, status = _query(request, "uid", MAX_UID), parse_status(_query(request, "status"))
        limit, after = parse_limit(_query(request, "limit")), _query(request, "after")
        return _json(page(await view.rows(), uid=uid or None, status=status, after=after or None, limit=limit))

    async def session(request: Request) -> Response:
        entry = await view.session(request.path_params["session_id"])
        known = _query(request, "known", 20)
        if known and known.isdigit() and int(known) == entry.last_stream_seq:
            return _json({"unchanged": True, "last_stream_seq": entry.last_stream_seq})
        assert entry.state is not None
        decode = await view.decoder(entry.state.tokenizer)
        return _json(session_detail(entry.state, list(entry.audit), list(entry.requests), decode,
                                    last_stream_seq=entry.last_stream_seq))

    async def chain_tokens(request: Request) -> Response:
        entry = await view.session(request.path_params["session_id"])
        assert entry.state is not None
        index = request.path_params["chain"]
        if not 0 <= index < len(entry.state.chains):
            raise SessionNotFound(f"session {entry.state.session_id} has no chain {index}", param="chain")
        part, offset, limit = parse_window(_query(request, "part"), _query(request, "offset"),
                                           _query(request, "limit"))
        decode = await view.decoder(entry.state.tokenizer)
        return _json(window(entry.state.chains[index], decode, part=part, offset=offset, limit=limit))

    async def raw_request(request: Request) -> Response:
        entry = await view.session(request.path_params["session_id"])
        number = request.path_params["request_no"]
        if number not in entry.bodies:
            raise SessionNotFound(f"session {request.path_params['session_id']} has no request {number} "
                                  f"(it has {len(entry.bodies)})", param="request_no")
        return Response(entry.bodies.body(number), media_type="application/json", headers=SECURITY_HEADERS)

    async def image(request: Request) -> Response:
        entry = await view.session(request.path_params["session_id"])
        assert entry.state is not None
        sid, digest = entry.state.session_id, request.path_params["digest"]
        ref = next((i for chain in entry.state.chains for i in chain.images if i.digest == digest), None)
        if ref is None:
            raise SessionNotFound(f"session {sid} has no image {digest[:64]}", param="digest")
        data = await view.image(sid, digest)
        if data is None or hashlib.sha256(data).hexdigest() != digest:
            raise SessionNotFound(f"image {digest} of session {sid} is "
                                  f"{'not in' if data is None else 'altered in'} the log's object store",
                                  param="digest")
        media = ref.media_type if ref.media_type in IMAGE_TYPES else "application/octet-stream"
        return Response(data, media_type=media, headers={**SECURITY_HEADERS, "Cache-Control": "private, max-age=86400"})

    async def healthz(request: Request) -> Response:
        return _json({"status": "ok"})

    def page_file(name: str) -> Any:
        async def serve(request: Request) -> Response:
            return FileResponse(STATIC / name, headers=SECURITY_HEADERS)
        return serve

    routes = [
        Route("/", page_file("index.html")),
        Route("/session/{session_id}", page_file("session.html")),
        Route("/healthz", healthz),
        Route("/api/sessions", sessions),
        Route("/api/sessions/{session_id}", session),
        Route("/api/sessions/{session_id}/chains/{chain:int}/tokens", chain_tokens),
        Route("/api/sessions/{session_id}/requests/{request_no:int}", raw_request),
        Route("/api/sessions/{session_id}/images/{digest}", image),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    return Starlette(routes=routes, exception_handlers={RollbusError: _rollbus_error, HTTPException: _http_error})
