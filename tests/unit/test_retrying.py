"""The retry policies (eventlog.retrying) and the loops on them that need no server: the agent framework's
edge pool against real sockets (one refuses, one answers)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_fixed

from agent_framework.pool import EdgePool
from eventlog.retrying import replay_first, until_stopped
from schemas.errors import EdgeError

log = logging.getLogger("test_retrying")


class Flaky:
    def __init__(self, failures: list[BaseException]) -> None:
        self.failures = failures
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)
        return "done"


async def test_until_stopped_retries_the_named_errors_doubling_up_to_the_most(caplog) -> None:
    stop = asyncio.Event()
    call = Flaky([TimeoutError("a"), TimeoutError("b"), ConnectionError("c"), TimeoutError("d")])
    with caplog.at_level(logging.WARNING, logger=log.name):
        assert await until_stopped(stop, (TimeoutError, ConnectionError), call, first=0.01, most=0.03, logger=log,
                                   what="not subscribed") == "done"
    assert call.calls == 5
    assert [r.args[2] for r in caplog.records] == pytest.approx([0.01, 0.02, 0.03, 0.03])  # the waits
    assert caplog.records[0].getMessage() == "not subscribed (TimeoutError('a')); trying again in 0.0s"


async def test_until_stopped_raises_another_error_at_once_and_tries_nothing_once_stopped() -> None:
    stop = asyncio.Event()
    with pytest.raises(ValueError):
        await until_stopped(stop, (TimeoutError,), Flaky([ValueError("not retried"), TimeoutError()]), first=0.01,
                            most=0.01, logger=log, what="x")
    call = Flaky([TimeoutError(str(n)) for n in range(1000)])
    started = time.monotonic()
    asyncio.get_running_loop().call_later(0.2, stop.set)
    assert await until_stopped(stop, (TimeoutError,), call, first=60.0, most=60.0, logger=log, what="x") is None
    assert call.calls == 1 and time.monotonic() - started < 5  # the stop cut the 60 s wait short, no try after it
    assert await until_stopped(stop, (TimeoutError,), call, first=1, most=1, logger=log, what="x") is None
    assert call.calls == 1  # stopped before: not tried at all


async def test_replay_first_counts_the_first_failure_as_attempt_one() -> None:
    seen: list[int] = []

    async def call(attempt: int) -> str:
        seen.append(attempt)
        if attempt < 3:
            raise TimeoutError(attempt)
        return f"attempt {attempt}"

    def retrying() -> AsyncRetrying:
        return AsyncRetrying(stop=stop_after_attempt(3), wait=wait_fixed(0),
                             retry=retry_if_exception_type(TimeoutError), reraise=True)

    assert await replay_first(retrying(), TimeoutError(1), call) == "attempt 3" and seen == [2, 3]
    seen.clear()
    with pytest.raises(TimeoutError):  # attempts 2 and 3 fail too: the third failure is raised
        await replay_first(retrying(), TimeoutError(1), lambda attempt: call(attempt - 1))
    assert seen == [1, 2]


class _Edge(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = json.dumps({"session_id": "s1", "base_url": "b", "anthropic_base_url": "a", "reward_url": "r",
                           "api_key": "k"}).encode()
        self.send_response(201)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def live_edge() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Edge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def dead_edge() -> str:
    with socket.socket() as sock:  # a port nothing listens on: the connection is refused
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


async def test_an_open_refused_by_one_edge_moves_to_the_next(live_edge: str, dead_edge: str) -> None:
    pool = EdgePool([dead_edge, live_edge], "token", open_attempts=3)
    placement = pool.reserve()
    started = time.monotonic()
    handle = await pool.open(placement, {})
    assert handle.session_id == "s1" and placement.url == live_edge and pool.active == [0, 1]
    assert time.monotonic() - started >= 0.2  # one wait (0.2 s) before the second attempt
    await pool.aclose()


async def test_an_open_no_edge_takes_fails_after_its_attempts(dead_edge: str) -> None:
    pool = EdgePool([dead_edge], "token", open_attempts=2)
    with pytest.raises(EdgeError, match=r"no edge opened the session after 2 attempts: .*ConnectError") as info:
        await pool.open(pool.reserve(), {})
    assert info.value.retriable
    await pool.aclose()
