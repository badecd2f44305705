"""The edge's ASGI app, assembled in one place.

The model routes (one per wire) are served by the thin :class:`ModelRoutes` front;
admin, reward, health and metrics by FastAPI behind it. State lives on ``app.state``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

from fastapi import FastAPI, Response

from edge.codec.anthropic_wire import AnthropicWire
from edge.codec.openai_wire import OpenAIWire
from edge.metrics import Metrics
from edge.routes import admin, reward
from edge.routes.model import ModelRoutes
from edge.service import EdgeService

Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]


def create_app(service: EdgeService, *, ready: Callable[[], bool] = lambda: True,
               metrics: Metrics | None = None, lifespan: Lifespan | None = None) -> ModelRoutes:
    app = FastAPI(title="rollbus edge", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.service = service
    app.state.metrics = metrics or Metrics()
    app.include_router(admin.router)
    app.include_router(reward.router)

    @app.get("/healthz")
    async def healthz() -> Response:
        ok = ready()
        return Response(content=b'{"status":"ok"}' if ok else b'{"status":"starting"}',
                        status_code=200 if ok else 503, media_type="application/json")

    @app.get("/metrics")
    async def metrics_text() -> Response:
        return Response(content=app.state.metrics.render(), media_type="text/plain; version=0.0.4")

    adapters = {"v1/chat/completions": OpenAIWire(), "v1/messages": AnthropicWire()}
    return ModelRoutes(app, service, app.state.metrics, adapters)
