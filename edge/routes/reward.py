"""Reward intake: ``POST /sessions/{id}/reward_info`` with ``{"reward_info": {"reward": 1.0, ...}}``."""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import APIRouter, Request, Response

from edge.routes.handling import bearer, json_response, read_body, wire_route
from edge.service import EdgeService
from edge.wires.openai import encode_error
from edge.wires.strict import decode_strict

router = APIRouter(route_class=wire_route(encode_error))

_LIMIT = 1024 * 1024


class RewardBody(msgspec.Struct, frozen=True, kw_only=True):
    reward_info: dict[str, Any]


class RewardAccepted(msgspec.Struct, frozen=True, kw_only=True):
    status: str = "ok"


_ACCEPTED = msgspec.json.encode(RewardAccepted())


@router.post("/sessions/{session_id}/reward_info")
async def reward_info(session_id: str, request: Request) -> Response:
    service: EdgeService = request.app.state.service
    live = await service.reward_access(session_id, bearer(request.headers))  # from the headers: before the body
    body = decode_strict(await read_body(request, _LIMIT), RewardBody)
    await service.report_reward(live, body.reward_info)
    return json_response(_ACCEPTED)
