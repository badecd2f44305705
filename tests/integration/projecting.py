"""Running a projector inside a test, and waiting (bounded) for it to catch up."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from schemas.log import LogConfig
from session_projector.projections import iter_projections
from session_projector.service import Projector


@contextlib.asynccontextmanager
async def running(projector: Projector) -> AsyncIterator[Projector]:
    stop = asyncio.Event()
    task = asyncio.create_task(projector.run(stop))
    try:
        yield projector
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def wait_projected(js: JetStreamContext, cfg: LogConfig, expected: dict[str, int], timeout: float = 20) -> None:
    """Until each session's projection holds event #expected[sid]."""
    deadline = time.monotonic() + timeout
    while True:
        seen = {p.session_id: p.state.seq async for p in iter_projections(js, cfg)}
        if all(seen.get(sid) == seq for sid, seq in expected.items()):
            return
        assert time.monotonic() < deadline, f"projections stuck at {seen}, want {expected}"
        await asyncio.sleep(0.05)


async def wait_drained(js: JetStreamContext, stream: str, durable: str, timeout: float = 20) -> None:
    """Until the durable consumer exists and has nothing pending or unacknowledged."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(NotFoundError):
            info = await js.consumer_info(stream, durable)
            if info.num_pending == 0 and info.num_ack_pending == 0:
                return
        assert time.monotonic() < deadline, f"consumer {durable} did not drain"
        await asyncio.sleep(0.05)
