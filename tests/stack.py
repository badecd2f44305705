"""A real rollbus stack (edge + projector + materializer) on its own thread and event loop.

Tests drive it over HTTP with the official SDKs, sync or async, while it talks to the
test session's nats-server and to a scripted SGLang-protocol engine.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from nats.aio.client import Client

from edge.engines.base import Engine
from eventlog.reader import read_session
from schemas.events import AnyEvent
from stack.runtime import Stack, StackOptions


class StackThread:
    def __init__(self, options: StackOptions, *, engine: Engine | None = None) -> None:
        self.options = options
        self._engine = engine
        self.stack: Stack | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="rollbus-stack", daemon=True)

    @property
    def url(self) -> str:
        assert self.stack is not None
        return self.stack.url

    @property
    def nats_url(self) -> str:
        assert self.stack is not None
        return self.stack.nats_url

    @property
    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.options.admin_token}"}

    @property
    def trajectories(self) -> Path:
        return self.options.data_dir / "trajectories"

    def events(self, session_id: str) -> list[AnyEvent]:
        """The session's events, read from the stack's log by a client of the test's own."""

        async def read() -> list[AnyEvent]:
            nc = Client()
            await nc.connect(self.nats_url)
            try:
                return (await read_session(nc.jetstream(), self.options.log, session_id)).events
            finally:
                await nc.close()

        return asyncio.run(read())

    def _main(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.stack = Stack(self.options, engine=self._engine)
        try:
            await self.stack.start()
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            raise
        self._ready.set()
        await self.stack.run_until_stopped()
        await self.stack.stop()

    def start(self, timeout: float = 60.0) -> StackThread:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("stack did not start")
        if self._error is not None:
            raise RuntimeError("stack failed to start") from self._error
        return self

    def stop(self) -> None:
        if self._loop is not None and self.stack is not None:
            self._loop.call_soon_threadsafe(self.stack.stop_event.set)
        self._thread.join(30)
