"""``GET /sessions/{id}/v1/responses/{response_id}``: a stored response of the session, as the
Responses API answers it (the session's key, checked first as on every model route; a response the
session does not hold is a 404)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from edge.routes.handling import bearer, json_response, wire_route
from edge.service import EdgeService
from edge.wires.openai import encode_error
from edge.wires.responses import ResponsesWire, parse_response_id
from edge.wires.responses_encode import encode_response
from schemas.errors import ResponseNotFound

router = APIRouter(route_class=wire_route(encode_error))


@router.get("/sessions/{session_id}/v1/responses/{response_id}")
async def get_response(session_id: str, response_id: str, request: Request) -> Response:
    service: EdgeService = request.app.state.service
    wire: ResponsesWire = request.app.state.responses_wire
    live = await service.authorize(session_id, bearer(request.headers))  # first: a 401 says nothing more
    named = parse_response_id(response_id, "response_id")
    if named.session_id != session_id:
        raise ResponseNotFound(f"response {response_id} is not one of session {session_id}'s", param="response_id")
    outcome, stored = await service.stored_response(live, named.request_no)
    return json_response(encode_response(outcome, stored.options, wire.refs, service.token_strings))
