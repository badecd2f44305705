"""``GET /openapi.json``: an OpenAPI 3.1 document of every route the edge serves.

The routes read their bodies themselves (:mod:`edge.routes.handling`) and decode them with the wires'
msgspec structs, so FastAPI's generated schema would say nothing of them; this document is built
from those same structs instead (``msgspec.json.schema_components``): the requests as the routes
decode them, the answers as they encode them, the errors in each wire's shape (OpenAI's
everywhere but under ``/sessions/{id}/v1/messages``, Anthropic's there). :data:`OPERATIONS` lists
the operations; ``tests/contract/test_openapi.py`` holds it to the routes the app serves, both ways.

Two structs leave part of a request as raw JSON (the edge decodes only the history it has not seen
before): their documented twins (:func:`_documented`) name what that raw JSON must decode to.

Security: a model or reward route takes the session's key (``Authorization: Bearer`` or
``x-api-key``, both read by :func:`edge.routes.handling.bearer`); an admin route the admin token the
same way (none when the edge runs without one); ``HEAD /sessions/{id}``, ``/healthz``,
``/metrics`` and this document take nothing. The document is built once per app, on its first
request, and holds no secret: only the shapes of the wires, which docs/wires.md documents too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from edge.routes.admin import AbortBody, AbortedAnswer, FinalizedAnswer, SessionOpenedAnswer
from edge.routes.count_tokens import TokenCount
from edge.routes.reward import RewardAccepted, RewardBody
from edge.service import OpenSession
from schemas import wire_anthropic as anthropic
from schemas import wire_openai as openai
from schemas import wire_responses as responses
from session.summary import SessionSummary

OPENAPI_VERSION = "3.1.0"
JSON = "application/json"
SSE = "text/event-stream"


class ChatTemplateMode(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """``/healthz``' ``chat_template`` (:class:`edge.tokens.incremental.TemplateMode`)."""

    mode: str  # "prefix-stable" or "continuous tokens"
    reason: str = ""  # with "continuous tokens": the probe that found the template not prefix-stable, and how


class Health(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """``/healthz``' answer (:func:`edge.app.health`)."""

    status: str  # "ok" (200); "starting", "stopping" or "unavailable" (503)
    failing: list[str] = []  # with "unavailable": the parts that are down
    chat_template: ChatTemplateMode | None = None  # how the edge encodes its chat template's chains


def _documented(struct: type[msgspec.Struct], **types: Any) -> type[msgspec.Struct]:
    """A twin of ``struct`` (same name, fields, defaults) whose raw-JSON fields are typed as ``types``
    says, defaulting to None: what the document shows for them."""
    fields = []
    for info in msgspec.structs.fields(struct):
        if info.name in types:
            fields.append((info.name, types[info.name], None))
        elif info.required:
            fields.append((info.name, info.type))
        else:
            default = info.default if info.default is not msgspec.NODEFAULT else msgspec.field(
                default_factory=info.default_factory)
            fields.append((info.name, info.type, default))
    return msgspec.defstruct(struct.__name__, fields, kw_only=True, frozen=True, module=struct.__module__)


ChatCompletionRequest = _documented(openai.ChatCompletionRequest[openai.MessageIn, list[openai.ToolDef] | None])
ResponsesRequest = _documented(responses.ResponsesRequest, input=str | list[responses.InputItem] | None,
                               tools=list[responses.ToolParam] | None)
ResponseObject = _documented(responses.ResponseObject, tools=list[dict[str, Any]] | None)


@dataclass(frozen=True)
class Operation:
    """One method on one path: its request body, its answers (status -> media type -> struct, or
    ``None`` for a body the struct cannot describe), the statuses of its errors, who may call it."""

    method: str
    path: str
    summary: str
    ok: dict[int, dict[str, Any]]
    errors: tuple[int, ...] = ()
    body: Any = None
    body_required: bool = True
    security: str | None = None  # "session", "admin", or None (anyone)
    anthropic: bool = False  # errors in Anthropic's shape
    headers: tuple[str, ...] = ()
    tags: tuple[str, ...] = field(default_factory=tuple)


SESSION = "/sessions/{session_id}"
_MODEL_ERRORS = (400, 401, 404, 409, 413, 429, 502, 503, 504)
_IDEMPOTENT = ("Idempotency-Key",)

OPERATIONS: tuple[Operation, ...] = (
    Operation("post", "/sessions", "Open a session", {201: {JSON: SessionOpenedAnswer}},
              (400, 401, 409, 413, 429, 503), OpenSession, body_required=False, security="admin", tags=("admin",)),
    Operation("head", SESSION, "Reachability probe (any id, no key: tells nothing of the session)",
              {200: {}}, tags=("admin",)),
    Operation("get", SESSION, "The session's summary", {200: {JSON: SessionSummary}}, (401, 404, 503),
              security="admin", tags=("admin",)),
    Operation("post", f"{SESSION}/finalize", "Finalize the session (idempotent)", {200: {JSON: FinalizedAnswer}},
              (401, 404, 409, 503), security="admin", tags=("admin",)),
    Operation("post", f"{SESSION}/abort", "Abort the session (idempotent)", {200: {JSON: AbortedAnswer}},
              (400, 401, 404, 409, 413, 503), AbortBody, body_required=False, security="admin", tags=("admin",)),
    Operation("post", f"{SESSION}/reward_info", "Post the session's reward", {200: {JSON: RewardAccepted}},
              (400, 401, 404, 409, 413, 503), RewardBody, security="session", tags=("reward",)),
    Operation("post", f"{SESSION}/v1/chat/completions", "OpenAI chat completions",
              {200: {JSON: openai.ChatCompletion, SSE: None}}, _MODEL_ERRORS, ChatCompletionRequest,
              security="session", headers=_IDEMPOTENT, tags=("model",)),
    Operation("post", f"{SESSION}/v1/messages", "Anthropic messages", {200: {JSON: anthropic.Message, SSE: None}},
              _MODEL_ERRORS, anthropic.MessagesRequest, security="session", anthropic=True, headers=_IDEMPOTENT,
              tags=("model",)),
    Operation("post", f"{SESSION}/v1/messages/count_tokens", "Anthropic token counting (nothing is recorded)",
              {200: {JSON: TokenCount}}, (400, 401, 404, 409, 413, 503), anthropic.CountTokensRequest,
              security="session", anthropic=True, tags=("model",)),
    Operation("post", f"{SESSION}/v1/responses", "OpenAI Responses API", {200: {JSON: ResponseObject, SSE: None}},
              _MODEL_ERRORS, ResponsesRequest, security="session", headers=_IDEMPOTENT, tags=("model",)),
    Operation("get", f"{SESSION}/v1/responses/{{response_id}}", "A stored response of the session",
              {200: {JSON: ResponseObject}}, (400, 401, 404, 409, 503), security="session", tags=("model",)),
    Operation("get", "/healthz", "Health: 200 when every part is up, else 503 naming the parts down",
              {200: {JSON: Health}, 503: {JSON: Health}}, tags=("ops",)),
    Operation("get", "/metrics", "Prometheus metrics (OpenMetrics when asked for)",
              {200: {"text/plain": None, "application/openmetrics-text": None}}, tags=("ops",)),
    Operation("get", "/openapi.json", "This document", {200: {JSON: None}}, tags=("ops",)),
)

EXAMPLES_BY_PATH: dict[str, Any] = {  # requests the e2e tests send, answered 200
    f"{SESSION}/v1/chat/completions": {
        "model": "m", "max_tokens": 8, "messages": [
            {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "ok"}]}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "stream": True, "stream_options": {"include_usage": True}, "stop": ["\n\n"], "logprobs": True},
    f"{SESSION}/v1/messages": {
        "model": "m", "max_tokens": 8, "system": [{"type": "text", "text": "be brief"}],
        "messages": [{"role": "user", "content": "hi"},
                     {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "auto"},
        "metadata": {"user_id": "u"}},
    f"{SESSION}/v1/messages/count_tokens": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    "/sessions": {"uid": "task-1", "session_index": 2, "metadata": {"agent_name": "a", "rollout_n": 4},
                  "sampling": {"temperature": 0.7, "stop": ["</answer>"]}},
    f"{SESSION}/reward_info": {"reward_info": {"reward": 1.0, "acc": True}},
    f"{SESSION}/abort": {"reason": "timeout"},
    f"{SESSION}/v1/responses": {
        "model": "m", "instructions": "be brief", "max_output_tokens": 8, "input": [
            {"role": "user", "content": "hi"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"}],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}], "tool_choice": "auto",
        "reasoning": {"effort": "low"}, "text": {"format": {"type": "text"}}, "store": True},
}

_STATUS_TEXT = {200: "OK", 201: "Created", 400: "Malformed request", 401: "No valid key",
                404: "No such session, response or route", 409: "Closed or owned elsewhere (or uid and index taken)",
                413: "Request body too large", 429: "Too many requests (Retry-After)",
                502: "The engine failed", 503: "Unavailable: engine, log or sink (Retry-After)",
                504: "The engine timed out"}

SECURITY_SCHEMES: dict[str, dict[str, Any]] = {
    "sessionBearer": {"type": "http", "scheme": "bearer",
                      "description": "The session's api_key (from POST /sessions) as Authorization: Bearer."},
    "sessionApiKey": {"type": "apiKey", "in": "header", "name": "x-api-key",
                      "description": "The session's api_key as x-api-key (read when there is no Authorization)."},
    "adminBearer": {"type": "http", "scheme": "bearer",
                    "description": "The edge's admin token (--admin-token) as Authorization: Bearer; "
                                   "an edge without one takes none."},
    "adminApiKey": {"type": "apiKey", "in": "header", "name": "x-api-key",
                    "description": "The admin token as x-api-key (read when there is no Authorization)."},
}
_SECURITY = {"session": [{"sessionBearer": []}, {"sessionApiKey": []}],
             "admin": [{"adminBearer": []}, {"adminApiKey": []}], None: []}
_REF = "#/components/schemas/{name}"


def build_document() -> dict[str, Any]:
    """The whole document (a new dict each call: :func:`document_bytes` caches its encoding)."""
    structs = {ChatCompletionRequest, ResponsesRequest, ResponseObject, openai.ErrorResponse,
               anthropic.ErrorResponse}
    for op in OPERATIONS:
        structs.update(t for t in [op.body, *(t for media in op.ok.values() for t in media.values())]
                       if t is not None)
    ordered = sorted(structs, key=lambda t: f"{t.__module__}.{t.__qualname__}")
    refs, components = msgspec.json.schema_components(ordered, ref_template=_REF)
    ref = dict(zip(ordered, refs, strict=True))
    paths: dict[str, dict[str, Any]] = {}
    for op in OPERATIONS:
        paths.setdefault(op.path, {})[op.method] = _operation(op, ref)
    return {
        "openapi": OPENAPI_VERSION,
        "info": {"title": "rollbus edge", "version": "1",
                 "description": "The edge's routes: the model wires (OpenAI chat completions, Anthropic "
                                "messages, the OpenAI Responses API) under a session's base URL, rewards, "
                                "the admin API, health and metrics."},
        "paths": paths,
        "components": {"schemas": components, "securitySchemes": SECURITY_SCHEMES},
    }


def _operation(op: Operation, ref: dict[Any, dict[str, Any]]) -> dict[str, Any]:
    answers: dict[str, Any] = {}
    for status, media in op.ok.items():
        answers[str(status)] = {"description": _STATUS_TEXT.get(status, "Unavailable"),
                                **({"content": {kind: {"schema": ref[t] if t is not None else _free(kind)}
                                                for kind, t in media.items()}} if media else {})}
    error = ref[anthropic.ErrorResponse if op.anthropic else openai.ErrorResponse]
    for status in op.errors:
        answers[str(status)] = {"description": _STATUS_TEXT[status], "content": {JSON: {"schema": error}}}
    parameters = [{"name": name[1:-1], "in": "path", "required": True, "schema": {"type": "string"}}
                  for name in op.path.split("/") if name.startswith("{")]
    parameters += [{"name": name, "in": "header", "required": False, "schema": {"type": "string"}}
                   for name in op.headers]
    operation: dict[str, Any] = {"summary": op.summary, "operationId": _operation_id(op), "tags": list(op.tags),
                                 "security": _SECURITY[op.security], "responses": answers}
    if parameters:
        operation["parameters"] = parameters
    if op.body is not None:
        operation["requestBody"] = {"required": op.body_required,
                                    "content": {JSON: {"schema": ref[op.body], "example": EXAMPLES_BY_PATH[op.path]}}}
    return operation


SSE_EVENT = {"type": "object", "required": ["data"],
             "properties": {"event": {"type": "string"}, "data": {"type": "string"}, "id": {"type": "string"}},
             "description": "One server-sent event: the wire's chunk or event as JSON in data (OpenAI's chat "
                            "stream ends with data: [DONE]); the event name on the Anthropic and Responses wires."}


def _free(kind: str) -> dict[str, Any]:
    """A body the structs do not describe: a JSON object, a stream's events, or text."""
    return {"type": "object"} if kind == JSON else SSE_EVENT if kind == SSE else {"type": "string"}


def _operation_id(op: Operation) -> str:
    words = [part.strip("{}") for part in op.path.replace(".", "_").split("/") if part]
    return "_".join([op.method, *words])


def document_bytes(state: Any) -> bytes:
    """The document, encoded once per app (kept on its ``state``)."""
    cached: bytes | None = getattr(state, "openapi", None)
    if cached is None:
        cached = state.openapi = msgspec.json.encode(build_document())
    return cached
