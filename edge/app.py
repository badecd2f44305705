"""The edge's ASGI app, assembled in one place.

The model routes (one per wire: OpenAI chat completions, Anthropic messages, OpenAI responses)
are served by the thin :class:`ModelRoutes` front; admin, reward, health, metrics and stored
responses (``GET .../v1/responses/{id}``) and the OpenAPI document (``GET /openapi.json``, :mod:`edge.openapi`)
by FastAPI behind it. State lives on ``app.state``.

Every error is answered in a wire's JSON error shape, FastAPI's own too (an unknown path, a
method a route does not serve, a request it cannot validate, an unexpected failure): under
``/sessions/{id}/v1/messages`` Anthropic's, everywhere else OpenAI's (the admin and reward
routes' shape). Paths are matched as sent: no redirect to the same path with or without its
trailing slash (a redirect would be built from the request's ``Host`` header).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager

import msgspec
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from edge.http_errors import http_error
from edge.openapi import document_bytes
from edge.routes import admin, count_tokens, responses, reward
from edge.routes.handling import ErrorEncoder, json_response
from edge.routes.model import ModelRoutes, is_anthropic_path
from edge.service import EdgeService
from edge.tokens.incremental import TemplateMode
from edge.wires import anthropic as anthropic_wire
from edge.wires import openai as openai_wire
from edge.wires.adapter import WireAdapter
from edge.wires.anthropic import AnthropicWire
from edge.wires.openai import OpenAIWire
from edge.wires.reasoning_refs import ReasoningRefs, stack_key
from edge.wires.responses import ResponsesWire
from observability.registry import Metrics
from schemas.errors import MalformedRequest, MethodNotAllowed, RollbusError, RouteNotFound

Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]


def error_encoder(path: str) -> ErrorEncoder:
    """The error shape of the wire ``path`` belongs to."""
    return anthropic_wire.encode_error if is_anthropic_path(path) else openai_wire.encode_error


def _answer(request: Request, exc: RollbusError, headers: dict[str, str] | None = None) -> Response:
    response = json_response(error_encoder(request.url.path)(exc), http_error(exc).status)
    response.headers.update(headers or {})
    return response


async def _http_error(request: Request, exc: Exception) -> Response:
    """FastAPI's (Starlette's) 404, 405 and other HTTP errors, in the wire's shape: another 4xx is
    answered as a malformed request (400), a 5xx as an internal error (500)."""
    assert isinstance(exc, HTTPException)
    where = f"{request.method} {request.url.path}"
    error: RollbusError
    if exc.status_code == 404:
        error = RouteNotFound(f"no route serves {where}")
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        error = MethodNotAllowed(f"method {request.method} is not allowed on {request.url.path} (allowed: {allowed})")
    elif exc.status_code < 500:
        error = MalformedRequest(str(exc.detail))
    else:
        error = RollbusError("internal error")
    return _answer(request, error, exc.headers)


async def _server_error(request: Request, exc: Exception) -> Response:
    """A bug outside the routes' own error handling (logged by the server): a 500, in the wire's shape."""
    return _answer(request, RollbusError("internal error"))


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    details = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg', '')}" for e in exc.errors())
    return _answer(request, MalformedRequest(f"invalid request: {details}"[:1000]))


def health(ready: bool, failing: Sequence[str], stopping: bool = False,
           template: TemplateMode | None = None) -> tuple[bytes, int]:
    """``/healthz``'s body and status: 200 ``{"status": "ok"}`` when every part is up; else 503 with
    ``{"status": "stopping"}``, ``{"status": "starting"}``, or ``{"status": "unavailable", "failing": [...]}``
    naming the parts that are down. With ``template`` (the edge's), each also says how its chat template is
    encoded: ``"chat_template": {"mode": "prefix-stable"}`` or ``{"mode": "continuous tokens", "reason": ...}``."""
    if stopping:
        body: dict[str, object] = {"status": "stopping"}
    elif not ready:
        body = {"status": "starting"}
    elif failing:
        body = {"status": "unavailable", "failing": list(failing)}
    else:
        body = {"status": "ok"}
    if template is not None:
        body["chat_template"] = {"mode": template.name, **({"reason": template.reason} if template.reason else {})}
    return msgspec.json.encode(body), 200 if body["status"] == "ok" else 503


def create_app(service: EdgeService, *, ready: Callable[[], bool] = lambda: True,
               failing: Callable[[], Sequence[str]] = tuple, stopping: Callable[[], bool] = lambda: False,
               metrics: Metrics | None = None, lifespan: Lifespan | None = None) -> ModelRoutes:
    """``ready``: whether the stack has started; ``failing``: the parts that are down now (e.g. ``["nats"]``);
    ``stopping``: whether the stack is shutting down; all are called on every ``/healthz``, so they must be cheap."""
    app = FastAPI(title="rollbus edge", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan,
                  redirect_slashes=False,
                  exception_handlers={HTTPException: _http_error, RequestValidationError: _validation_error,
                                      Exception: _server_error})
    app.state.service = service
    # the service's registry (its turns are counted there), unless told another
    app.state.metrics = metrics if metrics is not None else getattr(service, "metrics", None) or Metrics()
    app.include_router(admin.router)
    app.include_router(reward.router)
    app.include_router(count_tokens.router)
    app.include_router(responses.router)

    template = getattr(service, "template_mode", None)  # (tests may serve routes without a codec)
    template = template if isinstance(template, TemplateMode) else None

    @app.get("/healthz")
    async def healthz() -> Response:
        body, status = health(ready(), failing(), stopping(), template)
        return Response(content=body, status_code=status, media_type="application/json")

    @app.get("/metrics")
    async def metrics_text(request: Request) -> Response:
        """Prometheus' text format (OpenMetrics when the scraper asks for it), by prometheus-client."""
        body, content_type = app.state.metrics.render(request.headers.get("accept", ""))
        return Response(content=body, headers={"content-type": content_type})

    @app.get("/openapi.json")
    async def openapi() -> Response:
        """Every route, as OpenAPI 3.1 (:mod:`edge.openapi`); open to all, as it holds no secret."""
        return Response(content=document_bytes(app.state), media_type="application/json")

    settings = getattr(service, "settings", None)  # (tests may serve routes without a service)
    app.state.responses_wire = ResponsesWire(ReasoningRefs(stack_key(settings.admin_token if settings else "")))
    adapters: dict[str, WireAdapter] = {"v1/chat/completions": OpenAIWire(), "v1/messages": AnthropicWire(),
                                        "v1/responses": app.state.responses_wire}
    if hasattr(service, "decoders"):
        service.decoders.update({adapter.name: adapter.decode for adapter in adapters.values()})
    return ModelRoutes(app, service, app.state.metrics, adapters)
