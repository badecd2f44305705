"""The edge's HTTP server as rollbus configures it (stack.runtime.EdgeServer: granian, embedded in
the test's event loop), over real sockets: what the edge relies on it for. Framing, keep-alive, bodies,
errors, ``http.disconnect``, idle and shutdown; hostile clients against the real edge app are in
test_http_hostile.py."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from schemas.errors import StartupError
from stack.runtime import EdgeServer, bind

Seen = dict[str, Any]
TIMEOUT_S = 1.0  # the server's header read timeout here (idle and half-sent requests)


def make_app(seen: Seen) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope["path"]
        seen["scope"] = scope
        seen["loop"] = asyncio.get_running_loop()
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                seen["disconnected_early"] = True
                return
            body += message["body"]
            if not message.get("more_body", False):
                break
        seen["body"] = body
        if path == "/echo":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/octet-stream"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
        elif path == "/stream":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            for part in (b"one ", b"two ", b"three"):
                await send({"type": "http.response.body", "body": part, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        elif path == "/fail-before":
            raise ValueError("before the response")
        elif path == "/fail-after":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"10")]})
            await send({"type": "http.response.body", "body": b"12345", "more_body": True})
            raise ValueError("after the response started")
        elif path == "/slow":
            seen["waiting"].set()
            message = await receive()  # the body is in: the next message is the client leaving
            seen["after_body"] = message["type"]
            seen["done"].set()
        elif path == "/hold":
            seen["waiting"].set()
            await seen["release"].wait()
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"4")]})
            await send({"type": "http.response.body", "body": b"held"})
        else:
            await send({"type": "http.response.start", "status": 404, "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})

    return app


class Served:
    def __init__(self, server: EdgeServer, task: asyncio.Task[None], port: int, seen: Seen) -> None:
        self.server = server
        self.task = task
        self.port = port
        self.seen = seen
        self.url = f"http://127.0.0.1:{port}"

    async def raw(self, data: bytes, *, timeout: float = 5.0) -> bytes:
        """Send ``data`` on a connection of its own; what comes back until the server closes it."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        writer.write(data)
        await writer.drain()
        try:
            return await asyncio.wait_for(reader.read(-1), timeout)
        finally:
            writer.close()


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    seen: Seen = {"waiting": asyncio.Event(), "done": asyncio.Event(), "release": asyncio.Event()}
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = EdgeServer(make_app(seen), sock, header_read_timeout=TIMEOUT_S)
    task = asyncio.ensure_future(server.serve())
    yield Served(server, task, port, seen)
    server.stop()
    await asyncio.wait_for(task, 10)


def request(path: str, body: bytes = b"", *, method: str = "POST", extra: str = "") -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\n{extra}\r\n").encode() + body


async def test_the_app_runs_on_the_callers_event_loop(served: Served) -> None:
    async with httpx.AsyncClient(base_url=served.url) as client:
        await client.post("/echo/caf%C3%A9?x=1", content=b"", headers={"X-Thing": "V"})
    assert served.seen["loop"] is asyncio.get_running_loop()  # embedded: beside the stack's other components
    scope = served.seen["scope"]
    assert scope["type"] == "http" and scope["http_version"] == "1.1" and scope["method"] == "POST"
    assert scope["path"] == "/echo/café" and scope["query_string"] == b"x=1"
    assert (b"x-thing", b"V") in scope["headers"]  # names lowercased, values as sent


async def test_keep_alive_requests_on_one_connection_with_date_header(served: Served) -> None:
    async with httpx.AsyncClient(base_url=served.url) as client:
        first = await client.post("/echo", content=b"hello")
        second = await client.post("/echo", content=b"again")
    assert (first.status_code, first.content, second.content) == (200, b"hello", b"again")
    assert first.headers["content-length"] == "5" and "date" in first.headers


async def test_chunked_request_body_and_streamed_response(served: Served) -> None:
    async def parts() -> AsyncIterator[bytes]:
        for part in (b"ab", b"cd", b"ef"):
            yield part

    async with httpx.AsyncClient(base_url=served.url) as client:
        echoed = await client.post("/echo", content=parts())
        streamed = await client.post("/stream", content=b"")
    assert echoed.content == b"abcdef"
    assert streamed.headers["transfer-encoding"] == "chunked" and streamed.content == b"one two three"


async def test_a_large_body_flows_through(served: Served) -> None:
    body = bytes(range(256)) * 16384  # 4 MiB
    async with httpx.AsyncClient(base_url=served.url) as client:
        echoed = await client.post("/echo", content=body)
    assert echoed.content == body


async def test_expect_100_continue_is_answered(served: Served) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
    writer.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n")
    interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert interim.startswith(b"HTTP/1.1 100 Continue\r\n")
    writer.write(b"body")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200 OK") and await reader.readexactly(4) == b"body"
    writer.close()


async def test_a_malformed_request_gets_400_and_the_connection_closes(served: Served) -> None:
    out = await served.raw(b"NOT HTTP AT ALL\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 400 Bad Request") and "scope" not in served.seen


async def test_app_failure_before_the_response_is_a_500_and_serving_goes_on(served: Served) -> None:
    async with httpx.AsyncClient(base_url=served.url) as client:
        failed = await client.post("/fail-before", content=b"x")
        ok = await client.post("/echo", content=b"still serving")
    assert failed.status_code == 500 and ok.content == b"still serving"


async def test_app_failure_after_the_response_started_cuts_it_short(served: Served) -> None:
    out = await served.raw(request("/fail-after", b"x"))
    assert out.startswith(b"HTTP/1.1 200 OK") and out.endswith(b"12345")  # cut short: the client sees the close


async def test_client_leaving_is_an_http_disconnect(served: Served) -> None:
    _, writer = await asyncio.open_connection("127.0.0.1", served.port)
    writer.write(request("/slow", b"data"))
    await asyncio.wait_for(served.seen["waiting"].wait(), 5)
    assert not served.seen["done"].is_set()  # nothing to receive while the client stays
    writer.close()
    await asyncio.wait_for(served.seen["done"].wait(), 5)
    assert served.seen["after_body"] == "http.disconnect" and served.seen["body"] == b"data"


async def test_an_idle_connection_is_closed_after_the_header_read_timeout(served: Served) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
    writer.write(request("/echo", b"x"))
    await reader.readuntil(b"\r\n\r\n")
    assert await reader.readexactly(1) == b"x"
    started = asyncio.get_running_loop().time()
    assert await asyncio.wait_for(reader.read(1), 5) == b""  # closed by the server
    assert 0.5 * TIMEOUT_S < asyncio.get_running_loop().time() - started < 3 * TIMEOUT_S
    writer.close()


async def test_stop_lets_the_request_in_flight_finish(served: Served) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
    writer.write(request("/hold", b"data"))
    await asyncio.wait_for(served.seen["waiting"].wait(), 5)
    served.server.stop()
    await asyncio.sleep(0.3)  # the server is stopping, the response is not out yet
    assert not served.task.done()
    served.seen["release"].set()
    out = await asyncio.wait_for(reader.read(-1), 5)  # the whole response, then the close
    assert out.startswith(b"HTTP/1.1 200 OK") and out.endswith(b"held")
    await asyncio.wait_for(served.task, 5)
    writer.close()


async def test_the_port_is_the_servers_alone_until_it_stops(served: Served) -> None:
    with pytest.raises(StartupError, match="in use"):
        bind("127.0.0.1", served.port).close()  # granian's own listener would have let it share the port
    served.server.stop()
    await asyncio.wait_for(served.task, 5)
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", served.port), timeout=1).close()  # the listener is closed
    bind("127.0.0.1", served.port).close()  # and the port free again
