"""Errors that carry a retry delay are answered with Retry-After (which the SDKs honour)."""

from __future__ import annotations

from fastapi import APIRouter, FastAPI
from fastapi.testclient import TestClient

from edge.routes.handling import wire_route
from edge.wires.openai import encode_error
from observability.registry import Metrics
from schemas.errors import OwnershipLost, SessionOwned


def _app() -> FastAPI:
    router = APIRouter(route_class=wire_route(encode_error))

    @router.post("/owned")
    async def owned() -> None:
        raise SessionOwned("session s is served by edge e", retry_after=2.2)

    @router.post("/lost")
    async def lost() -> None:
        raise OwnershipLost("another writer")

    app = FastAPI()
    app.state.metrics = Metrics()
    app.include_router(router)
    return app


def test_session_owned_elsewhere_is_a_409_with_retry_after():
    client = TestClient(_app())
    owned = client.post("/owned")
    assert owned.status_code == 409 and owned.json()["error"]["code"] == "session_owned_elsewhere"
    assert owned.headers["retry-after"] == "3" and owned.headers["retry-after-ms"] == "2200"
    lost = client.post("/lost")
    assert lost.status_code == 409 and lost.json()["error"]["code"] == "ownership_lost"
    assert "retry-after" not in lost.headers
