"""OpenAI-compatible model route: ``POST /sessions/{id}/v1/chat/completions``."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from edge.codec.openai_wire import decode_request, encode_completion, encode_error
from edge.idempotency import retry_count
from edge.routes.wire import bearer, json_response, read_body, wire_route
from edge.service import EdgeService
from edge.turns import TurnRequest
from schemas.errors import MalformedRequest

router = APIRouter(route_class=wire_route(encode_error))


@router.post("/sessions/{session_id}/v1/chat/completions")
async def chat_completions(session_id: str, request: Request) -> Response:
    service: EdgeService = request.app.state.service
    body = await read_body(request, service.settings.max_request_bytes)
    conversation = decode_request(body)
    if conversation.stream:
        raise MalformedRequest("stream=true is not supported yet", param="stream")
    turn = TurnRequest(conversation=conversation, wire="openai", body=body,
                       idempotency_key=request.headers.get("idempotency-key"),
                       retry_count=retry_count(request.headers))
    outcome = await service.complete(session_id, bearer(request), turn)
    token_text = service.token_strings(outcome.token_ids) if conversation.logprobs else None
    return json_response(encode_completion(outcome, model=conversation.model, logprobs=conversation.logprobs,
                                           token_text=token_text))
