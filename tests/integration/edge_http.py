"""The real edge app on the edge's server (stack.runtime.EdgeServer: granian, on the edge's own socket),
in front of real JetStream and a scripted SGLang engine, for tests that speak HTTP to it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
from nats.aio.client import Client

from edge.app import create_app
from edge.engines.sglang import SGLangEngine
from edge.settings import EdgeSettings
from schemas.log import LogConfig
from stack.runtime import EdgeServer, bind, build_edge_service

ADMIN = "edge-http-admin"


class ServedEdge:
    def __init__(self, url: str, port: int) -> None:
        self.url = url
        self.port = port

    async def open_session(self) -> dict[str, Any]:
        """A new session's answer (``session_id``, ``base_url``, ``api_key``, ...)."""
        async with httpx.AsyncClient(timeout=10) as client:
            opened = await client.post(f"{self.url}/sessions", json={}, headers={"Authorization": f"Bearer {ADMIN}"})
        assert opened.status_code == 201, opened.text
        answer: dict[str, Any] = opened.json()
        return answer

    async def finalize(self, session_id: str) -> None:
        async with httpx.AsyncClient(timeout=10) as client:
            done = await client.post(f"{self.url}/sessions/{session_id}/finalize",
                                     headers={"Authorization": f"Bearer {ADMIN}"})
        assert done.status_code == 200, done.text

    async def raw(self, data: bytes, *, timeout: float = 10.0) -> bytes:
        """Send ``data`` on a connection of its own; what comes back until the server closes it."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            writer.write(data)
            await writer.drain()
            return await asyncio.wait_for(reader.read(-1), timeout)
        finally:
            writer.close()


def chat_body(text: str = "hi", **extra: Any) -> bytes:
    return msgspec.json.encode({"model": "m", "messages": [{"role": "user", "content": text}], **extra})


@contextlib.asynccontextmanager
async def served_edge(nc: Client, cfg: LogConfig, engine_url: str, *, max_connections: int | None = None,
                      **settings: Any) -> AsyncIterator[ServedEdge]:
    """An edge serving on a free port; ``settings``: :class:`EdgeSettings` fields to change;
    ``max_connections``: the server's cap on connections served at once (:class:`EdgeServer`'s)."""
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    settings.setdefault("max_trajectory_length", 4096)
    edge_settings = EdgeSettings(public_url=url, admin_token=ADMIN, log=cfg, edge_id=f"http:{port}", **settings)
    service = build_edge_service(edge_settings, nc, SGLangEngine([engine_url]))
    server = EdgeServer(create_app(service), sock, **({} if max_connections is None else
                                                      {"max_connections": max_connections}))
    task = asyncio.ensure_future(server.serve())
    try:
        yield ServedEdge(url, port)
    finally:
        server.stop()
        await asyncio.wait_for(task, 20)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(service.registry.close(), 5)
        await service.close_log()
        await service._turns._engine.aclose()
