"""A recording reverse proxy: an agent is pointed at it instead of the edge, so a test sees every
request the agent sent and the answer it got (method, path, body, status, answer body), in order.

It forwards each request as it came (method, path, query, body, headers but ``Host``) with httpx and
streams the answer back (decoded), keeping a copy; served by uvicorn on 127.0.0.1 in a daemon thread.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

HOP_BY_HOP = {"host", "connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding"}


@dataclass
class Exchange:
    """One request the agent sent and the answer it got (the answer's body once it has all arrived)."""

    method: str
    path: str  # without the query
    query: str
    body: bytes
    status: int = 0
    answer: bytes = b""

    def json(self) -> Any:
        return json.loads(self.body)

    def answer_json(self) -> Any:
        return json.loads(self.answer)


class Recorder:
    """Forwards everything to ``upstream`` and keeps each :class:`Exchange` in :attr:`exchanges`."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.exchanges: list[Exchange] = []
        self.url = ""
        app = Starlette(routes=[Route("/{path:path}", self._forward,
                                      methods=["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"])])
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                                     timeout_graceful_shutdown=1))
        self._thread: threading.Thread | None = None

    def at(self, url: str) -> str:
        """``url`` (of the upstream) as reached through this proxy."""
        assert url.startswith(self.upstream), url
        return self.url + url[len(self.upstream):]

    async def _forward(self, request: Request) -> StreamingResponse:
        exchange = Exchange(request.method, request.url.path, request.url.query, await request.body())
        self.exchanges.append(exchange)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        url = f"{self.upstream}{request.url.path}" + (f"?{request.url.query}" if request.url.query else "")
        client = httpx.AsyncClient(timeout=httpx.Timeout(300.0))
        upstream = await client.send(client.build_request(request.method, url, headers=headers,
                                                          content=exchange.body), stream=True)
        exchange.status = upstream.status_code

        async def relay() -> AsyncIterator[bytes]:
            async for chunk in upstream.aiter_bytes():
                exchange.answer += chunk
                yield chunk

        kept = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
        return StreamingResponse(relay(), status_code=upstream.status_code, headers=kept,
                                 background=BackgroundTask(self._close, upstream, client))

    @staticmethod
    async def _close(upstream: httpx.Response, client: httpx.AsyncClient) -> None:
        await upstream.aclose()
        await client.aclose()

    def start(self) -> Recorder:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            assert time.monotonic() < deadline and self._thread.is_alive(), "the recording proxy did not start"
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
        self._thread = None

    def __enter__(self) -> Recorder:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop()
