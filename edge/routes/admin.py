"""Admin API (bearer admin token): open, inspect, finalize and abort sessions; and ``HEAD`` on a
session's URL, which answers anyone (:func:`reachable`)."""

from __future__ import annotations

import msgspec
from fastapi import APIRouter, Request, Response

from edge.routes.handling import json_response, read_body, require_admin, wire_route
from edge.service import EdgeService, OpenSession
from edge.wires.openai import encode_error
from edge.wires.strict import decode_strict

router = APIRouter(route_class=wire_route(encode_error))

_ADMIN_BODY_LIMIT = 1024 * 1024


class AbortBody(msgspec.Struct, frozen=True, kw_only=True):
    reason: str = "aborted"


class SessionOpenedAnswer(msgspec.Struct, frozen=True, kw_only=True):
    """``POST /sessions``' answer (201): where the session's agent sends its requests, and its key."""

    session_id: str
    base_url: str  # the OpenAI wires' base URL (chat completions, responses)
    anthropic_base_url: str
    reward_url: str
    api_key: str


class FinalizedAnswer(msgspec.Struct, frozen=True, kw_only=True):
    session_id: str
    status: str
    trajectories: int


class AbortedAnswer(msgspec.Struct, frozen=True, kw_only=True):
    session_id: str
    status: str


def _service(request: Request) -> EdgeService:
    service: EdgeService = request.app.state.service
    require_admin(request, service.settings.admin_token)
    return service


@router.post("/sessions")
async def open_session(request: Request) -> Response:
    service = _service(request)
    spec = decode_strict(await read_body(request, _ADMIN_BODY_LIMIT), OpenSession, empty_ok=True)
    opened = await service.open_session(spec)
    base = f"{service.settings.public_url.rstrip('/')}/sessions/{opened.session_id}"
    body = SessionOpenedAnswer(session_id=opened.session_id, base_url=f"{base}/v1", anthropic_base_url=base,
                               reward_url=f"{base}/reward_info", api_key=opened.api_key)
    return json_response(msgspec.json.encode(body), 201)


@router.head("/sessions/{session_id}")
async def reachable(session_id: str) -> Response:
    """Claude Code's preconnect: ``HEAD`` on its base URL (the session's ``anthropic_base_url``) as it
    starts, without a key, its answer ignored. 200, empty, the same for any id: it tells nothing of
    the session, not even whether it exists (``GET`` stays the admin's)."""
    return Response(status_code=200)


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, request: Request) -> Response:
    summary = await _service(request).summary(session_id)
    return json_response(msgspec.json.encode(summary))


@router.post("/sessions/{session_id}/finalize")
async def finalize(session_id: str, request: Request) -> Response:
    summary = await _service(request).finalize(session_id)
    body = FinalizedAnswer(session_id=session_id, status=summary.status, trajectories=summary.trajectories)
    return json_response(msgspec.json.encode(body))


@router.post("/sessions/{session_id}/abort")
async def abort(session_id: str, request: Request) -> Response:
    service = _service(request)
    spec = decode_strict(await read_body(request, _ADMIN_BODY_LIMIT), AbortBody, empty_ok=True)
    summary = await service.abort(session_id, spec.reason)
    return json_response(msgspec.json.encode(AbortedAnswer(session_id=session_id, status=summary.status)))
