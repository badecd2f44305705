"""``POST /sessions/{id}/v1/messages/count_tokens``: Anthropic's token counting, which Claude Code calls.

The session's key is checked before the body is read. The body is a Messages request without
``max_tokens`` (:func:`edge.wires.anthropic.decode_count_request`, the same refusals as
``/v1/messages``); the answer, ``{"input_tokens": n}``, is the ``usage.input_tokens`` a turn for
that conversation would report now: its chain's tokens and the increment when it continues one,
else the template's render of it, tokenized (:meth:`edge.turns.TurnRunner.count_prompt`).
Nothing is recorded: a count is no turn. Errors in Anthropic's shape.
"""

from __future__ import annotations

import msgspec
from fastapi import APIRouter, Request, Response

from edge.routes.handling import bearer, json_response, receive_body, wire_route
from edge.service import EdgeService
from edge.wires.anthropic import decode_count_request, encode_error

router = APIRouter(route_class=wire_route(encode_error))


class TokenCount(msgspec.Struct, frozen=True, kw_only=True):
    input_tokens: int


@router.post("/sessions/{session_id}/v1/messages/count_tokens")
async def count_tokens(session_id: str, request: Request) -> Response:
    service: EdgeService = request.app.state.service
    live = await service.authorize(session_id, bearer(request.headers))
    with live.in_use():  # its lease kept while the body arrives
        body = await receive_body(request.receive, request.headers, service.body_limits)
    count = await service.count_tokens(live, decode_count_request(body))
    return json_response(msgspec.json.encode(TokenCount(input_tokens=count)))
