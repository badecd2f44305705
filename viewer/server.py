"""Serving the viewer: granian embedded in the caller's event loop, as the stack serves the edge."""

from __future__ import annotations

import asyncio

from nats.js.client import JetStreamContext

from schemas.log import LogConfig
from stack.runtime import EdgeServer, bind
from viewer.app import create_app
from viewer.store import LogView


class Viewer:
    """The viewer on ``host:port`` (0: any free port), its URL known once :meth:`start` returns."""

    def __init__(self, js: JetStreamContext, cfg: LogConfig, *, host: str = "127.0.0.1", port: int = 8090) -> None:
        self._view = LogView(js, cfg)
        self._app = create_app(self._view)
        self._host, self._port = host, port
        self._server: EdgeServer | None = None
        self._task: asyncio.Task[None] | None = None
        self.url = ""

    def start(self) -> str:
        """Listen (raises :class:`schemas.errors.StartupError` when the address cannot be had) and serve."""
        sock = bind(self._host, self._port)
        host, port = sock.getsockname()[:2]
        self.url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
        self._server = EdgeServer(self._app, sock)
        self._task = asyncio.ensure_future(self._server.serve())
        return self.url

    async def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        await self._view.close()
